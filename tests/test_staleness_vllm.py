"""rollout.max_staleness through whole training runs with rollout.backend=vllm (the registry's CPU build, in the
environment scripts/vllm_env.sh builds):

    .venv-vllm/bin/python -m pytest -m vllm tests/test_staleness_vllm.py

k = 0 trains exactly as the synchronous run did; at k = 2 a run resumed from a checkpoint, after a clean stop or a
SIGKILL, is the run never interrupted (the rollout before a checkpoint drains, so no episode is lost with the
process); under ZeRO-3 a rank that carries nothing and one that carries long episodes meet at every collective.
The runs play sokoban_visual from the shipped warm start with its image hooks off (`standard_copy`), whose episodes
differ in length, so that episodes are carried over updates in practice.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import child_env
from test_vllm import require_vllm, standard_copy

from vagen.config import checkpoints_dir

pytestmark = pytest.mark.vllm

WORKER = Path(__file__).parent / "staleness_worker.py"
SMALL = ["rollout.backend=vllm", "rollout.env_groups=2", "rollout.group_size=2", "train.mini_batch_size=4",
         "train.micro_batch_size=2", "train.iterations=4", "eval.every=0", "log.progress=false"]
# k = 2: two groups per update, six in flight; the checkpoint after iteration 1 and at the end (iteration 3)
K2 = [*SMALL, "algo.rollout_correction=tis", "rollout.max_staleness=2", "train.save_every=2", "train.seed=0",
      "rollout.max_turns=5"]


def _train(run_dir: Path, name: str, *overrides: str, worker: tuple = (), ranks: int = 1):
    """vagen/train.py's `main` through tests/staleness_worker.py (`worker`: its options) as run `name` under
    `run_dir`, on `ranks` gloo ranks (the DeepSpeed launcher for more than one)."""
    args = [*worker, "--config", *overrides, f"train.run_dir={run_dir}", f"train.run_name={name}"]
    if ranks == 1:
        cmd = [sys.executable, str(WORKER), *args]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
               str(port), str(WORKER), *args]
    return subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)


def _succeeded(done) -> None:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "Traceback" not in done.stderr, done.stderr[-5000:]


def _record(run: Path) -> list[dict]:
    """metrics.jsonl without what depends on the clock."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.startswith("timing/")}
            for line in lines]


def _rollouts(folder: Path, rank: int = 0) -> list[dict]:
    """The rollouts tests/staleness_worker.py recorded (`--record`)."""
    return [json.loads(line) for line in (folder / f"rank{rank}.jsonl").read_text().splitlines()]


def _same_weights(checkpoint: Path, other: Path) -> None:
    """The actor's and the critic's parameters in the two checkpoints are equal, bit for bit."""
    from safetensors.torch import load_file

    compared = 0
    for part in ("actor", "critic/backbone"):
        shards = sorted((checkpoint / part).glob("*.safetensors"))
        assert [p.name for p in shards] == [p.name for p in sorted((other / part).glob("*.safetensors"))]
        for shard in shards:
            mine, theirs = load_file(shard), load_file(other / part / shard.name)
            assert mine.keys() == theirs.keys()
            for key, value in mine.items():
                assert torch.equal(value, theirs[key]), f"{part}/{key}"
                compared += 1
    head, other_head = (torch.load(c / "critic" / "value_head.pt")["weight"] for c in (checkpoint, other))
    assert torch.equal(head, other_head)
    assert compared > 10


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    require_vllm()
    return standard_copy(checkpoints_dir() / "sokoban_visual", tmp_path_factory.mktemp("staleness") / "sokoban_visual")


@pytest.fixture(scope="module")
def uninterrupted(warm_start, tmp_path_factory):
    """(run directory, recorded rollouts) of the k = 2 run never interrupted."""
    root = tmp_path_factory.mktemp("uninterrupted")
    _succeeded(_train(root, "whole", "sokoban_visual", f"model.path={warm_start}", *K2, worker=("--record", str(root))))
    return root / "whole", _rollouts(root)


