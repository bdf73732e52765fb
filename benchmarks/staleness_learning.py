"""Learning at rollout.max_staleness = 0 against k >= 1: two `--out` folders of `benchmarks/learning.py` that
differ only in the staleness key (same method, warm start, training seeds, held-out levels and `--eval-every`),
read as synchronous and carried. Every update trains exactly `rollout.env_groups` level groups at every k (the
synchronous run's groups of that iteration), so the arms' n-th evaluations follow the same iterations and the
same trained groups; what differs is when a group was played and under which weights. Prints four Markdown
tables:

- held-out success per seed at the start (the warm start) and at each run's last evaluation and its last
  within --minutes, greedy and sampled, 95% Wilson intervals;
- the difference carried − synchronous in greedy success at each arm's n-th evaluation, its last, and its last
  within --minutes: per training seed (seed s of one arm against seed s
  of the other), their mean with a 95% t interval over seeds, and the seeds' episodes pooled with Newcombe's
  interval (the same levels in both arms, so this treats paired episodes as independent: conservative);
- each arm's staleness: token-weighted mean age of trained turns, the largest, episodes carried over an update
  (`rollout/carried_episodes`: those of admitted groups not yet at their first turn and of ended groups not yet
  due included) and trained episodes whose turns span versions, groups trained and optimizer steps per update
  (the same in both arms), TIS's clamped fraction;
- throughput: episodes trained per CPU-second of the training process (vLLM's engine included: it runs in the
  trainer's process) and per wall-second of its iterations, and the carried/synchronous ratio per seed pair
  with a 95% t interval.

    .venv-vllm/bin/python benchmarks/staleness_learning.py runs/stale_k0 runs/stale_k1 --env frozenlake_text \\
        --method GRPO --minutes 4 --plot docs/results/figures/staleness_run_st.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# two-sided 95% quantiles of Student's t by degrees of freedom
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of `values` with a 95% Student t interval (2 to 11 values)."""
    n = len(values)
    if n - 1 not in T975:
        raise ValueError(f"a t interval over {n} values: needs 2 to {max(T975) + 1}")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T975[n - 1] * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def newcombe(successes_a: int, n_a: int, successes_b: int, n_b: int) -> tuple[float, float, float]:
    """(difference, low, high): p_a − p_b with Newcombe's 95% hybrid score interval (from Wilson intervals)."""
    from vagen.eval import wilson_interval

    p_a, p_b = successes_a / n_a, successes_b / n_b
    low_a, high_a = wilson_interval(successes_a, n_a)
    low_b, high_b = wilson_interval(successes_b, n_b)
    difference = p_a - p_b
    return (difference, difference - math.sqrt((p_a - low_a) ** 2 + (high_b - p_b) ** 2),
            difference + math.sqrt((high_a - p_a) ** 2 + (p_b - low_b) ** 2))


def iteration_rows(path: Path) -> list[dict]:
    """A metrics.jsonl's rows, one per iteration in order: a chunk resumed from a checkpoint logs its iterations
    again after the first try's, and the last row of an iteration counts."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[row["iteration"]] = row
    return [rows[i] for i in sorted(rows)]


def training_rows(run_dir: Path, env_config: str, method: str, seed: str, last: int) -> list[dict]:
    """The metrics.jsonl rows of one seed's iterations below `last` (the last evaluated), one per iteration."""
    path = run_dir / "runs" / f"{env_config}-{method}-seed{seed}" / "metrics.jsonl"
    return [row for row in iteration_rows(path) if row["iteration"] < last]


def arm_runs(run_dir: Path, env: str, method: str, env_config: str) -> tuple[dict, dict[str, dict]]:
    """(warm start evaluation, {seed: {"curve": evaluations, "rows": metrics rows}}) of one folder."""
    result = json.loads((run_dir / "results.json").read_text())[env]
    if method not in result["methods"]:
        raise SystemExit(f"{run_dir}/results.json has no {method!r} runs for {env}; it has "
                         f"{', '.join(result['methods'])}: pass --method")
    runs = {}
    for seed, curve in sorted(result["methods"][method].items()):
        runs[seed] = {"curve": curve, "rows": training_rows(run_dir, env_config, method, seed, curve[-1]["iteration"])}
    return result["warm_start"], runs


