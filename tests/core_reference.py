"""Naive per-sequence Python-loop references for vagen.core, written for clarity, not speed.

Each reference follows the docstring of its vagen.core counterpart literally, one sequence
and one position at a time, in Python floats. The tests compare against them on random
ragged inputs; benchmarks/bench_core.py times the two GAE ones.
"""

import math

import torch


def _rows(x: torch.Tensor) -> list[list]:
    return x.tolist()


def gae_ref(token_rewards, values, mask, gamma, lam):
    rewards, vals, masks = _rows(token_rewards), _rows(values), _rows(mask)
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        positions = [t for t, m in enumerate(masks[b]) if m]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[b][t] + gamma * next_value - vals[b][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = vals[b][t]
            adv[b][t] = next_adv
            ret[b][t] = next_adv + vals[b][t]
    return torch.tensor(adv, dtype=values.dtype), torch.tensor(ret, dtype=values.dtype)


def turn_level_gae_ref(
    token_rewards, values, loss_mask, turn_end_mask, gamma_turn, lam_turn, gamma_token, lam_token
):
    rewards, vals, masks, ends = _rows(token_rewards), _rows(values), _rows(loss_mask), _rows(turn_end_mask)
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        gen = [t for t, m in enumerate(masks[b]) if m]
        if not gen:
            continue
        # Split the generated tokens into turns; a truncated last turn ends at the last token.
        turns, current = [], []
        for t in gen:
            current.append(t)
            if ends[b][t]:
                turns.append(current)
                current = []
        if current:
            turns.append(current)
        # Turn level.
        turn_adv = [0.0] * len(turns)
        next_value, next_adv = 0.0, 0.0
        for k in reversed(range(len(turns))):
            e = turns[k][-1]
            delta = rewards[b][e] + gamma_turn * next_value - vals[b][e]
            next_adv = delta + gamma_turn * lam_turn * next_adv
            next_value = vals[b][e]
            turn_adv[k] = next_adv
        # Token level, restarting at each turn end.
        for k, turn in enumerate(turns):
            a = turn_adv[k]
            adv[b][turn[-1]] = a
            for i in reversed(range(len(turn) - 1)):
                t, t_next = turn[i], turn[i + 1]
                delta = rewards[b][t] + gamma_token * vals[b][t_next] - vals[b][t]
                a = delta + gamma_token * lam_token * a
                adv[b][t] = a
            for t in turn:
                ret[b][t] = adv[b][t] + vals[b][t]
    return torch.tensor(adv, dtype=values.dtype), torch.tensor(ret, dtype=values.dtype)


def grpo_ref(scores, group_ids, eps=1e-6, norm_by_std=True):
    s, g = scores.tolist(), group_ids.tolist()
    out = []
    for i in range(len(s)):
        members = [s[j] for j in range(len(s)) if g[j] == g[i]]
        if len(members) < 2 or max(members) == min(members):
            out.append(0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((s[i] - mean) / (std + eps) if norm_by_std else s[i] - mean)
    return torch.tensor(out, dtype=torch.float64)


def masked_whiten_ref(x, mask, shift_mean=True, eps=1e-8):
    xs, ms = _rows(x), _rows(mask)
    vals = [v for xr, mr in zip(xs, ms, strict=True) for v, m in zip(xr, mr, strict=True) if m]
    out = [[0.0] * len(r) for r in xs]
    if not vals:
        return torch.tensor(out, dtype=torch.float64)
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
    for b in range(len(xs)):
        for t in range(len(xs[b])):
            if ms[b][t]:
                y = (xs[b][t] - mean) / math.sqrt(var + eps)
                out[b][t] = y if shift_mean else y + mean
    return torch.tensor(out, dtype=torch.float64)


def aggregate_ref(per_token, mask, mode):
    """per_token, mask: nested lists [B][L]."""
    rows = [[v for v, m in zip(pr, mr, strict=True) if m] for pr, mr in zip(per_token, mask, strict=True)]
    length = len(mask[0]) if mask else 0
    nonempty = [r for r in rows if r]
    if not nonempty:
        return 0.0
    if mode == "token-mean":
        return sum(sum(r) for r in nonempty) / sum(len(r) for r in nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) / length for r in nonempty) / len(nonempty)
    raise AssertionError(mode)


def ppo_policy_loss_ref(logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual_clip, agg):
    lp, olp, adv, ms = _rows(logprobs), _rows(old_logprobs), _rows(advantages), _rows(mask)
    per_token = [[0.0] * len(r) for r in lp]
    clipped, clipped_lower, kl, n = 0, 0, 0.0, 0
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            if not ms[b][t]:
                continue
            log_ratio = min(max(lp[b][t] - olp[b][t], -20.0), 20.0)
            ratio = math.exp(log_ratio)
            a = adv[b][t]
            unclipped = -a * ratio
            clipped_loss = -a * min(max(ratio, 1.0 - clip_low), 1.0 + clip_high)
            loss = max(unclipped, clipped_loss)
            clipped += clipped_loss > unclipped
            if dual_clip is not None and a < 0:
                if loss > -a * dual_clip:
                    clipped_lower += 1
                    loss = -a * dual_clip
            per_token[b][t] = loss
            kl += (ratio - 1.0) - log_ratio
            n += 1
    metrics = {
        "clipfrac": clipped / max(n, 1),
        "clipfrac_lower": clipped_lower / max(n, 1),
        "approx_kl": kl / max(n, 1),
    }
    return aggregate_ref(per_token, ms, agg), metrics


def value_loss_ref(values, old_values, returns, mask, clip, agg):
    v, ov, ret, ms = _rows(values), _rows(old_values), _rows(returns), _rows(mask)
    per_token = [[0.0] * len(r) for r in v]
    clipped, n = 0, 0
    for b in range(len(v)):
        for t in range(len(v[b])):
            if not ms[b][t]:
                continue
            plain = (v[b][t] - ret[b][t]) ** 2
            if clip is None:
                clipped_sq = plain
            else:
                v_clip = ov[b][t] + min(max(v[b][t] - ov[b][t], -clip), clip)
                clipped_sq = (v_clip - ret[b][t]) ** 2
            per_token[b][t] = 0.5 * max(plain, clipped_sq)
            clipped += clipped_sq > plain
            n += 1
    return aggregate_ref(per_token, ms, agg), {"clipfrac": clipped / max(n, 1)}


def kl_penalty_ref(logprobs, ref_logprobs, kind):
    out = []
    for lp_row, ref_row in zip(_rows(logprobs), _rows(ref_logprobs), strict=True):
        row = []
        for lp, ref in zip(lp_row, ref_row, strict=True):
            diff = lp - ref
            if kind == "k1":
                row.append(diff)
            elif kind == "abs":
                row.append(abs(diff))
            elif kind == "k2":
                row.append(0.5 * diff * diff)
            elif kind == "k3":
                log_r = min(max(ref - lp, -20.0), 20.0)
                row.append(min(max(math.exp(log_r) - log_r - 1.0, -10.0), 10.0))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def entropy_ref(logits):
    out = []
    for seq in logits.tolist():
        row = []
        for lg in seq:
            m = max(lg)
            z = sum(math.exp(x - m) for x in lg)
            ps = [math.exp(x - m) / z for x in lg]
            row.append(-sum(p * math.log(p) for p in ps if p > 0))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def logprobs_ref(logits, labels):
    out = []
    for seq, lab in zip(logits.tolist(), labels.tolist(), strict=True):
        row = []
        for lg, y in zip(seq, lab, strict=True):
            m = max(lg)
            row.append(lg[y] - m - math.log(sum(math.exp(x - m) for x in lg)))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def select_critical_tokens_ref(loss_mask, answer_mask, think_mask, entropies, mode, top_ratio):
    lm, am, tm, ent = _rows(loss_mask), _rows(answer_mask), _rows(think_mask), _rows(entropies)
    out = []
    for b in range(len(lm)):
        gen = [t for t in range(len(lm[b])) if lm[b][t]]
        if mode == "all":
            keep = set(gen)
        elif mode == "answer":
            keep = {t for t in gen if am[b][t]}
        elif mode == "think_answer":
            keep = {t for t in gen if am[b][t] or tm[b][t]}
        elif mode == "entropy":
            keep = {t for t in gen if am[b][t]}
            k = math.ceil(top_ratio * len(gen) - 1e-9)
            ranked = sorted(gen, key=lambda t, b=b: (-ent[b][t], t))
            keep |= set(ranked[:k])
        out.append([t in keep for t in range(len(lm[b]))])
    return torch.tensor(out, dtype=torch.bool)


def filter_groups_ref(scores, group_ids, keep_ratio, mode):
    s, g = scores.tolist(), group_ids.tolist()
    groups = sorted(set(g))
    stds = []
    for gid in groups:
        members = [s[i] for i in range(len(s)) if g[i] == gid]
        if len(members) < 2:
            stds.append(0.0)
            continue
        mean = sum(members) / len(members)
        stds.append(math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1)))
    order = list(range(len(groups)))
    if mode == "std":
        order.sort(key=lambda i: (-stds[i], i))
        n_keep = max(1, math.ceil(keep_ratio * len(groups) - 1e-9))
    elif mode == "std_rev":
        order.sort(key=lambda i: (stds[i], i))
        n_keep = max(1, math.ceil(keep_ratio * len(groups) - 1e-9))
    else:
        n_keep = len(groups)
    kept = {groups[i] for i in order[:n_keep]}
    indices = [i for i in range(len(s)) if g[i] in kept]
    kept_stds = [stds[i] for i in order[:n_keep]]
    metrics = {
        "reward_std_before": sum(stds) / len(stds),
        "reward_std_after": sum(kept_stds) / len(kept_stds),
        "kept_groups": float(n_keep),
        "total_groups": float(len(groups)),
        "kept_trajectories": float(len(indices)),
    }
    return indices, metrics
