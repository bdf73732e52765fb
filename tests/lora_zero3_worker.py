"""Run under the DeepSpeed launcher by tests/test_lora.py: two iterations of `vagen.train` with LoRA (r = 8) on
two ranks, once with ZeRO-0 and then with ZeRO-3 (every parameter partitioned, float32 and bfloat16, both with
gradient checkpointing), from the shipped Sokoban warm start. After each run every rank gathers the actor's
parameters, and rank 0 saves them whole, with the names of those that train."""

import os
from pathlib import Path

import torch
from child_env import worker_args

import vagen.train

COMMON = ["train.iterations=2", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=64",
          "rollout.max_turns=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false",
          "log.tensorboard=false", "model.lora_rank=8", "algo.kl_coef=0.1", "train.actor_lr=0.003",
          "train.critic_lr=0.01", "train.save_every=1"]
STAGES = {"zero0": ["train.deepspeed_config=deepspeed/zero0_fp32.json"],
          "zero3": ["train.deepspeed_config=deepspeed/zero3_fp32.json", "model.gradient_checkpointing=true"],
          "zero3_bf16": ["train.deepspeed_config=deepspeed/zero3_bf16.json", "model.dtype=bfloat16",
                         "model.gradient_checkpointing=true"]}

built = []
real_build_models = vagen.train.build_models


def recording_build_models(*args, **kwargs):
    built.append(real_build_models(*args, **kwargs))
    return built[-1]


vagen.train.build_models = recording_build_models


def whole_parameters(module: torch.nn.Module) -> tuple[dict, list[str]]:
    """Every parameter of `module`, whole (gathered from the ranks under ZeRO-3), and the names of those
    that train."""
    import deepspeed

    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        whole = {name: p.detach().clone() for name, p in params.items()}
    return whole, sorted(name for name, p in params.items() if p.requires_grad)


def main():
    args = worker_args()
    rank = int(os.environ["RANK"])
    out = Path(args.out)
    for stage, overrides in STAGES.items():
        built.clear()
        code = vagen.train.main(["--config", "sokoban_visual", *COMMON, *overrides,
                                 f"model.builtin_cache={args.cache}", f"train.run_dir={out}",
                                 f"train.run_name={stage}"])
        assert code == 0, f"{stage}: vagen.train returned {code}"
        actor = built[0].actor
        whole, trained = whole_parameters(actor.module)
        if rank == 0:
            torch.save({"parameters": whole, "trained": trained, "stage": actor.zero_optimization_stage()},
                       out / f"{stage}_actor.pt")


if __name__ == "__main__":
    main()
