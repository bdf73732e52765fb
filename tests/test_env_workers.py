"""Environments in worker processes (`env.workers`): the same episodes as in the trainer's process, and an
environment that raises, hangs or kills its worker ends only its own episode."""

import time
from pathlib import Path

import pytest
import torch
from faulty_env import FaultyFactory

from vagen.config import load_config
from vagen.env_workers import EnvFactory, EnvWorkers
from vagen.episode import ChatEncoder
from vagen.rollout import InProcessEnvs, make_env, rollout

SEEDS = [5, 6, 7, 8, 9, 10]


def _played(episodes):
    return [(ep.seed, ep.input_ids, [t.info.get("actions") for t in ep.turns], [t.reward for t in ep.turns],
             ep.done, ep.success) for ep in episodes]


def test_workers_play_the_same_episodes_as_the_trainers_process(tiny_text):
    _, model, tokenizer = tiny_text
    cfg = load_config("sokoban_text", ["rollout.max_new_tokens=12", "rollout.max_turns=3", "rollout.temperature=1.0"])
    encoder = ChatEncoder(tokenizer)
    torch.manual_seed(0)  # the hf decoder draws from torch's generator
    here, _ = rollout(model, encoder, cfg, [3, 4], group_size=2)
    cfg.env.workers = 2
    torch.manual_seed(0)
    there, _ = rollout(model, encoder, cfg, [3, 4], group_size=2)
    assert _played(there) == _played(here)
    assert sum(len(ep.turns) for ep in here) >= 6 and all(ep.error is None for ep in there)


def test_frames_come_back_from_a_worker_as_rendered():
    cfg = load_config("sokoban_visual", [])
    local = InProcessEnvs([make_env(cfg.env)], None)
    workers = EnvWorkers(EnvFactory(cfg.env), 1, 1, None)
    try:
        for pool in (local, workers):
            pool.reset(0, 42)
            pool.step(0, "<think>go</think><answer>Up, Left</answer>")
        a, b = local.answers(), workers.answers(block=True) + workers.answers(block=True)
        assert [x.kind for x in b] == ["reset", "step"] and all(x.error is None for x in a + b)
        assert a[0].value[0].images[0].tobytes() == b[0].value[0].images[0].tobytes()
        assert a[1].value[0].images[0].tobytes() == b[1].value[0].images[0].tobytes()
        assert a[1].value[1:4] == b[1].value[1:4] and a[1].value[4]["actions"] == b[1].value[4]["actions"]
        assert a[0].value[2] == b[0].value[2]  # the system prompt
    finally:
        workers.close()


def test_a_step_that_raises_hangs_or_kills_its_worker_ends_only_its_episode(tiny_text, monkeypatch):
    import vagen.env_workers

    _, model, tokenizer = tiny_text
    monkeypatch.setattr(vagen.env_workers, "WORKER_GRACE", 0.5)
    cfg = load_config("sokoban_text", ["rollout.max_new_tokens=8", "rollout.max_turns=3", "env.step_timeout=0.3",
                                       "rollout.temperature=1.0"])
    encoder = ChatEncoder(tokenizer)
    # Two workers: episodes 0, 2, 4 in one, 1, 3, 5 in the other.
    faults = {(5, 0): "exit", (6, 0): "hang", (7, 1): "raise", (8, 1): "hang_in_c"}
    workers = EnvWorkers(FaultyFactory(cfg.env, faults), len(SEEDS), 2, cfg.env.step_timeout)
    # The same episodes where every fault is an exception in the trainer's own process.
    raising = FaultyFactory(cfg.env, {key: "raise" for key in faults})
    try:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        there, stats = rollout(model, encoder, cfg, SEEDS, 1, envs=workers)
        assert time.perf_counter() - t0 < 30
        torch.manual_seed(0)
        here, _ = rollout(model, encoder, cfg, SEEDS, 1, envs=[raising() for _ in SEEDS])
        assert workers.replaced == 2  # the one that exited and the one stuck where the alarm cannot reach
        assert _played(there) == _played(here)
        errors = [ep.error for ep in there]
        assert errors[0].startswith("step 0: EnvWorkerDied: the worker process holding this environment ended "
                                    "(exit code 3)")
        assert errors[1].startswith("step 0: EnvTimeout: no answer within env.step_timeout=0.3 s (")
        assert errors[2].startswith("step 1: ValueError: level state out of bounds")
        assert errors[3].startswith("step 1: EnvTimeout: no answer within env.step_timeout=0.3 s (its worker "
                                    "process did not return to Python within 0.5 s more, and was replaced)")
        assert errors[4] is None and errors[5] is None and stats["rollout/generated_tokens"] > 0
        assert len(there[4].turns) == len(here[4].turns) >= 2  # rebuilt in the new worker, and played on
        # the pool goes on serving the next rollout with its replacement workers
        again, _ = rollout(model, encoder, cfg, [20, 21], 3, envs=workers)
        assert all(ep.error is None and ep.turns for ep in again)
    finally:
        workers.close()
    assert all(worker.process.poll() is not None for worker in workers.workers)


def test_on_step_needs_the_environments_in_this_process(tiny_text):
    _, model, tokenizer = tiny_text
    cfg = load_config("sokoban_text", ["env.workers=1"])
    before = _child_processes()
    with pytest.raises(ValueError, match="lives in a worker process with env.workers > 0; use env.workers=0"):
        rollout(model, ChatEncoder(tokenizer), cfg, [1], 1, on_step=lambda *args: None)
    assert _child_processes() == before  # the workers the refused rollout started are gone


def _child_processes() -> set[int]:
    """This process's children (Linux's /proc), finished ones not yet waited for included."""
    return {int(pid) for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()}
