"""Does the policy look at its frames? The batch's responses scored a second time with each trajectory's frames
swapped for another level group's, beside their log-probabilities under their own frames.

    rollout/frame_gap           mean over turns of (own-frame - swapped-frame) summed response log-prob, nats/turn
    rollout/frame_gap_positive  share of those turns whose gap is > 0
    rollout/frame_gap_turns     turns scored (every rank's)
    rollout/<task>/frame_gap... the same per task (rollout.tasks)

A policy that reads its frames gives its own responses a much higher probability with the frames they were
written for (the shipped FrozenLake and Sokoban warm starts: docs/algorithms.md, "Does the policy look?"); a
blind one gives them about the same with another level's. Frames are never blanked: an all-zero frame is out of
distribution, and the loss of a blind model rises on it as if it read them.

The swap (`swap_donors`), on each rank's samples and deterministic by seed: the samples of each task are split
by level group; the groups are put in an order drawn from the seed, and each group takes its frames from the
next group in that order (the last from the first), its j-th sample from that group's (j mod size)-th sample.
Frame k of a sample becomes frame (k mod n) of its donor's n frames, which must have the same image grid. So no
sample keeps a frame of its own group, every frame is a real frame of another level, and the token sequence,
positions and text are unchanged. A task with one level group on a rank, text samples and samples whose
donor's frames differ in size are not scored.

In training (`run_frame_check`) the own-frame log-probabilities are the update's old log-probabilities
(`vagen.update.annotate`), and one more no-grad pass of the same forward (`vagen.update.token_logprobs`, at the
sampling temperature, with the tokens the rollout never samples left out) scores the swapped frames, so the
check costs one forward pass of the batch. Every rank runs as many passes as the busiest (ZeRO-3). In
evaluation (`eval_frame_gap`) both sides are scored here.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from vagen.distributed import all_reduce, gather_objects
from vagen.trajectory import Sample, collate

GAP_KEYS = ("frame_gap", "frame_gap_positive", "frame_gap_turns")
# log.frame_check_every=-1 on a visual config: the check's period (its measured cost: docs/algorithms.md)
AUTO_EVERY = 1


def is_visual(cfg) -> bool:
    """Whether the config's environment (any task's, with rollout.tasks) shows frames."""
    from vagen.config import task_configs

    if cfg.rollout.tasks:
        return any(sub.env.render_mode == "vision" for _, sub in task_configs(cfg))
    return cfg.env.render_mode == "vision"


def check_every(cfg) -> int:
    """The period of the check in iterations (0 = never): log.frame_check_every, where -1 (the default) is
    AUTO_EVERY for a visual config and 0 for a text one."""
    every = cfg.log.frame_check_every
    if every < 0:
        return AUTO_EVERY if is_visual(cfg) else 0
    return every


def swap_donors(group_ids: list[int], tasks: list[str], grids: list[list[tuple] | None], seed: int) -> list[int | None]:
    """For each sample, the sample whose frames it is scored with (None: not scored), by the rule in the module
    docstring. `grids`: each sample's image grids (a tuple per image), None for a sample without frames."""
    generator = torch.Generator().manual_seed(seed)
    donors: list[int | None] = [None] * len(group_ids)
    for task in sorted(set(tasks)):
        members: dict[int, list[int]] = {}
        for i, (group, name) in enumerate(zip(group_ids, tasks)):
            if name == task and grids[i]:
                members.setdefault(group, []).append(i)
        order = sorted(members)
        if len(order) < 2:
            continue
        order = [order[k] for k in torch.randperm(len(order), generator=generator).tolist()]
        for position, group in enumerate(order):
            giving = members[order[(position + 1) % len(order)]]
            for j, i in enumerate(members[group]):
                donor = giving[j % len(giving)]
                n = len(grids[donor])
                if all(grids[i][k] == grids[donor][k % n] for k in range(len(grids[i]))):
                    donors[i] = donor
    return donors


def _frames(sample: Sample) -> list[torch.Tensor]:
    sizes = [int(t * h * w) for t, h, w in sample.image_grid_thw.tolist()]
    return list(torch.split(sample.pixel_values, sizes))


def _grids(sample: Sample) -> list[tuple] | None:
    if sample.pixel_values is None or sample.image_grid_thw is None:
        return None
    return [tuple(g) for g in sample.image_grid_thw.tolist()]


def swapped_samples(samples: list[Sample], donors: list[int | None]) -> list[Sample]:
    """Copies of the scored samples (donor not None), each with its frames replaced by its donor's."""
    out = []
    for sample, donor in zip(samples, donors):
        if donor is None:
            continue
        theirs = _frames(samples[donor])
        frames = [theirs[k % len(theirs)] for k in range(len(sample.image_grid_thw))]
        out.append(dataclasses.replace(sample, pixel_values=torch.cat(frames)))
    return out


