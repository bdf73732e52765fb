"""A plain-torch PPO update to check `vagen.update.ppo_update` against: whole mini-batches in one
forward pass each (no micro-batches, no shared prefix, no packing, no DeepSpeed), SGD with gradient clipping.
Shared by the in-process update tests and the data-parallel workers."""

from __future__ import annotations

import torch

from vagen import core
from vagen.trajectory import collate

# Trajectories of different lengths, so that a token mean over a mini-batch differs from a mean of
# micro-batch means.
ANSWERS = ["Left", "Right, Right, Down", "Up", "Down, Left", "Left, Up", "Right", "Up, Up, Up", "Down",
           "Left, Left", "Right, Down", "Up", "Down, Down, Down"]
ADVANTAGES = [1.0, -0.5, 0.25, -1.0, 0.75, -0.25, 0.5, -0.75, -1.0, 0.5, -0.25, 1.0]
LR = 0.05


def overrides(mini: int, micro: int) -> list[str]:
    return ["train.actor_lr=0.05", f"train.mini_batch_size={mini}", f"train.micro_batch_size={micro}",
            "rollout.group_size=12", "rollout.env_groups=1", "rollout.temperature=0.8", "algo.entropy_coef=0.01",
            "train.grad_clip=1.0"]


def sgd_engine(model, cfg, dist):
    """A DeepSpeed engine as `vagen.train.make_engine` builds it, with plain SGD: an update linear in the
    gradient, so that summation order shows as float noise, not as Adam's sign flips of near-zero gradients."""
    import deepspeed

    from vagen.train import deepspeed_config

    config = deepspeed_config(cfg, LR, dist.world_size, on_gpu=False)
    config.pop("optimizer")
    config["zero_allow_untested_optimizer"] = True  # ZeRO-2/3 wrap torch's SGD as they wrap AdamW
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def token_logprobs_plain(model, batch, temperature: float):
    """The whole padded batch in one forward, with its attention mask; a vision model's frames go in as the
    processor gives them, and the model derives its M-RoPE positions itself."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if "pixel_values" in batch:
        image_token_id = getattr(model, "module", model).config.image_token_id
        inputs.update(pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                      mm_token_type_ids=(batch["input_ids"] == image_token_id).int())
    logits = model(**inputs).logits.float()[:, :-1]
    logits = logits / temperature
    labels = batch["input_ids"][:, 1:]
    pad = torch.zeros(labels.shape[0], 1)
    logprobs = torch.cat([pad, core.logprobs_from_logits(logits, labels)], dim=1)
    entropies = torch.cat([pad, core.entropy_from_logits(logits)], dim=1)
    return logprobs, entropies


def reference_update(model, samples, minibatches: list[list[int]], cfg, pad_id: int) -> None:
    """One SGD step per mini-batch on the loss of the whole mini-batch (token means over all of it)."""
    algo = cfg.algo
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with torch.no_grad():
        everything = collate(samples, pad_id)
        old_logprobs, _ = token_logprobs_plain(model, everything, cfg.rollout.temperature)
    for indices in minibatches:
        batch = collate([samples[i] for i in indices], pad_id, ("advantages", "adv_mask"))
        width = batch["input_ids"].shape[1]
        old = old_logprobs[indices, :width]
        logprobs, entropies = token_logprobs_plain(model, batch, cfg.rollout.temperature)
        pg_loss, _ = core.ppo_policy_loss(logprobs, old, batch["advantages"], batch["adv_mask"],
                                          clip_low=algo.clip_low, clip_high=algo.clip_high,
                                          dual_clip=algo.dual_clip, agg="token-mean")
        entropy = core.aggregate_loss(entropies, batch["sampled_mask"], "token-mean")
        optimizer.zero_grad()
        (pg_loss - algo.entropy_coef * entropy).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()


def assert_update_equals_plain(model, reference, samples, cfg, pad_id: int, distributed) -> None:
    """`vagen.update.ppo_update` of `model` (through an SGD engine, mini-batches 0-7 and 8-11 unshuffled) moves
    its weights where `reference_update` moves `reference`, a copy of it, to float32 tolerance, and by more
    than that tolerance."""
    from vagen.update import annotate, ppo_update

    engine = sgd_engine(model, cfg, distributed)
    annotate(samples, engine, None, None, cfg, pad_id, distributed.device)
    ppo_update(engine, None, samples, cfg, pad_id, distributed.device, shuffle=False)
    initial = {k: v.clone() for k, v in reference.state_dict().items()}
    reference_update(reference, samples, [list(range(8)), list(range(8, 12))], cfg, pad_id)
    moved = 0.0
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], expected, atol=1e-6, rtol=0, msg=name)
        moved = max(moved, float((expected - initial[name]).abs().max()))
    assert moved > 1e-3

