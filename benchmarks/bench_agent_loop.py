"""The two rollout schedules of `rollout.backend=vllm` on the same levels and seeds: the per-turn loop
(every running episode's turn in one batch; the next turn once all environments answered) against the
agent loop (`VLLMDecoder.play`: each episode's next request joins the running batch as soon as its
observation is ready). Information only: nothing is asserted. Runs in the vLLM environment:

    .venv-vllm/bin/python benchmarks/bench_agent_loop.py --setting sokoban64     # 16 x 8, 3 turns, 64 tokens
    .venv-vllm/bin/python benchmarks/bench_agent_loop.py --setting sokoban256    # 256 tokens, 5 turns
    .venv-vllm/bin/python benchmarks/bench_agent_loop.py --setting navigation   # env.workers 0 and 2
    PYTHONPATH=/tmp/ray .venv-vllm/bin/python benchmarks/bench_agent_loop.py --setting navigation_ray
                                               # the loop with 2 worker processes and with 2 Ray actors
    .venv-vllm/bin/python benchmarks/bench_agent_loop.py --setting wait_navigation --groups 4 --group-size 4
    .venv-vllm/bin/python benchmarks/bench_agent_loop.py --setting wait_manipulation --groups 4 --group-size 4
                                               # rollout.env_wait_ms: every answer due against bounded waits

    .venv-vllm/bin/python benchmarks/bench_agent_loop.py --setting multitask --iterations 2
                                               # rollout.tasks: the tasks one after another against one loop

(.venv-vllm has no Ray: `.venv-vllm/bin/python -m pip install --no-deps --target /tmp/ray "ray==2.60.0"` puts
it beside the venv without changing it; the venv has Ray's own dependencies through vLLM's.)

The policy is the environment's shipped warm start with vagen's image hooks taken out of its config (stock
vLLM does not run them), at temperature 1. For each schedule: rollout wall time, the engine's forward
passes (scheduler steps that ran at least one request), the mean number of requests per forward pass,
and the share of the rollout the engine spent waiting for environments (stepping them in this process,
or waiting for a worker's answer), the share of environment steps whose answer joined the pass right
after the response (all of them when environments step in this process), and the rollout's wall time per turn
played (every played turn is trained at max_staleness 0). Each schedule plays the levels `--repeats` times after one warm-up
rollout (the engine's compilation); the figures are means over the repeats.

`--setting multitask` plays `multitask_visual`'s tasks (`vagen.tasks.TaskRollouts`, the run's own rollouts) for
`--iterations` iterations after a warm-up rollout, each task's groups one task after another (each its own agent
loop) and in one agent loop, and counts the forward passes per trained turn,
the passes that decoded turns of several tasks, and whether both played the same episodes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {  # config, overrides, (schedule, env.workers[, env.backend]) runs
    "sokoban64": ("sokoban_visual", ["rollout.max_turns=3", "rollout.max_new_tokens=64"],
                  [("turns", 0), ("loop", 0)]),
    "sokoban256": ("sokoban_visual", ["rollout.max_turns=5", "rollout.max_new_tokens=256"],
                   [("turns", 0), ("loop", 0)]),
    "navigation": ("navigation_visual", [], [("turns", 0), ("loop", 0), ("turns", 2), ("loop", 2)]),
    "navigation_ray": ("navigation_visual", [], [("loop", 0), ("loop", 2, "process"), ("loop", 2, "ray")]),
    # the agent loop's wait for environment answers before each pass (rollout.env_wait_ms; None: every one due)
    "wait_navigation": ("navigation_visual", [], [("loop", 2, "process", None), ("loop", 2, "process", 0.0),
                                                  ("loop", 2, "process", 2.0), ("loop", 2, "process", 10.0)]),
    "multitask": ("multitask_visual", [], []),  # `multitask`: rollout.tasks played by `TaskRollouts`
    "wait_manipulation": ("manipulation_visual", [], [("loop", 2, "process", None), ("loop", 2, "process", 0.0),
                                                      ("loop", 2, "process", 10.0), ("loop", 2, "process", 50.0)]),
}


def standard_warm_start(config: str, out: Path) -> Path:
    """A copy of the shipped warm start of `config` whose config.json turns vagen's image hooks off."""
    from vagen.config import load_config
    from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE, base_checkpoint

    shutil.copytree(base_checkpoint(load_config(config, []).model), out)
    settings = json.loads((out / "config.json").read_text())
    for key in (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE):
        settings.pop(key, None)
    (out / "config.json").write_text(json.dumps(settings, indent=2))
    return out


