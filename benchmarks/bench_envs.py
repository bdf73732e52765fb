"""Single-process environment throughput: resets per second and step+render per second.

    python benchmarks/bench_envs.py [--seconds 1.0] [--only sokoban,frozenlake]

Each benchmark is a function returning table rows; `BENCHMARKS` lists them in print order, so a
new environment adds one function and one entry. "step+render" is one `env.step(response)` call:
parse the response, execute one action, render the next observation (a PIL image in vision mode).
"reset" is `env.reset(seed)` with a fresh seed, including level generation (and its solvability
guarantee) and the first observation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import envs_visual  # noqa: E402


@dataclass
class Row:
    env: str
    config: str
    measure: str
    per_second: float
    target: float | None = None

    @property
    def met(self) -> str:
        if self.target is None:
            return "-"
        return "yes" if self.per_second >= self.target else "NO"


def time_resets(env, seconds: float) -> float:
    """Resets per second over fresh seeds."""
    count, start, seed = 0, time.perf_counter(), 0
    while True:
        for _ in range(50):
            env.reset(seed=seed)
            seed += 1
        count += 50
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def time_steps(env, responses: list[str], seconds: float) -> float:
    """`env.step` calls per second cycling through `responses`; the resets needed when an episode
    ends are not counted."""
    env.reset(seed=0)
    count, excluded, seed, start = 0, 0.0, 0, time.perf_counter()
    while True:
        for response in responses:
            _, _, terminated, truncated, _ = env.step(response)
            if terminated or truncated:
                t = time.perf_counter()
                seed += 1
                env.reset(seed=seed)
                excluded += time.perf_counter() - t
        count += len(responses)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / (elapsed - excluded)


def move_responses(actions: tuple[str, ...], n: int = 64) -> list[str]:
    """A fixed pseudo-random walk of one-action free_think responses."""
    return [
        f"<think>I move.</think><answer>{actions[(i * 7 + i // 3) % len(actions)]}</answer>" for i in range(n)
    ]


def bench_sokoban(seconds: float) -> list[Row]:
    rows = []
    for cell_size, target_steps, target_resets in ((16, 10_000, 2_000), (28, None, None)):
        env = envs_visual.make("sokoban", dim_room=(6, 6), num_boxes=1, cell_size=cell_size, max_steps=10**9)
        config = f"6x6, 1 box, vision {6 * cell_size}x{6 * cell_size}"
        rows.append(
            Row(
                "sokoban",
                config,
                "step+render",
                time_steps(env, move_responses(env.action_names), seconds),
                target_steps,
            )
        )
        rows.append(Row("sokoban", config, "reset", time_resets(env, seconds), target_resets))
    env = envs_visual.make("sokoban", render_mode="text", max_steps=10**9)
    rows.append(
        Row(
            "sokoban",
            "6x6, 1 box, text",
            "step+render",
            time_steps(env, move_responses(env.action_names), seconds),
        )
    )
    env = envs_visual.make("sokoban", dim_room=(8, 8), num_boxes=2, cell_size=16)
    rows.append(Row("sokoban", "8x8, 2 boxes, vision 128x128", "reset", time_resets(env, seconds)))
    return rows


def bench_frozenlake(seconds: float) -> list[Row]:
    rows = []
    for cell_size in (16, 28):
        env = envs_visual.make("frozenlake", cell_size=cell_size, max_steps=10**9)
        config = f"4x4, vision {4 * cell_size}x{4 * cell_size}"
        rows.append(
            Row(
                "frozenlake",
                config,
                "step+render",
                time_steps(env, move_responses(env.action_names), seconds),
            )
        )
        rows.append(Row("frozenlake", config, "reset", time_resets(env, seconds)))
    env = envs_visual.make("frozenlake", size=8, is_slippery=True, render_mode="text", max_steps=10**9)
    rows.append(
        Row(
            "frozenlake",
            "8x8 slippery, text",
            "step+render",
            time_steps(env, move_responses(env.action_names), seconds),
        )
    )
    return rows


def bench_text_envs(seconds: float) -> list[Row]:
    bandit = envs_visual.make("bandit")
    countdown = envs_visual.make("countdown")
    # a one-turn episode: every step ends it, so step+reset is the meaningful unit
    return [
        Row("bandit", "one pull", "reset", time_resets(bandit, seconds)),
        Row("countdown", "4 numbers", "reset", time_resets(countdown, seconds)),
        Row(
            "countdown",
            "4 numbers",
            "step",
            time_steps(countdown, ["<think>t</think><answer>(1 + 2) * 3 - 4</answer>"], seconds),
        ),
    ]


def bench_navigation(seconds: float) -> list[Row]:
    """MuJoCo navigation beside a bare `mujoco.Renderer` render of the same scene, in the same run;
    the step+render target is 60% of the bare rate."""
    from benchmarks.bench_navigation import navigation_rows

    rows = navigation_rows(steps=max(50, int(300 * seconds)), size=128)
    bare = rows[0]["per_s"]
    config = "128x128, EGL"
    out = [Row("navigation", config, "bare mujoco render", bare)]
    out.append(Row("navigation", config, "step+render", rows[1]["per_s"], target=0.6 * bare))
    out += [Row("navigation", config, r["name"].removeprefix("navigation "), r["per_s"]) for r in rows[2:]]
    return out


def bench_manipulation(seconds: float) -> list[Row]:
    """MuJoCo tabletop: one step is one primitive of the scripted expert (pick, place or push), its
    simulated second or so of physics included; the resets needed when an episode ends are not counted."""
    from envs_visual.base import format_response

    rows = []
    for render_mode, size in (("vision", 168), ("text", 168)):
        env = envs_visual.make("manipulation", task="any", render_mode=render_mode, image_width=size,
                               image_height=size, max_steps=10**9)
        env.reset(seed=0)
        count, excluded, sim_time, seed, start = 0, 0.0, 0.0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds or count < 10:
            plan = env.solve() or ["pick(0, 0, 20)"]
            _, _, terminated, truncated, info = env.step(format_response(env.prompt_format, plan[0]))
            count += 1
            sim_time += info["sim_time"]
            if terminated or truncated:
                t = time.perf_counter()
                seed += 1
                env.reset(seed=seed)
                excluded += time.perf_counter() - t
        elapsed = time.perf_counter() - start - excluded
        config = f"vision {size}x{size}" if render_mode == "vision" else "text"
        rows.append(Row("manipulation", config, f"step+render (1 primitive, {sim_time / count:.1f} s simulated)",
                        count / elapsed))
        rows.append(Row("manipulation", config, "reset", time_resets(env, seconds)))
        env.close()
    return rows


# Append one (name, function) per environment; each function takes the seconds per measurement.
BENCHMARKS: list[tuple[str, Callable[[float], list[Row]]]] = [
    ("sokoban", bench_sokoban),
    ("frozenlake", bench_frozenlake),
    ("text", bench_text_envs),
    ("navigation", bench_navigation),
    ("manipulation", bench_manipulation),
]


def print_table(rows: list[Row]) -> None:
    header = ("env", "config", "measure", "per second", "target", "met")
    table = [header] + [
        (
            r.env,
            r.config,
            r.measure,
            f"{r.per_second:,.0f}",
            "-" if r.target is None else f"{r.target:,.0f}",
            r.met,
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    for k, line in enumerate(table):
        print(
            "  ".join(
                cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))
            )
        )
        if k == 0:
            print("  ".join("-" * w for w in widths))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="wall time per measurement")
    parser.add_argument("--only", default="", help="comma-separated benchmark names, e.g. sokoban,frozenlake")
    args = parser.parse_args()
    only = {name for name in args.only.split(",") if name}
    rows = []
    for name, bench in BENCHMARKS:
        if not only or name in only:
            rows.extend(bench(args.seconds))
    print_table(rows)
    if any(r.met == "NO" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
