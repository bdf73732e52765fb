"""Do the collapse monitor's warnings come before the drops in success? One table over runs.

Reads runs of `benchmarks/learning.py` (each positional argument is a `--out` folder; every
`runs/*/metrics.jsonl` under it is one run). Each iteration's record in metrics.jsonl holds the
warnings `vagen.core.monitor.CollapseMonitor` raised at that iteration, so nothing is recomputed.

A run's success drops where:
  - held out: the first evaluation (results.json) whose greedy success lies more than --drop below
    the best before it (the warm start included);
  - in training: the first iteration where the mean rollout success of the last --window iterations
    lies more than --drop below the highest such mean before it.
A run collapsed when its last evaluation lies more than --drop below its best (held out).

For each run the table gives those points, and for each kind of warning the iteration of its first
occurrence and how many iterations it came before the drop (positive: a warning ahead of the drop;
an evaluation at iteration E has seen iterations 0..E-1). A second table counts every kind of
warning per 100 iterations in the runs that did not collapse: the monitor's false alarms.

    python benchmarks/warning_lead.py runs/collapse_grpo runs/div_16x4 --drop 0.10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The monitor's warning texts (vagen/core/monitor.py), by kind.
KINDS = {"grad-norm spike": "gradient-norm spike", "entropy collapse": "entropy collapse",
         "std floor": "in-group reward std collapsed", "std drop": "in-group reward std drop",
         "format collapse": "format collapse"}


def kind_of(warning: str) -> str:
    return next((kind for kind, text in KINDS.items() if text in warning), "other")


def held_out_drop(curve: list[dict], warm_start: float, drop: float) -> tuple[int | None, str]:
    """(evaluation iteration of the first drop, 'best → value'), or (None, '')."""
    best = warm_start
    for point in curve:
        value = point["greedy"]["success"]
        if value < best - drop:
            return point["iteration"], f"{best:.3f} → {value:.3f}"
        best = max(best, value)
    return None, ""


def training_drop(rows: list[dict], window: int, drop: float) -> tuple[int | None, str]:
    """(iteration of the first drop of the trailing-mean rollout success, 'best → value'), or (None, '')."""
    success = [r.get("rollout/success") for r in rows]
    best = None
    for i in range(window - 1, len(success)):
        values = [s for s in success[i - window + 1: i + 1] if s is not None]
        if not values:
            continue
        mean = sum(values) / len(values)
        if best is not None and mean < best - drop:
            return rows[i]["iteration"], f"{best:.2f} → {mean:.2f}"
        best = mean if best is None else max(best, mean)
    return None, ""


def load_runs(out: Path, env: str):
    """(name, metrics rows, held-out curve or None, warm start greedy or None) for each run under `out`."""
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    for metrics in sorted(out.glob("runs/*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        name = metrics.parent.name  # e.g. sokoban_visual-GRPO-seed0
        config, method, seed = name.rsplit("-", 2)
        res = results.get(env) or next(iter(results.values()), None)
        curve = res["methods"].get(method, {}).get(seed.removeprefix("seed")) if res else None
        warm = res["warm_start"]["greedy"]["success"] if res else None
        yield f"{out.name}/{name}", rows, curve, warm


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="--out folders of benchmarks/learning.py")
    parser.add_argument("--env", default="", help="results.json's env key (default: the first)")
    parser.add_argument("--drop", type=float, default=0.10, help="a fall in success larger than this is a drop")
    parser.add_argument("--window", type=int, default=5, help="iterations in the training-success mean")
    args = parser.parse_args(argv)

    kinds = list(KINDS)
    print(f"| run | iterations | collapsed (last eval > {args.drop:g} below best) | held-out drop: eval iteration "
          f"(best → value) | training drop: iteration (best → value) | "
          + " | ".join(f"first {k}: iteration (lead)" for k in kinds) + " |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in kinds) + " |")
    quiet = {k: 0 for k in kinds}
    quiet_iterations, quiet_runs = 0, 0
    for out in args.runs:
        for name, rows, curve, warm in load_runs(out, args.env):
            ho_iter, ho_text = held_out_drop(curve, warm, args.drop) if curve else (None, "")
            tr_iter, tr_text = training_drop(rows, args.window, args.drop)
            collapsed = bool(curve) and max([warm] + [p["greedy"]["success"] for p in curve]) - \
                curve[-1]["greedy"]["success"] > args.drop
            reference = min([i for i in (ho_iter, tr_iter) if i is not None], default=None)
            cells = []
            for kind in kinds:
                hits = [r["iteration"] for r in rows for w in r.get("warnings", []) if kind_of(w) == kind]
                if not hits:
                    cells.append("–")
                    continue
                lead = f" ({reference - hits[0]:+d})" if reference is not None else ""
                cells.append(f"{hits[0]}{lead}, {len(hits)} in all")
            print(f"| {name} | {len(rows)} | {'yes' if collapsed else 'no'} | "
                  f"{f'{ho_iter} ({ho_text})' if ho_iter is not None else '–'} | "
                  f"{f'{tr_iter} ({tr_text})' if tr_iter is not None else '–'} | " + " | ".join(cells) + " |")
            if not collapsed and ho_iter is None:
                quiet_runs += 1
                quiet_iterations += len(rows)
                for r in rows:
                    for w in r.get("warnings", []):
                        if kind_of(w) in quiet:
                            quiet[kind_of(w)] += 1
    print("\nLead: iterations from the first warning of a kind to the earlier of the two drops "
          "(positive: the warning came first).")
    if quiet_iterations:
        print(f"\nRuns with no held-out drop and no collapse: {quiet_runs} runs, {quiet_iterations} iterations; "
              "warnings per 100 iterations:\n")
        print("| " + " | ".join(kinds) + " |")
        print("| " + " | ".join("---" for _ in kinds) + " |")
        print("| " + " | ".join(f"{100 * quiet[k] / quiet_iterations:.1f}" for k in kinds) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
