"""Run under the DeepSpeed launcher by tests/test_distributed.py: one PPO update on a fixed batch
of 16 trajectories split over the ranks, then rank 0 saves the actor's parameters."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from update_fixtures import answer_samples  # noqa: E402

from vagen.config import load_config  # noqa: E402
from vagen.models import load_policy, resolve_model_path  # noqa: E402
from vagen.rollout import ChatEncoder  # noqa: E402
from vagen.train import init_distributed, make_engine  # noqa: E402
from vagen.update import annotate, ppo_update  # noqa: E402

ANSWERS = ["Left", "Right", "Up", "Down", "Left, Up", "Right, Right, Down", "Up", "Down, Left"] * 2
ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 0.75, -0.25, 0.5, -0.75, -1.0, 0.5, -0.25, 1.0, -0.5, 0.25, -0.75, 0.75]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache", required=True)
    args = parser.parse_args()
    dist = init_distributed()
    torch.manual_seed(0)
    model, tokenizer = load_policy(resolve_model_path("builtin:tiny-text", args.cache, seed=0))
    encoder = ChatEncoder(tokenizer)
    cfg = load_config("bandit_text", ["train.actor_lr=1e-3", "train.mini_batch_size=8", "train.micro_batch_size=2",
                                      "rollout.group_size=8", "rollout.env_groups=2", "rollout.temperature=1.0"])
    engine = make_engine(model, cfg, cfg.train.actor_lr, dist)
    samples = answer_samples(encoder, ANSWERS, ADVANTAGES)
    # Global mini-batch m is samples[8m : 8m + 8]; rank r holds its r-th share of each mini-batch.
    share = 8 // dist.world_size
    mine = [samples[m * 8 + dist.rank * share + i] for m in range(2) for i in range(share)]
    annotate(mine, engine, None, None, cfg, encoder.pad_id, dist.device)
    ppo_update(engine, None, mine, cfg, encoder.pad_id, dist.device, world_size=dist.world_size, shuffle=False)
    if dist.rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out)


if __name__ == "__main__":
    main()
