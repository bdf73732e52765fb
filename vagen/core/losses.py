"""Losses and per-token quantities: PPO policy/value losses, KL penalties, entropy, logprobs.

All tensors are [B, L] (B sequences, L tokens) unless stated; logits are [B, L, V]. Masks
may be bool or 0/1; an entry counts when it is non-zero. Metrics come back as dicts of
Python floats, computed without gradient; the caller namespaces them (e.g. "actor/clipfrac").
"""

import torch

from vagen.core._checks import check_same_shape, unknown_choice

__all__ = [
    "AGG_MODES",
    "aggregate_loss",
    "loss_denominator",
    "ppo_policy_loss",
    "value_loss",
    "kl_penalty",
    "entropy_from_logits",
    "logprobs_from_logits",
]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "abs")


def loss_denominator(mask: torch.Tensor, mode: str) -> float:
    """What `aggregate_loss` divides by: masked-in tokens (token-mean) or sequences with at least one
    masked-in token (every seq-mean mode).

    A mini-batch spread over micro-batches and data-parallel ranks sums this over all of them and
    passes the total to each micro-batch's `aggregate_loss(..., denominator=total)`: the micro-batch
    losses then add up to the loss of the whole mini-batch, whatever its split.

    Args:
        mask: [B, L] bool or 0/1.
        mode: one of AGG_MODES.
    """
    check_same_shape("loss_denominator", 2, mask=mask)
    n_tokens = (mask != 0).sum(-1)
    if mode == "token-mean":
        return float(n_tokens.sum())
    if mode in AGG_MODES:
        return float((n_tokens > 0).sum())
    raise unknown_choice("loss_denominator", "mode", mode, AGG_MODES)


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_tokens: int | None = None,
                   denominator: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, L] to a scalar over the masked-in tokens.

    Modes (n_b = masked-in tokens of row b; "sequences" = rows with n_b > 0, S of them):
        token-mean               sum_b sum_t loss / sum_b n_b
        seq-mean-token-sum       (1/S) sum_b sum_t loss
        seq-mean-token-mean      (1/S) sum_b (sum_t loss / n_b)
        seq-mean-token-sum-norm  (1/S) sum_b (sum_t loss / N), N = `norm_tokens`, a constant
                                 independent of response length and batch shape (Dr. GRPO);
                                 without it N = mask.shape[-1], the padded width
    Rows with an empty mask contribute nothing and are not counted. An all-empty mask gives
    0 (still connected to the graph of `loss`).

    Args:
        loss: [B, L] float.
        mask: [B, L] bool or 0/1.
        mode: one of AGG_MODES.
        norm_tokens: N of seq-mean-token-sum-norm (e.g. the longest trajectory's generated tokens).
        denominator: sum_b n_b (token-mean) or S (seq-mean modes) of a larger batch this one is a
            part of (see `loss_denominator`); None = this batch's own.

    Returns:
        0-dim tensor.
    """
    check_same_shape("aggregate_loss", 2, loss=loss, mask=mask)
    if mode not in AGG_MODES:
        raise unknown_choice("aggregate_loss", "mode", mode, AGG_MODES)
    if norm_tokens is not None and not norm_tokens > 0:
        raise ValueError(f"aggregate_loss: norm_tokens must be > 0 or None, got {norm_tokens!r}")
    if denominator is not None and not denominator >= 0:
        raise ValueError(f"aggregate_loss: denominator must be >= 0 or None, got {denominator!r}")
    keep = mask != 0
    masked = torch.where(keep, loss, torch.zeros_like(loss))  # not loss * mask: NaN * 0 is NaN
    n_tokens = keep.sum(-1)
    count = loss_denominator(mask, mode) if denominator is None else denominator
    count = max(count, 1.0)
    if mode == "token-mean" or mode == "seq-mean-token-sum":
        return masked.sum() / count
    elif mode == "seq-mean-token-mean":
        return (masked.sum(-1) / n_tokens.clamp(min=1)).sum() / count
    else:  # seq-mean-token-sum-norm
        return masked.sum() / ((norm_tokens if norm_tokens is not None else mask.shape[-1]) * count)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask != 0
    n = int(m.sum())
    return float(torch.where(m, x, torch.zeros_like(x)).sum()) / max(n, 1)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = 3.0,
    agg: str = "token-mean",
    norm_tokens: int | None = None,
    denominator: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with asymmetric clipping (clip-higher) and dual clip.

    ratio = exp(clamp(logprobs - old_logprobs, -20, 20)), per token:
        loss = max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))
        loss = min(loss, -A * dual_clip)     where A < 0 (dual clip; skipped if dual_clip is None)
    then aggregated with `aggregate_loss(loss, mask, agg, norm_tokens, denominator)`.

    Args:
        logprobs: [B, L] current policy log-probs (with grad).
        old_logprobs: [B, L] the old policy's log-probs, which the ratio is taken against: the trainer's own,
            computed before the update (with decoupled PPO the proximal policy's; the sampler's, the behaviour
            policy's, enter only through `weights`).
        advantages: [B, L].
        mask: [B, L] bool or 0/1, tokens that get policy gradient (usually adv_mask).
        clip_low, clip_high: clip range below / above 1 (e.g. clip_high=0.28 for clip-higher).
        dual_clip: c > 1 bounding the loss of negative-advantage tokens at -A * c, or None.
        agg: one of AGG_MODES.
        norm_tokens, denominator: see `aggregate_loss`.
        weights: [B, L] per-token weights of the loss before aggregation, or None (importance weights
            p_old / p_behaviour where another engine or an older policy sampled, clamped at C or masked above it).

    Returns:
        (loss 0-dim tensor, metrics) with metrics over masked-in tokens:
        clipfrac (fraction where the clipped term was the larger one), clipfrac_lower
        (fraction where the dual clip bound), approx_kl (mean of (ratio - 1) - log ratio).
    """
    check_same_shape(
        "ppo_policy_loss", 2, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask
    )
    if agg not in AGG_MODES:
        raise unknown_choice("ppo_policy_loss", "agg", agg, AGG_MODES)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"ppo_policy_loss: dual_clip must be > 1.0 or None, got {dual_clip!r}")
    if clip_low < 0 or clip_high < 0:
        raise ValueError(
            f"ppo_policy_loss: clip_low and clip_high must be >= 0, got {clip_low!r}, {clip_high!r}"
        )
    log_ratio = torch.clamp(logprobs - old_logprobs, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(mask, dtype=torch.bool)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_active, bound, per_token)
    if weights is not None:
        check_same_shape("ppo_policy_loss", 2, logprobs=logprobs, weights=weights)
        per_token = per_token * weights
    loss = aggregate_loss(per_token, mask, agg, norm_tokens, denominator)
    with torch.no_grad():
        metrics = {
            "clipfrac": _masked_mean((clipped > unclipped).double(), mask),
            "clipfrac_lower": _masked_mean(dual_active.double(), mask),
            "approx_kl": _masked_mean((ratio - 1.0 - log_ratio).double(), mask),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    norm_tokens: int | None = None,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clamp(V - V_old, +-clip).

    Args:
        values: [B, L] current critic values (with grad).
        old_values: [B, L] values at rollout time.
        returns: [B, L] targets.
        mask: [B, L] bool or 0/1 (usually loss_mask).
        clip: clip range around old_values, or None for the plain squared error.
        agg: one of AGG_MODES.
        norm_tokens, denominator: see `aggregate_loss`.

    Returns:
        (loss 0-dim tensor, metrics) with clipfrac (fraction of masked-in tokens where the
        clipped error was the larger one) and values_mean.
    """
    check_same_shape("value_loss", 2, values=values, old_values=old_values, returns=returns, mask=mask)
    if agg not in AGG_MODES:
        raise unknown_choice("value_loss", "agg", agg, AGG_MODES)
    if clip is not None and clip < 0:
        raise ValueError(f"value_loss: clip must be >= 0 or None, got {clip!r}")
    plain = (values - returns) ** 2
    if clip is None:
        clipped = plain
    else:
        clipped = (old_values + torch.clamp(values - old_values, -clip, clip) - returns) ** 2
    loss = aggregate_loss(0.5 * torch.maximum(plain, clipped), mask, agg, norm_tokens, denominator)
    with torch.no_grad():
        metrics = {
            "clipfrac": _masked_mean((clipped > plain).double(), mask),
            "values_mean": _masked_mean(values.double(), mask),
        }
    return loss, metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    With d = logprobs - ref_logprobs:
        k1   d
        abs  |d|
        k2   0.5 * d^2
        k3   exp(-d) + d - 1 (low variance, >= 0), -d clamped to [-20, 20] before exp and
             the result clamped to [-10, 10]

    Args:
        logprobs, ref_logprobs: [B, L] (any equal shapes).
        kind: "k1", "k2", "k3" or "abs".

    Returns:
        [B, L] penalty, not masked (multiply by loss_mask or aggregate).
    """
    check_same_shape("kl_penalty", None, logprobs=logprobs, ref_logprobs=ref_logprobs)
    diff = logprobs - ref_logprobs
    if kind == "k1":
        return diff
    elif kind == "abs":
        return diff.abs()
    elif kind == "k2":
        return 0.5 * diff.square()
    elif kind == "k3":
        log_r = torch.clamp(-diff, -20.0, 20.0)
        return torch.clamp(torch.exp(log_r) - log_r - 1.0, -10.0, 10.0)
    else:
        raise unknown_choice("kl_penalty", "kind", kind, KL_KINDS)


def _check_logits(fn: str, logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{fn}: logits must be [B, L, V], got {shape}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: H = -sum p log p, log p = z - logsumexp(z).

    Stable for large logits and for -inf logits (masked vocabulary entries count 0).

    Args:
        logits: [B, L, V] float.

    Returns:
        [B, L], dtype of logits (computed in float32 for half-precision input).
    """
    _check_logits("entropy_from_logits", logits)
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    # Shift by the row max first: lse - sum(p * z) cancels catastrophically for large logits.
    top = z.amax(dim=-1, keepdim=True)
    z = z - torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(logp)
    # 0 * -inf avoided in the value and in the gradient: a where around p * logp would still send
    # 0 * -inf = NaN back through the product at a masked (-inf) entry
    plogp = p * torch.where(p > 0, logp, torch.zeros_like(logp))
    return (-plogp.sum(-1)).to(logits.dtype)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 8) -> torch.Tensor:
    """log softmax(logits)[labels] without materialising a full log_softmax.

    logprob = logits[label] - logsumexp(logits). Half-precision logits are upcast to float32
    `chunk_rows` sequences at a time, which bounds the extra memory to one chunk.

    Args:
        logits: [B, L, V] float.
        labels: [B, L] int, token ids in [0, V).

    Returns:
        [B, L] log-probs, dtype of logits (float32 for half-precision input).
    """
    _check_logits("logprobs_from_logits", logits)
    if labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logprobs_from_logits: labels has shape {tuple(labels.shape)}, expected {tuple(logits.shape[:2])} "
            f"(the first two dims of logits {tuple(logits.shape)})"
        )
    if labels.dtype.is_floating_point:
        raise ValueError(f"logprobs_from_logits: labels must be an integer tensor, got {labels.dtype}")
    if logits.dtype not in (torch.float16, torch.bfloat16):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    out = []
    for start in range(0, logits.shape[0], chunk_rows):  # memory chunks, not per-sequence logic
        z = logits[start : start + chunk_rows].float()
        y = labels[start : start + chunk_rows]
        out.append(z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1))
    return torch.cat(out, dim=0)
