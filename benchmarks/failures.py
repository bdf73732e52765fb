"""Where a grid agent fails: plays a checkpoint on distinct held-out levels and replays every
executed action against the level.

    python benchmarks/failures.py CHECKPOINT [--config frozenlake_visual] [--n 256] [--sampled] [key=value ...]
    python benchmarks/failures.py CHECKPOINT --config sokoban_visual
    python benchmarks/failures.py teacher --config sokoban_visual      # or solver: the scripted policy

Prints how episodes end next to the teacher's outcome on the same level, and per position of an
action within its turn (first, second, ... of the answer) what the actions did.
- FrozenLake: episodes end at the goal, in a hole or out of turns; actions step into a hole, match
  the teacher's move, or lie on a shortest path. A policy that reads the cell next to it but not the
  cells its later moves enter shows it as holes at positions 2 and 3. An agent that reasons along its
  path (`sft.reasoning=path`) also gets, per action, whether its clause names the cell the move
  starts from and whether it is word for word the clause the teacher writes in that state (the
  holes read right and the teacher's move chosen).
- Sokoban: episodes end solved, deadlocked (a push left the level unsolvable) or out of turns with
  the level still solvable; actions change nothing (split into walking into a wall and pushing a box
  that cannot move), match the teacher's move, lie on an optimal plan (the solver's remaining length
  drops by one), or deadlock; with path reasoning, whether the action's clause names the cell the
  player stands on.
The teacher's move is its choice in that state. FrozenLake's teacher always has one; where it moves
at random the draw comes from a fixed generator, so even the teacher's own episodes match it less
than always. Sokoban's is counted only where it is not random: of the states where the teacher
would push, and of those where it would step toward the cell it wants to push from.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def path_clauses(response: str) -> list[str]:
    """The `row R, column C: …` clauses of a response's <think> (`sft.reasoning=path`), in order."""
    think = response.split("<think>")[-1].split("</think>")[0] if "</think>" in response else ""
    return re.findall(r"row \d+, column \d+: [^.]*\.", think)


def names_cell(clause: str, cell: tuple[int, int]) -> bool:
    """Whether a path clause starts from `cell` (row, column)."""
    return clause.startswith(f"row {cell[0]}, column {cell[1]}:")


def replay_frozenlake(cfg, episode, counts: collections.Counter) -> str:
    """Count `episode`'s executed actions by position in their turn; returns how it ended."""
    import numpy as np

    import envs_visual.frozenlake as frozenlake
    from envs_visual.grid import DIRECTIONS, bfs_path
    from vagen.rollout import make_env
    from vagen.warmstart.demos import frozenlake_path

    env = make_env(cfg.env, {"render_mode": "text", "prompt_format": "no_think"})
    env.reset(seed=episode.seed)
    state = env.state()
    holes, free = {tuple(h) for h in state["holes"]}, np.ones(state["size"], dtype=bool)
    for hole in holes:
        free[hole] = False
    paths = {cell: bfs_path(free, cell, tuple(state["goal"])) for cell in np.ndindex(*free.shape) if free[cell]}
    dist = {cell: len(path) for cell, path in paths.items() if path is not None}  # moves to the goal
    for turn in episode.turns:
        clauses = path_clauses(getattr(turn, "response", ""))
        for index, action in enumerate(turn.info.get("actions", [])):
            state = env.state()
            (r, c), (dr, dc) = state["player"], DIRECTIONS[action]
            cell, teacher = (r + dr, c + dc), frozenlake.teacher_action(state)
            counts[index, "actions"] += 1
            if index < len(clauses):  # sft.reasoning=path: did its clause name this cell, and read it as the teacher?
                counts[index, "where"] += names_cell(clauses[index], (r, c))
                counts[index, "read"] += clauses[index] == frozenlake_path([state], [teacher])["reasoning"]
            counts[index, "hole"] += cell in holes
            counts[index, "teacher"] += action == teacher
            counts[index, "shortest"] += (r, c) in dist and dist.get(cell, -1) == dist[(r, c)] - 1
            _, _, terminated, truncated, info = env.step(f"<answer>{action}</answer>")
            if terminated:
                return "goal" if info["success"] else "hole"
            if truncated:
                return "out of turns"
    return "goal" if episode.success else "out of turns"


