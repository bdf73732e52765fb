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
from vagen.rollout import InProcessEnvs, make_env, make_envs, rollout

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


STEP = "<think>go</think><answer>Up</answer>"


def _answered(pool, count: int) -> dict:
    """The next `count` answers of `pool`, by environment index."""
    got = {}
    while len(got) < count:
        got.update({answer.index: answer for answer in pool.answers(block=True)})
    return got


def test_by_default_a_worker_stuck_in_a_step_is_replaced_and_only_its_episode_ends(monkeypatch):
    """The default config with workers has a finite step timeout, and the pool a run makes from it uses that
    timeout. A minute then passes at once (the workers' clock skips the default timeout) while environment 0's
    worker is stuck where its alarm cannot reach: that worker is replaced, environment 0's step fails, and
    environment 2, which shares the worker, is rebuilt and answers its step."""
    import math
    import types

    import vagen.env_workers
    from vagen.config_sections import DEFAULT_STEP_TIMEOUT

    cfg = load_config("sokoban_text", ["env.workers=2"])
    assert cfg.env.step_timeout == DEFAULT_STEP_TIMEOUT and math.isfinite(cfg.env.step_timeout)
    made = make_envs(cfg.env, 4)
    try:
        assert made.step_timeout == cfg.env.step_timeout and all(w.step_timeout == cfg.env.step_timeout
                                                                 for w in made.workers)
    finally:
        made.close()
    skipped = [0.0]
    monkeypatch.setattr(vagen.env_workers, "time", types.SimpleNamespace(monotonic=lambda: time.monotonic()
                                                                         + skipped[0]))
    pool = EnvWorkers(FaultyFactory(cfg.env, {(5, 0): "hang_in_c"}), 4, 2, cfg.env.step_timeout)
    try:
        for index, seed in enumerate([5, 6, 7, 8]):  # environments 0 and 2 in worker 0, 1 and 3 in worker 1
            pool.reset(index, seed)
        _answered(pool, 4)
        for index in (0, 1, 2):
            pool.step(index, STEP)
        skipped[0] = DEFAULT_STEP_TIMEOUT
        t0 = time.perf_counter()
        answers = _answered(pool, 3)
        assert time.perf_counter() - t0 < 20  # the worker's grace, and the new worker's start
        assert pool.replaced == 1
        assert answers[0].error.startswith(f"EnvTimeout: no answer within env.step_timeout={DEFAULT_STEP_TIMEOUT} s")
        assert answers[1].error is None and answers[2].error is None
        pool.step(2, STEP)  # played on in the new worker from its rebuilt state
        again = _answered(pool, 1)[2]
        assert again.error is None and again.value[4]["steps"] == 2
    finally:
        pool.close()


def test_a_worker_killed_while_idle_is_replaced_before_its_next_step_and_no_episode_fails():
    """A worker process killed between steps (as when the kernel kills it for memory during an update): the next
    step sent there goes to a new worker, where its environment was rebuilt by replay, and answers as if nothing
    happened; so does the next rollout's first step after a kill (`check_idle`)."""
    import os
    import signal

    cfg = load_config("sokoban_text", [])
    here = InProcessEnvs([make_env(cfg.env) for _ in range(2)], None)
    pool = EnvWorkers(EnvFactory(cfg.env), 2, 2, 30.0)
    try:
        for envs in (here, pool):
            envs.reset(0, 5)
            envs.reset(1, 6)
        _answered(pool, 2)
        for envs in (here, pool):
            envs.step(0, STEP)
        _answered(pool, 1)
        victim = pool.workers[0].process
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        for envs in (here, pool):
            envs.step(0, "<think>go</think><answer>Left</answer>")
        expected, answer = here.answers()[-1], _answered(pool, 1)[0]
        assert pool.replaced == 1 and pool.workers[0].process is not victim
        assert answer.error is None and answer.value[1:4] == expected.value[1:4]
        assert answer.value[4]["state_key"] == expected.value[4]["state_key"]
        # killed while the trainer updates: replaced when the next rollout starts, before any request
        victim = pool.workers[1].process
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        pool.check_idle()
        assert pool.replaced == 2 and pool.workers[1].process.poll() is None
        for envs in (here, pool):
            envs.step(1, STEP)
        assert _answered(pool, 1)[1].value[4]["state_key"] == here.answers()[-1].value[4]["state_key"]
    finally:
        pool.close()


