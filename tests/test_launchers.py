"""Every launcher starts the same training: torchrun, srun (SLURM's variables read by vagen.distributed) and
the DeepSpeed launcher (tests/test_resume.py, tests/test_distributed.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import child_env
from test_distributed import _free_port

from vagen.distributed import first_host, slurm_environment

TRAIN = Path(__file__).parent.parent / "vagen" / "train.py"
SMALL = ["--config", "bandit_text", "train.iterations=1", "rollout.env_groups=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4", "train.mini_batch_size=2", "train.micro_batch_size=1", "log.progress=false",
         "log.tensorboard=false"]


def _trained_on_two_ranks(run: Path) -> None:
    """One iteration logged, and a checkpoint whose engine states two data-parallel ranks wrote."""
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0]
    ckpt = run / "checkpoints" / "step_1"
    assert json.loads((ckpt / "trainer_state.json").read_text())["ranks"] == 2
    state = torch.load(ckpt / "deepspeed" / "actor" / "mp_rank_00_model_states.pt", map_location="cpu",
                       weights_only=False)
    assert state["dp_world_size"] == 2 and state["global_steps"] == 2


def test_torchrun_trains_an_iteration_on_two_processes(tmp_path, tiny_text, model_cache):
    """torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and MASTER_ADDR/PORT, and passes no
    --local_rank: that is all vagen/train.py needs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(TRAIN), *SMALL, f"train.run_dir={tmp_path}", "train.run_name=tr",
           f"model.builtin_cache={model_cache}"]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _trained_on_two_ranks(tmp_path / "tr")


SRUN = {"SLURM_JOB_ID": "123456", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "8", "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[01-08]"}


def test_srun_tasks_become_ranks_of_the_process_group():
    assert slurm_environment(SRUN) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                                       "MASTER_ADDR": "gpu07", "MASTER_PORT": "23456"}
    # the batch script itself (no step variables) is one process, whatever the job's task count
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP_")}
    assert slurm_environment({**batch, "SLURM_PROCID": "0"}) == {}
    # the user's address and port are kept; tasks spread unevenly over nodes: the first node's count
    assert slurm_environment({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "2,1,1", "MASTER_ADDR": "10.0.0.1",
                              "MASTER_PORT": "29500"}) == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500"}
    assert slurm_environment({**SRUN, "RANK": "0"}) == {}  # torchrun or deepspeed inside the job: theirs
    assert slurm_environment({**SRUN, "SLURM_STEP_NUM_TASKS": "1"}) == {}  # one task: a plain run
    assert slurm_environment({}) == {}
    nowhere = {k: v for k, v in SRUN.items() if not k.endswith("NODELIST")}
    with pytest.raises(ValueError, match="srun started 4 tasks but set no SLURM_STEP_NODELIST"):
        slurm_environment(nowhere)


@pytest.mark.parametrize("nodes, first", [("gpu[03-04,07],cpu1", "gpu03"), ("node7", "node7"),
                                          ("a01,b[1-3]", "a01"), ("rack[2-3]-n[001-004]", "rack2-n001"),
                                          ("x[009]", "x009")])
def test_first_host_of_a_slurm_node_list(nodes, first):
    assert first_host(nodes) == first


@pytest.mark.slow
def test_two_srun_tasks_train_an_iteration(tmp_path, tiny_text, model_cache):
    """Two processes with only what srun sets for each task (as `srun --ntasks 2 python vagen/train.py ...` on
    one node starts them) train one iteration together."""
    port = str(_free_port())
    procs = []
    for task in range(2):
        env = child_env(SLURM_JOB_ID="1", SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_PROCID=str(task),
                        SLURM_LOCALID=str(task), SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="localhost",
                        MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, str(TRAIN), *SMALL, f"train.run_dir={tmp_path}",
                                       "train.run_name=sr", f"model.builtin_cache={model_cache}"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    _trained_on_two_ranks(tmp_path / "sr")


WAITER = """
import sys, time
from vagen.distributed import init_distributed
import torch
dist = init_distributed(timeout_minutes=float(sys.argv[1]))
if dist.rank == 0:
    t0 = time.perf_counter()
    try:
        torch.distributed.barrier()
        print("barrier passed")
    except Exception as error:
        print(f"gave up after {time.perf_counter() - t0:.1f} s: {type(error).__name__}: {error}"[:300])
else:
    time.sleep(40)  # longer than rank 0's timeout: it must give up first
"""


@pytest.mark.slow
def test_a_collective_waits_for_the_process_group_timeout_it_was_given(tmp_path):
    """init_distributed's timeout (train.dist_timeout_minutes) is the group's: rank 0 waiting in a barrier for a
    rank that never comes gives up after it (15 s here), not after DeepSpeed's default of 10 minutes. (The
    timeout also bounds init's own barrier, so it must exceed the ranks' start-up skew on a busy machine.)"""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-c", WAITER, "0.25"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for rank in range(2)]
    output = procs[0].communicate(timeout=120)[0]
    procs[1].kill()
    procs[1].communicate()
    said = [line for line in output.splitlines() if line.startswith("gave up after")]
    assert said, output[-3000:]
    seconds = float(said[0].split()[3])
    assert 14 < seconds < 40 and "Timed out" in said[0], said[0]


def test_the_process_group_timeout_is_a_setting_of_whole_minutes():
    from vagen.config import ConfigError, load_config

    assert load_config("bandit_text").train.dist_timeout_minutes == 30
    assert load_config("bandit_text", ["train.dist_timeout_minutes=120"]).train.dist_timeout_minutes == 120
    with pytest.raises(ConfigError, match=r"train.dist_timeout_minutes=0 must be >= 1 \(minutes a rank waits"):
        load_config("bandit_text", ["train.dist_timeout_minutes=0"])
