"""Arms of `benchmarks/learning.py` that differ in a few config values: one table and one plot.

Each positional argument is a `--out` folder of learning.py; its arm is named by the values of
`--keys` in its runs' saved config.yaml. Prints a Markdown table per arm: the baselines and the warm
start on that arm's settings, each training seed's last evaluation (greedy and sampled, 95% Wilson
intervals), the mean over seeds, and the pooled interval over all seeds' episodes (the same levels
once per seed, so narrower than over as many distinct levels). A second table gives training-rollout
means over each run's first and last three iterations that sampled rollouts (from metrics.jsonl). Writes one plot of every
seed's greedy curve against CPU-minutes, over the first arm's warm-start interval. A folder without results.json (a run stopped early) gives
only its training-rollout rows.

    python benchmarks/arms.py runs/div_4x16 runs/div_16x4 runs/div_64x1 \\
        --keys rollout.env_groups rollout.group_size --plot docs/results/figures/diversity.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROLLOUT_KEYS = [("rollout/success", "success", 2), ("rollout/format_ok", "format ok", 2), ("rollout/actions", "actions / episode", 2),
                ("rollout/turns", "turns", 2), ("rollout/response_length", "tokens / turn", 0),
                ("rollout/in_group_reward_std", "in-group reward std", 3), ("rollout/echo_rate", "echo rate", 2),
                ("rollout/distinct_2", "distinct-2", 3), ("actor/entropy_mean", "entropy", 3)]


def config_value(config: dict, dotted: str):
    section, key = dotted.split(".", 1)
    return config.get(section, {}).get(key)


def arm_name(run_dir: Path, keys: list[str]) -> str:
    import yaml

    config = next((run_dir / "runs").glob("*/config.yaml"), None)
    if config is None:
        raise SystemExit(f"{run_dir}: no runs/*/config.yaml; pass a --out folder of benchmarks/learning.py")
    values = yaml.safe_load(config.read_text())
    return ", ".join(f"{k.split('.')[-1]}={config_value(values, k)}" for k in keys)


def metrics_of(run_dir: Path, env_config: str, method: str, seed: str) -> list[dict]:
    path = run_dir / "runs" / f"{env_config}-{method}-seed{seed}" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main(argv=None) -> int:
    from vagen.eval import wilson_interval

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="--out folders of benchmarks/learning.py")
    parser.add_argument("--keys", nargs="+", required=True, help="section.key values that name an arm")
    parser.add_argument("--env", default="frozenlake")
    parser.add_argument("--env-config", default="frozenlake_visual", help="the config name in the run folders")
    parser.add_argument("--method", default="TRICO")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)

    def cell(successes: int, n: int) -> str:
        low, high = wilson_interval(successes, n)
        return f"{successes / n:.3f} ({low:.3f}–{high:.3f})"

    print("| arm | row | iteration, CPU-min | greedy (95% CI) | sampled (95% CI) |")
    print("| --- | --- | --- | --- | --- |")
    curves, rollout_rows, warm_band = {}, [], None
    for run_dir in args.runs:
        arm = arm_name(run_dir, args.keys)
        if not (run_dir / "results.json").exists():  # a stopped run: its training rollouts only
            for metrics in sorted((run_dir / "runs").glob("*/metrics.jsonl")):
                rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
                if len(rows) >= 6:
                    rollout_rows.append((arm, metrics.parent.name.rsplit("seed", 1)[-1], rows))
            continue
        result = json.loads((run_dir / "results.json").read_text())[args.env]
        base = result["baselines"]
        print(f"| {arm} | teacher / solver / best blind plan | – | {base['teacher']['success']:.3f} / "
              f"{base['solver']['success']:.3f} / {base['blind']['success']:.3f} | – |")
        ws = result["warm_start"]
        warm_band = warm_band or wilson_interval(ws["greedy"]["successes"], ws["greedy"]["n"])
        print(f"| {arm} | warm start | 0, 0.0 | {cell(ws['greedy']['successes'], ws['greedy']['n'])} | "
              f"{cell(ws['sampled']['successes'], ws['sampled']['n'])} |")
        finals, pooled = [], {"greedy": [0, 0], "sampled": [0, 0]}
        for seed, curve in sorted(result["methods"].get(args.method, {}).items()):
            last = curve[-1]
            print(f"| {arm} | seed {seed} | {last['iteration']}, {last['cpu_minutes']:.1f} | "
                  f"{cell(last['greedy']['successes'], last['greedy']['n'])} | "
                  f"{cell(last['sampled']['successes'], last['sampled']['n'])} |")
            finals.append(last["greedy"]["success"])
            for mode in pooled:
                pooled[mode][0] += last[mode]["successes"]
                pooled[mode][1] += last[mode]["n"]
            curves.setdefault(arm, []).append([(0.0, ws["greedy"]["success"])] +
                                              [(p["cpu_minutes"], p["greedy"]["success"]) for p in curve])
            rows = metrics_of(run_dir, args.env_config, args.method, seed)
            if len(rows) >= 6:
                rollout_rows.append((arm, seed, rows))
        if finals:
            print(f"| {arm} | mean of {len(finals)} seeds (range) | | {sum(finals) / len(finals):.3f} "
                  f"({min(finals):.3f}–{max(finals):.3f}) | |")
            print(f"| {arm} | pooled over seeds | | {cell(*pooled['greedy'])} | {cell(*pooled['sampled'])} |")

    if rollout_rows:
        print("\nTraining rollouts, mean of the first three → last three iterations that sampled one:\n")
        print("| arm | seed | iterations | " + " | ".join(label for _, label, _ in ROLLOUT_KEYS) + " |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in ROLLOUT_KEYS) + " |")
        for arm, seed, rows in rollout_rows:
            n = len(rows)
            cells = []
            for key, _, digits in ROLLOUT_KEYS:
                values = [r[key] for r in rows if key in r]  # a reused batch's iterations log no rollout
                a, b = values[:3], values[-3:]
                cells.append(f"{sum(a) / len(a):.{digits}f} → {sum(b) / len(b):.{digits}f}" if a and b else "–")
            print(f"| {arm} | {seed} | {n} | " + " | ".join(cells) + " |")

    if args.plot:
        from compare_learning import plot_seed_curves  # benchmarks/ is on the path of a script run from it

        plot_seed_curves(curves, args.plot, f"{args.env}, {args.method}: "
                         + ", ".join(k.split(".")[-1] for k in args.keys), warm_band=warm_band)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
