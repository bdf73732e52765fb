"""rollout.max_staleness = k: admission in order (`vagen.staleness.Admission`), and rollouts that carry unfinished
episodes over updates (`vagen.rollout.Rollouts`), played by a scripted decoder against environments whose episode
lengths are scripted by their level seed."""

import pytest

from envs_visual.base import Observation
from vagen.config import load_config
from vagen.decoding import Generated
from vagen.episode import ChatEncoder, train_seeds
from vagen.rollout import Rollouts, rollout
from vagen.staleness import Admission, token_staleness


def test_admission_at_k0_admits_each_iterations_share_in_order():
    admission = Admission(groups_per_rank=3)
    assert [list(admission.admit(v)) for v in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert admission.level(7) == (2, 1)
    # a reused batch (rollout.reuse_iterations=2) plays no rollout at version 1: its levels are skipped
    skipping = Admission(groups_per_rank=2)
    assert [list(skipping.admit(v)) for v in (0, 2, 4)] == [[0, 1], [4, 5], [8, 9]]


def test_admission_bound_is_arealS_rule():
    admission = Admission(groups_per_rank=2, max_staleness=2)
    assert admission.bound(0) == 6 and list(admission.admit(0)) == [0, 1, 2, 3, 4, 5]
    assert list(admission.admit(0)) == []  # nothing more before an update
    assert list(admission.admit(1)) == [6, 7]
    assert admission.started == 8


def test_a_group_is_finished_before_it_would_be_more_than_k_updates_old():
    admission = Admission(groups_per_rank=1, max_staleness=2)
    # carried over the update of version 5, a group is trained at version 6 at the earliest
    assert not admission.must_finish(4, 5)  # 6 - 4 = 2: may wait
    assert admission.must_finish(3, 5)  # 6 - 3 = 3 > 2
    assert not admission.must_finish(None, 5)  # no turn yet: its first is sampled by a later version
    assert Admission(groups_per_rank=1).must_finish(5, 5)  # k = 0: every started group ends


def test_resumed_admission_continues_the_numbering():
    assert Admission(4, 2).resumed(0) == 0
    assert Admission(4, 2).resumed(3) == 20  # the drained rollout of version 2 admitted up to (2 + 2 + 1) x 4
    assert Admission(4, 0).resumed(3) == 12


@pytest.mark.parametrize("bad", [dict(groups_per_rank=0), dict(groups_per_rank=2, max_staleness=-1)])
def test_admission_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="at least one group per rank"):
        Admission(**bad)


def test_token_staleness_is_token_weighted():
    # turns of 10 tokens at version 3 and 30 tokens at version 1, trained at version 4: (1*10 + 3*30) / 40
    total, tokens, oldest = token_staleness([(10, 3), (30, 1), (0, 0)], 4)
    assert (total, tokens, oldest) == (100.0, 40.0, 3.0)


class Steps:
    """An environment whose episode on level `seed` lasts `1 + seed % 3` turns (scripted lengths)."""

    def reset(self, seed):
        self.left = 1 + seed % 3
        return Observation(f"level {seed}, {self.left} to go"), {}

    def step(self, text):
        self.left -= 1
        return Observation(f"{self.left} to go"), 1.0, self.left == 0, False, {"format_ok": True}

    def system_prompt(self):
        return "answer"


class Answers:
    """A decoder that answers every turn with the same few tokens; what it was asked is recorded (row, turn)."""

    def __init__(self, encoder):
        self.ids, self.asked = encoder.encode_text("<answer>Up</answer>") + [encoder.im_end_id], []

    def start_rollout(self):
        pass

    def any_rank(self, flag):
        return flag

    def generate(self, episodes, rows, sampling):
        self.asked += [(row, len(ep.turns), sampling.seed) for row, ep in zip(rows, episodes)]
        return [Generated(list(self.ids)) for _ in episodes]


def _config(groups=4, group_size=2):
    return load_config("sokoban_text", [f"rollout.env_groups={groups}", f"rollout.group_size={group_size}",
                                        "rollout.max_turns=3", "rollout.max_new_tokens=8", "train.seed=3"])


def _rollouts(tiny_text, k, groups=4, group_size=2, rank=0, world_size=1):
    cfg = _config(groups, group_size)
    cfg.rollout.max_staleness = k  # a config check refuses the hf backend at k > 0; the decoder here is scripted
    encoder = ChatEncoder(tiny_text[2])
    envs = [Steps() for _ in range(groups // world_size * group_size * (k + 1))]
    return Rollouts(encoder, cfg, envs, rank, world_size), encoder


@pytest.mark.parametrize("k", [1, 2, 3])
def test_carried_rollouts_train_no_turn_older_than_k_and_lose_no_group(tiny_text, k):
    source, encoder = _rollouts(tiny_text, k)
    decoder, trained, carried, spanning, versions = Answers(encoder), [], 0, 0, 8
    for version in range(versions):
        episodes, stats = source.play(decoder, version, drain=version == versions - 1)
        assert episodes and len(episodes) % 2 == 0
        numbers = sorted({ep.admission for ep in episodes})
        assert [ep.group_id for ep in episodes] == [g for g in range(len(numbers)) for _ in range(2)]
        for ep in episodes:
            assert ep.done
            assert all(version - k <= t.version <= version for t in ep.turns), [t.version for t in ep.turns]
            # the group's level is the one its number gives in the synchronous run
            iteration, index = divmod(ep.admission, 4)
            assert ep.seed == train_seeds(iteration, 4, 3)[index]
        assert len(numbers) >= 4  # the rollout ended once 4 groups had ended, or later
        trained += numbers
        carried += stats["rollout/carried_episodes"]
        spanning += sum(len({t.version for t in ep.turns}) > 1 for ep in episodes)
        in_flight = set(source.game.groups)
        # trained and in flight are every admitted group, none twice
        assert len(trained) == len(set(trained)) and not set(trained) & in_flight
        assert set(trained) | in_flight == set(range(source.admission.started))
        assert source.admission.started <= source.admission.bound(version)
        assert stats["rollout/carried_episodes"] == len(source.game.waiting)
    assert carried > 0  # episodes did go on after an update
    assert not source.game.groups and not source.game.waiting  # the last rollout drained every group
    assert spanning > 0  # some trained episodes have turns of several versions


def test_k0_rollouts_play_the_synchronous_runs_groups_in_its_order(tiny_text):
    source, encoder = _rollouts(tiny_text, 0, groups=4, group_size=2, rank=1, world_size=2)
    cfg, decoder = source.cfg, Answers(encoder)
    for version in range(3):
        start = len(decoder.asked)
        episodes, stats = source.play(decoder, version)
        asked = decoder.asked[start:]
        assert stats["rollout/carried_episodes"] == 0
        # rank 1 of 2: the second half of the iteration's levels, the iteration's request seeds
        seeds = train_seeds(version, 4, 3)[2:4]
        today, _ = rollout(None, encoder, cfg, seeds, 2, envs=[Steps() for _ in range(4)], decoder=decoder,
                           sample_seed=(3 * 1_000_003 + version) * 1_009 + 1)
        assert decoder.asked[start + len(asked):] == asked  # the same requests (rows, turns, seeds), in order
        assert [(ep.seed, ep.group_id, ep.input_ids) for ep in episodes] == [
            (ep.seed, ep.group_id, ep.input_ids) for ep in today]
        assert {t.version for ep in episodes for t in ep.turns} == {version}
