"""Advantage estimators: token-level GAE, TRICO turn-level GAE, GRPO, GiGPO, masked whitening.

All tensors are [B, L] (B sequences, L tokens) unless stated. Masks may be bool or 0/1 of any
dtype; an entry is "in" when it is non-zero.

How the recursions are vectorised (no Python loop over sequences or positions):
1. The masked-in positions of each row are gathered into a dense, left-aligned [B, N] tensor
   (N = the largest number of masked-in positions in a row), so masked-out positions are
   skipped, not chained through, and the padding past a row's count is 0.
2. A backward linear recursion A_j = d_j + c * A_{j+1} is A_j = sum_{k>=j} c^(k-j) d_k. It is
   computed in float64 in chunks of C positions: one [C, C] matmul inside each chunk, one
   [n_chunks, n_chunks] matmul to carry the chunk heads. Only non-negative powers of c (c in
   [0, 1]) appear, so nothing overflows however long the span (small c underflows to 0,
   which is the right limit).
3. A recursion that restarts at segment ends (turn ends) is the unrestarted one minus the
   part that came from after the segment: A_j = S_j - c^(e+1-j) * S_{e+1}.
4. Results are scattered back to [B, L]; masked-out positions get 0.
"""

import math

import torch

from vagen.core._checks import check_same_shape, check_unit_interval, unknown_choice
from vagen.core.selection import group_moments

__all__ = ["GIGPO_NORMS", "compact_index", "gae", "turn_level_gae", "grpo_advantages", "gigpo_advantages", "masked_whiten"]

GIGPO_NORMS = ("mean_std", "mean")


# ----------------------------------------------------------------------------- helpers


def compact_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Index maps between a [B, L] bool mask and its left-aligned dense form [B, N].

    Returns (row, col, dense_col, counts, N): masked-in entry (row[i], col[i]) of the input
    sits at (row[i], dense_col[i]) of the dense form; counts [B] is the number per row.
    """
    row, col = mask.nonzero(as_tuple=True)  # row-major, so per row in position order
    counts = mask.sum(dim=1)
    starts = torch.cumsum(counts, 0) - counts
    dense_col = torch.arange(row.numel(), device=mask.device) - starts[row]
    n_max = int(counts.max()) if counts.numel() > 0 else 0
    return row, col, dense_col, counts, n_max


def _to_dense(x: torch.Tensor, row, col, dense_col, n_max: int) -> torch.Tensor:
    """[B, L] -> [B, N] float64 holding x's masked-in entries left-aligned, 0 after."""
    dense = torch.zeros(x.shape[0], n_max, dtype=torch.float64, device=x.device)
    dense[row, dense_col] = x[row, col].to(torch.float64)
    return dense


def _from_dense(dense: torch.Tensor, shape, dtype, row, col, dense_col) -> torch.Tensor:
    """Inverse of _to_dense: [B, N] -> [B, L] of `dtype`, 0 at masked-out positions."""
    out = torch.zeros(shape, dtype=dtype, device=dense.device)
    out[row, col] = dense[row, dense_col].to(dtype)
    return out