def _check_k2(records: list[dict], rollouts: list[dict]) -> None:
    """The uninterrupted k = 2 run is worth comparing against: before and after its checkpoint it trained groups
    played before the previous update (the rollouts before a checkpoint admit 2 x 2 groups, then none), trained
    none older than k, 2 groups per update, and drained before each checkpoint."""
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert [r["version"] for r in rollouts] == [0, 1, 2, 3]
    assert records[1]["rollout/staleness_max"] == records[3]["rollout/staleness_max"] == 1
    assert records[1]["rollout/carried_episodes"] == records[3]["rollout/carried_episodes"] == 0  # drained
    assert all(r["rollout/filter_total_groups"] == 2 for r in records)
    for rollout in rollouts:
        assert all(rollout["version"] - 2 <= v <= rollout["version"] for ep in rollout["episodes"]
                   for v in ep["versions"])


def test_a_k2_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(warm_start, uninterrupted, tmp_path):
    """The run stopped after its checkpoint at iteration 2 (its run directory as that checkpoint left it) and
    resumed plays the groups the uninterrupted run played, carried over the same updates, and ends with the same
    metrics (timing aside) and parameters."""
    whole, rollouts = uninterrupted
    expected = _record(whole)
    _check_k2(expected, rollouts)
    stopped = tmp_path / "stopped"
    shutil.copytree(whole, stopped)
    shutil.rmtree(stopped / "checkpoints" / "step_4")
    (stopped / "checkpoints" / "latest").write_text("step_2")
    done = _train(tmp_path, "stopped", "sokoban_visual", f"model.path={warm_start}", *K2,
                  f"train.resume={stopped / 'checkpoints' / 'step_2'}", worker=("--record", str(tmp_path)))
    _succeeded(done)
    assert f"resuming from {stopped / 'checkpoints' / 'step_2'} at iteration 2" in done.stdout
    assert _rollouts(tmp_path) == rollouts[2:]  # the same groups (admission numbers), turn versions and carry-over
    assert _record(stopped) == expected
    _same_weights(stopped / "checkpoints" / "step_4", whole / "checkpoints" / "step_4")


@pytest.mark.slow
def test_a_k2_run_killed_while_episodes_are_carried_resumes_as_if_never_killed(warm_start, uninterrupted, tmp_path):
    """SIGKILL in the update of iteration 2, after the checkpoint at iteration 2 and while this process held
    episodes waiting for the next weights: `train.resume=auto` starts again from the checkpoint, which holds no
    carried episode, and ends as the run never killed."""
    whole, rollouts = uninterrupted
    run = [f"model.path={warm_start}", *K2]
    killed = _train(tmp_path, "killed", "sokoban_visual", *run, worker=("--record", str(tmp_path / "killed"),
                                                                        "--kill-in-update", "2"))
    assert killed.returncode == -9, killed.stdout[-3000:] + killed.stderr[-5000:]  # SIGKILL
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_2"]
    assert (checkpoints / "latest").read_text() == "step_2"
    played = _rollouts(tmp_path / "killed")
    assert played == rollouts[:3] and played[-1]["carried"] > 0  # lost with the process
    assert [r["iteration"] for r in _record(tmp_path / "killed")] == [0, 1]
    resumed = _train(tmp_path, "killed", "sokoban_visual", *run, "train.resume=auto",
                     worker=("--record", str(tmp_path)))
    _succeeded(resumed)
    assert "resuming from" in resumed.stdout
    assert _rollouts(tmp_path) == rollouts[2:]
    assert _record(tmp_path / "killed") == _record(whole)
    _same_weights(checkpoints / "step_4", whole / "checkpoints" / "step_4")


