"""Run under the DeepSpeed launcher by tests/test_frame_check.py on two gloo ranks: the frame check of training
(`vagen.frame_check.run_frame_check`) on a ZeRO-3 engine, whose parameters are partitioned over the ranks, beside
the same check computed on each rank with the whole model. Rank 0 plays three level groups of FrozenLake, rank 1
one (nothing to swap with, so none of its turns is scored, and it passes along with rank 0 all the same). Each
rank saves its whole-model sums, the ZeRO-3 metrics and the forward passes its model ran in the check."""

import types
from pathlib import Path

import torch
from child_env import worker_args


def main():
    args = worker_args()
    from vagen.config import load_config
    from vagen.distributed import init_distributed
    from vagen.episode import ChatEncoder
    from vagen.frame_check import frame_gaps, run_frame_check, swapped_logprobs
    from vagen.models import load_policy, resolve_model_path
    from vagen.rollout import rollout
    from vagen.train import make_engine
    from vagen.trajectory import episode_samples
    from vagen.update import annotate

    dist = init_distributed()
    rank = dist.rank
    cfg = load_config("frozenlake_visual", ["model.path=builtin:tiny-vl", f"model.builtin_cache={args.cache}",
                                            "train.deepspeed_config=deepspeed/zero3_fp32.json", "rollout.max_turns=2",
                                            "rollout.max_new_tokens=6", "train.micro_batch_size=2",
                                            "train.mini_batch_size=4"])
    model, processor = load_policy(resolve_model_path(cfg.model.path, args.cache, seed=0))
    encoder = ChatEncoder(processor)
    episodes, _ = rollout(model, encoder, cfg, [5, 6, 7] if rank == 0 else [8], group_size=2, sample_seed=rank)
    samples = [s for k, ep in enumerate(episodes) for s in episode_samples(ep, encoder, model, k)]
    seed = (cfg.train.seed * 1_000_003 + 0) * 1_009 + rank  # run_frame_check's at iteration 0
    temperature, pad_id = cfg.rollout.temperature, encoder.pad_id
    own = swapped_logprobs(model, samples, samples, temperature, pad_id, "cpu", 2, encoder.suppress_ids)
    whole = frame_gaps(model, samples, own, seed, temperature, pad_id, "cpu", 2, encoder.suppress_ids)
    engine = make_engine(model, cfg, cfg.train.actor_lr, dist)
    assert engine.zero_optimization_stage() == 3
    annotate(samples, engine, None, None, cfg, pad_id, dist.device, suppress_ids=encoder.suppress_ids)
    forwards = [0]
    handle = engine.module.register_forward_pre_hook(lambda module, inputs: forwards.__setitem__(0, forwards[0] + 1))
    metrics = run_frame_check(samples, cfg, 0, types.SimpleNamespace(actor=engine, encoder=encoder), dist)
    handle.remove()
    torch.save({"whole": whole, "metrics": metrics, "forwards": forwards[0]}, Path(args.out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