def count_scheduled(engine, counts: dict, steps: str = "steps") -> dict:
    """Wrap `engine`'s scheduler (the engine core's, in this process) so that every step that runs requests adds
    one to `counts[steps]`, its requests to `counts["sequences"]` and the tokens it computes (prefix-cache hits
    left out) to `counts["tokens"]`."""
    from vagen import vllm_compat

    scheduler = vllm_compat.scheduler(engine)
    schedule = scheduler.schedule

    def counted(*args, **kwargs):
        output = schedule(*args, **kwargs)
        if output.num_scheduled_tokens:
            counts[steps] += 1
            counts["sequences"] += len(output.num_scheduled_tokens)
            counts["tokens"] += sum(output.num_scheduled_tokens.values())
        return output

    scheduler.schedule = counted
    return counts


def count_forward_passes(decoder) -> dict:
    """Wrap the engine's scheduler so that every step that runs requests is counted with its requests."""
    return count_scheduled(decoder.llm.llm_engine, {"steps": 0, "sequences": 0, "tokens": 0})


def count_answers_in_time(counts: dict) -> None:
    """Count in `counts["in_time"]` the environment steps whose answer was taken before the pass that
    followed the response (`counts["steps"]` unchanged between `Game.respond` and `Game.step_answered`)."""
    import vagen.rollout

    respond, step_answered, sent = vagen.rollout.Game.respond, vagen.rollout.Game.step_answered, {}

    def responded(game, i, new):
        sent[i] = counts["steps"]
        return respond(game, i, new)

    def answered(game, answer):
        counts["answers"] += 1
        counts["in_time"] += sent.pop(answer.index) == counts["steps"]
        return step_answered(game, answer)

    vagen.rollout.Game.respond, vagen.rollout.Game.step_answered = responded, answered