def replay_sokoban(cfg, episode, counts: collections.Counter) -> str:
    """Count `episode`'s executed actions by position in their turn; returns how it ended."""
    import envs_visual.sokoban as sokoban
    from envs_visual.grid import DIRECTIONS
    from vagen.rollout import make_env

    env = make_env(cfg.env, {"render_mode": "text", "prompt_format": "no_think"})
    env.reset(seed=episode.seed)
    remaining = len(env.solve())
    for turn in episode.turns:
        clauses = path_clauses(getattr(turn, "response", ""))
        for index, action in enumerate(turn.info.get("actions", [])):
            before = env.state()
            (r, c), (dr, dc) = before["player"], DIRECTIONS[action]
            counts[index, "actions"] += 1
            wanted, mode, _ = sokoban.teacher_decision(before)
            if mode != "random":  # the teacher would push, or step toward the cell it pushes from
                counts[index, mode] += 1
                counts[index, "teacher " + mode] += action == wanted
            if index < len(clauses):  # sft.reasoning=path: does its clause start from where the player stands?
                counts[index, "where"] += names_cell(clauses[index], (r, c))
            _, _, terminated, truncated, info = env.step(f"<answer>{action}</answer>")
            if env.state() == before:
                counts[index, "no effect"] += 1
                wall = (r + dr, c + dc) in {tuple(w) for w in before["walls"]}
                counts[index, "into a wall" if wall else "box stuck"] += 1
            plan = env.solve()
            counts[index, "optimal"] += plan is not None and len(plan) == remaining - 1
            if plan is None:
                counts[index, "deadlock"] += 1
                return "deadlocked"
            remaining = len(plan)
            if terminated:
                return "solved" if info["success"] else "out of turns"
            if truncated:
                return "out of turns"
    return "solved" if episode.success else "out of turns"


def scripted_episodes(cfg, seeds: list[int], policy: str) -> list:
    """The teacher's or the solver's episodes on `seeds`, with what `replay_*` reads of an episode."""
    from types import SimpleNamespace

    from vagen.rollout import make_env
    from vagen.warmstart.demos import play_demo

    env = make_env(cfg.env, {"render_mode": "text"})
    episodes = []
    for seed in seeds:
        demo = play_demo(env, seed, policy, cfg.rollout.max_turns)
        env.reset(seed=seed)
        turns = [SimpleNamespace(info=env.step(response)[-1]) for response in demo.responses]
        episodes.append(SimpleNamespace(seed=seed, success=demo.success, turns=turns))
    return episodes


# env: (replay, how episodes end, (count key, column title[, the count it is a share of: else all actions]) per action)
REPLAYS = {
    "frozenlake": (replay_frozenlake, ("goal", "hole", "out of turns"),
                   (("hole", "into a hole"), ("teacher", "teacher's move"), ("shortest", "on a shortest path"))),
    "sokoban": (replay_sokoban, ("solved", "deadlocked", "out of turns"),
                (("no effect", "no effect"), ("into a wall", "of which into a wall"),
                 ("box stuck", "of which a box that cannot move"),
                 ("teacher push", "the teacher's push, where it pushes", "push"),
                 ("teacher approach", "the teacher's step, where it walks to a pushing cell", "approach"),
                 ("optimal", "on an optimal plan"), ("deadlock", "deadlocks"))),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory, or teacher / solver for the scripted policy")
    parser.add_argument("--config", default="frozenlake_visual")
    parser.add_argument("--n", type=int, default=256, help="distinct held-out levels")
    parser.add_argument("--sampled", action="store_true", help="sample at rollout.temperature instead of greedy")
    parser.add_argument("overrides", nargs="*", help="section.key=value (e.g. env.max_actions_per_turn=1)")
    args = parser.parse_intermixed_args(argv)

    from vagen.config import load_config
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy
    from vagen.rollout import make_env, rollout
    from vagen.warmstart.demos import distinct_eval_seeds, play_demo

    cfg = load_config(args.config, args.overrides)
    if cfg.env.name not in REPLAYS:
        raise SystemExit(f"failures.py replays {' and '.join(REPLAYS)} levels; --config {args.config} plays "
                         f"{cfg.env.name}")
    replay, endings, columns = REPLAYS[cfg.env.name]
    seeds = distinct_eval_seeds(cfg.env, args.n)
    if args.checkpoint in ("teacher", "solver"):
        episodes = scripted_episodes(cfg, seeds, args.checkpoint)
    else:
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
    print("| level | " + " | ".join(endings) + " |\n|" + " --- |" * (len(endings) + 1))
    for side in ("teacher solves", "teacher fails"):
        print(f"| {side} | " + " | ".join(str(ends[side, end]) for end in endings) + " |")
    if any(key == "where" for _, key in counts):
        columns += (("where", "its clause names the cell"),)
    if any(key == "read" for _, key in counts):
        columns += (("read", "its clause is the teacher's"),)
    print("\n| action in turn | actions | " + " | ".join(title for _, title, *_ in columns) + " |\n|"
          + " --- |" * (len(columns) + 2))
    for index in sorted({i for i, _ in counts}):
        n = counts[index, "actions"]
        cells = []
        for key, _, *of in columns:
            total = counts[index, of[0]] if of else n
            share = f"{counts[index, key] / total:.1%}" if total else "–"
            cells.append(f"{counts[index, key]} ({share})" if not of else f"{counts[index, key]}/{total} ({share})")
        print(f"| {index + 1} | {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
