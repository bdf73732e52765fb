"""One run over several tasks against one run per task, at one CPU budget, from one warm start.

Arms, each a run of the same config (by default `multitask_visual`: its algorithm, learning rates, batches and group
size) from the same `--warm-start`, differing only in `rollout.tasks`:

- `mixed`: the config's tasks with their shares of the level groups (Sokoban 2, FrozenLake 1, navigation 1);
- one arm per task: that task alone, with all the config's level groups per iteration (4), so every arm trains
  the same episodes per iteration.

Each (arm, training seed) trains in chunks of `--chunk` iterations (resumed from the last checkpoint) until its
training process has spent `--minutes` CPU-minutes (environments step in that process), then its last checkpoint
and the warm start are played greedily on each task's first `--eval-n` distinct held-out levels (the levels every
card uses). A single-task arm is evaluated on every task, so what it does to the tasks it did not train on shows too.
Writes OUT/results.json and prints Markdown tables: per-task success of each seed and pooled (95% Wilson intervals),
and mixed − single on each task per seed, their mean (95% t interval over seeds) and pooled (Newcombe's interval).

    python benchmarks/multitask_learning.py --warm-start runs/ws_multitask_visual --out runs/multitask_cmp \\
        --minutes 8 --seeds 2 --eval-n 128 --jobs 2
    python benchmarks/multitask_learning.py --out runs/multitask_cmp --report      # the tables again
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from staleness_learning import iteration_rows, newcombe, t_interval  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="multitask_visual", help="a config that lists rollout.tasks")
    parser.add_argument("--warm-start", default=None, help="the checkpoint every arm starts from")
    parser.add_argument("--arms", nargs="+", default=None, help="mixed and task names (default: all)")
    parser.add_argument("--minutes", type=float, default=8.0, help="CPU-minutes of training per arm and seed")
    parser.add_argument("--seeds", type=int, default=2, help="training seeds per arm")
    parser.add_argument("--chunk", type=int, default=20, help="iterations per training call")
    parser.add_argument("--eval-n", type=int, default=128, help="distinct held-out levels per task")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, each a process with one thread")
    parser.add_argument("--out", default="runs/multitask_cmp")
    parser.add_argument("--report", action="store_true", help="only print the tables of OUT/results.json")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child: ARM:SEED (SEED -1: warm start)
    parser.add_argument("overrides", nargs="*", help="section.key=value for every arm")
    return parser.parse_args(argv)


def arm_overrides(arm: str, cfg) -> list[str]:
    """`rollout.tasks` of an arm: the config's own for `mixed`, else the named task with every level group."""
    if arm == "mixed":
        return []
    names = [task.name for task in cfg.rollout.tasks]
    if arm not in names:
        raise SystemExit(f"arm {arm!r}: expected mixed or one of the tasks of {cfg.name}: {', '.join(names)}")
    task = cfg.rollout.tasks[names.index(arm)]
    groups = sum(t.groups for t in cfg.rollout.tasks)
    return [f"rollout.tasks=[{{config: {task.config}, groups: {groups}}}]", "sft.task_shares=[1]"]


def held_out_by_task(checkpoint: Path, cfg, n: int) -> dict[str, dict]:
    """Greedy held-out metrics of `checkpoint` on each task of `cfg` (its first `n` distinct evaluation levels, the
    cards' levels, with `successes` for intervals; `vagen.eval.evaluate_tasks` plays a run's eval.episodes levels
    and writes their folders instead)."""
    from vagen.config import task_configs
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy
    from vagen.warmstart.demos import distinct_eval_seeds
    from vagen.warmstart.sft import held_out_metrics

    model, processor = load_policy(Path(checkpoint), cfg.model.dtype)
    encoder = ChatEncoder(processor)
    return {name: held_out_metrics(model, encoder, sub, distinct_eval_seeds(sub.env, n), do_sample=False)
            for name, sub in task_configs(cfg)}