def play_tasks(args, overrides: list[str]) -> int:
    """`--setting multitask`: every task's episodes one task after another against one agent loop."""
    import torch

    from vagen import vllm_compat
    from vagen.config import load_configs, task_configs
    from vagen.decoding_vllm import VLLMDecoder
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy
    from vagen.rollout import close_envs
    from vagen.tasks import TaskRollouts

    work = Path(tempfile.mkdtemp(prefix="vagen_bench_tasks_"))
    path = standard_warm_start("multitask_visual", work / "model")
    _, processor = load_policy(path, "float32")
    encoder = ChatEncoder(processor)
    cfg = load_configs("multitask_visual", [f"model.path={path}", "rollout.temperature=1.0",
                                            f"rollout.group_size={args.group_size}", *overrides])
    decoder = VLLMDecoder(path, encoder, dtype="float32", seed=0)
    scheduler = vllm_compat.scheduler(decoder.llm.llm_engine)
    schedule, counts = scheduler.schedule, {"steps": 0, "sequences": 0, "mixed": 0, "computed": 0}

    def counted(*a, **kw):  # request ids name their game: game-<task>-... in one loop
        output = schedule(*a, **kw)
        if output.num_scheduled_tokens:
            counts["steps"] += 1
            counts["sequences"] += len(output.num_scheduled_tokens)
            counts["mixed"] += len({r.split("-")[1] for r in output.num_scheduled_tokens}) > 1
            counts["computed"] += sum(output.num_scheduled_tokens.values())  # prefix-cache hits left out
        return output

    scheduler.schedule = counted
    rows, played = [], {}
    for together in (None, True, False):  # None: a warm-up rollout (the engine's compilation)
        source = TaskRollouts(encoder, cfg)
        decoder.llm.reset_prefix_cache()  # both ways play the same levels: neither may find the other's prompts
        counts.update(steps=0, sequences=0, mixed=0, computed=0)
        t0, episodes, generate = time.perf_counter(), [], 0.0
        for iteration in range(1 if together is None else args.iterations):
            played_now, stats = source.play(decoder, iteration, together=bool(together))
            episodes += played_now
            generate += stats["timing/generate"]
        wall = time.perf_counter() - t0
        close_envs(source.all_envs())
        if together is None:
            continue
        turns = sum(len(ep.turns) for ep in episodes)
        played[together] = [(ep.task, ep.group_id, ep.seed, ep.input_ids) for ep in episodes]
        rows.append(("one agent loop" if together else "one task after another", len(episodes), turns,
                     counts["steps"], counts["sequences"], counts["mixed"], counts["computed"], wall, generate))
        print(f"{rows[-1][0]}: {counts['steps']} passes, {turns} turns, {wall:.1f} s", flush=True)
    decoder.close()
    shutil.rmtree(work, ignore_errors=True)

    groups = ", ".join(f"{name} {sub.rollout.env_groups}" for name, sub in task_configs(cfg))
    print(f"\nmultitask: multitask_visual ({groups} groups) x {args.group_size}, {args.iterations} iterations, "
          f"temperature 1, CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads); the same episodes: "
          f"{played[True] == played[False]}")
    print("| tasks played | episodes | trained turns | forward passes | passes per trained turn | sequences / pass | "
          "passes with several tasks | tokens computed | rollout wall s | engine s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, episodes, turns, steps, sequences, mixed, computed, wall, generate in rows:
        print(f"| {name} | {episodes} | {turns} | {steps} | {steps / max(turns, 1):.2f} | "
              f"{sequences / max(steps, 1):.1f} | {mixed} | {computed} | {wall:.1f} | {generate:.1f} |")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="sokoban64")
    parser.add_argument("--groups", type=int, default=None,
                        help="level groups (default 16; multitask: the config's, shared out over the tasks)")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per level group")
    parser.add_argument("--repeats", type=int, default=1, help="measured rollouts per schedule, after a warm-up")
    parser.add_argument("--waits", default="", help="wait_* settings: the rollout.env_wait_ms values to run, "
                                                    "comma-separated, 'all' for null (default: the setting's)")
    parser.add_argument("--iterations", type=int, default=2, help="--setting multitask: measured iterations")
    args = parser.parse_args(argv)
    if args.setting == "multitask":
        return play_tasks(args, [f"rollout.env_groups={args.groups}"] if args.groups else [])
    args.groups = args.groups or 16

    import torch

    from vagen.config import load_config
    from vagen.decoding_vllm import VLLMDecoder
    from vagen.episode import ChatEncoder, train_seeds
    from vagen.models import load_policy
    from vagen.rollout import close_envs, make_envs, rollout

    config, overrides, runs = SETTINGS[args.setting]
    if args.waits:
        runs = [("loop", 2, "process", None if wait == "all" else float(wait)) for wait in args.waits.split(",")]
    work = Path(tempfile.mkdtemp(prefix="vagen_bench_loop_"))
    path = standard_warm_start(config, work / "model")
    model, processor = load_policy(path, "float32")
    encoder = ChatEncoder(processor)
    cfg = load_config(config, [f"model.path={path}", "rollout.temperature=1.0", "rollout.max_trajectory_length=8192",
                               *overrides])
    decoder = VLLMDecoder(path, encoder, dtype="float32", seed=0)
    counts = count_forward_passes(decoder)
    count_answers_in_time(counts)
    seeds = train_seeds(0, args.groups)
    rows = []
    for schedule, workers, *backend in runs:
        cfg.env.workers = workers
        cfg.env.backend = backend[0] if backend else "process"
        waits = len(backend) > 1
        cfg.rollout.env_wait_ms = backend[1] if waits else None
        envs = make_envs(cfg.env, len(seeds) * args.group_size)
        measured = []
        for repeat in range(args.repeats + 1):
            counts.update(steps=0, sequences=0, answers=0, in_time=0)
            t0 = time.perf_counter()
            episodes, timing = rollout(model, encoder, cfg, seeds, args.group_size, decoder=decoder, envs=envs,
                                       schedule=schedule, sample_seed=repeat)
            wall = time.perf_counter() - t0
            tokens = sum(t.response_length for ep in episodes for t in ep.turns)
            turns = sum(len(ep.turns) for ep in episodes)
            print(f"{schedule} workers={workers} {cfg.env.backend} rollout {repeat}: {wall:.1f} s, {counts['steps']} forward passes, "
                  f"{tokens} tokens, env {timing['timing/env']:.1f} s, {counts['in_time']} of {counts['answers']} "
                  f"answers in time for the next pass", flush=True)
            if repeat:  # the first is warm-up
                measured.append((wall, counts["steps"], counts["sequences"], timing["timing/env"], tokens,
                                 counts["in_time"] / max(counts["answers"], 1), wall / max(turns, 1)))
        close_envs(envs)
        mean = [sum(m[k] for m in measured) / len(measured) for k in range(7)]
        where = f"{workers} ({cfg.env.backend})" if workers and backend else workers
        if waits:
            where = f"{where}, wait {'all' if backend[1] is None else f'{backend[1]:g} ms'}"
        rows.append((schedule, where, *mean))
    decoder.close()
    shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.setting}: {config} {' '.join(overrides)}, {args.groups} x {args.group_size} rollouts, temperature 1, "
          f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads), mean of {args.repeats}")
    print("| schedule | env.workers | rollout wall s | forward passes | sequences / pass | engine waits for envs | "
          "tokens | answers in time for the next pass | wall ms per turn |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for schedule, workers, wall, steps, sequences, env, tokens, in_time, per_turn in rows:
        print(f"| {'per-turn' if schedule == 'turns' else 'agent loop'} | {workers} | {wall:.1f} | {steps:.0f} | "
              f"{sequences / max(steps, 1):.1f} | {env / wall:.1%} | {tokens:.0f} | {in_time:.0%} | "
              f"{1000 * per_turn:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
