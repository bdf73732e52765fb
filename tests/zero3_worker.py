"""Run under the DeepSpeed launcher by tests/test_zero3.py: one iteration of `vagen.train` (rollout,
update with a KL term, evaluation, checkpoint) on two ranks with ZeRO-0, then twice with ZeRO-3 and every
parameter partitioned (decoding with the cache kept across turns, and with it dropped every turn); then
with per-turn samples (`rollout.context=window`) under ZeRO-0 and ZeRO-3.
Each rank also records, for every model it loads, whether the model came partitioned out of loading.

The ranks play unequal episodes: rank 0 three turns of up to 8 new tokens, rank 1 one turn of up to 4;
in evaluation, 2 and 1 episodes. Each rank saves, per rollout call, how many forward passes its policy
ran and the token ids of its episodes."""

import os
from pathlib import Path

import torch
from child_env import worker_args

import vagen.models
import vagen.rollout as rollout_module

COMMON = ["model.path=builtin:tiny-vl", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_turns=3",
          "rollout.temperature=1.0", "train.mini_batch_size=4", "train.micro_batch_size=2", "train.iterations=1",
          "train.actor_lr=1e-3", "train.critic_lr=1e-3", "eval.every=1", "eval.episodes=3", "eval.videos=0",
          "log.tensorboard=false", "log.progress=false", "algo.kl_coef=0.01"]
# Rank 1's histories reach their length limit after one turn (the first prompt is 182 tokens, the second
# observation 77), as episodes that end early would.
PER_RANK = [["rollout.max_new_tokens=8"], ["rollout.max_new_tokens=4", "rollout.max_trajectory_length=220"]]
WINDOW = ["rollout.context=window", "rollout.window_turns=1"]
# ZeRO-3 twice: with the cache kept across turns (TurnGenerator) and with transformers' generate.
STAGES = {"zero0": ["train.deepspeed_config=deepspeed/zero0_fp32.json"],
          "zero3": ["train.deepspeed_config=deepspeed/zero3_fp32.json"],
          "zero3_generate": ["train.deepspeed_config=deepspeed/zero3_fp32.json", "rollout.reuse_cache=false"],
          # per-turn samples, each turn's prompt a window of one earlier turn: ZeRO-0, then ZeRO-3
          "zero0_window": ["train.deepspeed_config=deepspeed/zero0_fp32.json", *WINDOW],
          "zero3_window": ["train.deepspeed_config=deepspeed/zero3_fp32.json", *WINDOW]}

calls: list[dict] = []


def counted(play, model, *args, **kwargs):
    """`play(*args, **kwargs)`, recording the forward passes `model` ran in it and the episodes' token ids."""
    forwards = [0]
    handle = model.register_forward_pre_hook(lambda module, inputs: forwards.__setitem__(0, forwards[0] + 1))
    try:
        episodes, stats = play(*args, **kwargs)
    finally:
        handle.remove()
    calls.append({"forwards": forwards[0], "input_ids": [ep.input_ids for ep in episodes]})
    return episodes, stats


def counting_rollout(model, *args, **kwargs):  # evaluation's rollouts
    return counted(real_rollout, model, model, *args, **kwargs)


def counting_play(self, decoder, *args, **kwargs):  # training's rollouts (`vagen.rollout.Rollouts`)
    return counted(real_play, decoder.model, self, decoder, *args, **kwargs)


real_rollout, real_play = rollout_module.rollout, rollout_module.Rollouts.play
rollout_module.rollout = counting_rollout  # vagen.eval imports it when it runs
rollout_module.Rollouts.play = counting_play

loads: list[tuple[int, int]] = []  # per model loaded: (parameters this rank holds, parameters of the model)


def recording_load_policy(*args, **kwargs):
    model, processor = real_load_policy(*args, **kwargs)
    held = sum(p.numel() for p in model.parameters())
    whole = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    loads.append((held, whole))
    return model, processor


real_load_policy = vagen.models.load_policy
vagen.models.load_policy = recording_load_policy  # vagen.train imports it when it builds the models


def main():
    args = worker_args()
    from vagen.train import main as train

    rank = int(os.environ["RANK"])
    out = Path(args.out)
    for stage, overrides in STAGES.items():
        calls.clear()
        loads.clear()
        code = train(["--config", "frozenlake_visual", *COMMON, *PER_RANK[rank], f"model.builtin_cache={args.cache}",
                      *overrides, f"train.run_dir={out}", f"train.run_name={stage}"])
        assert code == 0, f"{stage}: vagen.train returned {code}"
        torch.save(list(calls), out / f"{stage}_rank{rank}.pt")
        torch.save(list(loads), out / f"{stage}_loads_rank{rank}.pt")


if __name__ == "__main__":
    main()
