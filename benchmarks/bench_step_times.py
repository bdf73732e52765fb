"""The slowest legitimate reset and step of each shipped environment, the measurement behind the default
`env.step_timeout` (vagen.config_sections.DEFAULT_STEP_TIMEOUT, derivation in docs/benchmarks.md).

    python benchmarks/bench_step_times.py [--seeds 12] [--turns 5]
    python benchmarks/bench_step_times.py --only manipulation_visual env.params.task=any   # every task drawn

For each shipped environment config, at its CPU frame size and at the environment's own default size (what a
real model's recipe renders), it makes the environment, resets `--seeds` levels (level generation with its solvability check, the
first frame; the first reset counts the making, as a worker's first request does) and steps each for up to `--turns` turns with the teacher's responses (valid actions: the
longest physics and renders) and with random ones, in this process, one call at a time. It prints the median
and the largest time of a reset and of a step, in milliseconds. Information only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONFIGS = ("sokoban_visual", "frozenlake_visual", "navigation_visual", "manipulation_visual")
SIZE_PARAMS = ("image_width", "image_height", "cell_size")


def measure(cfg_env, seeds: int, turns: int) -> tuple[list[float], list[float]]:
    """Seconds of each reset and each step of `seeds` levels played `turns` turns by the teacher and by random
    responses; the first reset includes making the environment."""
    import copy
    import pickle

    import numpy as np

    from vagen.env_workers import build_env
    from vagen.warmstart.demos import demo_response

    t0 = time.perf_counter()
    env = build_env(cfg_env)  # a worker makes an environment on its first request, inside that request's deadline
    made = time.perf_counter() - t0
    # The responses come from a twin that never renders (the teacher plans on a copy of its environment, and a
    # MuJoCo renderer cannot be copied), stepped alongside.
    text_env = copy.deepcopy(cfg_env)
    text_env.render_mode = "text"
    planner = build_env(text_env)
    resets, steps = [], []
    for policy in ("teacher", "random"):
        for seed in range(seeds):
            t0 = time.perf_counter()
            answer = env.reset(seed=seed)
            pickle.dumps(answer)  # a worker pickles its answer: frames rendered lazily are rendered here
            resets.append(time.perf_counter() - t0 + (made if not resets else 0.0))
            planner.reset(seed=seed)
            rng = np.random.default_rng([seed, 3])
            for _ in range(turns):
                response = demo_response(planner, policy, rng)
                t0 = time.perf_counter()
                answer = env.step(response)
                pickle.dumps(answer)
                steps.append(time.perf_counter() - t0)
                planner.step(response)
                if answer[2] or answer[3]:
                    break
    for made in (env, planner):
        if hasattr(made, "close"):
            made.close()
    return resets, steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=12, help="levels per environment and policy")
    parser.add_argument("--turns", type=int, default=5, help="turns per level at most")
    parser.add_argument("--only", default="", help="comma-separated configs (default: all four)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every config, e.g. env.params.task=any")
    args = parser.parse_args(argv)

    from vagen.config import load_config

    rows = []
    for name in [c for c in args.only.split(",") if c] or CONFIGS:
        cfg = load_config(name, args.overrides)
        for size in ("config", "env default"):
            if size == "env default":
                sized = {k: v for k, v in cfg.env.params.items() if k in SIZE_PARAMS}
                if not sized:
                    continue
                cfg.env.params = {k: v for k, v in cfg.env.params.items() if k not in SIZE_PARAMS}
            resets, steps = measure(cfg.env, args.seeds, args.turns)
            ms = [1000 * statistics.median(resets), 1000 * max(resets), 1000 * statistics.median(steps),
                  1000 * max(steps)]
            rows.append((name, size, len(resets), len(steps), *ms))
            print(f"{name} ({size}): reset median {ms[0]:.1f} ms max {ms[1]:.1f} ms; step median {ms[2]:.1f} ms "
                  f"max {ms[3]:.1f} ms", flush=True)
    load = os.getloadavg()[0]
    print(f"\n{args.seeds} levels x (teacher, random), up to {args.turns} turns, one process, load average {load:.1f} "
          f"on {os.cpu_count()} cores")
    print("| config | frame size | resets | steps | reset median ms | reset max ms | step median ms | step max ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, size, n_resets, n_steps, *ms in rows:
        print(f"| {name} | {size} | {n_resets} | {n_steps} | " + " | ".join(f"{v:.1f}" for v in ms) + " |")
    worst = max(max(row[5], row[7]) for row in rows)
    print(f"\nslowest reset or step: {worst:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
