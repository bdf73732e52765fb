"""Bounded staleness (`rollout.max_staleness = k`): which level groups a rank starts, which it must finish
before an update, and how old the turns an update trains on are. Pure bookkeeping: no torch, no engine.

A policy's version counts the updates completed before it; every turn records the version that sampled
it (`vagen.episode.Turn.version`), and its staleness at an update of version v is v minus that. A rank
numbers its groups over the whole run in the order it admits them; group n plays the level of group
n mod B of iteration n div B of the synchronous run (B = groups per rank), with that iteration's request
seeds, so k = 0 admits exactly the synchronous run's groups, in its order.

Admission follows AReaL: before the update of version v, a rank starts groups while it has started at most
(v + k + 1) x B, all of them at once, so that episodes are carried over in practice, not only allowed to
be. A rollout ends once B of its groups have ended whole; episodes still unfinished then wait between
turns and go on after the update with the new weights, except those of a group whose oldest turn would be
more than k updates old at the next update: those are played to their end first, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    """One rank's admission of level groups. `started`: the groups admitted so far, which is also the number
    of the next one."""

    groups_per_rank: int
    max_staleness: int = 0
    started: int = 0

    def __post_init__(self):
        if self.groups_per_rank < 1 or self.max_staleness < 0:
            raise ValueError(f"Admission(groups_per_rank={self.groups_per_rank}, max_staleness={self.max_staleness}): "
                             f"needs at least one group per rank and a staleness >= 0")

    def bound(self, version: int) -> int:
        """The most groups started before the update of `version` (AReaL's (v + k + 1) x B)."""
        return (version + self.max_staleness + 1) * self.groups_per_rank

    def admit(self, version: int) -> range:
        """The numbers of the groups to start now, before the update of `version`: up to the bound. Numbers of
        iterations that played no rollout (`rollout.reuse_iterations`) are skipped, as their levels are."""
        self.started = max(self.started, version * self.groups_per_rank)
        numbers = range(self.started, max(self.started, self.bound(version)))
        self.started = numbers.stop
        return numbers

    def must_finish(self, oldest: int | None, version: int) -> bool:
        """Whether a group whose oldest turn was sampled by version `oldest` (None: no turn yet) must end before
        the update of `version`: carried over it, the group would be trained at version + 1 or later, more
        than k versions after that turn."""
        return oldest is not None and version + 1 - oldest > self.max_staleness

    def level(self, number: int) -> tuple[int, int]:
        """(iteration, index) of group `number` in the synchronous run: its level and request seeds are those of
        the index-th group of this rank at that iteration."""
        return divmod(number, self.groups_per_rank)

    def resumed(self, start: int) -> int:
        """`started` of a run resumed at iteration `start`. A checkpoint is saved after a rollout that finished
        every group it had started (`drain`), and that rollout had admitted up to its bound: (start - 1 + k + 1)
        x B groups, every one of them trained."""
        return 0 if start == 0 else (start + self.max_staleness) * self.groups_per_rank


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