def train_arm(arm: str, seed: int, args, cfg) -> dict:
    """Train one arm and seed to the CPU budget; its CPU time, iterations, trained episodes per task and the
    evaluation of its last checkpoint."""
    from vagen.config import load_config, task_configs
    from vagen.train import main as train_main

    out = Path(args.out)
    run_name = f"{arm}-seed{seed}"
    overrides = [f"model.path={args.warm_start}", f"train.seed={seed}", f"train.run_dir={out / 'runs'}",
                 f"train.run_name={run_name}", f"train.save_every={args.chunk}", "log.progress=false",
                 "log.tensorboard=false", *args.overrides, *arm_overrides(arm, cfg)]
    cpu, iterations = 0.0, 0
    while cpu < args.minutes * 60:
        resume = ["train.resume=auto"] if iterations else []
        iterations += args.chunk
        start = time.process_time()
        code = train_main(["--config", args.config, *overrides, f"train.iterations={iterations}", *resume])
        cpu += time.process_time() - start
        if code != 0:
            raise RuntimeError(f"{run_name}: training exited with {code}")
        print(f"  {run_name}: {iterations} iterations, {cpu / 60:.2f} CPU-minutes", flush=True)
    arm_cfg = load_config(args.config, overrides)
    trained = {name: iterations * sub.rollout.env_groups * sub.rollout.group_size for name, sub in task_configs(arm_cfg)}
    checkpoint = out / "runs" / run_name / "checkpoints" / f"step_{iterations}" / "actor"
    return {"cpu_minutes": cpu / 60, "iterations": iterations, "trained_episodes": trained,
            "eval": held_out_by_task(checkpoint, cfg, args.eval_n)}


def run_children(jobs: list[tuple[str, int]], args, parts: Path) -> list[str]:
    """Each (arm, seed) as a child process of this script, `--jobs` at a time (seed -1: the warm start's
    evaluation); each writes parts/ARM-seedSEED.json. Returns the failed ones."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--config", args.config, "--warm-start", args.warm_start, "--minutes", str(args.minutes), "--chunk",
              str(args.chunk), "--eval-n", str(args.eval_n), "--out", args.out, *args.overrides]
    running, failed, todo = [], [], list(jobs)
    while todo or running:
        while todo and len(running) < args.jobs:
            arm, seed = todo.pop(0)
            if (parts / f"{arm}-seed{seed}.json").exists():
                continue  # finished by an earlier call
            with open(parts / f"{arm}-seed{seed}.log", "w") as log:  # the child keeps its own handle
                running.append((arm, seed, subprocess.Popen([sys.executable, __file__, "--part", f"{arm}:{seed}",
                                                             *common], env=env, stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(2.0)
        for job in [job for job in running if job[2].poll() is not None]:
            running.remove(job)
            if job[2].returncode != 0:
                failed.append(f"{job[0]} seed {job[1]} (exit {job[2].returncode}, log {parts}/{job[0]}-seed{job[1]}.log)")
    return failed


def training_success(metrics: Path, window: int = 5) -> dict[str, list[float]]:
    """Each task's success on its training rollouts (sampled), the mean of the first and of the last `window`
    iterations of a run's metrics.jsonl (`staleness_learning.iteration_rows`: each iteration once)."""
    ordered = iteration_rows(metrics)
    tasks = [key.split("/")[1] for key in ordered[0] if key.startswith("rollout/") and key.count("/") == 2
             and key.endswith("/success")]
    return {task: [sum(row[f"rollout/{task}/success"] for row in part) / len(part)
                   for part in (ordered[:window], ordered[-window:])] for task in tasks}


def wilson(row: dict) -> str:
    from vagen.eval import wilson_interval

    low, high = wilson_interval(row["successes"], row["n"])
    return f"{row['success']:.3f} ({low:.3f}–{high:.3f})"


def pooled(rows: list[dict]) -> dict:
    successes, n = sum(r["successes"] for r in rows), sum(r["n"] for r in rows)
    return {"successes": successes, "n": n, "success": successes / n}


