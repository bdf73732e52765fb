"""Does describing the board, and being rewarded for describing it right, help the tiny agent?

FrozenLake from frames (`frozenlake_visual`), four arms trained the same way (TRICO, `benchmarks/learning.py`'s
RL settings) for the same CPU-minutes per training seed, each from a warm start in its prompt format:

    no_think          <answer> only
    free_think        <think> then <answer> (the shipped warm start)
    gwm               <observation>, <reasoning>, <prediction>, then <answer>, not graded
    gwm+state         the same, with the rule-based state reward (algo.state_reward=rules)

The no_think and gwm warm starts continue the shipped free_think one on the teacher's demonstrations
in their format (`python -m vagen.sft --base assets/checkpoints/frozenlake_visual env.prompt_format=F`,
demonstrations only, early stopping on held-out answer accuracy), so every arm starts from the same
perception. Each arm is evaluated on the same distinct held-out levels (greedy and sampled, 95% Wilson
intervals). From each run's metrics over training: the grading score of its descriptions
(`rollout/grounding_score`, `rollout/worldmodel_score`), its response length and its echo rate.
Writes OUT/table.md and OUT/formats.png; each arm's own results are in OUT/<arm>/.

    python benchmarks/formats.py                          # 3 seeds x 4 arms, 256 levels, one after another
    python benchmarks/formats.py --smoke                  # a couple of minutes: proves the pipeline runs
    python benchmarks/formats.py --report                 # only rewrite the table and plot from OUT

The recorded run (docs/results/frozenlake.md, run S) ran two arms at a time on two cores, one thread
each, the structured arms with evaluations every 5 iterations (theirs cost about five times as much,
and a run stops at the first evaluation past its budget):

    python benchmarks/formats.py --arms no_think --minutes 6 --eval-every 10 &
    python benchmarks/formats.py --arms free_think --minutes 6 --eval-every 10
    python benchmarks/formats.py --arms gwm --minutes 5 --eval-every 5 &
    python benchmarks/formats.py --arms gwm+state --minutes 5 --eval-every 5
    python benchmarks/formats.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHIPPED = "assets/checkpoints/frozenlake_visual"
LONG = ["rollout.max_new_tokens=320"]  # a structured FrozenLake response is 130-260 tokens
# arm: (warm start: None = shipped, else the format it is built in; overrides of every run)
ARMS = {
    "no_think": ("no_think", ["env.prompt_format=no_think"]),
    "free_think": (None, []),
    "gwm": ("grounding_worldmodeling", ["env.prompt_format=grounding_worldmodeling", *LONG]),
    "gwm+state": ("grounding_worldmodeling", ["env.prompt_format=grounding_worldmodeling", *LONG,
                                              "algo.state_reward=rules"]),
}
WARM_START = ["sft.perception_steps=0", "sft.cell_questions=0", "sft.lr=3e-4", "sft.lr_schedule=constant",
              "sft.min_steps=200", "sft.max_steps=600"]
SMOKE_WARM_START = ["sft.demos=16", "sft.val_demos=4", "sft.min_steps=0", "sft.max_steps=2", "sft.check_every=2"]
TRACKED = ("rollout/grounding_score", "rollout/worldmodel_score", "rollout/grounding_score_raw",
           "rollout/worldmodel_score_raw", "rollout/response_length", "rollout/echo_rate", "rollout/success")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--minutes", type=float, default=6.0,
                        help="CPU-minutes of RL per arm and training seed (a run stops at the first evaluation past them)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-n", type=int, default=256, help="distinct held-out levels")
    parser.add_argument("--eval-every", type=int, default=5, help="RL iterations between evaluations")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--out", default="runs/formats")
    parser.add_argument("--report", action="store_true", help="only rewrite table.md and formats.png from OUT")
    parser.add_argument("--smoke", action="store_true", help="tiny everything: checks that the pipeline runs")
    return parser.parse_args(argv)


def run(command: list[str]) -> None:
    print("$", " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=ROOT, env=env, check=True)


def warm_start(fmt: str | None, out: Path, smoke: bool) -> Path:
    """The shipped free_think warm start, or one in `fmt` built from it (once; kept in OUT)."""
    if fmt is None:
        return ROOT / SHIPPED
    path = out / f"warm_start_{fmt}"
    if not (path / "config.json").exists():
        extra = LONG if fmt == "grounding_worldmodeling" else []
        run([sys.executable, "-m", "vagen.sft", "--config", "frozenlake_visual", "--base", SHIPPED, "--out", str(path),
             f"env.prompt_format={fmt}", *extra, *WARM_START, *(SMOKE_WARM_START if smoke else [])])
    return path


def training_curves(arm_dir: Path) -> dict[int, list[dict]]:
    """Each training seed's metrics per iteration (the TRACKED ones present)."""
    curves = {}
    for run_dir in sorted((arm_dir / "runs").glob("*-TRICO-seed*")):
        seed = int(run_dir.name.rsplit("seed", 1)[1])
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        curves[seed] = [{k: r[k] for k in ("iteration", *TRACKED) if k in r} for r in rows if "iteration" in r]
    return curves


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def collect(out: Path, arms: list[str]) -> dict:
    results = {}
    for arm in arms:
        path = out / arm / "results.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())["frozenlake"]
        results[arm] = {"warm_start": res["warm_start"], "baselines": res["baselines"],
                        "finals": {int(s): c[-1] for s, c in res["methods"]["TRICO"].items()},
                        "evals": {int(s): c for s, c in res["methods"]["TRICO"].items()},
                        "training": training_curves(out / arm)}
    return results