def turn_sums(logprobs: torch.Tensor, mask: torch.Tensor, turn_end_mask: torch.Tensor) -> torch.Tensor:
    """Per turn, the sum of `logprobs` [L] over the positions of `mask` [L] in it (a turn ends at each 1 of
    `turn_end_mask` [L]); returns [turns]."""
    ends = turn_end_mask > 0
    turn_ids = torch.cumsum(ends.long(), 0) - ends.long()
    turns = int(ends.sum())
    keep = (mask > 0) & (turn_ids < turns)
    return torch.zeros(turns, dtype=torch.float64).index_add(0, turn_ids[keep], logprobs[keep].double())


def gap_sums(own: list[torch.Tensor], swapped: list[torch.Tensor], tasks: list[str]) -> dict[str, list[float]]:
    """Per task: [sum of gaps, turns with a gap > 0, turns] over the samples' turns (`own` and `swapped`: each
    sample's per-turn log-prob sums)."""
    out: dict[str, list[float]] = {}
    for mine, theirs, task in zip(own, swapped, tasks):
        gap = mine - theirs
        sums = out.setdefault(task, [0.0, 0.0, 0.0])
        sums[0] += float(gap.sum())
        sums[1] += float((gap > 0).sum())
        sums[2] += float(gap.numel())
    return out


def gap_metrics(sums: dict[str, list[float]], prefix: str = "rollout/") -> dict[str, float]:
    """The metrics of per-task [gap sum, positive turns, turns] (`gap_sums`, every rank's added): over all
    tasks under `prefix`, and per task under `prefix<task>/` where there are named tasks. Nothing where no
    turn was scored."""
    out: dict[str, float] = {}
    total = [sum(v[k] for v in sums.values()) for k in range(3)]
    parts = [("", total)] + [(f"{task}/", v) for task, v in sorted(sums.items()) if task]
    for where, (gap, positive, turns) in parts:
        if turns > 0:
            out.update({f"{prefix}{where}frame_gap": gap / turns, f"{prefix}{where}frame_gap_positive": positive / turns,
                        f"{prefix}{where}frame_gap_turns": turns})
    return out


def _all_ranks(sums: dict[str, list[float]]) -> dict[str, list[float]]:
    total: dict[str, list[float]] = {}
    for part in gather_objects(sums):
        for task, values in part.items():
            row = total.setdefault(task, [0.0, 0.0, 0.0])
            for k in range(3):
                row[k] += values[k]
    return total


@torch.no_grad()
def swapped_logprobs(model, samples: list[Sample], swapped: list[Sample], temperature: float, pad_id: int, device,
                     micro_batch_size: int, suppress_ids=()) -> list[torch.Tensor]:
    """Log-probabilities [length] of each of `swapped`'s generated tokens (`vagen.update.token_logprobs`), a
    micro-batch at a time; every rank runs as many passes as the busiest (a pass over `samples[0]`, thrown
    away, where it has none left), as ZeRO-3's collective gathers need."""
    from vagen.batch_plan import chunks
    from vagen.update import token_logprobs

    micro = chunks(list(range(len(swapped))), micro_batch_size)
    most = int(all_reduce(torch.tensor([len(micro)], dtype=torch.float64), "max")[0])
    if most and not samples:
        raise RuntimeError("this rank holds no trajectory while others do, so it cannot take part in the frame "
                           "check's passes; keep at least one level group per rank")
    out: list[torch.Tensor] = []
    for k in range(most):
        indices = micro[k] if k < len(micro) else None
        group = [swapped[i] for i in indices] if indices is not None else [samples[0]]
        batch = {key: value.to(device) for key, value in collate(group, pad_id).items()}
        logprobs, _ = token_logprobs(model, batch, temperature, with_entropy=False, suppress_ids=suppress_ids)
        if indices is not None:
            out += [logprobs[row, : s.length].float().cpu() for row, s in enumerate(group)]
    return out


def frame_gaps(model, samples: list[Sample], own_logprobs: list[torch.Tensor], seed: int, temperature: float,
               pad_id: int, device, micro_batch_size: int, suppress_ids=()) -> dict[str, list[float]]:
    """This rank's per-task [gap sum, positive turns, turns] (`gap_sums`) of `samples`, whose log-probabilities
    under their own frames are `own_logprobs` (one [length] tensor each), swapped by `swap_donors(seed)`. The
    gap of a turn sums its sampled tokens (`sampled_mask`)."""
    donors = swap_donors([s.group_id for s in samples], [s.task for s in samples], [_grids(s) for s in samples],
                         seed)
    swapped = swapped_samples(samples, donors)
    theirs = swapped_logprobs(model, samples, swapped, temperature, pad_id, device, micro_batch_size, suppress_ids)
    scored = [i for i, donor in enumerate(donors) if donor is not None]
    own = [turn_sums(own_logprobs[i], samples[i].sampled_mask, samples[i].turn_end_mask) for i in scored]
    other = [turn_sums(lp, swapped[k].sampled_mask, swapped[k].turn_end_mask) for k, lp in enumerate(theirs)]
    return gap_sums(own, other, [samples[i].task for i in scored])


