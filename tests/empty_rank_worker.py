"""Run by tests/test_distributed.py as one of two gloo ranks: rank 1's level groups all failed at reset, so
it has no episode to train. Prints what `plan_groups` did on this rank: the error it raised, or "planned"."""

import sys

import torch

from vagen.batch_plan import plan_groups
from vagen.config import load_config


def main() -> None:
    torch.distributed.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    cfg = load_config("bandit_text", ["rollout.env_groups=2", "rollout.group_size=2", "train.mini_batch_size=4",
                                       "train.micro_batch_size=2"])
    scores, groups = ([1.0, 0.0], [0, 0]) if rank == 0 else ([], [])
    try:
        plan_groups(scores, groups, cfg, rank, world)
        print("planned", flush=True)
    except RuntimeError as err:
        print(f"raised: {err}", flush=True)
    torch.distributed.barrier()  # both ranks got here: neither waits in a collective for the other
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
