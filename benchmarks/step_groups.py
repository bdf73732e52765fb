"""How often do the turns of a level group start from the same environment state? GiGPO's step-level
advantage exists only in step groups of two or more turns (a singleton gets 0), so this says how much
step-level credit each env can give.

For each config: `--levels` training levels x `--group-size` rollouts each (the training layout), played
by the config's policy (`model.path`, sampled at `rollout.temperature`) and by random valid actions
(the env's `random_actions`, `env.max_actions_per_turn` per turn); a config whose model is a random
built-in gets only the second. Turns are grouped exactly as
`algo.adv_estimator=gigpo` groups them (level group, `info["state_key"]` of the state before the turn),
and the table reports, for all turns and for turns after the first (every group's first turns share the
reset state): the share of turns in a step group of two or more, and the mean step-group size.

    python benchmarks/step_groups.py --configs frozenlake_visual sokoban_visual navigation_visual \
        manipulation_visual --levels 32 --group-size 8
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["frozenlake_visual", "sokoban_visual"])
    parser.add_argument("--levels", type=int, default=32, help="level groups per config")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per level")
    parser.add_argument("--first-seed", type=int, default=10**6, help="first training level seed")
    parser.add_argument("--no-model", action="store_true", help="random valid actions only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="section.key=value for every config")
    args = parser.parse_args(argv)
    if args.levels < 1 or args.group_size < 2:
        parser.error(f"--levels must be >= 1 and --group-size >= 2 (a step group needs two rollouts of a level), "
                     f"got {args.levels} and {args.group_size}")
    return args


def step_group_stats(keyed_turns: list[tuple[int, int, object]]) -> dict[str, float]:
    """`keyed_turns`: (level group, turn index, state key) of every turn played. Turns are in one step
    group when their level group and state key are equal (the turn index is not part of the key, as in
    training). Returns the share of turns in a step group of two or more and the mean step-group size,
    and the share of the turns after the first that are in a step group of two or more."""
    sizes = Counter((group, key) for group, _, key in keyed_turns)
    later = [(group, key) for group, turn, key in keyed_turns if turn > 0]
    return {"turns": len(keyed_turns), "later_turns": len(later),
            "share": sum(sizes[(g, k)] >= 2 for g, _, k in keyed_turns) / max(len(keyed_turns), 1),
            "size": len(keyed_turns) / max(len(sizes), 1),
            "later_share": sum(sizes[x] >= 2 for x in later) / max(len(later), 1)}


def random_turns(cfg, seeds: list[int], group_size: int) -> list[tuple[int, int, object]]:
    import numpy as np

    from envs_visual.base import format_response
    from vagen.rollout import make_env

    env = make_env(cfg.env)
    keyed = []
    for group, seed in enumerate(seeds):
        for member in range(group_size):
            rng = np.random.default_rng([seed, member])
            _, info = env.reset(seed=seed)
            key = info.get("state_key")
            for turn in range(cfg.rollout.max_turns):
                actions = env.random_actions(rng, env.max_actions_per_turn)
                if actions is None:
                    return []
                keyed.append((group, turn, key))
                _, _, terminated, truncated, info = env.step(format_response(env.prompt_format, ", ".join(actions)))
                key = info.get("state_key")
                if terminated or truncated:
                    break
    if hasattr(env, "close"):
        env.close()
    return keyed


def policy_turns(cfg, seeds: list[int], group_size: int) -> list[tuple[int, int, object]]:
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy, resolve_model_path
    from vagen.rollout import rollout

    model, processor = load_policy(Path(resolve_model_path(cfg.model.path)), cfg.model.dtype)
    model.eval()
    episodes, _ = rollout(model, ChatEncoder(processor), cfg, seeds, group_size, do_sample=True)
    return [(ep.group_id, t, turn.state_key) for ep in episodes for t, turn in enumerate(ep.turns)]


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from vagen.config import load_config
    from vagen.rollout import make_env
    from vagen.warmstart.demos import distinct_levels

    rows = []
    for name in args.configs:
        cfg = load_config(name, args.overrides)
        seeds = list(distinct_levels(make_env(cfg.env), args.levels, itertools.count(args.first_seed)))
        policies = [("random valid actions", random_turns)]
        if not args.no_model and not cfg.model.path.startswith("builtin:"):  # a random model never parses
            policies.insert(0, (f"policy ({cfg.model.path}, T = {cfg.rollout.temperature})", policy_turns))
        for label, play in policies:
            with torch.no_grad():
                keyed = play(cfg, seeds, args.group_size)
            if not keyed:
                continue
            stats = step_group_stats(keyed)
            rows.append((name, cfg.rollout.max_turns, label, stats))
            print(f"  {name} {label}: {stats}", flush=True)
    print(f"\n{args.levels} level groups x {args.group_size} rollouts per config\n")
    print("| config | max turns | policy | turns | in a step group of 2+ | mean step-group size | "
          "turns after the first | of those, in a step group of 2+ |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, turns, label, s in rows:
        print(f"| {name} | {turns} | {label} | {s['turns']} | {s['share']:.3f} | {s['size']:.2f} | "
              f"{s['later_turns']} | {s['later_share']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
