"""One StarPO/TRICO update over a batch of trajectories: annotate them with the old policy's
log-probabilities, entropies, values and reference log-probabilities, compute advantages, then run
PPO epochs of mini-batches (gradient accumulation over micro-batches) on the actor and critic.

The engines passed in are anything with `__call__` (forward), `backward(loss)`, `step()` and
`set_train_batch_size(n)`: DeepSpeed engines in training (built by `vagen/train.py`), which own the
optimizer, scheduler, gradient clipping and accumulation boundaries.
"""

from __future__ import annotations

import math

import torch

from vagen import core
from vagen.trajectory import Sample, collate, forward_shared_prefix, generated_positions, model_inputs


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def token_logprobs(model, batch: dict[str, torch.Tensor], temperature: float, with_entropy: bool):
    """Log-probabilities [B, L] of the generated tokens of `batch` (on the model's device) given
    their prefix, and optionally the entropy of the distribution each was drawn from. Only positions
    where some row generates are computed (only generated tokens are trained); the rest are 0.
    Logits are divided by the sampling temperature so that ratios compare the distributions that
    were actually sampled."""
    input_ids = batch["input_ids"]
    positions = generated_positions(batch["loss_mask"])
    logits = forward_shared_prefix(model, model_inputs(batch), logits_to_keep=positions).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.zeros(input_ids.shape, device=logits.device)
    logprobs[:, positions + 1] = core.logprobs_from_logits(logits, input_ids[:, positions + 1])
    entropies = None
    if with_entropy:
        entropies = torch.zeros(input_ids.shape, device=logits.device)
        entropies[:, positions + 1] = core.entropy_from_logits(logits)
    return logprobs, entropies


@torch.no_grad()
def annotate(samples: list[Sample], actor, critic, reference, cfg, pad_id: int, device) -> None:
    """Store old_logprobs, entropies, values (with a critic) and ref_logprobs (with a reference) on
    each sample's `extra`, trimmed to the sample's length."""
    temperature = cfg.rollout.temperature
    for group in chunks(samples, cfg.train.micro_batch_size):
        batch = {k: v.to(device) for k, v in collate(group, pad_id).items()}
        logprobs, entropies = token_logprobs(actor, batch, temperature, with_entropy=True)
        results = {"old_logprobs": logprobs, "entropies": entropies}
        if critic is not None:
            results["old_values"] = critic(**model_inputs(batch)).float()
        if reference is not None:
            results["ref_logprobs"], _ = token_logprobs(reference, batch, temperature, with_entropy=False)
        for row, sample in enumerate(group):
            for name, value in results.items():
                sample.extra[name] = value[row, : sample.length].cpu()


def _all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over ranks. NCCL reduces CUDA tensors only: CPU values travel through the rank's GPU."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    on = values
    if torch.distributed.get_backend() == "nccl" and values.device.type != "cuda":
        on = values.to(torch.device("cuda", torch.cuda.current_device()))
    torch.distributed.all_reduce(on)
    return on.to(values.device)


