"""Run under the DeepSpeed launcher by tests/test_packing.py: `ppo_update` with SGD under ZeRO-3 (every parameter
partitioned) on two ranks, of the 12 Sokoban trajectories with frames of `update_fixtures.visual_samples`, in
unequal shares, with micro-batches cut by count, by a token budget and by a packed token budget (`CUTS`). Rank 0
saves the actor's gathered parameters after each update and each rank's micro-batch counts."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from child_env import worker_args  # noqa: E402
from ppo_reference import ADVANTAGES, ANSWERS, overrides, sgd_engine  # noqa: E402
from update_fixtures import visual_samples  # noqa: E402

from vagen.batch_plan import plan_epoch  # noqa: E402
from vagen.config import load_config  # noqa: E402
from vagen.distributed import init_distributed  # noqa: E402
from vagen.episode import ChatEncoder  # noqa: E402
from vagen.models import load_policy, resolve_model_path  # noqa: E402
from vagen.update import annotate, ppo_update  # noqa: E402

# Global mini-batches {0..7} and {8..11}: each rank's mini-batches of 8 / 2 ranks are the m-th part of both.
SHARES = [[0, 1, 2, 3, 8, 9, 10], [4, 5, 6, 7, 11]]
ZERO3 = ["train.deepspeed_config=deepspeed/zero3_fp32.json"]
CUTS = {"count 2": ["train.micro_batch_size=2"], "tokens 800": ["train.micro_batch_tokens=800"],
        "packed 700": ["train.micro_batch_tokens=700", "train.pack_sequences=true"]}


def main():
    args = worker_args()
    dist = init_distributed()
    assert dist.world_size == 2, dist.world_size
    if dist.rank == 0:
        resolve_model_path("builtin:tiny-vl", args.cache, seed=0)
    torch.distributed.barrier()
    path = resolve_model_path("builtin:tiny-vl", args.cache, seed=0)
    results = {}
    for case, cut in CUTS.items():
        cfg = load_config("bandit_text", overrides(mini=8, micro=2) + ZERO3 + cut)
        model, processor = load_policy(path)
        encoder = ChatEncoder(processor)
        samples = visual_samples(encoder, model, ANSWERS, ADVANTAGES)
        mine = [samples[i] for i in SHARES[dist.rank]]
        engine = sgd_engine(model, cfg, dist)
        params = list(model.parameters())
        assert all(p.ds_tensor.numel() < p.ds_numel for p in params), "a parameter is held whole on a rank"
        annotate(mine, engine, None, None, cfg, encoder.pad_id, dist.device)
        micro = [[len(m) if m is not None else 0 for m in mini.micro]
                 for mini in plan_epoch(mine, cfg, dist.world_size, None, shuffle=False)]
        metrics = ppo_update(engine, None, mine, cfg, encoder.pad_id, dist.device, world_size=dist.world_size,
                             shuffle=False)
        with deepspeed.zero.GatheredParameters(params):
            gathered = {name: p.detach().clone() for name, p in model.named_parameters()}
        counts = [None] * dist.world_size
        torch.distributed.all_gather_object(counts, micro)
        results[case] = {"params": gathered, "steps": engine.global_steps, "micro": counts,
                         "passes": metrics["update/micro_batches"]}
        engine.destroy()
    if dist.rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
