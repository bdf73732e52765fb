"""Rollout freshness (`rollout.reuse_iterations`): held-out success against CPU-minutes for runs of
`benchmarks/learning.py` that differ only in how many iterations each batch of rollouts trains.
Prints a Markdown table (each seed's last evaluation and its last within --minutes, 95% Wilson
intervals) and writes one plot of every seed's curve.

    for k in 1 2 4; do
      python benchmarks/learning.py --envs frozenlake --methods TRICO --seeds 3 --minutes 6 --eval-n 128 \\
        --eval-every 12 --jobs 2 --warm-start assets/checkpoints/frozenlake_visual --out runs/fresh_k$k \\
        env.format_reward=0.0 rollout.env_groups=32 algo.filter_mode=std algo.filter_keep_ratio=0.25 \\
        rollout.reuse_iterations=$k
    done
    python benchmarks/freshness.py runs/fresh_k1 runs/fresh_k2 runs/fresh_k4 --plot docs/results/figures/freshness.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reuse_of(run_dir: Path) -> int:
    """`rollout.reuse_iterations` of the runs under `run_dir` (from a saved config.yaml)."""
    import yaml

    config = next((run_dir / "runs").glob("*/config.yaml"), None)
    if config is None:
        raise SystemExit(f"{run_dir}: no runs/*/config.yaml; pass a --out folder of benchmarks/learning.py")
    return int(yaml.safe_load(config.read_text()).get("rollout", {}).get("reuse_iterations", 1))


def main(argv=None) -> int:
    from vagen.eval import wilson_interval

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="--out folders of benchmarks/learning.py")
    parser.add_argument("--env", default="frozenlake")
    parser.add_argument("--method", default="TRICO")
    parser.add_argument("--minutes", type=float, default=6.0, help="the CPU budget compared at")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)

    def cell(result) -> str:
        low, high = wilson_interval(result["successes"], result["n"])
        return f"{result['success']:.3f} ({low:.3f}–{high:.3f})"

    print(f"| reuse_iterations | seed | last evaluation: iteration, CPU-min | greedy (95% CI) | sampled (95% CI) "
          f"| last within {args.minutes:g} CPU-min: iteration, CPU-min, greedy |")
    print("| --- | --- | --- | --- | --- | --- |")
    curves = {}
    for run_dir in args.runs:
        k = reuse_of(run_dir)
        result = json.loads((run_dir / "results.json").read_text())[args.env]
        start = result["warm_start"]["greedy"]["success"]
        finals = []
        for seed, curve in sorted(result["methods"][args.method].items()):
            last = curve[-1]
            within = [p for p in curve if p["cpu_minutes"] <= args.minutes]
            budget = (f"{within[-1]['iteration']}, {within[-1]['cpu_minutes']:.1f}, "
                      f"{within[-1]['greedy']['success']:.3f}") if within else "–"
            print(f"| {k} | {seed} | {last['iteration']}, {last['cpu_minutes']:.1f} | {cell(last['greedy'])} | "
                  f"{cell(last['sampled'])} | {budget} |")
            finals.append(last["greedy"]["success"])
            curves.setdefault(k, []).append([(0.0, start)] + [(p["cpu_minutes"], p["greedy"]["success"]) for p in curve])
        print(f"|  | mean of {len(finals)} | | {sum(finals) / len(finals):.3f} (seeds {min(finals):.3f}–{max(finals):.3f}) "
              f"| | |")
    if args.plot:
        from compare_learning import plot_seed_curves  # benchmarks/ is on the path of a script run from it

        plot_seed_curves({f"rollout.reuse_iterations={k}": runs for k, runs in sorted(curves.items())}, args.plot,
                         f"{args.env}, {args.method}: rollout freshness", budget=args.minutes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
