"""Run by tests/test_staleness_vllm.py as its own process (or under the DeepSpeed launcher, one per rank):
`vagen.train.main` with the arguments given, and

- `--record DIR`: every rollout of training written to DIR/rank<R>.jsonl as it ends: the version it was
  played before, the episodes it left waiting for the next weights on this rank, and each episode's group
  number (admission order) and the version of each of its turns;
- `--kill-in-update N`: SIGKILL in the update of iteration N (0-based);
- `--nan-from N`: from the update of iteration N (0-based) on, every policy loss is NaN, so that every optimizer
  step is skipped (with train.max_bad_steps=1 the run stops there, with a checkpoint forced);
- `--synchronous`: each rollout played as training played it before rollout.max_staleness existed:
  `vagen.rollout.rollout` over the iteration's share of level seeds, with the iteration's request seed, on
  the run's environments; no turn of it was carried, and every turn was the iteration's own version (each says
  so on stdout);
- `--long-rank R --short-slots N`: every episode ends after its first turn (the environment says terminated),
  except on rank R those of its environments after the first N (in the rank's order of slots), which never end
  before rollout.max_turns."""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import vagen.rollout as rollout_module
import vagen.update
from vagen.distributed import leave_process_group
from vagen.episode import train_seeds
from vagen.train import main

RANK = int(os.environ.get("RANK", "0"))
real_play = rollout_module.Rollouts.play


def synchronous_play(self, decoder, version, saves_in=0):
    cfg, share = self.cfg, self.admission.groups_per_rank
    seeds = train_seeds(version, cfg.rollout.env_groups, cfg.train.seed)[self.rank * share : (self.rank + 1) * share]
    episodes, stats = rollout_module.rollout(None, self.game.encoder, cfg, seeds, cfg.rollout.group_size,
                                             envs=self.envs, decoder=decoder,
                                             sample_seed=(cfg.train.seed * 1_000_003 + version) * 1_009 + self.rank)
    for episode in episodes:
        for turn in episode.turns:
            turn.version = version
    stats["rollout/carried_episodes"] = 0.0
    print(f"rollout {version}: played synchronously", flush=True)
    return episodes, stats


def recording(out: Path):
    def play(self, decoder, version, saves_in=0):
        episodes, stats = real_play(self, decoder, version, saves_in)
        line = {"version": version, "drain": saves_in == 1, "carried": len(self.game.waiting),
                "episodes": [{"admission": ep.admission, "versions": [t.version for t in ep.turns]} for ep in episodes]}
        with open(out / f"rank{RANK}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        return episodes, stats
    return play


class Ending:
    """An environment whose episodes end after one turn (`one_turn`), or never before the turn limit."""

    def __init__(self, env, one_turn: bool):
        self.env, self.one_turn = env, one_turn

    def __getattr__(self, name):
        return getattr(self.env, name)

    def step(self, text):
        obs, reward, terminated, truncated, info = self.env.step(text)
        return obs, reward, self.one_turn, False, info


def kill_in_update(n: int):
    real_update, calls = vagen.update.ppo_update, []

    def ppo_update(*a, **k):
        calls.append(1)
        if len(calls) == n + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_update(*a, **k)

    vagen.update.ppo_update = ppo_update


def nan_from(n: int):
    import vagen.core

    real_loss, real_update, calls = vagen.core.ppo_policy_loss, vagen.update.ppo_update, []

    def ppo_update(*a, **k):
        calls.append(1)
        return real_update(*a, **k)

    def ppo_policy_loss(*a, **k):
        loss, metrics = real_loss(*a, **k)
        return (loss * float("nan") if len(calls) > n else loss), metrics

    vagen.update.ppo_update, vagen.update.core.ppo_policy_loss = ppo_update, ppo_policy_loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", type=Path, default=None)
    parser.add_argument("--kill-in-update", type=int, default=None)
    parser.add_argument("--nan-from", type=int, default=None)
    parser.add_argument("--synchronous", action="store_true")
    parser.add_argument("--long-rank", type=int, default=None)
    parser.add_argument("--short-slots", type=int, default=0)
    args, rest = parser.parse_known_args()
    if args.record is not None:
        rollout_module.Rollouts.play = recording(args.record)
    if args.synchronous:
        rollout_module.Rollouts.play = synchronous_play
    if args.long_rank is not None:
        real_make_env, made = rollout_module.make_env, []

        def make_env(*a, **k):  # `make_envs` makes a rank's environments in the order of their slots
            made.append(1)
            return Ending(real_make_env(*a, **k), one_turn=RANK != args.long_rank or len(made) <= args.short_slots)

        rollout_module.make_env = make_env
    if args.kill_in_update is not None:
        kill_in_update(args.kill_in_update)
    if args.nan_from is not None:
        nan_from(args.nan_from)
    sys.exit(leave_process_group(main(rest)))