def global_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`masked_whiten` with mean and variance over the masked entries of every rank's batch, so that
    data-parallel ranks normalise exactly as one process with the whole batch would."""
    m = mask.to(torch.float64)
    stats = _all_reduce_sum(torch.stack([(x * m).sum(), (x * x * m).sum(), m.sum()]).to(torch.float64))
    count = stats[2].clamp(min=1)
    mean = stats[0] / count
    var = (stats[1] / count - mean * mean) * count / (count - 1).clamp(min=1)
    return ((x - mean) * torch.rsqrt(var + eps) * mask).to(x.dtype)


def compute_advantages(samples: list[Sample], cfg) -> dict[str, float]:
    """Advantages, returns and the adv_mask of every sample, from its rewards and old values."""
    algo = cfg.algo
    fields = ["old_logprobs", "entropies"] + (["old_values"] if "old_values" in samples[0].extra else [])
    fields += ["ref_logprobs"] if "ref_logprobs" in samples[0].extra else []
    batch = collate(samples, pad_id=0, fields=tuple(fields))
    loss_mask = batch["loss_mask"]
    rewards = batch["token_rewards"]
    metrics = {}
    if "ref_logprobs" in batch:
        kl = core.kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_kind) * loss_mask
        metrics["actor/kl_to_ref"] = float(kl.sum() / loss_mask.sum().clamp(min=1))
        if algo.kl_in_reward:
            rewards = rewards - algo.kl_coef * kl
    if algo.adv_estimator == "grpo":
        scores = torch.tensor([s.score for s in samples])
        group_ids = torch.tensor([s.group_id for s in samples])
        per_traj = core.grpo_advantages(scores, group_ids, norm_by_std=algo.grpo_norm_by_std)
        advantages = per_traj[:, None] * loss_mask
        returns = advantages
    elif algo.adv_estimator == "gae":
        advantages, returns = core.gae(rewards, batch["old_values"], loss_mask, algo.gamma, algo.lam)
    elif algo.adv_estimator == "turn_gae":
        advantages, returns = core.turn_level_gae(rewards, batch["old_values"], loss_mask, batch["turn_end_mask"],
                                                  algo.gamma_turn, algo.lam_turn, algo.gamma, algo.lam)
    else:
        raise ValueError(f"unknown algo.adv_estimator {algo.adv_estimator!r}; choices: turn_gae, gae, grpo")
    if algo.whiten_advantages and algo.adv_estimator != "grpo":
        advantages = global_whiten(advantages, loss_mask)
    adv_mask = core.select_critical_tokens(loss_mask, batch["answer_mask"], batch["think_mask"],
                                           batch["entropies"], algo.token_selection, algo.top_ratio)
    for row, sample in enumerate(samples):
        n = sample.length
        sample.extra["advantages"] = advantages[row, :n]
        sample.extra["returns"] = returns[row, :n]
        sample.extra["adv_mask"] = adv_mask[row, :n]
    selected = adv_mask.sum()
    metrics["actor/selected_token_ratio"] = float(selected / loss_mask.sum().clamp(min=1))
    metrics["actor/advantage_mean"] = float((advantages * loss_mask).sum() / loss_mask.sum().clamp(min=1))
    return metrics


def ppo_update(actor_engine, critic_engine, samples: list[Sample], cfg, pad_id: int, device, world_size: int = 1,
               generator: torch.Generator | None = None, update_actor: bool = True,
               shuffle: bool = True) -> dict[str, float]:
    """PPO epochs over `samples` (this rank's share). Each mini-batch is `train.mini_batch_size`
    trajectories across all ranks, processed in micro-batches of `train.micro_batch_size` with one
    optimizer step at the end of the mini-batch. Returns mean metrics."""
    algo, tr = cfg.algo, cfg.train
    mini_per_rank = max(1, tr.mini_batch_size // world_size)
    fields = ("old_logprobs", "advantages", "adv_mask", "returns")
    fields += ("old_values",) if critic_engine is not None else ()
    fields += ("ref_logprobs",) if (algo.kl_coef > 0 and not algo.kl_in_reward) else ()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(name, value):
        sums[name] = sums.get(name, 0.0) + float(value)
        counts[name] = counts.get(name, 0) + 1

    for _ in range(tr.ppo_epochs):
        order = torch.randperm(len(samples), generator=generator).tolist() if shuffle else list(range(len(samples)))
        for mini in chunks(order, mini_per_rank):
            micro = chunks(mini, tr.micro_batch_size)
            global_batch = len(micro) * tr.micro_batch_size * world_size
            for engine in (actor_engine if update_actor else None, critic_engine):
                if engine is not None:
                    engine.set_train_batch_size(global_batch)
            boundary_norms: dict[str, float | None] = {}
            for indices in micro:
                batch = collate([samples[i] for i in indices], pad_id, fields)
                batch = {k: v.to(device) for k, v in batch.items()}
                inputs = model_inputs(batch)
                loss_mask = batch["loss_mask"]
                if update_actor:
                    logprobs, entropies = token_logprobs(actor_engine, batch, cfg.rollout.temperature,
                                                         with_entropy=True)
                    pg_loss, pg_metrics = core.ppo_policy_loss(
                        logprobs, batch["old_logprobs"], batch["advantages"], batch["adv_mask"],
                        clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
                        agg=algo.loss_agg)
                    entropy = core.aggregate_loss(entropies, loss_mask, algo.loss_agg)
                    loss = pg_loss - algo.entropy_coef * entropy
                    if "ref_logprobs" in batch:
                        kl = core.aggregate_loss(core.kl_penalty(logprobs, batch["ref_logprobs"], algo.kl_kind),
                                                 loss_mask, algo.loss_agg)
                        loss = loss + algo.kl_coef * kl
                        add("actor/kl_loss", kl.item())
                    actor_engine.backward(loss)
                    boundary_norms["actor/grad_norm"] = _step(actor_engine, indices is micro[-1])
                    add("actor/pg_loss", pg_loss.item())
                    add("actor/entropy", entropy.item())
                    for key, value in pg_metrics.items():
                        add(f"actor/{key}", value)
                if critic_engine is not None:
                    values = critic_engine(**inputs)
                    vf_loss, vf_metrics = core.value_loss(values, batch["old_values"], batch["returns"], loss_mask,
                                                          clip=algo.value_clip, agg=algo.loss_agg)
                    critic_engine.backward(algo.vf_coef * vf_loss)
                    boundary_norms["critic/grad_norm"] = _step(critic_engine, indices is micro[-1])
                    add("critic/vf_loss", vf_loss.item())
                    for key, value in vf_metrics.items():
                        add(f"critic/{key}", value)
            for name, norm in boundary_norms.items():
                if norm is not None and math.isfinite(float(norm)):
                    add(name, float(norm))
    metrics = {k: sums[k] / counts[k] for k in sums}
    if critic_engine is not None:
        metrics["critic/explained_var"] = explained_variance(samples)
    return metrics


def _step(engine, boundary: bool) -> float | None:
    """`engine.step()`; at an accumulation boundary also the norm of the (data-parallel averaged)
    gradient before clipping. DeepSpeed reports it itself under ZeRO and mixed precision only."""
    norm = None
    if boundary and engine.zero_optimization_stage() == 0:
        grads = [p.grad.detach().float() for p in engine.module.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    engine.step()
    if boundary and norm is None:
        norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def explained_variance(samples: list[Sample]) -> float:
    """1 - Var(returns - values) / Var(returns) over generated tokens, with the values before the update."""
    returns = torch.cat([s.extra["returns"][s.loss_mask > 0] for s in samples])
    values = torch.cat([s.extra["old_values"][s.loss_mask > 0] for s in samples])
    var = returns.var(unbiased=False)
    if returns.numel() < 2 or var < 1e-12:
        return 0.0
    return float(1.0 - (returns - values).var(unbiased=False) / var)


def batch_indicators(scores: torch.Tensor, group_ids: torch.Tensor, samples: list[Sample], episodes) -> dict[str, float]:
    """Collapse indicators of one iteration: in-group reward std over all groups (before filtering),
    entropy over the trained tokens, response length, echoed reasoning across level seeds."""
    entropies = torch.cat([s.extra["entropies"] for s in samples])[None] if samples else torch.zeros(1, 0)
    mask = torch.cat([s.loss_mask for s in samples])[None] if samples else torch.zeros(1, 0)
    lengths = torch.tensor([float(sum(t.response_length for t in ep.turns)) for ep in episodes])
    thoughts = [" ".join(t.info.get("parsed", {}).get("think", "") for t in ep.turns) for ep in episodes]
    values = core.collapse_indicators(scores, group_ids, entropies, mask, lengths, thoughts,
                                      [ep.seed for ep in episodes])
    return {
        "rollout/in_group_reward_std": values["reward_std_in_group"],
        "actor/entropy_mean": values["entropy_mean"],
        "rollout/trajectory_response_length": values["response_length_mean"],
        "rollout/echo_rate": values["echo_rate"],
        "rollout/distinct_2": values["distinct_2"],
    }