def _discounted_reverse_cumsum(d: torch.Tensor, c: float) -> torch.Tensor:
    """A_j = sum_{k >= j} c^(k-j) d_k along the last dim, i.e. A_j = d_j + c * A_{j+1}.

    d: [B, N] float64; c in [0, 1]. Returns [B, N] float64. Chunked matmuls, see module doc.
    """
    batch, n = d.shape
    if n == 0:
        return d.clone()
    chunk = max(1, math.isqrt(n - 1) + 1)  # ~sqrt(N): balances the two matmuls
    n_chunks = -(-n // chunk)
    x = torch.nn.functional.pad(d, (0, n_chunks * chunk - n)).view(batch, n_chunks, chunk)

    def power_matrix(base: float, size: int) -> torch.Tensor:
        # W[j, k] = base^(k - j) for k >= j, else 0
        offs = torch.arange(size, device=d.device, dtype=torch.float64)
        expo = offs[None, :] - offs[:, None]
        return torch.where(expo >= 0, torch.pow(base, expo.clamp(min=0)), torch.zeros((), dtype=d.dtype))

    local = x @ power_matrix(c, chunk).T  # suffix sums inside each chunk
    heads = power_matrix(c**chunk, n_chunks) @ local[:, :, 0].unsqueeze(-1)  # [B, n_chunks, 1]
    next_heads = torch.nn.functional.pad(heads[:, 1:, 0], (0, 1))  # full suffix sum at next chunk start
    offs = torch.arange(chunk, device=d.device, dtype=torch.float64)
    carry = next_heads.unsqueeze(-1) * torch.pow(c, chunk - offs)  # c^(distance to next chunk start)
    return (local + carry).reshape(batch, n_chunks * chunk)[:, :n]


def _segmented_reverse_cumsum(d: torch.Tensor, c: float, seg_end: torch.Tensor) -> torch.Tensor:
    """Like _discounted_reverse_cumsum, but the recursion restarts after every seg_end.

    A_j = sum_{k=j}^{e(j)} c^(k-j) d_k, with e(j) the first k >= j where seg_end is True
    (the row end when none). d: [B, N] float64, seg_end: [B, N] bool.
    """
    batch, n = d.shape
    if n == 0:
        return d.clone()
    full = _discounted_reverse_cumsum(d, c)
    pos = torch.arange(n, device=d.device)
    end_idx = torch.where(seg_end, pos, torch.full_like(pos, n - 1))
    end_idx = torch.flip(torch.cummin(torch.flip(end_idx, [1]), dim=1).values, [1])
    after = torch.nn.functional.pad(full, (0, 1)).gather(1, end_idx + 1)  # S_{e(j)+1}, 0 past the row
    return full - torch.pow(c, (end_idx + 1 - pos).to(torch.float64)) * after


# ----------------------------------------------------------------------------- public API


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over the masked-in positions only.

    Masked-out positions (prompt, observation, image tokens) are skipped, not chained
    through: for masked-in positions t_1 < ... < t_n of a row,
        delta_i = r(t_i) + gamma * V(t_{i+1}) - V(t_i)      (V(t_{n+1}) = 0)
        A_i     = delta_i + gamma * lam * A_{i+1}           (A_{n+1} = 0)
        returns = A + V.

    Args:
        token_rewards: [B, L] float.
        values: [B, L] float (critic values).
        mask: [B, L] bool or 0/1 (usually loss_mask).
        gamma, lam: floats in [0, 1].

    Returns:
        (advantages, returns), both [B, L] with the dtype of `values`, 0 where mask is 0.
        Computed in float64 internally.
    """
    check_same_shape("gae", 2, token_rewards=token_rewards, values=values, mask=mask)
    check_unit_interval("gae", gamma=gamma, lam=lam)
    row, col, dense_col, _, n_max = compact_index(mask != 0)
    r = _to_dense(token_rewards, row, col, dense_col, n_max)
    v = _to_dense(values, row, col, dense_col, n_max)
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))  # dense padding is 0 past a row's last token
    delta = r + gamma * v_next - v
    adv = _discounted_reverse_cumsum(delta, gamma * lam)
    ret = adv + v
    advantages = _from_dense(adv, values.shape, values.dtype, row, col, dense_col)
    returns = _from_dense(ret, values.shape, values.dtype, row, col, dense_col)
    return advantages, returns


def turn_level_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    turn_end_mask: torch.Tensor,
    gamma_turn: float,
    lam_turn: float,
    gamma_token: float,
    lam_token: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRICO cross-turn credit assignment: turn-level GAE feeding token-level GAE.

    `turn_end_mask` marks the last generated token of each turn; the turn's reward sits at
    its turn end in `token_rewards`; other entries (e.g. per-token KL penalties) stay where
    they are. Per sequence, with turn ends e_1 < ... < e_K:

    Turn level, backwards (V(e_{K+1}) = 0, A_{K+1} = 0):
        delta_k = r(e_k) + gamma_turn * V(e_{k+1}) - V(e_k)
        A_k     = delta_k + gamma_turn * lam_turn * A_{k+1}
    Token level, inside turn k over its generated tokens t_1 < ... < t_m = e_k, backwards:
        A(e_k) = A_k                                           (restarts at every turn end)
        delta_t = r_t + gamma_token * V(t_next) - V(t)         (t_next: next generated token)
        A_t     = delta_t + gamma_token * lam_token * A(t_next)
    returns = advantages + values.

    If a row's last generated token is not a turn end (the final turn was cut by the length
    limit) it is treated as one; its turn reward is whatever token_rewards holds there.
    With all gammas and lambdas 1 and rewards only at turn ends this equals `gae`; rewards
    at non-turn-end tokens of later turns do not flow back across a turn end.

    Args:
        token_rewards, values: [B, L] float.
        loss_mask: [B, L] bool or 0/1, the generated tokens.
        turn_end_mask: [B, L] bool or 0/1, a subset of loss_mask.
        gamma_turn, lam_turn, gamma_token, lam_token: floats in [0, 1].

    Returns:
        (advantages, returns), both [B, L] with the dtype of `values`, 0 where loss_mask is 0.
    """
    check_same_shape(
        "turn_level_gae",
        2,
        token_rewards=token_rewards,
        values=values,
        loss_mask=loss_mask,
        turn_end_mask=turn_end_mask,
    )
    check_unit_interval(
        "turn_level_gae",
        gamma_turn=gamma_turn,
        lam_turn=lam_turn,
        gamma_token=gamma_token,
        lam_token=lam_token,
    )
    gen = loss_mask != 0
    ends = turn_end_mask != 0
    stray = int((ends & ~gen).sum())
    if stray:
        raise ValueError(
            f"turn_level_gae: turn_end_mask has {stray} position(s) where loss_mask is 0; a turn end "
            "must be a generated token (pass turn_end_mask & loss_mask if that is intended)"
        )
    row, col, dense_col, counts, n_max = compact_index(gen)
    r = _to_dense(token_rewards, row, col, dense_col, n_max)
    v = _to_dense(values, row, col, dense_col, n_max)
    is_end = torch.zeros(gen.shape[0], n_max, dtype=torch.bool, device=gen.device)
    is_end[row, dense_col] = ends[row, col]
    has_gen = counts > 0
    # A truncated final turn ends at the row's last generated token.
    is_end[has_gen.nonzero(as_tuple=True)[0], counts[has_gen] - 1] = True

    # Turn level, on the turn ends compacted to [B, K].
    t_row, t_col, t_dense, _, k_max = compact_index(is_end)
    r_turn = torch.zeros(gen.shape[0], k_max, dtype=torch.float64, device=gen.device)
    v_turn = torch.zeros_like(r_turn)
    r_turn[t_row, t_dense] = r[t_row, t_col]
    v_turn[t_row, t_dense] = v[t_row, t_col]
    delta_turn = r_turn + gamma_turn * torch.nn.functional.pad(v_turn[:, 1:], (0, 1)) - v_turn
    adv_turn = _discounted_reverse_cumsum(delta_turn, gamma_turn * lam_turn)

    # Token level: at a turn end the "delta" is the turn advantage and the recursion restarts.
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))
    d = r + gamma_token * v_next - v
    d[t_row, t_col] = adv_turn[t_row, t_dense]
    adv = _segmented_reverse_cumsum(d, gamma_token * lam_token, is_end)
    ret = adv + v
    advantages = _from_dense(adv, values.shape, values.dtype, row, col, dense_col)
    returns = _from_dense(ret, values.shape, values.dtype, row, col, dense_col)
    return advantages, returns


