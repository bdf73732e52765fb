"""Bounded staleness (`rollout.max_staleness = k`) against the synchronous run (k = 0), in training: each
configuration trains through `vagen/train.py` with `rollout.backend=vllm` and is measured from outside, by
wrapping the vLLM engine's `step` and `add_request`, its scheduler, and `vagen.rollout.Rollouts.play`.
Information only: nothing is asserted. Runs in the vLLM environment:

    .venv-vllm/bin/python benchmarks/bench_staleness.py                    # both envs, k = 0, 1, 2, seeds 0, 1
    .venv-vllm/bin/python benchmarks/bench_staleness.py --envs sokoban_visual --ks 0 1 --seeds 0
    .venv-vllm/bin/python benchmarks/bench_staleness.py --json rows.json   # the table's rows as JSON too

The policy is the environment's shipped warm start (the tiny Qwen2.5-VL) with vagen's image hooks taken out
of its config, which makes it a standard Qwen2.5-VL that vLLM runs and the trainer trains (as
tests/test_agent_loop.py does); turns of up to `--max-new-tokens` (256) tokens, the config's temperature (0.7),
`algo.rollout_correction=tis` at every k (k > 0 needs it; k = 0 takes it too, so that k alone differs).
Each configuration runs in a process of its own; for each seed the configurations run one after another,
so that a ratio against k = 0 compares runs close in time on a machine whose load changes.

Every update trains exactly B = `--groups` level groups at every k (docs/training.md, "Rollouts carried
across updates"): the synchronous run's groups of that iteration, the same levels and request seeds, so the
trained turns are the same episodes at every k but for what the differing weights choose; k changes when a
group is played, not how many are trained. Measured over the steady iterations: all but the first (the
engine's warm-up, and with k > 0 the admission of (k + 1) x B groups) and the last (which plays every group
admitted to its end before the final checkpoint). The j-th rollout before that checkpoint keeps at most j x B
groups in flight, which at k = 2 limits one steady rollout (the last but one: 2 x B, not 3 x B):
- forward passes per trained turn: scheduler steps that ran at least one request, over the turns the steady
  rollouts played (one request each). Every turn played is trained once, by its group's update, so over a run
  the two counts are equal; over a window of a few iterations at k > 0 they are not: a rollout decodes turns
  that a later update trains (where episodes move in step, every other rollout at k = 1 decodes two batches
  and the next decodes none), so a count over the turns trained in the window would move by a whole batch;
- sequences per pass: requests those passes ran;
- tokens computed per trained turn: the tokens those passes computed (prompt tokens the prefix cache did not
  hold, and generated ones), over the turns played; a carried episode's history is computed again after the
  update, whose weight sync empties the cache;
- engine idle in the rollout: the share of the rollouts' wall time the engine was not inside a `step`
  (stepping environments, waiting for their answers, admitting requests); and in the iteration: the same
  over the whole iteration (the update and the weight sync included), with the rollouts' seconds scaled as
  below;
- seconds per trained sample: the rollouts' wall time (per turn played, times the turns the window's updates
  trained), the rest of the iterations' (annotation, update, weight sync: "update"), and their sum, over the
  samples trained. The update's work is the same at every k (the same samples, the same optimizer steps), so
  on a machine shared with other jobs its ratio to k = 0 gauges how the load differed between the two runs;
- samples per update (B x `--group-size` at every k, fewer only where StarPO-S filters groups out), the
  optimizer steps per update (`update/optimizer_steps`, printed per run), and the episodes left waiting for the
  next weights at each update (`rollout/carried_episodes`: episodes carried mid-way, those of groups that ended
  but are not yet due, and those of admitted groups not yet at their first turn). Where episodes move in step,
  the groups admitted with the due ones end with them and at k = 1 every other rollout finds its groups ended
  already: it admits the next ones, which wait for the next weights before their first turn.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ENVS = ("navigation_visual", "sokoban_visual")
# What each environment's config changes for this benchmark besides the turn length: sokoban_visual plays 3
# turns; 5 (the published range's end, as bench_agent_loop's 256-token setting) leave a longer tail to carry.
ENV_OVERRIDES = {"sokoban_visual": ["rollout.max_turns=5"], "navigation_visual": []}
MEASURES = ("passes_per_turn", "sequences_per_pass", "tokens_per_turn", "idle_rollout", "idle_iteration",
            "rollout_s_per_sample", "other_s_per_sample", "s_per_sample")


# -- in the child process: one training run, instrumented -----------------------------------------------------

def instrument(iterations: list[dict]) -> None:
    """Count, for each rollout (`Rollouts.play`), the engine's forward passes and the requests they ran, its
    requests, the seconds inside `LLMEngine.step`, the rollout's wall time and what the update then trained;
    each rollout appends a record to `iterations`."""
    from vllm import LLMEngine

    import vagen.rollout
    import vagen.train
    from vagen import vllm_compat

    counts = {"passes": 0, "sequences": 0, "tokens": 0, "requests": 0, "step_s": 0.0}
    step, add_request, play, kept_samples = (LLMEngine.step, LLMEngine.add_request, vagen.rollout.Rollouts.play,
                                             vagen.train.kept_samples)
    counted_schedulers = set()

    def count_passes(engine) -> None:
        """The engine's scheduler counted: a call that scheduled tokens is a forward pass."""
        scheduler = vllm_compat.scheduler(engine)
        if id(scheduler) in counted_schedulers:
            return
        counted_schedulers.add(id(scheduler))
        from benchmarks.bench_agent_loop import count_scheduled

        count_scheduled(engine, counts, steps="passes")

    def timed_step(engine, *args, **kwargs):
        count_passes(engine)
        t0 = time.perf_counter()
        try:
            return step(engine, *args, **kwargs)
        finally:
            counts["step_s"] += time.perf_counter() - t0

    def counted_request(engine, *args, **kwargs):
        counts["requests"] += 1
        return add_request(engine, *args, **kwargs)

    def measured_play(rollouts, decoder, version, saves_in=0):
        before = dict(counts)
        t0 = time.perf_counter()
        episodes, stats = play(rollouts, decoder, version, saves_in)
        record = {key: counts[key] - before[key] for key in counts}
        record.update(iteration=version, rollout_s=time.perf_counter() - t0, drain=saves_in == 1,
                      episodes=len(episodes), turns=sum(len(ep.turns) for ep in episodes))
        iterations.append(record)
        return episodes, stats

    def counted_kept(cfg, dist, models, played):
        samples, stats, kept = kept_samples(cfg, dist, models, played)
        iterations[-1].update(samples=len(samples), trained_turns=sum(len(ep.turns) for ep in kept))
        return samples, stats, kept

    LLMEngine.step, LLMEngine.add_request = timed_step, counted_request
    vagen.rollout.Rollouts.play, vagen.train.kept_samples = measured_play, counted_kept


