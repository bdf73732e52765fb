"""Selection and filtering: TRICO critical-token masks and StarPO-S reward-std group filtering.

All tensors are [B, L] (B sequences, L tokens) unless stated. Masks may be bool or 0/1.
"""

import torch

from vagen.core._checks import ceil_count, check_same_shape, unknown_choice

__all__ = [
    "SELECT_MODES",
    "FILTER_MODES",
    "select_critical_tokens",
    "filter_groups_by_reward_std",
    "group_std",
    "group_moments",
]

SELECT_MODES = ("all", "answer", "think_answer", "entropy")
FILTER_MODES = ("std", "std_rev", "none")


def select_critical_tokens(
    loss_mask: torch.Tensor,
    answer_mask: torch.Tensor,
    think_mask: torch.Tensor,
    entropies: torch.Tensor,
    mode: str,
    top_ratio: float = 0.2,
) -> torch.Tensor:
    """TRICO selective token masking: which generated tokens get policy gradient.

    Modes (the result is always a subset of loss_mask):
        all           every generated token
        answer        the answer span
        think_answer  the think and answer spans
        entropy       the answer span plus, per sequence, the k highest-entropy generated
                      tokens, k = ceil(top_ratio * n_generated) (with a 1e-9 tolerance, so
                      0.1 * 30 gives 3); equal entropies go to the earlier position.

    Args:
        loss_mask: [B, L] bool or 0/1, generated tokens.
        answer_mask, think_mask: [B, L] bool or 0/1, the <answer> / <think> spans.
        entropies: [B, L] float, per-token policy entropy (read only in "entropy" mode).
        mode: one of SELECT_MODES.
        top_ratio: fraction in [0, 1] of generated tokens picked by entropy.

    Returns:
        adv_mask: [B, L] with the dtype of loss_mask.
    """
    check_same_shape(
        "select_critical_tokens",
        2,
        loss_mask=loss_mask,
        answer_mask=answer_mask,
        think_mask=think_mask,
        entropies=entropies,
    )
    gen = loss_mask != 0
    answer = (answer_mask != 0) & gen
    if mode == "all":
        selected = gen
    elif mode == "answer":
        selected = answer
    elif mode == "think_answer":
        selected = answer | ((think_mask != 0) & gen)
    elif mode == "entropy":
        if not 0.0 <= top_ratio <= 1.0:
            raise ValueError(f"select_critical_tokens: top_ratio must be in [0, 1], got {top_ratio!r}")
        selected = answer | _top_entropy(gen, entropies, top_ratio)
    else:
        raise unknown_choice("select_critical_tokens", "mode", mode, SELECT_MODES)
    return selected.to(loss_mask.dtype)


def _top_entropy(gen: torch.Tensor, entropies: torch.Tensor, top_ratio: float) -> torch.Tensor:
    """[B, L] bool: per row, the ceil(top_ratio * n) generated tokens of highest entropy."""
    # Two stable sorts = one sort on the key (generated first, entropy descending, position):
    # a stable sort keeps earlier positions first among equal entropies.
    by_entropy = torch.sort(entropies, dim=1, descending=True, stable=True).indices
    by_gen = torch.sort(
        gen.gather(1, by_entropy).to(torch.uint8), dim=1, descending=True, stable=True
    ).indices
    order = by_entropy.gather(1, by_gen)
    n_gen = gen.sum(1, dtype=torch.float64)
    k = torch.ceil(n_gen * top_ratio - 1e-9).clamp(min=0).to(torch.long)
    rank = torch.arange(gen.shape[1], device=gen.device).expand_as(order)
    top = torch.zeros_like(gen)
    top.scatter_(1, order, rank < k[:, None])
    return top & gen


def group_moments(scores: torch.Tensor, group_ids: torch.Tensor):
    """In-group count, mean and unbiased std of scores (the one place they are computed).

    Args:
        scores: [B] float; group_ids: [B] int (any labels).

    Returns:
        (count, mean, std: [G] float64 in ascending group-id order, std 0 for a group of one;
         centred [B] float64, each score minus its group's mean;
         inverse [B] long, the group index of each trajectory).
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    s = scores.to(torch.float64)
    count = torch.bincount(inverse, minlength=n_groups).to(torch.float64)
    mean = torch.zeros(n_groups, dtype=torch.float64, device=s.device).index_add_(0, inverse, s) / count
    centred = s - mean[inverse]
    sq = torch.zeros_like(mean).index_add_(0, inverse, centred * centred)
    return count, mean, torch.sqrt(sq / (count - 1).clamp(min=1)), centred, inverse


def group_std(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased in-group std of scores: (std [G] float64, 0 for a group of one; inverse [B] long)."""
    _, _, std, _, inverse = group_moments(scores, group_ids)
    return std, inverse


def filter_groups_by_reward_std(
    scores: torch.Tensor, group_ids: torch.Tensor, keep_ratio: float = 0.25, mode: str = "std"
) -> tuple[torch.Tensor, dict[str, float]]:
    """StarPO-S uncertainty filtering: keep the whole groups whose rewards vary most.

    Groups are ranked by unbiased in-group reward std ("std": highest first, "std_rev":
    lowest first); equal stds keep ascending group-id order, so the result is
    deterministic. The number of groups kept is
        n_keep = max(1, ceil(keep_ratio * n_groups))     (1e-9 tolerance on the product)
    and "none" keeps every group.

    Args:
        scores: [B] float, one score per trajectory.
        group_ids: [B] int, trajectories with the same id form a group (any labels).
        keep_ratio: fraction of groups in (0, 1].
        mode: one of FILTER_MODES.

    Returns:
        (kept trajectory indices, LongTensor [n_kept] ascending;
         metrics: reward_std_before / reward_std_after (mean in-group std over all / kept
         groups), kept_groups, total_groups, kept_trajectories).
    """
    check_same_shape("filter_groups_by_reward_std", 1, scores=scores, group_ids=group_ids)
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"filter_groups_by_reward_std: keep_ratio must be in (0, 1], got {keep_ratio!r}")
    if scores.numel() == 0:
        raise ValueError("filter_groups_by_reward_std: scores is empty; need at least one trajectory")
    std, inverse = group_std(scores, group_ids)
    n_groups = std.numel()
    if mode == "std":
        order = torch.sort(std, descending=True, stable=True).indices
        n_keep = max(1, ceil_count(keep_ratio, n_groups))
    elif mode == "std_rev":
        order = torch.sort(std, stable=True).indices
        n_keep = max(1, ceil_count(keep_ratio, n_groups))
    elif mode == "none":
        order = torch.arange(n_groups, device=std.device)
        n_keep = n_groups
    else:
        raise unknown_choice("filter_groups_by_reward_std", "mode", mode, FILTER_MODES)
    kept_groups = torch.zeros(n_groups, dtype=torch.bool, device=std.device)
    kept_groups[order[:n_keep]] = True
    indices = kept_groups[inverse].nonzero(as_tuple=True)[0]
    metrics = {
        "reward_std_before": float(std.mean()),
        "reward_std_after": float(std[kept_groups].mean()),
        "kept_groups": float(n_keep),
        "total_groups": float(n_groups),
        "kept_trajectories": float(indices.numel()),
    }
    return indices, metrics