def tables(results: dict) -> str:
    """Markdown: per-task greedy success of the warm start and of each arm (seeds and pooled), its budget, and
    mixed − the task's own arm on each task."""
    tasks = list(results["warm_start"])
    arms = results["arms"]
    lines = ["| arm | seed | CPU-min | iterations | trained episodes | " + " | ".join(tasks) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in tasks) + " |",
             "| warm start | – | – | 0 | 0 | " + " | ".join(wilson(results["warm_start"][t]) for t in tasks) + " |"]
    for arm, seeds in arms.items():
        for seed, run in sorted(seeds.items()):
            episodes = ", ".join(f"{t.split('_')[0]} {k}" for t, k in run["trained_episodes"].items())
            lines.append(f"| {arm} | {seed} | {run['cpu_minutes']:.1f} | {run['iterations']} | {episodes} | "
                         + " | ".join(wilson(run["eval"][t]) for t in tasks) + " |")
        lines.append(f"| {arm} | pooled | | | | "
                     + " | ".join(wilson(pooled([r["eval"][t] for r in seeds.values()])) for t in tasks) + " |")
    if all("training_success" in run for seeds in arms.values() for run in seeds.values()):
        lines += ["", "| arm | seed | training rollouts' success, first 5 → last 5 iterations |", "| --- | --- | --- |"]
        for arm, seeds in arms.items():
            for seed, run in sorted(seeds.items()):
                lines.append(f"| {arm} | {seed} | " + "; ".join(f"{task} {first:.3f} → {last:.3f}" for task, (first, last)
                                                             in run["training_success"].items()) + " |")
    if "mixed" in arms:
        lines += ["", "| task | mixed − single, per seed | mean (95% t interval over seeds) | pooled (Newcombe 95%) |",
                  "| --- | --- | --- | --- |"]
        for task in [t for t in tasks if t in arms]:
            seeds = sorted(set(arms["mixed"]) & set(arms[task]))
            diffs = [arms["mixed"][s]["eval"][task]["success"] - arms[task][s]["eval"][task]["success"] for s in seeds]
            mean = (f"{t_interval(diffs)[0]:+.3f} ({t_interval(diffs)[1]:+.3f} to {t_interval(diffs)[2]:+.3f})"
                    if len(diffs) > 1 else "–")
            a = pooled([arms["mixed"][s]["eval"][task] for s in seeds])
            b = pooled([arms[task][s]["eval"][task] for s in seeds])
            d, low, high = newcombe(a["successes"], a["n"], b["successes"], b["n"])
            lines.append(f"| {task} | {', '.join(f'{x:+.3f}' for x in diffs)} | {mean} | "
                         f"{d:+.3f} ({low:+.3f} to {high:+.3f}) |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.report:
        print(tables(json.loads((out / "results.json").read_text())))
        return 0
    if not args.warm_start or not (Path(args.warm_start) / "config.json").exists():
        raise SystemExit(f"--warm-start {args.warm_start}: expected a checkpoint directory with config.json (as "
                         f"python -m vagen.sft --config {args.config} --out DIR writes)")
    from vagen.config import load_config

    cfg = load_config(args.config, args.overrides)
    if not cfg.rollout.tasks:
        raise SystemExit(f"config {args.config} lists no rollout.tasks: pass a config of several tasks")
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    if args.part:  # a child: one arm and seed, or the warm start
        arm, seed = args.part.rsplit(":", 1)
        result = (held_out_by_task(Path(args.warm_start), cfg, args.eval_n) if int(seed) < 0
                  else train_arm(arm, int(seed), args, cfg))
        (parts / f"{arm}-seed{seed}.json").write_text(json.dumps(result, indent=1, default=float))
        return 0
    arms = args.arms or ["mixed", *[task.name for task in cfg.rollout.tasks]]
    for arm in arms:
        arm_overrides(arm, cfg)  # an unknown arm is refused before anything runs
    jobs = [("warm_start", -1)] + [(arm, seed) for seed in range(args.seeds) for arm in arms]
    failed = run_children(jobs, args, parts)
    results = {"config": args.config, "warm_start_path": args.warm_start, "minutes": args.minutes,
               "eval_n": args.eval_n, "warm_start": json.loads((parts / "warm_start-seed-1.json").read_text()),
               "arms": {arm: {str(seed): json.loads((parts / f"{arm}-seed{seed}.json").read_text())
                              for seed in range(args.seeds) if (parts / f"{arm}-seed{seed}.json").exists()}
                        for arm in arms}}
    for arm, seeds in results["arms"].items():
        for seed, run in seeds.items():
            run["training_success"] = training_success(out / "runs" / f"{arm}-seed{seed}" / "metrics.jsonl")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=float))
    print(tables(results))
    if failed:
        print(f"runs failed: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