def throughput(run: dict) -> tuple[float, float, int]:
    """(episodes trained per CPU-second, per wall-second of iterations, episodes) up to the last evaluation."""
    rows, last = run["rows"], run["curve"][-1]
    episodes = int(sum(r["rollout/filter_kept_trajectories"] for r in rows))
    wall = sum(r["timing/iteration"] for r in rows)
    return episodes / (60 * last["cpu_minutes"]), episodes / wall, episodes


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv=None) -> int:
    from compare_learning import curve_cells, last_within

    from vagen.eval import wilson_interval

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("synchronous", type=Path, help="--out folder of the rollout.max_staleness=0 runs")
    parser.add_argument("carried", type=Path, help="--out folder of the rollout.max_staleness>=1 runs")
    parser.add_argument("--env", default="frozenlake_text", help="the env key of results.json")
    parser.add_argument("--env-config", default=None, help="the config name in the run folders (default: --env)")
    parser.add_argument("--method", default="GRPO")
    parser.add_argument("--minutes", type=float, default=4.0, help="the CPU budget compared at")
    parser.add_argument("--labels", nargs=2, default=["k=0", "k=1"])
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    env_config = args.env_config or args.env

    arms = [(label, *arm_runs(folder, args.env, args.method, env_config))
            for label, folder in zip(args.labels, (args.synchronous, args.carried))]
    seeds = sorted(set(arms[0][2]) & set(arms[1][2]))
    if not seeds:
        raise SystemExit(f"{args.synchronous} and {args.carried} share no training seed")

    print(f"| arm | seed | start: greedy / sampled | last evaluation: iteration, CPU-min | greedy (95% CI) "
          f"| sampled (95% CI) | last within {args.minutes:g} CPU-min: iteration, CPU-min, greedy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, warm, runs in arms:
        start = f"{warm['greedy']['success']:.3f} / {warm['sampled']['success']:.3f}"
        for seed in seeds:
            print(f"| {label} | {seed} | {start} | {curve_cells(runs[seed]['curve'], args.minutes)} |")

    print(f"\n| greedy success, {args.labels[1]} − {args.labels[0]} | per seed | mean over seeds (95% t interval) "
          f"| seeds' episodes pooled (95% Newcombe) |")
    print("| --- | --- | --- | --- |")
    # the n-th evaluations of the two arms: the same iterations, so the same trained groups (B per update at every k)
    shared = min(len(arm[2][seed]["curve"]) for arm in arms for seed in seeds)
    picks = [(f"evaluation {n + 1}", lambda curve, n=n: curve[n]) for n in range(shared)]
    for name, pick in picks + [("last evaluation", lambda curve: curve[-1]),
                               (f"last within {args.minutes:g} CPU-min",
                                lambda curve: last_within(curve, args.minutes))]:
        points = [[pick(arm[2][seed]["curve"]) for seed in seeds] for arm in arms]
        if any(p is None for side in points for p in side):
            print(f"| {name} | – (a run has no evaluation within the budget) | | |")
            continue
        name += " (CPU-min {:.1f} / {:.1f})".format(*(mean([p["cpu_minutes"] for p in side]) for side in points))
        differences = [b["greedy"]["success"] - a["greedy"]["success"] for a, b in zip(*points)]
        pooled = [(sum(p["greedy"]["successes"] for p in side), sum(p["greedy"]["n"] for p in side)) for side in points]
        difference, low, high = newcombe(*pooled[1], *pooled[0])
        spread = "{:+.3f} ({:+.3f} to {:+.3f})".format(*t_interval(differences)) if len(differences) > 1 else "–"
        print(f"| {name} | {' / '.join(f'{d:+.3f}' for d in differences)} | {spread} "
              f"| {difference:+.3f} ({low:+.3f} to {high:+.3f}) |")

    print("\n| arm | seed | iterations | staleness_mean (mean over iterations) | staleness_max (largest) "
          "| carried episodes per update (total) | cross-version episodes (share of trained) "
          "| groups trained per update | optimizer steps per update | TIS clamped fraction |")
    print("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |")
    for label, _, runs in arms:
        for seed in seeds:
            rows = runs[seed]["rows"]

            def values(key: str, rows=rows) -> list[float]:
                return [r[key] for r in rows if key in r]

            carried = values("rollout/carried_episodes")
            print(f"| {label} | {seed} | {len(rows)} | {mean(values('rollout/staleness_mean')):.3f} "
                  f"| {max(values('rollout/staleness_max'), default=float('nan')):.0f} "
                  f"| {mean(carried):.2f} ({sum(carried):.0f}) | {mean(values('rollout/cross_version_episodes')):.4f} "
                  f"| {mean(values('rollout/filter_kept_groups')):.2f} | {mean(values('update/optimizer_steps')):.2f} "
                  f"| {mean(values('actor/tis_clamped_fraction')):.4f} |")

    print("\n| arm | seed | episodes trained | CPU-min | episodes / CPU-s | episodes / wall-s of iterations "
          "| CPU-s / iteration |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rates = {}
    for label, _, runs in arms:
        for seed in seeds:
            per_cpu, per_wall, episodes = throughput(runs[seed])
            rates.setdefault(label, []).append((per_cpu, per_wall))
            last = runs[seed]["curve"][-1]
            print(f"| {label} | {seed} | {episodes} | {last['cpu_minutes']:.2f} | {per_cpu:.2f} | {per_wall:.2f} "
                  f"| {60 * last['cpu_minutes'] / last['iteration']:.2f} |")
    for index, unit in ((0, "CPU-s"), (1, "wall-s")):
        ratios = [b[index] / a[index] for a, b in zip(rates[args.labels[0]], rates[args.labels[1]])]
        spread = " (95% t interval {:.2f}–{:.2f})".format(*t_interval(ratios)[1:]) if len(ratios) > 1 else ""
        print(f"\nepisodes per {unit}, {args.labels[1]} / {args.labels[0]} by seed: "
              f"{' / '.join(f'{r:.2f}' for r in ratios)}; mean {mean(ratios):.2f}{spread}")

    if args.plot:
        from compare_learning import plot_seed_curves

        curves = {label: [[(0.0, warm["greedy"]["success"])] + [(p["cpu_minutes"], p["greedy"]["success"])
                                                                for p in runs[seed]["curve"]] for seed in seeds]
                  for label, warm, runs in arms}
        warm = arms[0][1]["greedy"]
        plot_seed_curves(curves, args.plot, f"{args.env}, {args.method}: " + " vs ".join(args.labels),
                         warm_band=wilson_interval(warm["successes"], warm["n"]), budget=args.minutes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