def grpo_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """Group-relative advantages, one scalar per trajectory.

    A_i = (s_i - mean_g) / (std_g + eps) with the unbiased in-group std, or s_i - mean_g when
    norm_by_std=False (Dr.GRPO). A group of one, or whose scores are all equal, gets 0.

    Args:
        scores: [B] float, one score per trajectory.
        group_ids: [B] int, trajectories with the same id form a group (any labels).
        eps: added to the std.
        norm_by_std: divide by the in-group std.

    Returns:
        advantages: [B], the float dtype of `scores` (float32 for integer scores).
    """
    check_same_shape("grpo_advantages", 1, scores=scores, group_ids=group_ids)
    out_dtype = scores.dtype if scores.is_floating_point() else torch.float32
    if scores.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=scores.device)
    s = scores.to(torch.float64)
    count, mean, std, centred, inverse = group_moments(scores, group_ids)
    s_max = torch.full_like(mean, -math.inf).scatter_reduce(0, inverse, s, "amax")
    s_min = torch.full_like(mean, math.inf).scatter_reduce(0, inverse, s, "amin")
    degenerate = (count < 2) | (s_max == s_min)  # exact test, not std < tol
    adv = centred / (std[inverse] + eps) if norm_by_std else centred
    adv = torch.where(degenerate[inverse], torch.zeros_like(adv), adv)
    return adv.to(out_dtype)


