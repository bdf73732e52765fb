"""Bounded staleness (`rollout.max_staleness = k`): which level groups a rank starts, which it must finish
before an update, and how old the turns an update trains on are. Pure bookkeeping: no torch, no engine.

A policy's version counts the updates completed before it; every turn records the version that sampled
it (`vagen.episode.Turn.version`), and its staleness at an update of version v is v minus that. A rank
numbers its groups over the whole run in the order it admits them; group n plays the level of group
n mod B of iteration n div B of the synchronous run (B = groups per rank), with that iteration's request
seeds, so k = 0 admits exactly the synchronous run's groups, in its order.

Admission follows AReaL: before the update of version v a rank starts groups, all at once, while it has
at most (k + 1) x B groups in flight (started and not yet trained); every update trains exactly B groups, so this
is AReaL's bound, started <= (v + k + 1) x B, and episodes are carried over in practice, not only allowed to be.
Unlike AReaL, which trains whichever groups end first, an update trains the B groups it admitted first (`due`):
the update of version v trains groups vB ... vB + B - 1, the synchronous run's groups of iteration v, so k changes
when a level is played, never which levels a batch holds or how many (no bias towards short episodes). A rollout
ends once its due groups have ended whole; groups that ended beyond them wait, ended, for their own update, and
unfinished episodes wait between turns and go on after the update with the new weights. That bounds the staleness
of every trained turn by k: group n is admitted before the update of u with n < (u + k + 1) x B, and trained at
the update of n div B <= u + k.

A checkpoint holds no group in flight: the k rollouts before it admit fewer groups (`Admission.limit`), so that
the last one holds exactly its B due groups, plays them to their end and trains them, every update still
training B.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Admission:
    """One rank's admission of level groups. `started`: the groups admitted so far, which is also the number
    of the next one; `ended`: those an update has taken (trained, or filtered out)."""

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

    def limit(self, saves_in: int = 0) -> int:
        """The most groups in flight after the admission of a rollout that is `saves_in` rollouts from a
        checkpoint, this one counted (0: none within reach): (k + 1) x B, or `saves_in` x B when that is fewer,
        so that the rollout before the checkpoint holds exactly B groups, which all end and are all trained."""
        if saves_in > 0:
            return min(self.max_staleness + 1, saves_in) * self.groups_per_rank
        return self.in_flight_limit

    def admit(self, version: int, saves_in: int = 0) -> range:
        """The numbers of the groups to start now, before the update of `version`: as many as keep `limit` in
        flight. Numbers of iterations that played no rollout (`rollout.reuse_iterations`, k = 0) are
        skipped, as their levels are."""
        skipped = version * self.groups_per_rank - self.started
        if skipped > 0:
            self.started += skipped
            self.ended += skipped
        numbers = range(self.started, max(self.started, self.ended + self.limit(saves_in)))
        self.started = numbers.stop
        return numbers

    def end(self, groups: int) -> None:
        """`groups` of the admitted ones have been trained (or filtered out)."""
        assert 0 <= groups <= self.started - self.ended, f"{groups=} {self.started=} {self.ended=}"
        self.ended += groups

    def due(self, numbers) -> list[int]:
        """Of the untrained groups `numbers` (a rank's in flight), the ones the next update trains: the B first
        admitted."""
        return sorted(numbers)[: self.groups_per_rank]

    def level(self, number: int) -> tuple[int, int]:
        """(iteration, index) of group `number` in the synchronous run: its level and request seeds are those of
        the index-th group of this rank at that iteration."""
        return divmod(number, self.groups_per_rank)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the counts and the groups per rank they were counted in."""
        return {"started": self.started, "ended": self.ended, "groups_per_rank": self.groups_per_rank}

    def load_state_dict(self, state: dict) -> None:
        """The counts of a checkpoint of as many ranks. Groups that were in flight when it was saved (a save
        forced by failing steps, taken with episodes waiting) are not in it: their levels are skipped, never
        played twice, and the resumed run admits (k + 1) x B new groups, so it carries episodes as before."""
        self.started = self.ended = int(state["started"])

    def load_ranks(self, states: list[dict]) -> None:
        """The counts of a checkpoint of another number of ranks (`states`, one per rank): the next group plays
        the first iteration of the synchronous run's levels that no rank had started, numbered for this rank's
        share. Every rank has the levels of a whole iteration (of any number of ranks), so none is played twice.
        States without their groups per rank (saved before they were kept) give none back (`resume`)."""
        if not states or any("groups_per_rank" not in state for state in states):
            return
        reached = max(-(-int(state["started"]) // int(state["groups_per_rank"])) for state in states)
        self.started = self.ended = reached * self.groups_per_rank

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
