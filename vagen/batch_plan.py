"""How an update's batch is cut: which level groups are trained and on which rank (StarPO-S over all ranks,
`plan_groups`, and the moves that even the ranks out, `share_groups`), and each PPO epoch's mini-batches (one
optimizer step each) and their micro-batches (one forward and backward each), padded so that every rank runs
as many passes as the busiest (`plan_epoch`). Indices only: no model runs here; `vagen.update` runs the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vagen import core
from vagen.distributed import all_reduce, gather_objects
from vagen.trajectory import Sample


def chunks(items: list, size: int) -> list[list]:
    """`items` in consecutive runs of `size` (the last one shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def micro_batch_tokens(lengths: list[int], packed: bool) -> int:
    """Tokens one forward/backward runs over sequences of `lengths`: the padded batch's rows x width, or with
    packing (`train.pack_sequences`) the sum of the lengths."""
    return sum(lengths) if packed else len(lengths) * max(lengths, default=0)


def micro_batches(indices: list[int], samples: list[Sample], train) -> list[list[int]]:
    """One mini-batch's samples (`indices` into `samples`, in order) cut into micro-batches, each one forward and
    backward: runs of `train.micro_batch_size` samples, or with `train.micro_batch_tokens` > 0 as many
    consecutive samples as fit that many tokens (`micro_batch_tokens`; a sample longer than the budget is a
    micro-batch of its own). The one place a micro-batch's extent is decided."""
    budget = train.micro_batch_tokens
    if budget <= 0:
        return chunks(indices, train.micro_batch_size)
    out, current = [], []
    for i in indices:
        lengths = [samples[j].length for j in current] + [samples[i].length]
        if current and micro_batch_tokens(lengths, train.pack_sequences) > budget:
            out.append(current)
            current = []
        current.append(i)
    return out + [current] * bool(current)


def synced_micro_batches(samples: list, train) -> list[list[int] | None]:
    """This rank's micro-batches (indices into `samples`, cut by `micro_batches` under the `train` section),
    padded with None to the largest count of any
    rank. Under ZeRO-3 every forward gathers parameters collectively, and under ZeRO-2 every backward
    reduces gradients, so every rank must run as many passes as the busiest; a None is a pass whose
    result is thrown away (or whose loss is multiplied by 0)."""
    micro = micro_batches(list(range(len(samples))), samples, train)
    most = int(all_reduce(torch.tensor([len(micro)], dtype=torch.float64), "max")[0])
    if most and not samples:
        raise RuntimeError("this rank holds no trajectory while others do, so it has nothing to run its "
                           "share of the collective passes with; keep at least one level group per rank")
    return micro + [None] * (most - len(micro))


@dataclass
class GroupPlan:
    """Which level groups of an iteration are trained, and on which rank (`plan_groups`). Group ids are
    global: rank * `span` + the id the group has on the rank that played it."""

    destination: dict[int, int]  # global group id -> the rank that trains it
    span: int
    stats: dict[str, float]

    def keeps(self, rank: int, group_id: int) -> bool:
        """Whether the group `group_id` that `rank` played is trained (here or elsewhere)."""
        return rank * self.span + group_id in self.destination


def plan_groups(scores: list[float], group_ids: list[int], cfg, rank: int = 0, world_size: int = 1,
                tasks: list[str] | None = None) -> GroupPlan:
    """StarPO-S over the groups of every rank: keep the groups whose rewards vary most across the whole
    iteration (not per rank), then share the kept groups out so that ranks hold equal numbers of them
    (a rank keeps its own groups up to its share; the rest move). Every rank computes the same plan
    from every rank's (scores, group ids), and refuses the same way when fewer groups are kept than
    there are ranks, so that no rank is left waiting in a collective for one that raised. `tasks`: each
    trajectory's task (rollout.tasks), whose groups are ranked among themselves only (`filter_by_task`), so
    that a task with larger rewards does not crowd out the others."""
    algo = cfg.algo
    tasks = list(tasks) if tasks is not None else [""] * len(scores)
    meta = gather_objects((list(scores), list(group_ids), tasks), active=world_size > 1)
    span = max(max(ids, default=-1) for _, ids, _ in meta) + 1
    all_scores = torch.tensor([x for sc, _, _ in meta for x in sc], dtype=torch.float64)
    owners = [r for r, (sc, _, _) in enumerate(meta) for _ in sc]
    global_ids = torch.tensor([r * span + g for r, (_, ids, _) in enumerate(meta) for g in ids], dtype=torch.long)
    keep, stats = filter_by_task(all_scores, global_ids, [t for _, _, names in meta for t in names],
                                 algo.filter_keep_ratio, algo.filter_mode)
    kept = sorted({int(global_ids[i]) for i in keep.tolist()})
    if world_size > 1 and len(kept) < world_size:
        played = sorted(set(global_ids.tolist()))
        raise RuntimeError(f"this iteration has {len(kept)} level group(s) to train (of {len(played)} played with at "
                           f"least one turn, rollout.env_groups={cfg.rollout.env_groups}) for {world_size} ranks, so a "
                           f"rank would have none; the others are episodes whose environment failed at reset (see the "
                           f"[env error] lines above), or groups the reward-std filter dropped. Fix the environment, or "
                           f"raise rollout.env_groups (or algo.filter_keep_ratio) so each rank keeps a group")
    # shares: the first (kept % world) ranks take one group more
    quota = [len(kept) // world_size + (r < len(kept) % world_size) for r in range(world_size)]
    home = {g: owners[int((global_ids == g).nonzero()[0])] for g in kept}
    stays, moving = [], []
    for r in range(world_size):
        mine = [g for g in kept if home[g] == r]
        stays += mine[: quota[r]]
        moving += mine[quota[r]:]
    destination = {g: home[g] for g in stays}
    for r in range(world_size):
        need = quota[r] - sum(1 for g in stays if home[g] == r)
        for g in moving[:need]:
            destination[g] = r
        moving = moving[need:]
    return GroupPlan(destination, span, stats)


def filter_by_task(scores: torch.Tensor, group_ids: torch.Tensor, tasks: list[str], keep_ratio: float,
                   mode: str) -> tuple[torch.Tensor, dict[str, float]]:
    """`core.filter_groups_by_reward_std` within each task's trajectories (scores [B], group_ids [B], `tasks` B
    names; a group lies within one task): each task keeps its share of its own groups. Returns the kept indices
    [K] ascending and the filter's metrics over all tasks (counts summed, stds averaged over groups)."""
    names = sorted(set(tasks))
    if len(names) <= 1:
        return core.filter_groups_by_reward_std(scores, group_ids, keep_ratio, mode)
    kept, totals = [], {"kept_groups": 0.0, "total_groups": 0.0, "kept_trajectories": 0.0}
    std_sums = {"reward_std_before": 0.0, "reward_std_after": 0.0}
    for name in names:
        rows = torch.tensor([i for i, task in enumerate(tasks) if task == name], dtype=torch.long)
        keep, stats = core.filter_groups_by_reward_std(scores[rows], group_ids[rows], keep_ratio, mode)
        kept.append(rows[keep])
        for key in totals:
            totals[key] += stats[key]
        std_sums["reward_std_before"] += stats["reward_std_before"] * stats["total_groups"]
        std_sums["reward_std_after"] += stats["reward_std_after"] * stats["kept_groups"]
    stats = {**totals, "reward_std_before": std_sums["reward_std_before"] / max(totals["total_groups"], 1.0),
             "reward_std_after": std_sums["reward_std_after"] / max(totals["kept_groups"], 1.0)}
    return torch.sort(torch.cat(kept)).values, stats


def share_groups(samples: list[Sample], plan: GroupPlan, rank: int = 0, world_size: int = 1) -> list[Sample]:
    """This rank's samples of the kept groups played here (their group ids made global), sent to the ranks
    the plan says, and the ones the plan sends here; ordered by group id."""
    for sample in samples:
        sample.group_id = rank * plan.span + sample.group_id
    leaving = [s for s in samples if s.group_id in plan.destination and plan.destination[s.group_id] != rank]
    arriving = gather_objects(leaving, active=world_size > 1) if world_size > 1 else []
    incoming = [s for part in arriving for s in part if plan.destination[s.group_id] == rank]
    mine = [s for s in samples if plan.destination.get(s.group_id) == rank] + incoming
    mine.sort(key=lambda s: s.group_id)
    return mine


def filter_groups(samples: list[Sample], cfg, rank: int = 0, world_size: int = 1) -> tuple[list[Sample], dict]:
    """`plan_groups` over the samples' scores, then `share_groups`: the samples this rank trains."""
    plan = plan_groups([s.score for s in samples], [s.group_id for s in samples], cfg, rank, world_size,
                       tasks=[s.task for s in samples])
    return share_groups(samples, plan, rank, world_size), plan.stats


def trajectory_rows(samples: list[Sample]) -> list[list[int]]:
    """The indices of each trajectory's samples, in turn order: one sample per trajectory with
    rollout.context=full, its turn samples (same group and episode index) with rollout.context=window."""
    if all(s.turn_index is None for s in samples):
        return [[i] for i in range(len(samples))]
    rows: dict[tuple[int, int | None], list[int]] = {}
    for i, s in enumerate(samples):
        rows.setdefault((s.group_id, s.episode_index), []).append(i)
    return [sorted(row, key=lambda i: samples[i].turn_index) for row in rows.values()]


def loss_denominators(samples: list[Sample], indices: list[int], mode: str) -> list[float]:
    """This rank's part of the mini-batch `indices`' loss denominators: [policy gradient (adv_mask),
    entropy and KL (sampled_mask), value (loss_mask)]."""
    out = [0.0, 0.0, 0.0]
    for i in indices:
        s = samples[i]
        for k, mask in enumerate((s.extra["adv_mask"], s.sampled_mask, s.loss_mask)):
            out[k] += core.loss_denominator(mask[None], mode)
    return out


@dataclass
class MiniBatch:
    """One optimizer step's share of this rank: its micro-batches (indices into the samples; None is a
    pass of loss 0 that pairs with a busier rank's collectives) and the global loss denominators."""

    micro: list[list[int] | None]
    pg_den: float  # policy gradient: adv_mask
    sampled_den: float  # entropy and KL: sampled_mask
    value_den: float  # value: loss_mask


def plan_epoch(samples: list[Sample], cfg, world_size: int, generator: torch.Generator | None,
               shuffle: bool) -> list[MiniBatch]:
    """One PPO epoch on this rank: its shuffled trajectories cut into mini-batches of `train.mini_batch_size /
    ranks` (with rollout.context=window, each with all its turn samples) and those into micro-batches of
    samples, padded to the count of the busiest rank (mini-batches and micro-batches alike), with each
    mini-batch's denominators summed over ranks."""
    tr = cfg.train
    rows = trajectory_rows(samples)  # a mini-batch takes whole trajectories (all turn samples of one)
    order = torch.randperm(len(rows), generator=generator).tolist() if shuffle else list(range(len(rows)))
    minis = [[i for t in part for i in rows[t]] for part in chunks(order, max(1, tr.mini_batch_size // world_size))]
    n_minis = int(all_reduce(torch.tensor([len(minis)], dtype=torch.float64), "max")[0])
    minis += [[] for _ in range(n_minis - len(minis))]
    plans = [micro_batches(m, samples, tr) for m in minis]
    shape = torch.tensor([[len(p)] + loss_denominators(samples, m, cfg.algo.loss_agg) for p, m in zip(plans, minis)],
                         dtype=torch.float64).reshape(n_minis, 4)
    most = all_reduce(shape[:, :1].clone(), "max")[:, 0]
    denominators = all_reduce(shape[:, 1:].clone(), "sum")
    return [MiniBatch(plan + [None] * (int(n) - len(plan)), *dens)
            for plan, n, dens in zip(plans, most.tolist(), denominators.tolist())]