def gigpo_advantages(
    turn_rewards: torch.Tensor,
    turn_mask: torch.Tensor,
    group_ids: torch.Tensor,
    state_ids: torch.Tensor,
    gamma: float,
    step_weight: float = 1.0,
    norm: str = "mean_std",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GiGPO: group-relative advantages at two levels, episodes and steps, without a critic.

    Shapes: B trajectories of at most T turns. For trajectory i with level group g_i and its
    masked-in turns t (in order; masked-out turns are skipped, not chained through):

    Episode level (GRPO over episode returns within a level group):
        R_i      = sum_t r_{i,t}
        A_E(i)   = (R_i - mean_{j: g_j = g_i} R_j) / F
    Step level (turns of one level group whose state before the turn is the same, the "anchor
    state", form a step group S = {(j, u): g_j = g_i, s_{j,u} = s_{i,t}}):
        G_{i,t}  = sum_{k >= t} gamma^(k - t) r_{i,k}           (discounted return-to-go)
        A_S(i,t) = (G_{i,t} - mean_{(j,u) in S} G_{j,u}) / F
    Final:
        A(i,t)   = A_E(i) + step_weight * A_S(i,t)

    F is the group's unbiased std + eps for norm="mean_std", and 1 for norm="mean" (the same at
    both levels). A group of one (in particular a singleton step group), or whose values are all
    equal, gets 0 at its level: both levels are `grpo_advantages` over their own groups.

    Args:
        turn_rewards: [B, T] float, each turn's reward.
        turn_mask: [B, T] bool or 0/1, the turns that exist.
        group_ids: [B] int, trajectories with the same id share a level (any labels).
        state_ids: [B, T] int, an id of the state before each turn: two turns of one level group
            are in one step group exactly when their ids are equal (ids of different level groups
            never meet, so they may repeat across groups).
        gamma: discount of the return-to-go, in [0, 1].
        step_weight: omega, the weight of the step-level advantage.
        norm: one of GIGPO_NORMS.
        eps: added to the std.

    Returns:
        advantages: [B, T] with the float dtype of `turn_rewards` (float32 for integer rewards),
            0 at masked-out turns;
        metrics: {"step_group_share": share of masked-in turns in a step group of two or more,
            "step_group_size": mean number of turns per step group}, both 0 without turns.
    """
    fn = "gigpo_advantages"
    check_same_shape(fn, 2, turn_rewards=turn_rewards, turn_mask=turn_mask, state_ids=state_ids)
    check_same_shape(fn, 1, group_ids=group_ids)
    if group_ids.shape[0] != turn_rewards.shape[0]:
        raise ValueError(f"{fn}: group_ids has {group_ids.shape[0]} entries but turn_rewards has "
                         f"{turn_rewards.shape[0]} rows; give one level group id per trajectory")
    for name, ids in (("group_ids", group_ids), ("state_ids", state_ids)):
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"{fn}: {name} must be an integer tensor, got {ids.dtype}; map each key to an int id")
    check_unit_interval(fn, gamma=gamma)
    if not (isinstance(step_weight, int | float) and math.isfinite(step_weight)):
        raise ValueError(f"{fn}: step_weight must be a finite float, got {step_weight!r}")
    if norm not in GIGPO_NORMS:
        raise unknown_choice(fn, "norm", norm, GIGPO_NORMS)
    norm_by_std = norm == "mean_std"
    out_dtype = turn_rewards.dtype if turn_rewards.is_floating_point() else torch.float32
    present = turn_mask != 0

    # Episode level: one score per trajectory, broadcast to its turns.
    returns = torch.where(present, turn_rewards.to(torch.float64), torch.zeros((), dtype=torch.float64))
    episode = grpo_advantages(returns.sum(dim=1), group_ids, eps=eps, norm_by_std=norm_by_std)

    # Step level: the masked-in turns as one flat list, grouped by (level group, anchor state).
    row, col, dense_col, _, n_max = compact_index(present)
    to_go = _discounted_reverse_cumsum(_to_dense(turn_rewards, row, col, dense_col, n_max), gamma)[row, dense_col]
    pairs = torch.stack([group_ids.to(torch.long)[row], state_ids.to(torch.long)[row, col]], dim=1)
    if pairs.shape[0] == 0:
        return torch.zeros(turn_rewards.shape, dtype=out_dtype, device=turn_rewards.device), {
            "step_group_share": 0.0, "step_group_size": 0.0}
    _, step_group = torch.unique(pairs, dim=0, return_inverse=True)
    step = grpo_advantages(to_go, step_group, eps=eps, norm_by_std=norm_by_std)

    advantages = torch.zeros(turn_rewards.shape, dtype=torch.float64, device=turn_rewards.device)
    advantages[row, col] = episode.to(torch.float64)[row] + step_weight * step.to(torch.float64)
    sizes = torch.bincount(step_group)
    metrics = {
        "step_group_share": float((sizes[step_group] >= 2).to(torch.float64).mean()),
        "step_group_size": float(step_group.numel() / sizes.numel()),
    }
    return advantages.to(out_dtype), metrics


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, reduce=None
) -> torch.Tensor:
    """Whiten x with the mean and unbiased variance of its masked-in entries (whole batch).

    y = (x - mean) / sqrt(var + eps); with shift_mean=False the mean is added back,
    y = (x - mean) / sqrt(var + eps) + mean. var uses n - 1 (0 when n < 2).

    Args:
        x: [B, L] float (any shape, same as mask).
        mask: [B, L] bool or 0/1.
        reduce: sums a float64 tensor over data-parallel ranks (an all-reduce), so that each rank
            whitens its part with the mean and variance of the whole batch; None = this batch alone.

    Returns:
        [B, L], dtype of x, 0 where mask is 0 (all 0 when the mask is empty).
    """
    check_same_shape("masked_whiten", None, x=x, mask=mask)
    reduce = reduce if reduce is not None else (lambda t: t)
    m = mask != 0
    vals = x[m].to(torch.float64)
    total, n = reduce(torch.stack([vals.sum(), torch.tensor(float(vals.numel()), dtype=torch.float64)]))
    if n == 0:
        return torch.zeros_like(x)
    mean = total / n
    var = reduce(((vals - mean) ** 2).sum()[None])[0] / (n - 1).clamp(min=1)
    y = (x.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mean
    return torch.where(m, y, torch.zeros_like(y)).to(x.dtype)
