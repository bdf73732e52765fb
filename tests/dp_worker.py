"""Run under the DeepSpeed launcher by tests/test_distributed.py: `ppo_update` with SGD on the 12
trajectories of `ppo_reference`, split over the ranks in two ways (equal and unequal shares), and the
reward-std filter over both ranks; rank 0 saves the actor's parameters after each update and what each
rank kept."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from child_env import worker_args  # noqa: E402
from ppo_reference import ADVANTAGES, ANSWERS, overrides, sgd_engine  # noqa: E402
from update_fixtures import answer_samples  # noqa: E402

from vagen.batch_plan import filter_groups  # noqa: E402
from vagen.config import load_config  # noqa: E402
from vagen.distributed import init_distributed  # noqa: E402
from vagen.episode import ChatEncoder  # noqa: E402
from vagen.models import load_policy, resolve_model_path  # noqa: E402
from vagen.update import annotate, ppo_update  # noqa: E402

# Global mini-batches are {0..7} and {8..11} either way: with mini-batches of 8 over 2 ranks, each rank
# cuts its share into mini-batches of 4, and mini-batch m is the union of the ranks' m-th.
SHARES = {
    "equal": [[0, 1, 2, 3, 8, 9], [4, 5, 6, 7, 10, 11]],  # micro-batches of 2: [2, 1] on each rank
    "unequal": [[0, 1, 2, 3, 8, 9, 10], [4, 5, 6, 7, 11]],  # [2, 2] and [2, 1]: rank 1 runs a pass of loss 0
}


def main():
    args = worker_args()
    dist = init_distributed()
    assert dist.world_size == 2, dist.world_size
    # Rank 1 builds the built-in model (an empty cache) while rank 0 waits: what it writes must be whole,
    # though transformers' save_pretrained writes nothing on a rank other than 0.
    if dist.rank == 1:
        path = resolve_model_path("builtin:tiny-text", args.cache, seed=0)
    torch.distributed.barrier()
    path = resolve_model_path("builtin:tiny-text", args.cache, seed=0)
    cfg = load_config("bandit_text", overrides(mini=8, micro=2))
    results = {}
    for case, shares in SHARES.items():
        model, tokenizer = load_policy(path)
        encoder = ChatEncoder(tokenizer)
        engine = sgd_engine(model, cfg, dist)
        samples = answer_samples(encoder, ANSWERS, ADVANTAGES)
        mine = [samples[i] for i in shares[dist.rank]]
        annotate(mine, engine, None, None, cfg, encoder.pad_id, dist.device)
        metrics = ppo_update(engine, None, mine, cfg, encoder.pad_id, dist.device, world_size=dist.world_size,
                             shuffle=False)
        results[case] = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                         "steps": engine.global_steps, "metrics": metrics}
    # StarPO-S over both ranks: rank 0's two groups vary, rank 1's do not. Both kept groups start on rank 0,
    # and one of them moves so that each rank trains one.
    filter_cfg = load_config("bandit_text", ["rollout.group_size=2", "rollout.env_groups=4", "train.mini_batch_size=4",
                                             "algo.filter_mode=std", "algo.filter_keep_ratio=0.5"])
    samples = answer_samples(encoder, ["Left"] * 4, [0.0] * 4)
    scores = [[0.0, 1.0, 0.0, 3.0], [1.0, 1.0, 2.0, 2.0]][dist.rank]
    for i, (sample, score) in enumerate(zip(samples, scores)):
        sample.group_id, sample.score = i // 2, score
    kept, _ = filter_groups(samples, filter_cfg, dist.rank, dist.world_size)
    gathered = [None] * dist.world_size
    torch.distributed.all_gather_object(gathered, [(s.group_id, s.score) for s in kept])
    results["filter"] = gathered
    if dist.rank == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
