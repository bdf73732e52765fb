"""Bounded staleness (`rollout.max_staleness = k`): which level groups a rank starts, which it must finish
before an update, and how old the turns an update trains on are. Pure bookkeeping: no torch, no engine.

A policy's version counts the updates completed before it; every turn records the version that sampled
it (`vagen.episode.Turn.version`), and its staleness at an update of version v is v minus that. A rank
numbers its groups over the whole run in the order it admits them; group n plays the level of group
n mod B of iteration n div B of the synchronous run (B = groups per rank), with that iteration's request
seeds, so k = 0 admits exactly the synchronous run's groups, in its order.

Admission follows AReaL: before the update of version v a rank starts groups, all at once, while it has
at most (k + 1) x B groups in flight (started and not yet ended); while every update trains B groups this is
AReaL's bound, started <= (v + k + 1) x B, so that episodes are carried over in practice, not only allowed
to be. (AReaL's count by version would stay short for good after an update that trained more than B groups:
those finished early to respect k, or every group, drained before a checkpoint.) A rollout ends once B of
its groups have ended whole; episodes still unfinished then wait between turns and go on after the update
with the new weights, except those of a group whose oldest turn would be more than k updates old at the
next update: those are played to their end first, never dropped. That, not the admission, bounds the
staleness of every trained turn by k.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    """One rank's admission of level groups. `started`: the groups admitted so far, which is also the number
    of the next one; `ended`: those that have ended (trained or filtered out)."""

    groups_per_rank: int
    max_staleness: int = 0
    started: int = 0
    ended: int = 0

    def __post_init__(self):
        if self.groups_per_rank < 1 or self.max_staleness < 0:
            raise ValueError(f"Admission(groups_per_rank={self.groups_per_rank}, max_staleness={self.max_staleness}): "
                             f"needs at least one group per rank and a staleness >= 0")

    @classmethod
    def for_config(cls, cfg, world_size: int = 1) -> Admission:
        """A rank's admission of `cfg`'s level groups: rollout.env_groups shared by the ranks, rollout.max_staleness."""
        return cls(cfg.rollout.env_groups // world_size, cfg.rollout.max_staleness)

    @property
    def in_flight_limit(self) -> int:
        """The most groups in flight at once: (k + 1) x B."""
        return (self.max_staleness + 1) * self.groups_per_rank

    def admit(self, version: int) -> range:
        """The numbers of the groups to start now, before the update of `version`: as many as keep (k + 1) x B
        in flight. Numbers of iterations that played no rollout (`rollout.reuse_iterations`, k = 0) are
        skipped, as their levels are."""
        skipped = version * self.groups_per_rank - self.started
        if skipped > 0:
            self.started += skipped
            self.ended += skipped
        numbers = range(self.started, max(self.started, self.ended + self.in_flight_limit))
        self.started = numbers.stop
        return numbers

    def end(self, groups: int) -> None:
        """`groups` of the admitted ones have ended."""
        assert 0 <= groups <= self.started - self.ended, f"{groups=} {self.started=} {self.ended=}"
        self.ended += groups

    def must_finish(self, oldest: int | None, version: int) -> bool:
        """Whether a group whose oldest turn was sampled by version `oldest` (None: no turn yet) must end before
        the update of `version`: carried over it, the group would be trained at version + 1 or later, more
        than k versions after that turn."""
        return oldest is not None and version + 1 - oldest > self.max_staleness

    def level(self, number: int) -> tuple[int, int]:
        """(iteration, index) of group `number` in the synchronous run: its level and request seeds are those of
        the index-th group of this rank at that iteration."""
        return divmod(number, self.groups_per_rank)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the counts (a checkpoint is saved with no group in flight, `drain`)."""
        return {"started": self.started, "ended": self.ended}

    def load_state_dict(self, state: dict) -> None:
        self.started, self.ended = int(state["started"]), int(state["ended"])

    def resume(self, start: int) -> None:
        """A run resumed at iteration `start` from a checkpoint that kept no counts (saved before they existed,
        by a synchronous run): the synchronous run's numbering."""
        if start > 0 and self.started == 0:
            self.started = self.ended = start * self.groups_per_rank


def token_staleness(turns_with_versions, version: int) -> tuple[float, float, float]:
    """(sum of token ages, tokens, largest age) of `turns_with_versions`, (response tokens, sampling version)
    pairs, trained at `version`; token-weighted: a turn counts once per generated token."""
    total = tokens = 0.0
    oldest = 0.0
    for length, sampled_at in turns_with_versions:
        age = float(version - sampled_at)
        total += age * length
        tokens += length
        if length:
            oldest = max(oldest, age)
    return total, tokens, oldest
