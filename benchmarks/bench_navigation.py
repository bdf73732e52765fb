"""Navigation throughput: `env.step` with a rendered frame next to a bare `mujoco.Renderer` render of
the same scene, in the same process. Target: step+render at >= 60% of the bare render rate.

    python -m benchmarks.bench_navigation [--steps 300] [--size 128]   # from the repository root
"""

from __future__ import annotations

import argparse
import time

import envs_visual
from envs_visual.navigation_scene import mujoco  # sets MUJOCO_GL=egl before mujoco's first import


def _rate(fn, n: int) -> float:
    for _ in range(min(10, n)):  # warm up caches and the GL pipeline
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - start)


def navigation_rows(steps: int = 300, size: int = 128, seed: int = 0) -> list[dict]:
    """One row per measurement: name, per_s (operations per second), ms (per operation) and
    ratio_to_bare (per_s divided by the bare render rate)."""
    env = envs_visual.make("navigation", image_width=size, image_height=size, max_steps=10**9)
    env.reset(seed=seed)
    scene = env._scene  # the env's own model and data: the bare renderer draws exactly this scene
    bare = mujoco.Renderer(scene.model, height=size, width=size)
    for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
        bare.scene.flags[flag] = False

    def bare_render():
        bare.update_scene(scene.data, camera=scene.camera_id, scene_option=scene.option)
        bare.render()

    turn = iter(range(10**12))

    def step():  # alternate turns so that every step needs a new frame
        env.step(f"<think>t</think><answer>{'rotateleft' if next(turn) % 2 else 'rotateright'}</answer>")

    text_env = envs_visual.make("navigation", render_mode="text", max_steps=10**9)
    text_env.reset(seed=seed)
    text_turn = iter(range(10**12))

    def text_step():
        text_env.step(f"<think>t</think><answer>{'rotateleft' if next(text_turn) % 2 else 'rotateright'}</answer>")

    seeds = iter(range(10**12))
    try:
        measured = [
            ("bare mujoco.Renderer update_scene+render", _rate(bare_render, steps)),
            ("navigation step (1 action) + frame", _rate(step, steps)),
            ("navigation reset + frame", _rate(lambda: env.reset(seed=next(seeds)), max(20, steps // 5))),
            ("navigation step, text mode", _rate(text_step, steps)),
        ]
    finally:
        bare.close()
        env.close()
        text_env.close()
    bare_rate = measured[0][1]
    return [
        {"name": name, "per_s": round(rate, 1), "ms": round(1000.0 / rate, 3), "ratio_to_bare": round(rate / bare_rate, 3)}
        for name, rate in measured
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    rows = navigation_rows(args.steps, args.size)
    print(f"navigation, {args.size}x{args.size} frames, MUJOCO_GL={__import__('os').environ['MUJOCO_GL']}")
    print(f"{'measurement':<42} {'per s':>9} {'ms':>8} {'vs bare':>8}")
    for row in rows:
        print(f"{row['name']:<42} {row['per_s']:>9.1f} {row['ms']:>8.3f} {row['ratio_to_bare']:>8.2f}")
    step_ratio = rows[1]["ratio_to_bare"]
    print(f"step+render / bare render = {step_ratio:.2f} (target >= 0.60): {'OK' if step_ratio >= 0.6 else 'BELOW'}")


if __name__ == "__main__":
    main()