def child(out: Path, train_args: list[str]) -> int:
    """One training run (`vagen.train.main(train_args)`), its per-iteration measures and metrics into `out`."""
    from vagen.distributed import leave_process_group
    from vagen.train import main

    iterations: list[dict] = []
    instrument(iterations)
    code = leave_process_group(main(train_args))
    run_dir = Path(next(arg.split("=", 1)[1] for arg in train_args if arg.startswith("train.run_dir=")))
    runs = [p for p in run_dir.iterdir() if p.is_dir()]
    if len(runs) != 1:
        raise SystemExit(f"{run_dir} holds {len(runs)} runs ({', '.join(p.name for p in runs)}); expected the one "
                         f"this configuration trained: give each configuration a train.run_dir of its own")
    run = runs[0]
    metrics = {r["iteration"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    for record in iterations:
        logged = metrics.get(record["iteration"], {})
        record.update({key: logged[key] for key in ("timing/iteration", "rollout/carried_episodes",
                                                    "rollout/staleness_max", "rollout/staleness_mean",
                                                    "rollout/success", "actor/tis_clamped_fraction",
                                                    "update/optimizer_steps") if key in logged})
    out.write_text(json.dumps({"code": code, "iterations": iterations}))
    return code


# -- in the parent: the configurations, and the table -------------------------------------------------------

def summarise(iterations: list[dict]) -> dict:
    """The measures of one run over its steady iterations (all but the first and the last; all when there are
    fewer than three): sums over them, then the ratios (module docstring). The rollouts' counts and seconds are
    taken per turn they played (one request each) and scaled to the turns the window's updates trained: at k > 0
    a rollout also decodes turns that an update after the window trains, or an update trains turns decoded
    before it, and the two differ by a whole batch in a window of a few iterations."""
    steady = iterations[1:-1] if len(iterations) >= 3 else iterations

    def total(key):
        return sum(r[key] for r in steady)

    passes, iteration_s, samples = total("passes"), total("timing/iteration"), max(total("samples"), 1)
    played, trained = max(total("requests"), 1), total("trained_turns")
    # the rollouts' time for the trained turns, and the engine's within it: per turn played, times the turns trained
    rollout_s, step_s = total("rollout_s") * trained / played, total("step_s") * trained / played
    other_s = iteration_s - total("rollout_s")  # the updates': one per iteration, B groups each
    return {
        "iterations": len(steady),
        "passes_per_turn": passes / played,
        "sequences_per_pass": total("sequences") / max(passes, 1),
        "tokens_per_turn": total("tokens") / played,
        "idle_rollout": 1.0 - total("step_s") / max(total("rollout_s"), 1e-9),
        "idle_iteration": 1.0 - step_s / max(rollout_s + other_s, 1e-9),
        "rollout_s_per_sample": rollout_s / samples,
        "other_s_per_sample": other_s / samples,
        "s_per_sample": (rollout_s + other_s) / samples,
        "carried": total("rollout/carried_episodes") / len(steady),
        "samples_per_update": total("samples") / len(steady),
        "optimizer_steps": sum(r.get("update/optimizer_steps", 0.0) for r in steady) / len(steady),
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in iterations),
        "samples": total("samples"),
    }


def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """The mean of `values` and the half-width of its 95% t interval (None for a single value)."""
    from benchmarks.staleness_learning import t_interval

    if len(values) < 2:
        return sum(values) / len(values), None
    mean, _, high = t_interval(values)
    return mean, high - mean


def compare(runs: dict) -> list[dict]:
    """Rows of the table from `runs` {(env, k, seed): summarise(...)}: per env and k, each measure's mean over the
    seeds and, for k > 0, its ratio to k = 0 of the same env and seed, as a mean with a 95% interval over seeds."""
    rows = []
    for env in sorted({key[0] for key in runs}):
        ks = sorted({key[1] for key in runs if key[0] == env})
        for k in ks:
            seeds = sorted(key[2] for key in runs if key[:2] == (env, k))
            row = {"env": env, "k": k, "seeds": seeds}
            for measure in (*MEASURES, "samples_per_update", "carried", "staleness_max"):
                row[measure] = mean_interval([runs[env, k, seed][measure] for seed in seeds])[0]
            paired = [seed for seed in seeds if (env, 0, seed) in runs]
            if k > 0 and paired:
                for measure in ("passes_per_turn", "sequences_per_pass", "tokens_per_turn", "rollout_s_per_sample",
                                "other_s_per_sample", "s_per_sample"):
                    row[f"{measure}_ratio"] = mean_interval([runs[env, k, seed][measure] / runs[env, 0, seed][measure]
                                                             for seed in paired])
            rows.append(row)
    return rows


def ratio_text(row: dict, measure: str) -> str:
    if f"{measure}_ratio" not in row:
        return ""
    mean, half = row[f"{measure}_ratio"]
    return f" ({mean:.2f}x)" if half is None else f" ({mean:.2f}x ± {half:.2f})"


def table(rows: list[dict]) -> list[str]:
    """The markdown table of `compare`'s rows, ratios to k = 0 in parentheses."""
    lines = ["| env | k | seeds | passes / trained turn | sequences / pass | tokens computed / trained turn | "
             "engine idle: rollout | engine idle: iteration | rollout s / trained sample | update s / trained sample | "
             "s / trained sample | "
             "samples / update | carried episodes / update | staleness max |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(
            f"| {row['env']} | {row['k']} | {len(row['seeds'])} | {row['passes_per_turn']:.2f}"
            f"{ratio_text(row, 'passes_per_turn')} | {row['sequences_per_pass']:.1f}{ratio_text(row, 'sequences_per_pass')} | "
            f"{row['tokens_per_turn']:.0f}{ratio_text(row, 'tokens_per_turn')} | {row['idle_rollout']:.1%} | {row['idle_iteration']:.1%} | {row['rollout_s_per_sample']:.3f}"
            f"{ratio_text(row, 'rollout_s_per_sample')} | {row['other_s_per_sample']:.3f}"
            f"{ratio_text(row, 'other_s_per_sample')} | {row['s_per_sample']:.3f}"
            f"{ratio_text(row, 's_per_sample')} | {row['samples_per_update']:.1f} | {row['carried']:.1f} | "
            f"{row['staleness_max']:.0f} |")
    return lines


def standard_warm_start(config: str, out: Path) -> Path:
    """A copy of the shipped warm start of `config` whose config.json turns vagen's image hooks off."""
    from benchmarks.bench_agent_loop import standard_warm_start as copy

    return copy(config, out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", choices=ENVS, default=list(ENVS))
    parser.add_argument("--ks", nargs="+", type=int, default=[0, 1, 2], help="rollout.max_staleness values")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="train.seed values")
    parser.add_argument("--iterations", type=int, default=5, help="train.iterations of each run")
    parser.add_argument("--groups", type=int, default=8, help="rollout.env_groups")
    parser.add_argument("--group-size", type=int, default=4, help="rollout.group_size")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="rollout.max_new_tokens")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a run may take")
    parser.add_argument("--json", help="write every run's per-iteration records here, after each run (--table reads them); the "
                                       "runs a file of that name holds already are not run again")
    parser.add_argument("--table", help="print the table of a --json file written before, and run nothing")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one instrumented training run
    args, rest = parser.parse_known_args(argv)
    if args.child:
        return child(Path(args.child), rest)
    if args.table:
        print("\n".join(table(compare(summaries(json.loads(Path(args.table).read_text())["runs"])))))
        return 0
    if 0 not in args.ks:
        parser.error(f"--ks {args.ks}: include 0, the synchronous run the others are compared with")

    work = Path(tempfile.mkdtemp(prefix="vagen_bench_staleness_"))
    # runs an earlier, interrupted benchmark kept in --json are kept and not run again
    saved = Path(args.json) if args.json else None
    done_runs: list[dict] = json.loads(saved.read_text())["runs"] if saved is not None and saved.exists() else []
    try:
        models = {env: standard_warm_start(env, work / f"model_{env}") for env in args.envs}
        for seed in args.seeds:
            for env in args.envs:
                for k in args.ks:
                    if any((r["env"], r["k"], r["seed"]) == (env, k, seed) for r in done_runs):
                        continue
                    iterations = run_one(work, models[env], env, k, seed, args)
                    if iterations is not None:
                        done_runs.append({"env": env, "k": k, "seed": seed, "iterations": iterations})
                        if args.json:  # after each run, so that an interrupted benchmark keeps what it measured
                            Path(args.json).write_text(json.dumps({"runs": done_runs}, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{', '.join(args.envs)}: {args.groups} groups x {args.group_size} per update, {args.max_new_tokens}-token "
          f"turns, {args.iterations} iterations (steady: all but the first and the last), seeds {args.seeds}, "
          f"{device_name()}; ratios to k = 0 of the same seed, mean ± 95% interval over seeds")
    asked = {(env, k, seed) for env in args.envs for k in args.ks for seed in args.seeds}
    measured = [r for r in done_runs if (r["env"], r["k"], r["seed"]) in asked]
    print("\n".join(table(compare(summaries(measured)))))
    return 0 if len(measured) == len(asked) else 1


def summaries(done_runs: list[dict]) -> dict:
    """{(env, k, seed): summarise(iterations)} of the runs as `--json` keeps them."""
    return {(r["env"], r["k"], r["seed"]): summarise(r["iterations"]) for r in done_runs}


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"


def run_one(work: Path, model: Path, env: str, k: int, seed: int, args) -> list[dict] | None:
    """One configuration trained in a process of its own (`child`); its iterations' records, or None if it failed."""
    out = work / f"{env}_k{k}_s{seed}.json"
    train_args = ["--config", env, f"model.path={model}", "rollout.backend=vllm", "algo.rollout_correction=tis",
                  f"rollout.max_staleness={k}", f"train.seed={seed}", f"train.iterations={args.iterations}",
                  f"rollout.env_groups={args.groups}", f"rollout.group_size={args.group_size}",
                  f"rollout.max_new_tokens={args.max_new_tokens}", "eval.every=0", "eval.before_training=false",
                  "log.progress=false", "train.save_every=0",
                  # a folder of its own: `child` reads the one run in it, not another configuration's
                  f"train.run_dir={work / 'runs' / f'{env}_k{k}_s{seed}'}", *ENV_OVERRIDES[env]]
    root = str(Path(__file__).resolve().parents[1])
    python_path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", str(out), *train_args],
                              capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "PYTHONPATH": python_path})
    except subprocess.TimeoutExpired:
        print(f"{env} k={k} seed={seed}: stopped after --timeout {args.timeout} s", file=sys.stderr, flush=True)
        return None
    if done.returncode != 0 or not out.exists():
        print(f"{env} k={k} seed={seed}: failed ({done.returncode}); the end of its output:\n"
              f"{done.stdout[-2000:]}{done.stderr[-4000:]}", file=sys.stderr, flush=True)
        return None
    iterations = json.loads(out.read_text())["iterations"]
    s = summarise(iterations)
    print(f"{env} k={k} seed={seed}: {time.perf_counter() - t0:.0f} s; {s['iterations']} steady iterations: "
          f"{s['passes_per_turn']:.2f} passes/turn, {s['sequences_per_pass']:.1f} seq/pass, engine idle "
          f"{s['idle_rollout']:.1%} of the rollout, {s['s_per_sample']:.3f} s/sample, {s['samples_per_update']:.1f} "
          f"samples and {s['optimizer_steps']:.1f} optimizer steps per update, carried {s['carried']:.1f}, "
          f"staleness max {s['staleness_max']:.0f}", flush=True)
    return iterations


if __name__ == "__main__":
    raise SystemExit(main())