def test_k0_trains_bit_for_bit_as_the_synchronous_run(warm_start, tmp_path):
    """rollout.max_staleness=0 against the run without the key whose rollouts are played as training played them
    before the key existed (`vagen.rollout.rollout` over each iteration's level seeds, a game of its own per
    rollout: staleness_worker.py --synchronous), over 4 iterations: the same metrics, timing aside, and the same
    parameters."""
    run = ["sokoban_visual", f"model.path={warm_start}", *SMALL, "rollout.max_turns=3", "train.seed=1"]
    synchronous = _train(tmp_path, "synchronous", *run, worker=("--synchronous",))
    _succeeded(synchronous)
    assert [f"rollout {v}: played synchronously" in synchronous.stdout for v in range(4)] == [True] * 4
    k0 = _train(tmp_path, "k0", *run, "rollout.max_staleness=0")
    _succeeded(k0)
    records = _record(tmp_path / "k0")
    assert [r["iteration"] for r in records] == [0, 1, 2, 3]
    assert records == _record(tmp_path / "synchronous")
    assert all(r["rollout/carried_episodes"] == r["rollout/staleness_max"] == 0 for r in records)
    assert all(r["actor/grad_norm"] > 0 and r["rollout/generated_tokens"] > 0 for r in records)  # it trained
    _same_weights(tmp_path / "k0" / "checkpoints" / "step_4", tmp_path / "synchronous" / "checkpoints" / "step_4")


def test_every_iteration_trains_the_configured_groups_in_the_same_optimizer_steps_at_every_k(warm_start, tmp_path):
    """The run without rollout.max_staleness, and at k = 1 and k = 2 (3 iterations, episodes of 1 to 5 turns):
    every update filters and trains rollout.env_groups = 2 groups, in as many optimizer steps as without the key,
    while at k > 0 turns are trained up to k updates after they were sampled, never later, and at k = 1 episodes
    wait for the next weights. (At k = 2 the 6 groups admitted first may all end together, which leaves nothing
    to carry within 3 iterations.)"""
    run = ["sokoban_visual", f"model.path={warm_start}", *SMALL, "rollout.max_turns=5", "train.seed=1",
           "train.iterations=3"]
    records = {}
    for k in (0, 1, 2):
        stale = [f"rollout.max_staleness={k}", "algo.rollout_correction=tis"] if k else []
        _succeeded(_train(tmp_path, f"k{k}", *run, *stale))
        records[k] = _record(tmp_path / f"k{k}")
    steps = [r["update/optimizer_steps"] for r in records[0]]
    assert steps[0] >= 1
    for k, rows in records.items():
        assert [r["iteration"] for r in rows] == [0, 1, 2]
        assert [r["rollout/filter_total_groups"] for r in rows] == [2.0] * 3
        assert [r["update/optimizer_steps"] for r in rows] == steps
        assert max(r["rollout/staleness_max"] for r in rows) == k  # turns trained k updates after they were sampled
    assert sum(r["rollout/carried_episodes"] for r in records[1]) > 0
    assert sum(r["rollout/carried_episodes"] for r in records[0]) == 0


