import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import child_env
from ppo_reference import ADVANTAGES, ANSWERS, overrides, reference_update
from update_fixtures import answer_samples

from vagen.config import load_config
from vagen.episode import ChatEncoder
from vagen.models import load_policy, resolve_model_path

WORKER = Path(__file__).parent / "dp_worker.py"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(ranks: int, out: Path, cache: str, worker: Path = WORKER):
    """`worker` on `ranks` ranks by the DeepSpeed launcher run by this interpreter, so the test runs whether
    or not the `deepspeed` script is on PATH; returns what it saved at `out`."""
    env = child_env()
    port = _free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(port),
           str(worker), "--out", str(out), "--cache", cache]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    # DeepSpeed's CPU all-reduce maps one shared-memory file per rank and never removes it: without
    # vagen.train.init_distributed unlinking them, every run would leave 66 MB per rank in /dev/shm.
    left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert not left, f"shared-memory files left behind by the run: {[p.name for p in left]}"
    return torch.load(out)


def test_two_cpu_ranks_with_equal_and_unequal_shares_match_a_plain_update_of_whole_minibatches(tmp_path):
    cache = str(tmp_path / "models")  # empty: rank 1 of the run builds the model
    results = _launch(2, tmp_path / "two.pt", cache)
    path = resolve_model_path("builtin:tiny-text", cache, seed=0)
    model, tokenizer = load_policy(path)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = load_config("bandit_text", overrides(mini=8, micro=2))
    samples = answer_samples(ChatEncoder(tokenizer), ANSWERS, ADVANTAGES)
    reference_update(model, samples, [list(range(8)), list(range(8, 12))], cfg, ChatEncoder(tokenizer).pad_id)
    for case in ("equal", "unequal"):
        result = results[case]
        assert result["steps"] == 2, case  # one optimizer step per mini-batch
        moved = 0.0
        for name, expected in model.state_dict().items():
            # SGD is linear in the gradient: two ranks summing in another order differ by float noise only.
            torch.testing.assert_close(result["params"][name], expected, atol=1e-6, rtol=0, msg=f"{case}: {name}")
            moved = max(moved, float((expected - initial[name]).abs().max()))
        assert moved > 1e-3  # the update really changed the parameters
    # groups are numbered rank * 2 + local id; the two that vary most (rank 0's) are kept, one per rank
    assert results["filter"] == [[(0, 0.0), (0, 1.0)], [(1, 0.0), (1, 3.0)]]


def test_a_rank_left_without_trajectories_makes_every_rank_raise_the_same_error():
    """Every episode of rank 1's groups failed at reset: both ranks refuse with one message, instead of
    rank 1 raising while rank 0 waits in the next collective until the timeout."""
    worker = Path(__file__).parent / "empty_rank_worker.py"
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, str(worker)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    lines = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert lines[0] == lines[1], lines
    assert lines[0].startswith("raised: this iteration has 1 level group(s) to train") and "for 2 ranks" in lines[0]


def test_each_cuda_rank_renders_mujoco_on_its_own_gpu_within_the_egl_devices():
    from vagen.distributed import mujoco_egl_device

    assert [mujoco_egl_device(rank, 8, {}) for rank in range(8)] == [str(rank) for rank in range(8)]
    assert mujoco_egl_device(3, 8, {"MUJOCO_GL": "EGL"}) == "3"
    assert [mujoco_egl_device(rank, 2, {}) for rank in range(4)] == ["0", "1", "0", "1"]  # fewer EGL devices
    assert mujoco_egl_device(None, 1, {}) is None  # a CPU rank: MuJoCo raises for an id its devices lack
    assert mujoco_egl_device(1, 0, {}) is None  # no EGL device
    assert mujoco_egl_device(1, 8, {"MUJOCO_GL": "osmesa"}) is None
    assert mujoco_egl_device(1, 8, {"MUJOCO_EGL_DEVICE_ID": "5"}) is None  # the user's choice stays


def test_the_egl_device_is_set_for_cuda_ranks_only_and_inherited_by_worker_processes():
    import vagen.distributed
    from vagen.distributed import render_on_rank_device

    def no_count():
        raise AssertionError("EGL devices counted for a rank that renders nothing on a GPU")

    environ = {}
    assert render_on_rank_device(torch.device("cpu"), environ, no_count) is None and environ == {}
    assert render_on_rank_device(vagen.distributed.rank_device(1), environ, no_count) is None or torch.cuda.is_available()
    assert "MUJOCO_EGL_DEVICE_ID" not in environ
    assert render_on_rank_device(torch.device("cuda", 1), {"MUJOCO_GL": "osmesa"}, no_count) is None
    environ = {"PATH": "/usr/bin"}
    assert render_on_rank_device(torch.device("cuda", 3), environ, lambda: 8) == "3"
    assert environ["MUJOCO_EGL_DEVICE_ID"] == "3"
    seen = subprocess.run([sys.executable, "-c", "import os; print(os.environ['MUJOCO_EGL_DEVICE_ID'])"],
                          env=environ, capture_output=True, text=True, check=True).stdout.strip()
    assert seen == "3"



def test_a_rank_that_sees_one_gpu_uses_it_and_tells_deepspeed_and_vllm_so(monkeypatch):
    """Under `srun --gpus-per-task=1` rank 3 of a node sees its GPU as device 0: it runs there (not on the
    cuda:3 it cannot see), and LOCAL_RANK, which DeepSpeed and vLLM's external_launcher read as a device
    index, names it. The visible count is faked; set_device records where the rank went."""
    import vagen.decoding_vllm as dv
    from vagen.distributed import device_index, init_distributed, rank_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert rank_device(3) == torch.device("cuda", 0) and rank_device(3, 8) == torch.device("cuda", 0)
    for key, value in {"RANK": "3", "WORLD_SIZE": "1", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                       "MUJOCO_GL": "osmesa", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    dist = init_distributed(need_group=False)
    assert dist.device == torch.device("cuda", 0) and chosen == [torch.device("cuda", 0)]
    assert dist.local_rank == 3 and dist.rank == 3
    assert os.environ["LOCAL_RANK"] == "0"
    assert dv.placement(1, ranks=8, device=0) == {"distributed_executor_backend": "external_launcher"}
    monkeypatch.setenv("LOCAL_RANK", "3")  # an engine built in a rank that init_distributed did not start
    with pytest.raises(RuntimeError, match=r"runs on GPU 0 but LOCAL_RANK=3.*init_distributed"):
        dv.placement(1, ranks=8, device=0)
    # every device visible: the rank's own index, as the DeepSpeed launcher and torchrun give it
    assert device_index(3, 8) == 3 and device_index(3, 8, 8) == 3 and device_index(0, 1, 8) == 0
    # two GPUs per task for eight tasks: no index is surely the rank's own
    for local_rank in (0, 3):
        with pytest.raises(RuntimeError, match=r"local rank \d of 8 ranks on this machine sees 2 CUDA devices.*"
                                               r"--gpus-per-task=1"):
            device_index(local_rank, 2, 8)
    with pytest.raises(RuntimeError, match="local rank 3 of an unknown number of ranks on this machine sees 2"):
        device_index(3, 2)
