"""Single-process environment throughput: resets per second and step+render per second.

    python benchmarks/bench_envs.py [--seconds 1.0] [--only sokoban,frozenlake]

Each benchmark is a function returning table rows; `BENCHMARKS` lists them in print order, so a
new environment adds one function and one entry. "step+render" is one `env.step(response)` call:
parse the response, execute one action, render the next observation (a PIL image in vision mode).
"reset" is `env.reset(seed)` with a fresh seed, including level generation (and its solvability
guarantee) and the first observation.

`gym_sokoban` plays the same levels and moves through gym-sokoban 0.0.6 (the reference
implementation, step + render of a 16-pixel-tile RGB frame) and through vagen's Sokoban (parse,
move, render a 96x96 frame) in this process, and prints the ratio. gym-sokoban needs the
unmaintained `gym` and `pkg_resources` (setuptools < 81), so it lives in a venv of its own that
sees this one's packages:

    python -m venv --system-site-packages .venv-gym-sokoban
    .venv-gym-sokoban/bin/pip install gym-sokoban==0.0.6 gym==0.26.2 'setuptools<81'
    .venv-gym-sokoban/bin/python benchmarks/bench_envs.py --only gym_sokoban
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


def _gym_sokoban_room(level) -> tuple:
    """`level` as gym-sokoban's (room_fixed, room_state): 0 wall, 1 floor, 2 target, 3 box on a target,
    4 box, 5 player."""
    import numpy as np

    fixed = np.where(np.array(level.walls).reshape(level.height, level.width), 0, 1).astype(np.uint8)
    fixed.flat[list(level.targets)] = 2
    state = fixed.copy()
    for box in level.boxes:
        state.flat[box] = 3 if fixed.flat[box] == 2 else 4
    state.flat[level.player] = 5
    return fixed, state


def bench_gym_sokoban(seconds: float) -> list[Row]:
    """vagen's Sokoban against gym-sokoban 0.0.6 on the same levels and moves, one process: step + render
    to a frame (16-pixel tiles on both sides), per CPU second. The ratio's target is 20x."""
    import warnings

    import numpy as np

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from gym_sokoban.envs.sokoban_env import SokobanEnv as GymSokoban
    except ImportError as error:
        print(f"gym_sokoban: skipped, gym-sokoban 0.0.6 does not import ({error}); install it as the module "
              "docstring says (a venv with gym-sokoban==0.0.6 gym==0.26.2 'setuptools<81')", file=sys.stderr)
        return []
    from envs_visual.sokoban import generate_level

    levels = [generate_level(seed) for seed in range(32)]
    ours = envs_visual.make("sokoban", cell_size=16, max_steps=10**9)
    responses = move_responses(ours.action_names)
    gym_actions = [1 + ours.action_names.index(r.split("<answer>")[1].split("</answer>")[0]) for r in responses]
    gym = GymSokoban(dim_room=(6, 6), num_boxes=1, max_steps=10**9, reset=False)

    def load_gym(level) -> None:
        gym.room_fixed, gym.room_state = _gym_sokoban_room(level)
        gym.player_position = np.argwhere(gym.room_state == 5)[0]
        gym.num_env_steps, gym.reward_last, gym.boxes_on_target = 0, 0, 0

    class Player:
        """Plays the levels in turn, 64 moves per `block`; counts this process's CPU time, not the time
        spent loading the next level."""

        def __init__(self, load, step):
            self.load, self.step = load, step
            self.index, self.count, self.cpu = 0, 0, 0.0
            load(levels[0])

        def block(self) -> None:
            start = time.process_time()
            for k in range(len(responses)):
                if self.step(k):
                    t = time.process_time()
                    self.index = (self.index + 1) % len(levels)
                    self.load(levels[self.index])
                    start += time.process_time() - t
            self.count += len(responses)
            self.cpu += time.process_time() - start

    def step_ours(k: int) -> bool:
        _, _, terminated, truncated, _ = ours.step(responses[k])
        return terminated or truncated

    def step_gym(k: int) -> bool:
        frame, _, done, _ = gym.step(gym_actions[k])
        assert frame.shape == (96, 96, 3), frame.shape
        return done

    # Blocks of each in turn, timed in CPU seconds, so that other load on the machine weighs on both sides
    # alike; gym-sokoban's time goes mostly to reading its seven tile PNGs on every render.
    theirs, mine = Player(load_gym, step_gym), Player(ours.load_level, step_ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # imageio's and numpy's deprecation warnings from gym-sokoban
        start = time.perf_counter()
        while time.perf_counter() - start < 2 * seconds or theirs.count < 256:
            theirs.block()
            for _ in range(4):  # ours is ~20x faster: four blocks keep its share of the time measurable
                mine.block()
    theirs, mine = theirs.count / theirs.cpu, mine.count / mine.cpu
    config = "6x6, 1 box, vision 96x96, same levels"
    return [
        Row("gym-sokoban 0.0.6", config, "step+render per CPU s", theirs),
        Row("sokoban", config, "step+render per CPU s", mine),
        Row("sokoban", config, "step+render, x gym-sokoban", mine / theirs, 20.0),
    ]


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
    ("gym_sokoban", bench_gym_sokoban),
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
            f"{r.per_second:,.1f}" if r.per_second < 100 else f"{r.per_second:,.0f}",
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
