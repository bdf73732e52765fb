"""Where a FrozenLake agent fails: plays a checkpoint on distinct held-out levels and replays every
executed action against the level's map.

    python benchmarks/failures.py CHECKPOINT [--config frozenlake_visual] [--n 256] [--sampled] [key=value ...]

Prints how episodes end (goal, hole, out of turns) next to the teacher's outcome on the same level,
and per position of an action within its turn (first, second, ... of the answer) how many actions
stepped into a hole, matched the teacher's move, or lay on a shortest path. A policy that reads the
cell next to it but not the cells its later moves enter shows it as holes at positions 2 and 3.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def replay(cfg, episode, counts: collections.Counter) -> str:
    """Count `episode`'s executed actions by position in their turn; returns how it ended."""
    import numpy as np

    import envs_visual.frozenlake as frozenlake
    from envs_visual.grid import DIRECTIONS, bfs_path
    from vagen.rollout import make_env

    env = make_env(cfg.env, {"render_mode": "text", "prompt_format": "no_think"})
    env.reset(seed=episode.seed)
    state = env.state()
    holes, free = {tuple(h) for h in state["holes"]}, np.ones(state["size"], dtype=bool)
    for hole in holes:
        free[hole] = False
    paths = {cell: bfs_path(free, cell, tuple(state["goal"])) for cell in np.ndindex(*free.shape) if free[cell]}
    dist = {cell: len(path) for cell, path in paths.items() if path is not None}  # moves to the goal
    for turn in episode.turns:
        for index, action in enumerate(turn.info.get("actions", [])):
            state = env.state()
            (r, c), (dr, dc) = state["player"], DIRECTIONS[action]
            cell = (r + dr, c + dc)
            counts[index, "actions"] += 1
            counts[index, "hole"] += cell in holes
            counts[index, "teacher"] += action == frozenlake.teacher_action(state)
            counts[index, "shortest"] += (r, c) in dist and dist.get(cell, -1) == dist[(r, c)] - 1
            _, _, terminated, truncated, info = env.step(f"<answer>{action}</answer>")
            if terminated:
                return "goal" if info["success"] else "hole"
            if truncated:
                return "out of turns"
    return "goal" if episode.success else "out of turns"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--config", default="frozenlake_visual")
    parser.add_argument("--n", type=int, default=256, help="distinct held-out levels")
    parser.add_argument("--sampled", action="store_true", help="sample at rollout.temperature instead of greedy")
    parser.add_argument("overrides", nargs="*", help="section.key=value (e.g. env.max_actions_per_turn=1)")
    args = parser.parse_intermixed_args(argv)

    from vagen.config import load_config
    from vagen.demos import distinct_eval_seeds, play_demo
    from vagen.models import load_policy
    from vagen.rollout import ChatEncoder, make_env, rollout

    cfg = load_config(args.config, args.overrides)
    if cfg.env.name != "frozenlake":
        raise SystemExit(f"failures.py replays FrozenLake maps; --config {args.config} plays {cfg.env.name}")
    seeds = distinct_eval_seeds(cfg.env, args.n)
    model, processor = load_policy(Path(args.checkpoint), cfg.model.dtype)
    model.eval()
    encoder = ChatEncoder(processor)
    episodes = []
    for start in range(0, len(seeds), 64):
        episodes += rollout(model, encoder, cfg, seeds[start:start + 64], 1, do_sample=args.sampled)[0]
    teacher_env = make_env(cfg.env, {"render_mode": "text"})
    counts, ends = collections.Counter(), collections.Counter()
    for episode in episodes:
        teacher = play_demo(teacher_env, episode.seed, "teacher", cfg.rollout.max_turns).success
        ends["teacher " + ("solves" if teacher else "fails"), replay(cfg, episode, counts)] += 1
    print(f"{len(episodes)} levels, success {sum(e.success for e in episodes) / len(episodes):.3f}\n")
    print("| level | goal | hole | out of turns |\n| --- | --- | --- | --- |")
    for side in ("teacher solves", "teacher fails"):
        print(f"| {side} | " + " | ".join(str(ends[side, end]) for end in ("goal", "hole", "out of turns")) + " |")
    print("\n| action in turn | actions | into a hole | teacher's move | on a shortest path |\n| --- | --- | --- | --- | --- |")
    for index in sorted({i for i, _ in counts}):
        n = counts[index, "actions"]
        print(f"| {index + 1} | {n} | {counts[index, 'hole']} ({counts[index, 'hole'] / n:.1%}) | "
              f"{counts[index, 'teacher'] / n:.1%} | {counts[index, 'shortest'] / n:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