def run_frame_check(samples: list[Sample], cfg, it: int, models, dist) -> dict[str, float]:
    """The check on an iteration's annotated samples (their `old_logprobs` are the own-frame side), with the
    actor engine; the metrics over every rank, and `timing/frame_check`. Every rank calls it together."""
    t0 = time.perf_counter()
    seed = (cfg.train.seed * 1_000_003 + it) * 1_009 + dist.rank
    sums = frame_gaps(models.actor, samples, [s.extra["old_logprobs"] for s in samples], seed,
                      cfg.rollout.temperature, models.encoder.pad_id, dist.device, cfg.train.micro_batch_size,
                      models.encoder.suppress_ids)
    stats = gap_metrics(_all_ranks(sums))
    stats["timing/frame_check"] = time.perf_counter() - t0
    return stats


@torch.no_grad()
def eval_frame_gap(model, encoder, cfg, episodes: list, dist=None) -> dict[str, float]:
    """The frame gap of evaluation episodes (each its own group), both sides scored here at
    rollout.temperature (1 where it is 0, greedy). Returns {frame_gap, frame_gap_positive, frame_gap_turns}
    over every rank's episodes, or {} where no turn could be scored (text, or a single episode)."""
    from vagen.trajectory import episode_samples

    samples = [s for index, ep in enumerate(episodes) if ep.turns
               for s in episode_samples(ep, encoder, model, index)]
    for k, sample in enumerate(samples):  # one group per episode, whatever the rollout numbered
        sample.group_id = sample.episode_index if sample.episode_index is not None else k
        sample.task = ""
    temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
    rank = dist.rank if dist is not None else 0
    device = next(model.parameters()).device
    own = swapped_logprobs(model, samples, samples, temperature, encoder.pad_id, device,
                           cfg.train.micro_batch_size, encoder.suppress_ids)
    sums = frame_gaps(model, samples, own, cfg.eval.sample_seed * 1_009 + rank, temperature, encoder.pad_id,
                      device, cfg.train.micro_batch_size, encoder.suppress_ids)
    return gap_metrics(_all_ranks(sums), prefix="")


class DecoyFrames:
    """An environment whose observations show another level's frames (`python -m vagen.eval --decoy-frames`):
    the text, rewards and success are those of the level played, each image that of `decoy` (an environment of
    the same config), reset on `decoy_seed` and stepped with the same responses, so that its frames are those
    the agent would see had it acted the same way on that level (held at its last frame once its episode ends).
    Closed-loop success with them, beside success with the level's own, is what the policy's reading of its
    frames is worth; a frame is never blank (out of distribution, it misleads)."""

    def __init__(self, env, decoy, decoy_seed: int):
        self.env, self.decoy, self.decoy_seed = env, decoy, decoy_seed
        self.decoy_images: list = []
        self.decoy_over = False

    def __getattr__(self, name):  # everything else is the played environment's
        return getattr(self.__dict__["env"], name)

    def _shown(self, obs):
        if not obs.images:
            return obs
        if not self.decoy_images:
            raise ValueError(f"the decoy level {self.decoy_seed} shows no frame where the played level shows "
                             f"{len(obs.images)}; --decoy-frames needs a visual environment (env.render_mode=vision)")
        images = []
        for k, own in enumerate(obs.images):
            image = self.decoy_images[k % len(self.decoy_images)]
            images.append(image if image.size == own.size else image.resize(own.size))
        return dataclasses.replace(obs, images=images)

    def reset(self, seed=None):
        obs, info = self.env.reset(seed=seed)
        decoy_obs, _ = self.decoy.reset(seed=self.decoy_seed)
        self.decoy_images, self.decoy_over = list(decoy_obs.images), False
        return self._shown(obs), info

    def step(self, response: str):
        obs, reward, terminated, truncated, info = self.env.step(response)
        if not self.decoy_over:
            decoy_obs, _, over, cut, _ = self.decoy.step(response)
            self.decoy_images = list(decoy_obs.images) or self.decoy_images
            self.decoy_over = over or cut
        return self._shown(obs), reward, terminated, truncated, info

    def close(self):
        for env in (self.env, self.decoy):
            if hasattr(env, "close"):
                env.close()


def decoy_seeds(seeds: list[int]) -> dict[int, int]:
    """Each evaluation seed's decoy: the next seed of the list, the last's the first (of one seed, the next
    evaluation seed after it)."""
    if len(seeds) == 1:
        return {seeds[0]: seeds[0] + 1}
    return {seed: seeds[(k + 1) % len(seeds)] for k, seed in enumerate(seeds)}