def pooled(rows: list[dict]) -> str:
    """Mean success over seeds, with the 95% Wilson interval of all their episodes pooled (the seeds
    play the same levels, so it is narrower than one over as many distinct levels would be)."""
    from vagen.eval import wilson_interval

    successes, n = sum(r["successes"] for r in rows), sum(r["n"] for r in rows)
    low, high = wilson_interval(successes, n)
    return f"{successes / n:.3f} [{low:.3f}, {high:.3f}]"


def fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def window(curve: list[dict], key: str, first: bool, k: int = 3):
    """Mean of `key` over the first (or last) `k` iterations that have it."""
    values = [row[key] for row in curve if row.get(key) is not None]
    return mean(values[:k] if first else values[-k:]) if values else None


def table(results: dict) -> str:
    lines = ["| arm | warm start greedy [95% CI] | after RL greedy [95% CI] | per seed | after RL sampled [95% CI] | "
             "format ok (greedy) | iterations (CPU-min) | grounding score first → last | world-model score first → last | "
             "response tokens first → last | echo rate first → last |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, res in results.items():
        finals = list(res["finals"].values())
        greedy = [f["greedy"] for f in finals]
        trained = list(res["training"].values())
        per_seed = " / ".join(f"{g['success']:.3f}" for g in greedy)
        iterations = " / ".join(f"{f['iteration']} ({f['cpu_minutes']:.1f})" for f in finals)

        def change(key, digits=2, trained=trained):
            if any(key + "_raw" in row for curve in trained for row in curve):
                key += "_raw"  # the state reward's grades before its repetition check, as an unrewarded run logs them
            first = mean([window(c, key, True) for c in trained])
            last = mean([window(c, key, False) for c in trained])
            return "-" if first is None else f"{fmt(first, digits)} → {fmt(last, digits)}"

        lines.append(
            f"| {arm} | {pooled([res['warm_start']['greedy']])} | {pooled(greedy)} | "
            f"{per_seed} | {pooled([f['sampled'] for f in finals])} | "
            f"{fmt(mean([g['format_ok'] for g in greedy]), 3)} | "
            f"{iterations} | {change('rollout/grounding_score')} | "
            f"{change('rollout/worldmodel_score')} | {change('rollout/response_length', 0)} | "
            f"{change('rollout/echo_rate')} |")
    any_arm = next(iter(results.values()))
    base = " · ".join(f"{name} {any_arm['baselines'][name]['success']:.3f}" for name in ("teacher", "solver", "random"))
    return "\n".join(lines) + f"\n\nOn the same levels: {base}.\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for k, (arm, res) in enumerate(results.items()):
        colour = f"C{k}"
        ax = axes[0][0]
        for i, curve in enumerate(res["evals"].values()):
            xs = [0.0] + [p["cpu_minutes"] for p in curve]
            ys = [res["warm_start"]["greedy"]["success"]] + [p["greedy"]["success"] for p in curve]
            ax.plot(xs, ys, color=colour, marker=".", alpha=0.8, label=arm if i == 0 else None)
        for (ax, key, label) in ((axes[0][1], "rollout/response_length", "response tokens (training rollouts)"),
                                 (axes[1][0], "rollout/echo_rate", "echo rate (training rollouts)"),
                                 (axes[1][1], "rollout/grounding_score", "description scores (solid: observation, "
                                                                         "dashed: prediction)")):
            for i, curve in enumerate(res["training"].values()):
                points = [(r["iteration"], r[key]) for r in curve if r.get(key) is not None]
                if points:
                    ax.plot(*zip(*points), color=colour, alpha=0.7, label=arm if i == 0 else None)
                if key == "rollout/grounding_score":
                    points = [(r["iteration"], r["rollout/worldmodel_score"]) for r in curve
                              if r.get("rollout/worldmodel_score") is not None]
                    if points:
                        ax.plot(*zip(*points), color=colour, alpha=0.7, ls="--")
            ax.set_title(label, fontsize=10)
            ax.set_xlabel("RL iteration")
    any_arm = next(iter(results.values()))
    for j, name in enumerate(("teacher", "random")):
        axes[0][0].axhline(any_arm["baselines"][name]["success"], ls=":", color=f"C{j + 6}", label=name)
    axes[0][0].set_title(f"held-out greedy success ({any_arm['warm_start']['greedy']['n']} levels)", fontsize=10)
    axes[0][0].set_xlabel("CPU-minutes of RL")
    axes[0][0].set_ylim(-0.02, 1.02)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for arm in args.arms:
            fmt_, overrides = ARMS[arm]
            start = warm_start(fmt_, out, args.smoke)
            run([sys.executable, str(HERE / "learning.py"), "--envs", "frozenlake", "--methods", "TRICO",
                 "--seeds", str(args.seeds), "--minutes", str(args.minutes), "--eval-n", str(args.eval_n),
                 "--eval-every", str(args.eval_every), "--jobs", str(args.jobs), "--threads", "1",
                 "--out", str(out / arm), "--warm-start", str(start), *(["--smoke"] if args.smoke else []),
                 *overrides])
    results = collect(out, args.arms)
    if not results:
        raise SystemExit(f"no arm has results in {out}; run without --report first")
    text = table(results)
    (out / "table.md").write_text(text)
    plot(results, out / "formats.png")
    print(text)
    print(f"wrote {out / 'table.md'} and {out / 'formats.png'}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
