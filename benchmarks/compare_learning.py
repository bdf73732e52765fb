"""Held-out success against CPU-minutes for arms of `benchmarks/learning.py` runs given as LABEL=FOLDER
(e.g. full fine-tuning against LoRA), or LABEL=FOLDER@METHOD for one method of a folder that ran several
(e.g. "GiGPO=runs/cmp@GiGPO" "GRPO=runs/cmp@GRPO"; without @, --method). Prints three Markdown tables: success (each seed's last evaluation and
its last within --minutes, 95% Wilson intervals, and each arm pooled over its seeds), success at each
evaluated iteration, and cost (iterations, seconds per iteration and its parts, from the runs'
metrics.jsonl), with GiGPO's step-group statistics where the runs logged them; writes one plot of every
seed's curve.

    python benchmarks/compare_learning.py "full fine-tuning=runs/fresh_k1" "LoRA r=8=runs/lora_r8" \\
        --plot docs/results/figures/lora_run_lr.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
          "tab:cyan", "tab:gray"]


def arm(text: str) -> tuple[str, Path, str | None]:
    label, sep, folder = text.rpartition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"{text!r}: pass LABEL=FOLDER or LABEL=FOLDER@METHOD, e.g. "
                                         f"'LoRA r=8=runs/lora_r8' or 'GiGPO=runs/cmp@GiGPO'")
    folder, at, method = folder.partition("@")
    return label, Path(folder), (method if at else None)


def metrics_of(run_dir: Path, env: str, method: str, seed: str) -> list[dict]:
    """The metrics.jsonl rows of one seed's training run (the run folder is <config>-<method>-seed<N>)."""
    files = sorted((run_dir / "runs").glob(f"{env}*-{method}-seed{seed}/metrics.jsonl"))
    if not files:
        return []
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def plot_seed_curves(curves: dict[str, list[list[tuple[float, float]]]], path: Path, title: str,
                     warm_start: float | None = None, warm_band: tuple[float, float] | None = None,
                     budget: float | None = None) -> None:
    """Greedy held-out success against CPU-minutes, one colour per arm and one line per seed
    (`curves`: arm label -> each seed's [(CPU-minutes, success)]), with the warm start as a line or a
    95% band and the CPU budget as a vertical line; writes `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if warm_band:
        ax.axhspan(*warm_band, color="grey", alpha=0.15, label="warm start, 95% CI (first arm's)")
    for (label, runs), color in zip(curves.items(), itertools.cycle(COLORS)):  # every arm drawn, colours reused past ten
        for i, curve in enumerate(runs):
            ax.plot(*zip(*curve), marker="o", ms=3, color=color, alpha=0.8, label=label if i == 0 else None)
    if warm_start is not None:
        ax.axhline(warm_start, color="grey", ls="--", lw=1, label="warm start")
    if budget is not None:
        ax.axvline(budget, color="grey", ls=":", lw=1)
    ax.set_xlabel("CPU-minutes of training")
    ax.set_ylabel("greedy held-out success")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def cell(successes: int, n: int) -> str:
    """A success rate with its 95% Wilson interval, as a table cell."""
    from vagen.eval import wilson_interval

    low, high = wilson_interval(successes, n)
    return f"{successes / n:.3f} ({low:.3f}–{high:.3f})"


def last_within(curve: list[dict], minutes: float) -> dict | None:
    """The last evaluation of `curve` within `minutes` CPU-minutes, or None."""
    return ([p for p in curve if p["cpu_minutes"] <= minutes] or [None])[-1]


def curve_cells(curve: list[dict], minutes: float) -> str:
    """Table cells of one run: its last evaluation (iteration, CPU-minutes), greedy and sampled success there with
    95% intervals, and its last evaluation within `minutes` CPU-minutes (iteration, CPU-minutes, greedy)."""
    last, within = curve[-1], last_within(curve, minutes)
    budget = (f"{within['iteration']}, {within['cpu_minutes']:.1f}, {within['greedy']['success']:.3f}"
              if within else "–")
    return (f"{last['iteration']}, {last['cpu_minutes']:.1f} | {cell(last['greedy']['successes'], last['greedy']['n'])}"
            f" | {cell(last['sampled']['successes'], last['sampled']['n'])} | {budget}")


def main(argv=None) -> int:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arms", nargs="+", type=arm, help="LABEL=FOLDER, a --out folder of benchmarks/learning.py")
    parser.add_argument("--env", default="frozenlake")
    parser.add_argument("--method", default="TRICO")
    parser.add_argument("--minutes", type=float, default=6.0, help="the CPU budget compared at")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)

    print(f"| arm | seed | last evaluation: iteration, CPU-min | greedy (95% CI) | sampled (95% CI) "
          f"| last within {args.minutes:g} CPU-min: iteration, CPU-min, greedy |")
    print("| --- | --- | --- | --- | --- | --- |")
    curves, costs, start, runs_of = {}, [], None, []
    for label, run_dir, method in args.arms:
        method = method or args.method
        result = json.loads((run_dir / "results.json").read_text())[args.env]
        if method not in result["methods"]:
            raise SystemExit(f"{run_dir}/results.json has no {method!r} runs for {args.env}; it has "
                             f"{', '.join(result['methods'])}: name one with LABEL=FOLDER@METHOD or --method")
        start = result["warm_start"]["greedy"]["success"]
        runs_of.append((label, result["methods"][method]))
        finals, pooled = [], {"greedy": [0, 0], "sampled": [0, 0]}
        for seed, curve in sorted(runs_of[-1][1].items()):
            last = curve[-1]
            print(f"| {label} | {seed} | {curve_cells(curve, args.minutes)} |")
            finals.append(last["greedy"]["success"])
            for kind in pooled:
                pooled[kind][0] += last[kind]["successes"]
                pooled[kind][1] += last[kind]["n"]
            curves.setdefault(label, []).append([(0.0, start)] + [(p["cpu_minutes"], p["greedy"]["success"])
                                                                  for p in curve])
            rows = metrics_of(run_dir, args.env, method, seed)
            costs.append((label, seed, last, rows))
        print(f"| {label} | all {len(finals)} pooled | | {cell(*pooled['greedy'])} | {cell(*pooled['sampled'])} "
              f"| seeds {min(finals):.3f}–{max(finals):.3f} |")

    print("\n| arm | iteration | greedy per seed | greedy, seeds pooled (95% CI) | CPU-min per seed |")
    print("| --- | ---: | --- | --- | --- |")
    for label, result in runs_of:
        by_iteration: dict[int, list[dict]] = {}
        for _, curve in sorted(result.items()):
            for point in curve:
                by_iteration.setdefault(point["iteration"], []).append(point)
        for iteration, points in sorted(by_iteration.items()):
            successes, n = sum(p["greedy"]["successes"] for p in points), sum(p["greedy"]["n"] for p in points)
            per_seed = " / ".join(f"{p['greedy']['success']:.3f}" for p in points)
            cpu = " / ".join(f"{p['cpu_minutes']:.1f}" for p in points)
            print(f"| {label} | {iteration} | {per_seed} | {cell(successes, n)} | {cpu} |")

    print("\n| arm | seed | iterations | CPU-s / iteration | s / iteration | generate | annotate | update "
          "| mean actor/approx_kl | mean actor/grad_norm | rollout/success, first 3 → last 3 iterations |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for label, seed, last, rows in costs:
        if not rows:
            print(f"| {label} | {seed} | {last['iteration']} | – | – | – | – | – | – | – | – |")
            continue

        def avg(key: str, rows=rows) -> float:
            return mean([r[key] for r in rows if key in r])

        success = [r["rollout/success"] for r in rows if "rollout/success" in r]
        print(f"| {label} | {seed} | {len(rows)} | {60 * last['cpu_minutes'] / last['iteration']:.1f} "
              f"| {avg('timing/iteration'):.1f} | {avg('timing/generate'):.1f} | {avg('timing/annotate'):.1f} "
              f"| {avg('timing/update'):.1f} | {avg('actor/approx_kl'):.1e} | {avg('actor/grad_norm'):.3f} "
              f"| {mean(success[:3]):.3f} → {mean(success[-3:]):.3f} |")
    step_groups = [(label, seed, rows) for label, seed, _, rows in costs
                   if any("rollout/step_group_share" in r for r in rows)]
    if step_groups:
        print("\n| arm | seed | turns in a step group of 2+ (mean over iterations, first → last 3) "
              "| mean step-group size (first → last 3) |")
        print("| --- | --- | --- | --- |")
        for label, seed, rows in step_groups:
            share = [r["rollout/step_group_share"] for r in rows if "rollout/step_group_share" in r]
            size = [r["rollout/step_group_size"] for r in rows if "rollout/step_group_size" in r]
            print(f"| {label} | {seed} | {mean(share):.3f} ({mean(share[:3]):.3f} → {mean(share[-3:]):.3f}) "
                  f"| {mean(size):.2f} ({mean(size[:3]):.2f} → {mean(size[-3:]):.2f}) |")

    if args.plot:
        methods = {method or args.method for _, _, method in args.arms}
        plot_seed_curves(curves, args.plot, f"{args.env}, {methods.pop() + ': ' if len(methods) == 1 else ''}"
                         + " vs ".join(curves), warm_start=start, budget=args.minutes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
