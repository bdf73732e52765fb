"""Several tasks (rollout.tasks) played by the vLLM engine's agent loop, on real vLLM (the registry's CPU build):

    .venv-vllm/bin/python -m pytest -m vllm tests/test_tasks_vllm.py

One agent loop plays every task's episodes (one engine pass decodes turns of several tasks); each task's requests
take its own tokens per turn, and its groups keep their own ids; with rollout.max_staleness each task carries its
own episodes over the update.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env
from test_vllm import require_vllm

from vagen.config import checkpoints_dir, load_configs, task_configs
from vagen.decoding_vllm import VLLMDecoder
from vagen.episode import ChatEncoder, train_seeds
from vagen.models import load_policy
from vagen.rollout import close_envs
from vagen.tasks import TaskRollouts

pytestmark = pytest.mark.vllm


def _played(episodes):
    return [(ep.task, ep.group_id, ep.seed, ep.input_ids, [t.reward for t in ep.turns]) for ep in episodes]


def test_one_agent_loop_plays_every_task_with_its_own_tokens_per_turn(distributed, tmp_path):
    """Every task's episodes in one engine loop: passes decode turns of both tasks, fewer passes than the tasks
    played one after the other, and the same episodes (tokens, group ids) and metrics at the same seeds."""
    from vagen import vllm_compat

    require_vllm()
    short = tmp_path / "frozenlake_short.yaml"
    short.write_text("env:\n  name: frozenlake\n  render_mode: text\nrollout:\n  max_new_tokens: 6\n")
    cfg = load_configs(None, [f"rollout.tasks=[{{config: sokoban_text, groups: 2}}, {{config: {short}, groups: 1, "
                              f"name: frozenlake_short}}]", "rollout.group_size=2", "rollout.max_turns=2",
                              "train.mini_batch_size=4", "model.path=assets:sokoban_text"])
    path = checkpoints_dir() / "sokoban_text"
    _, processor = load_policy(path)
    encoder = ChatEncoder(processor)
    decoder = VLLMDecoder(path, encoder, dtype="float32", seed=0)
    scheduler = vllm_compat.scheduler(decoder.llm.llm_engine)
    schedule, passes = scheduler.schedule, []

    def counted(*args, **kwargs):  # the games (tasks, in one loop) of each pass that ran requests
        output = schedule(*args, **kwargs)
        if output.num_scheduled_tokens:
            passes.append({request.split("-")[1] for request in output.num_scheduled_tokens})
        return output

    scheduler.schedule = counted
    played = {}
    try:
        for together in (False, True):
            source = TaskRollouts(encoder, cfg)
            try:
                passes.clear()
                played[together] = (*source.play(decoder, version=0, together=together), list(passes))
            finally:
                close_envs(source.all_envs())
    finally:
        decoder.close()
    (after, after_stats, after_passes), (episodes, stats, one_loop) = played[False], played[True]
    assert _played(episodes) == _played(after)  # request seeds are per row and turn, whatever shares the pass
    assert {k: v for k, v in stats.items() if "timing" not in k} == {
        k: v for k, v in after_stats.items() if "timing" not in k}
    assert any(games == {"0", "1"} for games in one_loop)  # a pass decoded turns of both tasks
    assert len(one_loop) < len(after_passes), (len(one_loop), len(after_passes))
    assert [(ep.task, ep.group_id, ep.seed) for ep in episodes] == [
        ("sokoban_text", 0, 0), ("sokoban_text", 0, 0), ("sokoban_text", 1, 1), ("sokoban_text", 1, 1),
        ("frozenlake_short", 2, 0), ("frozenlake_short", 2, 0)]
    short_turns = [t for ep in episodes if ep.task == "frozenlake_short" for t in ep.turns]
    assert short_turns and all(t.response_length <= 7 for t in short_turns)  # 6 sampled, and <|im_end|>
    # the Sokoban warm start writes a <think> longer than FrozenLake's 6 tokens
    assert max(t.response_length for ep in episodes if ep.task == "sokoban_text" for t in ep.turns) > 7
    assert stats["rollout/sokoban_text/format_ok"] > 0 and stats["rollout/frozenlake_short/format_ok"] == 0.0


@pytest.mark.slow  # 3 iterations of two tasks (~1 min idle); the scripted test in test_tasks.py covers the rule by default
def test_each_task_carries_its_own_episodes_over_updates_at_most_k_old(tmp_path):
    """rollout.max_staleness=1 over two text tasks from the shipped Sokoban text warm start (standard Qwen2: no
    image hooks), whose episodes end after 1 to 5 turns: each task's rollout ends once its 2 groups due have
    ended, and trains exactly those, its other episodes go on after the update, no trained turn is more than one update old, every group
    a task admitted is trained (or filtered out: the reward-std filter keeps half of each task's) or in
    flight, never twice, and the last rollout drains before the checkpoint."""
    require_vllm()
    record = tmp_path / "rollouts.jsonl"
    tasks = tmp_path / "two_text_tasks.yaml"
    tasks.write_text("rollout:\n  tasks: [{config: sokoban_text, groups: 2}, {config: frozenlake_text, groups: 2}]\n")
    overrides = [str(tasks), "model.path=assets:sokoban_text", "rollout.backend=vllm", "algo.rollout_correction=tis",
                 "rollout.max_staleness=1", "train.iterations=3", "train.seed=3", "rollout.group_size=2",
                 "rollout.max_turns=5", "rollout.max_new_tokens=48", "algo.filter_mode=std",
                 "algo.filter_keep_ratio=0.5", "train.mini_batch_size=4", "train.micro_batch_size=2", "eval.every=0",
                 "log.progress=false", f"train.run_dir={tmp_path}", "train.run_name=run"]
    worker = Path(__file__).parent / "tasks_worker.py"
    out = subprocess.run([sys.executable, str(worker), "--record", str(record), "--config", *overrides],
                         env=child_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stdout[-3000:] + out.stderr[-5000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["iteration"] for r in metrics] == [r["version"] for r in rollouts] == [0, 1, 2]
    assert all(r["rollout/staleness_max"] <= 1 for r in metrics)
    assert any(r["rollout/carried_episodes"] > 0 for r in metrics) and metrics[-1]["rollout/carried_episodes"] == 0
    assert metrics[1]["rollout/staleness_max"] == 1  # groups played beside the first ones were trained one update later
    trained = {"sokoban_text": [], "frozenlake_text": []}
    for played, r in zip(rollouts, metrics):
        groups = {}
        for ep in played["episodes"]:
            groups.setdefault(ep["group_id"], set()).add((ep["task"], ep["admission"]))
            assert all(played["version"] - 1 <= v <= played["version"] for v in ep["versions"])
        assert all(len(members) == 1 for members in groups.values())  # a group is one task's, one admission
        assert r["rollout/filter_total_groups"] == len(groups)  # every group that ended went to the filter
        for name, state in played["tasks"].items():
            numbers = sorted({ep["admission"] for ep in played["episodes"] if ep["task"] == name})
            assert len(numbers) == 2  # exactly the task's share, its 2 groups admitted first
            trained[name] += numbers
            assert len(trained[name]) == len(set(trained[name])) and not set(trained[name]) & set(state["in_flight"])
            assert set(trained[name]) | set(state["in_flight"]) == set(range(state["started"]))
            for key in ("success", "reward_mean", "turns", "format_ok"):
                assert f"rollout/{name}/{key}" in r, (name, key)
    assert all(not state["in_flight"] for state in rollouts[-1]["tasks"].values())  # drained before the checkpoint


@pytest.mark.slow  # two gloo ranks, then one, each with its engine (~4 min idle)
def test_each_tasks_staleness_survives_a_forced_save_and_a_change_of_rank_count(tmp_path):
    """rollout.max_staleness=1 over two text tasks on two gloo ranks (each rank holds one group of each task); every
    step of iteration 1 fails (train.max_bad_steps=1), so the run stops with a checkpoint saved while groups were in
    flight. Resumed on one rank (`train.resume=auto`, the admission counts of both ranks joined by
    `TaskAdmissions.load_ranks`), each task skips every level the two ranks had admitted, goes on with the next
    levels of the synchronous run's order, and still carries episodes over updates: k = 1 intact, no level trained
    twice."""
    require_vllm()
    tasks = tmp_path / "two_text_tasks.yaml"
    tasks.write_text("rollout:\n  tasks: [{config: sokoban_text, groups: 2}, {config: frozenlake_text, groups: 2}]\n")
    overrides = [str(tasks), "model.path=assets:sokoban_text", "rollout.backend=vllm", "algo.rollout_correction=tis",
                 "rollout.max_staleness=1", "train.iterations=4", "train.seed=3", "rollout.group_size=2",
                 "rollout.max_turns=5", "rollout.max_new_tokens=48", "train.mini_batch_size=4",
                 "train.micro_batch_size=2", "train.max_bad_steps=1", "eval.every=0", "log.progress=false",
                 "train.dist_timeout_minutes=5", f"train.run_dir={tmp_path}", "train.run_name=run"]
    worker = Path(__file__).parent / "tasks_worker.py"
    first, later = tmp_path / "first.jsonl", tmp_path / "later.jsonl"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stopped = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                              str(port), str(worker), "--record", str(first), "--nan-from", "1", "--config",
                              *overrides], env=child_env(), capture_output=True, text=True, timeout=900)
    assert stopped.returncode != 0, stopped.stdout[-3000:] + stopped.stderr[-5000:]
    checkpoints = tmp_path / "run" / "checkpoints"
    state = json.loads((checkpoints / (checkpoints / "latest").read_text() / "trainer_state.json").read_text())
    assert state["ranks"] == 2
    saved = state["admission"]["ranks"]
    assert len(saved) == 2
    names = ("sokoban_text", "frozenlake_text")
    assert any(rank["tasks"][name]["started"] > rank["tasks"][name]["ended"] for rank in saved for name in names)
    admitted = {name: max(rank["tasks"][name]["started"] for rank in saved) for name in names}  # per rank, 1 group
    played = {name: set() for name in names}
    for rank in (0, 1):
        for rollout in map(json.loads, Path(f"{first}.rank{rank}").read_text().splitlines()):
            for ep in rollout["episodes"]:
                played[ep["task"]].add(ep["seed"])
    resumed = subprocess.run([sys.executable, str(worker), "--record", str(later), "--config", *overrides,
                              "train.resume=auto"], env=child_env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, \
        resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert "resuming from" in resumed.stdout
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in metrics] == [0, 1, 2, 3][: len(metrics)] and metrics[-1]["iteration"] == 3
    rollouts = [json.loads(line) for line in later.read_text().splitlines()]
    cfg = load_configs(str(tasks), overrides[1:])
    subs = dict(task_configs(cfg))
    for name in names:
        sub = subs[name]
        # two ranks of one group each admitted `admitted` groups apiece: 2 x admitted of the task's order, i.e.
        # iterations 0 .. admitted - 1 of its 2 groups; the resumed run's first update trains iteration `admitted`'s
        first_levels = {ep["seed"] for ep in rollouts[0]["episodes"] if ep["task"] == name}
        assert first_levels == set(train_seeds(admitted[name], 2, sub.train.seed)), (name, admitted, first_levels)
        trained = [ep["seed"] for r in rollouts for ep in r["episodes"] if ep["task"] == name]
        assert not set(trained) & played[name]
    assert any(r["rollout/carried_episodes"] > 0 for r in metrics[-len(rollouts):-1])  # k = 1 after the resumption
    assert all(r["rollout/filter_total_groups"] == 4 for r in metrics)
