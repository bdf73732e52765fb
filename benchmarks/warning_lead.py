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
an evaluation at iteration E has seen the updates of iterations 0..E-1, so a warning at E-1 has lead
0; the training drop at iteration t is in the rollouts sampled before update t). A second table counts every kind of
warning per 100 iterations in the runs that did not collapse: the monitor's false alarms.

    python benchmarks/warning_lead.py runs/collapse_grpo runs/div_16x4 --drop 0.10 --plot collapse.png

--plot draws, for every run that collapsed, its success (held out and in training), format-ok rate,
in-group reward std, entropy and gradient norm against the iteration, with its warnings marked (an
evaluation is drawn at the last iteration it saw, the warm start at -1).

A run stopped before learning.py wrote results.json still has its evaluations in the log that
learning.py printed: pass it with --log (the lines "METHOD seed S it N cpu C min  greedy G ...";
several logs are read as one).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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


EVAL_LINE = re.compile(r"^\s*(\S+) seed (\d+) it (\d+) cpu ([\d.]+) min\s+greedy ([\d.]+)")
WARM_LINE = re.compile(r"warm start greedy ([\d.]+)")
LEVELS_LINE = re.compile(r"(\d+) distinct held-out levels")


def results_from_log(logs: list[Path]) -> dict:
    """results.json's shape ({env: {"warm_start", "methods"}}) from learning.py logs of one env (a
    child run with --only-seed prints no warm start line: pass it after its parent's log)."""
    methods, warm, n = {}, None, None
    for line in "\n".join(log.read_text() for log in logs).splitlines():
        if (m := LEVELS_LINE.search(line)) and n is None:
            n = int(m.group(1))
        elif (m := WARM_LINE.search(line)) and warm is None:
            warm = float(m.group(1))
        elif m := EVAL_LINE.match(line):
            method, seed, iteration, cpu, greedy = m.groups()
            methods.setdefault(method, {}).setdefault(seed, []).append(
                {"iteration": int(iteration), "cpu_minutes": float(cpu),
                 "greedy": {"success": float(greedy), "successes": round(float(greedy) * n), "n": n}})
    if warm is None or n is None:
        raise SystemExit(f"{logs}: no 'warm start greedy' or 'distinct held-out levels' line; pass learning.py's log")
    return {"log": {"warm_start": {"greedy": {"success": warm, "successes": round(warm * n), "n": n}},
                    "methods": methods}}


def load_runs(out: Path, env: str, logs: list[Path] | None = None):
    """(name, metrics rows, held-out curve or None, warm start greedy or None) for each run under `out`."""
    if (out / "results.json").exists():
        results = json.loads((out / "results.json").read_text())
    else:
        results = results_from_log(logs) if logs else {}
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
    parser.add_argument("--plot", type=Path, default=None, help="a figure of the collapsed runs' signals")
    parser.add_argument("--log", type=Path, nargs="+", default=None,
                        help="learning.py's logs, for an out folder without results.json (a stopped run)")
    args = parser.parse_args(argv)

    kinds = list(KINDS)
    print(f"| run | iterations | collapsed (last eval > {args.drop:g} below best) | held-out drop: eval iteration "
          f"(best → value) | training drop: iteration (best → value) | "
          + " | ".join(f"first {k}: iteration (lead)" for k in kinds) + " |")
    print("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in kinds) + " |")
    quiet = {k: 0 for k in kinds}
    quiet_iterations, quiet_runs = 0, 0
    collapsed_runs = []
    for out in args.runs:
        for name, rows, curve, warm in load_runs(out, args.env, args.log):
            ho_iter, ho_text = held_out_drop(curve, warm, args.drop) if curve else (None, "")
            tr_iter, tr_text = training_drop(rows, args.window, args.drop)
            collapsed = bool(curve) and max([warm] + [p["greedy"]["success"] for p in curve]) - \
                curve[-1]["greedy"]["success"] > args.drop
            # The evaluation at iteration E saw the updates of iterations 0..E-1; the warning of
            # iteration w comes after update w: a warning at E-1 is simultaneous with it (lead 0).
            reference = min([i for i in (None if ho_iter is None else ho_iter - 1, tr_iter) if i is not None],
                            default=None)
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
            if collapsed:
                collapsed_runs.append((name, rows, curve, warm))
            if not collapsed and ho_iter is None:
                quiet_runs += 1
                quiet_iterations += len(rows)
                for r in rows:
                    for w in r.get("warnings", []):
                        if kind_of(w) in quiet:
                            quiet[kind_of(w)] += 1
    print("\nLead: iterations from the first warning of a kind to the earlier of the two drops (the held-out one "
          "counted at the last iteration its evaluation saw); positive: the warning came first.")
    if quiet_iterations:
        print(f"\nRuns with no held-out drop and no collapse: {quiet_runs} runs, {quiet_iterations} iterations; "
              "warnings per 100 iterations:\n")
        print("| " + " | ".join(kinds) + " |")
        print("| " + " | ".join("---" for _ in kinds) + " |")
        print("| " + " | ".join(f"{100 * quiet[k] / quiet_iterations:.1f}" for k in kinds) + " |")
    if collapsed_runs:
        from vagen.eval import wilson_interval

        print("\nHeld-out greedy success of the runs that collapsed (95% Wilson intervals):\n")
        for name, _, curve, warm in collapsed_runs:
            n = curve[0]["greedy"]["n"]
            low, high = wilson_interval(round(warm * n), n)
            points = [f"warm start {warm:.3f} ({low:.3f}–{high:.3f})"]
            for p in curve:
                low, high = wilson_interval(p["greedy"]["successes"], p["greedy"]["n"])
                points.append(f"{p['iteration']}: {p['greedy']['success']:.3f} ({low:.3f}–{high:.3f})")
            print(f"- {name}: " + ", ".join(points))
    if args.plot and collapsed_runs:
        plot(collapsed_runs, args.plot)
    return 0


PANELS = [("rollout/success", "success"), ("rollout/format_ok", "format ok"),
          ("rollout/in_group_reward_std", "in-group reward std"), ("actor/entropy_mean", "entropy"),
          ("actor/grad_norm", "grad norm")]
MARKS = {"grad-norm spike": "tab:red", "entropy collapse": "tab:purple", "std floor": "black",
         "std drop": "tab:orange", "format collapse": "tab:brown"}


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), len(runs), figsize=(4.5 * len(runs), 1.6 * len(PANELS)), sharex="col",
                             squeeze=False)
    for col, (name, rows, curve, warm) in enumerate(runs):
        its = [r["iteration"] for r in rows]
        for row, (key, label) in enumerate(PANELS):
            ax = axes[row][col]
            ax.plot(its, [r.get(key, float("nan")) for r in rows], color="tab:blue", lw=1,
                    label="training rollouts" if row == 0 else None)
            if row == 0 and curve:
                ax.plot([-1] + [p["iteration"] - 1 for p in curve], [warm] + [p["greedy"]["success"] for p in curve],
                        "o-",
                        color="tab:green", ms=3, label="held out, greedy")
                ax.legend(fontsize=6)
            seen = set()
            for r in rows:
                for w in r.get("warnings", []):
                    kind = kind_of(w)
                    ax.axvline(r["iteration"], color=MARKS.get(kind, "grey"), lw=0.8, alpha=0.6,
                               label=kind if row == len(PANELS) - 1 and kind not in seen else None)
                    seen.add(kind)
            ax.set_ylabel(label, fontsize=7)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        axes[0][col].set_title(name, fontsize=8)
        axes[-1][col].set_xlabel("iteration", fontsize=7)
        axes[-1][col].legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