def test_a_checkpoint_forced_by_failing_steps_at_k1_resumes_carrying_episodes(warm_start, tmp_path):
    """k = 1, every step of iteration 1 fails (train.max_bad_steps=1): the run stops with a checkpoint forced while
    groups were in flight. Resumed (train.resume=auto), it admits (k + 1) x 2 groups again, after the last one the
    first run admitted, and carries episodes over updates; before, the groups in flight stayed counted for good
    and the resumed run was synchronous without a word."""
    run = ["sokoban_visual", f"model.path={warm_start}", *SMALL, "algo.rollout_correction=tis",
           "rollout.max_staleness=1", "rollout.max_turns=5", "train.seed=0", "train.iterations=5",
           "train.max_bad_steps=1"]
    for folder in ("first", "resumed"):
        (tmp_path / folder).mkdir()
    stopped = _train(tmp_path, "forced", *run, worker=("--record", str(tmp_path / "first"), "--nan-from", "1"))
    assert stopped.returncode == 1, stopped.stdout[-3000:] + stopped.stderr[-5000:]
    checkpoints = tmp_path / "forced" / "checkpoints"
    assert (checkpoints / "latest").read_text() == "step_2"
    first = _rollouts(tmp_path / "first")
    saved = json.loads((checkpoints / "step_2" / "trainer_state.json").read_text())["admission"]["ranks"][0]
    assert saved["started"] > saved["ended"] == 4  # groups were in flight when it was saved, 2 trained per update
    resumed = _train(tmp_path, "forced", *run, "train.resume=auto", worker=("--record", str(tmp_path / "resumed")))
    _succeeded(resumed)
    assert "resuming from" in resumed.stdout
    records = _record(tmp_path / "forced")
    assert [r["iteration"] for r in records] == [0, 1, 2, 3, 4]
    later = _rollouts(tmp_path / "resumed")
    # the resumed run trains groups admitted after every one the first run had started (their levels are skipped)
    assert [ep["admission"] for ep in later[0]["episodes"]] == [n for n in range(saved["started"], saved["started"] + 2)
                                                                for _ in range(2)], (saved, first, later[0])
    assert any(r["rollout/carried_episodes"] > 0 for r in records[2:])  # k = 1 intact after the resumption
    assert all(r["rollout/filter_total_groups"] == 2 for r in records)


@pytest.mark.slow
def test_zero3_ranks_one_carrying_nothing_one_carrying_long_episodes_do_not_deadlock(tmp_path):
    """k = 2 over two gloo ranks under ZeRO-3 (sokoban_text's warm start, 2 groups of 2 per rank and update):
    every episode of rank 0 ends after its first turn, so it never holds one back between turns, and its groups
    that ended beyond the 2 due wait, ended, for their update; on rank 1 the groups played in the first 2 groups' slots end so too, and the others run to
    the turn limit, waiting across updates. The ranks meet at every collective (the carried count, the group plan
    and the moves that even out the groups, the annotation, the update, the weight sync) whatever each played,
    and the turns of the long episodes are trained 2 updates late at most."""
    turns = 4
    done = _train(tmp_path, "zero3", "sokoban_text", *SMALL, "rollout.env_groups=4", f"rollout.max_turns={turns}",
                  "train.iterations=3", "algo.rollout_correction=tis", "rollout.max_staleness=2",
                  "train.deepspeed_config=deepspeed/zero3_fp32.json", "train.dist_timeout_minutes=5",
                  worker=("--record", str(tmp_path), "--long-rank", "1", "--short-slots", "4"), ranks=2)
    _succeeded(done)
    records = _record(tmp_path / "zero3")
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all(r["rollout/staleness_max"] <= 2 for r in records) and records[-1]["rollout/staleness_max"] == 2
    assert records[0]["rollout/carried_episodes"] > 0 and records[-1]["rollout/carried_episodes"] == 0
    short, long = _rollouts(tmp_path, 0), _rollouts(tmp_path, 1)
    assert [r["version"] for r in short] == [r["version"] for r in long] == [0, 1, 2]
    assert all(r["carried"] == 0 for r in short)
    assert all(r["version"] - 2 <= v <= r["version"] for r in short for ep in r["episodes"] for v in ep["versions"])
    assert [len(r["episodes"]) for r in short] == [2 * 2] * 3  # 2 groups per update, though all 6 ended at once
    # rank 1 closed its first rollout on the 2 short groups, with the 4 long ones unfinished
    assert long[0]["carried"] == 4 * 2 and len(long[0]["episodes"]) == 2 * 2
    lengths = {len(ep["versions"]) for r in long for ep in r["episodes"]}
    assert lengths == {1, turns}
    ages = [r["version"] - v for r in long for ep in r["episodes"] for v in ep["versions"]]
    assert max(ages) == 2  # carried over two updates, trained at the bound, never later