def test_the_agent_loop_waits_for_environment_answers_as_rollout_env_wait_ms_says(tiny_text):
    """Before an engine pass the agent loop takes the answers due: every one (rollout.env_wait_ms=null), or those
    that come within the wait, the others joining a later pass; with nothing to decode, the first answer and those
    within the wait after it. Environment 0's steps take 2 s, environment 1's a few milliseconds."""
    from vagen.decoding import Generated
    from vagen.decoding_vllm.play import AgentLoop
    from vagen.rollout import Game

    _, _, tokenizer = tiny_text
    cfg = load_config("sokoban_text", ["rollout.max_turns=5"])
    pool = EnvWorkers(FaultyFactory(cfg.env, {(5, turn): "slow" for turn in range(3)}), 2, 2, 30.0)
    response = Generated(tokenizer.encode("no answer"))  # no action: the episodes go on
    try:
        game = Game(ChatEncoder(tokenizer), cfg, [5, 6], 1, pool, False, 0)
        for wait_ms, decoding in ((100.0, True), (None, True), (100.0, False)):
            assert game.ready == [0, 1]
            game.ready.clear()
            for row in (0, 1):
                game.respond(row, response)
            cfg.rollout.env_wait_ms = wait_ms
            t0 = time.perf_counter()
            AgentLoop.take_answers([game], decoding)
            took = time.perf_counter() - t0
            if wait_ms is None:  # every answer due
                assert game.ready == [0, 1] and took >= 1.9, (game.ready, took)
            elif decoding:  # the engine decodes other episodes meanwhile: at most the wait
                assert 0 not in game.ready and took < 1.5, (game.ready, took)
            else:  # the first answer (environment 1's) and the wait after it
                assert game.ready == [1] and took < 1.5, (game.ready, took)
            game.take_answers(block=True, all_of_them=True)  # the slow answer, for a later pass
            assert game.ready == [0, 1]
    finally:
        pool.close()


def test_with_nothing_to_decode_the_agent_loop_takes_the_first_answer_of_any_task(tiny_text):
    """Every task's game in one loop (rollout.tasks): with nothing to decode (rollout.env_wait_ms=0, so the fast
    answer comes after the first look), the loop goes on with the answer of whichever task's environment answers
    first, not after the slow one's. Task 0's environment steps in 2 s, task 1's in a few milliseconds."""
    from vagen.decoding import Generated
    from vagen.decoding_vllm.play import AgentLoop
    from vagen.rollout import Game

    _, _, tokenizer = tiny_text
    cfg = load_config("sokoban_text", ["rollout.max_turns=5", "rollout.env_wait_ms=0"])
    pools = [EnvWorkers(FaultyFactory(cfg.env, {(5, 0): "slow"}), 1, 1, 30.0), EnvWorkers(EnvFactory(cfg.env), 1, 1, 30.0)]
    try:
        games = [Game(ChatEncoder(tokenizer), cfg, [seed], 1, pool, False, 0) for seed, pool in zip((5, 6), pools)]
        for game in games:
            game.ready.clear()
            game.respond(0, Generated(tokenizer.encode("no answer")))
        t0 = time.perf_counter()
        AgentLoop.take_answers(games, False)
        assert (games[0].ready, games[1].ready) == ([], [0]) and time.perf_counter() - t0 < 1.5
        games[0].take_answers(block=True, all_of_them=True)
        assert games[0].ready == [0]
    finally:
        for pool in pools:
            pool.close()
