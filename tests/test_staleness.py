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
    admitted = []
    for version in range(3):
        admitted.append(list(admission.admit(version)))
        admission.end(3)
    assert admitted == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert admission.level(7) == (2, 1)
    # a reused batch (rollout.reuse_iterations=2) plays no rollout at version 1: its levels are skipped
    skipping = Admission(groups_per_rank=2)
    admitted = []
    for version in (0, 2, 4):
        admitted.append(list(skipping.admit(version)))
        skipping.end(2)
    assert admitted == [[0, 1], [4, 5], [8, 9]]


def test_admission_keeps_k_plus_one_shares_in_flight():
    admission = Admission(groups_per_rank=2, max_staleness=2)
    assert list(admission.admit(0)) == [0, 1, 2, 3, 4, 5]  # AReaL's (0 + 2 + 1) x 2
    assert list(admission.admit(0)) == []  # nothing more before an update
    admission.end(2)
    assert list(admission.admit(1)) == [6, 7]  # (1 + 2 + 1) x 2: each update trains 2 groups
    admission.end(2)
    assert list(admission.admit(2)) == [8, 9]
    assert admission.started - admission.ended == admission.in_flight_limit == 6
    with pytest.raises(AssertionError):
        admission.end(7)  # more than are in flight


def test_admission_winds_down_before_a_checkpoint():
    """k = 2, B = 2, a checkpoint after the update of version 4: the rollouts of versions 3 and 4 admit fewer groups,
    so that the one of version 4 holds exactly B, while each update trains B."""
    admission = Admission(groups_per_rank=2, max_staleness=2)
    assert [admission.limit(n) for n in (0, 1, 2, 3, 4)] == [6, 2, 4, 6, 6]
    admitted = []
    for version, saves_in in enumerate([0, 0, 0, 2, 1, 0]):
        admitted.append(len(admission.admit(version, saves_in)))
        if saves_in == 1:
            assert admission.started - admission.ended == 2  # all of them end and are trained: none is left
        admission.end(2)
    assert admitted == [6, 2, 2, 0, 0, 6]  # after the checkpoint the pipeline fills as at the start
    assert Admission(3).limit(1) == Admission(3).limit(0) == 3  # k = 0: every rollout holds B, as ever


def test_the_groups_due_at_an_update_are_the_first_admitted():
    admission = Admission(groups_per_rank=2, max_staleness=2)
    assert admission.due([9, 4, 7, 5, 6]) == [4, 5]  # the synchronous run's groups of iteration 2
    assert admission.due([8]) == [8]


def test_admission_counts_survive_a_checkpoint():
    admission = Admission(4, 2)
    admission.admit(0)
    admission.end(12)
    restored = Admission(4, 2)
    restored.load_state_dict(admission.state_dict())
    assert (restored.started, restored.ended) == (12, 12)
    restored.resume(3)  # counts restored: kept
    assert restored.started == 12


def test_a_checkpoint_saved_with_groups_in_flight_resumes_with_k_intact():
    """A save forced by failing steps, at k = 1 and B = 2, with 2 groups in flight: the resumed run skips their
    levels and admits (k + 1) x B new groups (before, it counted the 2 as in flight for ever: k = 0 silently)."""
    admission = Admission(2, 1)
    assert list(admission.admit(0)) == [0, 1, 2, 3]
    admission.end(2)
    saved = admission.state_dict()
    assert (saved["started"], saved["ended"]) == (4, 2)
    restored = Admission(2, 1)
    restored.load_state_dict(saved)
    restored.resume(1)
    assert list(restored.admit(1)) == [4, 5, 6, 7]
    restored.end(2)
    assert list(restored.admit(2)) == [8, 9]  # and keeps (k + 1) x B in flight


def test_admission_counts_carry_over_a_change_of_rank_count():
    """Saved on 2 ranks of 3 groups each (rank 1 had started 8: iteration 2's levels in part), resumed on 3 ranks of
    2 groups: the first iteration no rank had started is iteration 3, numbered for the new share; on one rank it
    is the same. States without their share (older checkpoints) give nothing back."""
    states = [{"started": 6, "ended": 6, "groups_per_rank": 3}, {"started": 8, "ended": 5, "groups_per_rank": 3}]
    admission = Admission(2, 1)
    admission.load_ranks(states)
    assert (admission.started, admission.ended) == (6, 6) and admission.level(6) == (3, 0)
    drained = Admission(6, 1)
    drained.load_ranks([{"started": 6, "ended": 6, "groups_per_rank": 3}] * 2)
    assert (drained.started, drained.ended) == (12, 12)
    old = Admission(2, 1)
    old.load_ranks([{"started": 6, "ended": 6}] * 2)
    assert (old.started, old.ended) == (0, 0)
    old = Admission(4, 0)
    old.resume(3)  # a checkpoint without counts, of a synchronous run: iteration 3's groups come next
    assert (old.started, old.ended) == (12, 12) and list(old.admit(3)) == [12, 13, 14, 15]


@pytest.mark.parametrize("bad", [dict(groups_per_rank=0), dict(groups_per_rank=2, max_staleness=-1)])
def test_admission_refuses_nonsense(bad):
    with pytest.raises(ValueError, match="at least one group per rank"):
        Admission(**bad)


def test_token_staleness_is_token_weighted():
    # turns of 10 tokens at version 3 and 30 tokens at version 1, trained at version 4: (1*10 + 3*30) / 40
    total, tokens, oldest = token_staleness([(10, 3), (30, 1), (0, 0)], 4)
    assert (total, tokens, oldest) == (100.0, 40.0, 3.0)


class Steps:
    """An environment whose episode on level `seed` lasts `1 + seed % longest` turns (scripted lengths)."""

    def __init__(self, longest: int = 3):
        self.longest = longest

    def reset(self, seed):
        self.left = 1 + seed % self.longest
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


def _config(groups=4, group_size=2, turns=3):
    return load_config("sokoban_text", [f"rollout.env_groups={groups}", f"rollout.group_size={group_size}",
                                        f"rollout.max_turns={turns}", "rollout.max_new_tokens=8", "train.seed=3",
                                        f"train.mini_batch_size={groups * group_size}"])


def _saves_in(version: int, saves: set[int], k: int) -> int:
    """`vagen.train.rollouts_to_save` for checkpoints after the updates of `saves`."""
    return next((ahead + 1 for ahead in range(k + 1) if version + ahead in saves), 0)


def _rollouts(tiny_text, k, groups=4, group_size=2, rank=0, world_size=1, turns=3):
    cfg = _config(groups, group_size, turns)
    cfg.rollout.max_staleness = k  # a config check refuses the hf backend at k > 0; the decoder here is scripted
    encoder = ChatEncoder(tiny_text[2])
    envs = [Steps(turns) for _ in range(groups // world_size * group_size * (k + 1))]
    return Rollouts(encoder, cfg, envs, rank, world_size), encoder


@pytest.mark.parametrize("k", [1, 2, 3])
def test_carried_rollouts_train_no_turn_older_than_k_and_lose_no_group(tiny_text, k):
    source, encoder = _rollouts(tiny_text, k, turns=8)  # episodes of 1 to 8 turns
    decoder, trained, carried, spanning, versions, waited = Answers(encoder), [], 0, 0, 8, 0
    for version in range(versions):
        episodes, stats = source.play(decoder, version, saves_in=_saves_in(version, {versions - 1}, k))
        assert len(episodes) == 4 * 2  # exactly the share of groups, at every k
        numbers = sorted({ep.admission for ep in episodes})
        assert [ep.group_id for ep in episodes] == [g for g in range(len(numbers)) for _ in range(2)]
        for ep in episodes:
            assert ep.done
            assert all(version - k <= t.version <= version for t in ep.turns), [t.version for t in ep.turns]
            # the group's level is the one its number gives in the synchronous run: that of this iteration
            iteration, index = divmod(ep.admission, 4)
            assert iteration == version and ep.seed == train_seeds(iteration, 4, 3)[index]
        # groups that ended beyond the share wait, ended, for the next update
        waited += sum(source.game.group_ended(number) for number in source.game.groups)
        trained += numbers
        carried += stats["rollout/carried_episodes"]
        spanning += sum(len({t.version for t in ep.turns}) > 1 for ep in episodes)
        in_flight = set(source.game.groups)
        # trained and in flight are every admitted group, none twice
        assert len(trained) == len(set(trained)) and not set(trained) & in_flight
        assert set(trained) | in_flight == set(range(source.admission.started))
        assert source.admission.started - source.admission.ended == len(in_flight) <= 4 * (k + 1)
        assert stats["rollout/carried_episodes"] == len(source.game.waiting)
    assert carried > 0  # episodes did go on after an update
    assert waited > 0  # and ended groups waited for the next one
    assert not source.game.groups and not source.game.waiting  # the last rollout drained every group
    assert spanning > 0  # some trained episodes have turns of several versions


def test_every_update_trains_the_configured_groups_and_takes_the_same_optimizer_steps_at_every_k(tiny_text):
    """Episodes of 1 to 8 turns, 4 groups of 2 per update, mini-batches of 4 trajectories: at k = 0, 1 and 2 every
    update filters and trains 4 groups (`rollout/filter_total_groups`) in 2 optimizer steps an epoch (a k = 1
    update used to train every group that had ended: up to 8, in up to 4 steps), while episodes are carried at
    k > 0."""
    from types import SimpleNamespace

    from vagen.batch_plan import plan_epoch
    from vagen.train import kept_samples

    _, model, _ = tiny_text
    steps, carried = {}, {}
    for k in (0, 1, 2):
        source, encoder = _rollouts(tiny_text, k, turns=8)
        cfg = source.cfg
        cfg.train.mini_batch_size = 4
        models = SimpleNamespace(encoder=encoder, actor=SimpleNamespace(module=model))
        decoder, steps[k], carried[k] = Answers(encoder), [], 0.0
        for version in range(6):
            episodes, stats = source.play(decoder, version, saves_in=_saves_in(version, {5}, k))
            carried[k] += stats["rollout/carried_episodes"]
            samples, filtered, _ = kept_samples(cfg, SimpleNamespace(rank=0, world_size=1), models,
                                                [ep for ep in episodes if ep.turns])
            assert filtered["rollout/filter_total_groups"] == cfg.rollout.env_groups == 4
            for sample in samples:
                sample.extra["adv_mask"] = sample.sampled_mask
            steps[k].append(cfg.train.ppo_epochs * len(plan_epoch(samples, cfg, 1, None, shuffle=False)))
    assert steps[1] == steps[2] == steps[0] == [2 * source.cfg.train.ppo_epochs] * 6
    assert carried[0] == 0 and carried[1] > 0 and carried[2] > 0


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


def test_decoupled_ppo_on_a_hand_checked_case():
    """Proximal (old) log-probs from the policy at the update, behaviour ones from the sampler, weights
    min(p_prox / p_behav, C) with C = 2 (or 0 above C: mask), the PPO ratio against the proximal policy."""
    import math
    from types import SimpleNamespace

    import torch

    from vagen import core
    from vagen.update import rollout_correction

    log = math.log
    proximal = torch.tensor([[log(0.5), log(0.4), log(0.3)]])
    behaviour = torch.tensor([[log(0.2), log(0.5), log(0.3)]])  # weights 2.5 -> 2 (clamped), 0.8, 1
    current = torch.tensor([[log(0.6), log(0.2), log(0.3)]])  # ratios 1.2, 0.5, 1
    advantages = torch.tensor([[1.0, -1.0, 0.5]])
    mask = torch.ones(1, 3)
    sample = SimpleNamespace(length=3, extra={})
    algo = load_config("sokoban_text", ["rollout.backend=vllm", "algo.rollout_correction=tis"]).algo
    metrics = rollout_correction([sample], {"sampled_mask": mask, "old_logprobs": proximal,
                                            "rollout_logprobs": behaviour}, algo)
    weights = sample.extra["tis_weights"][None]  # the sample's own [L], as a batch of one
    assert torch.allclose(weights, torch.tensor([[2.0, 0.8, 1.0]]))
    assert metrics["actor/tis_clamped_fraction"] == pytest.approx(1 / 3)
    assert metrics["actor/tis_weight_mean"] == pytest.approx(3.8 / 3)
    loss, _ = core.ppo_policy_loss(current, proximal, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0,
                                   weights=weights)
    # token 1: max(-1.2, -clip(1.2) = -1.2) x 2 = -2.4; token 2 (A < 0): max(0.5, 0.8) = 0.8, under the dual clip 3,
    # x 0.8 = 0.64; token 3: -0.5 x 1; token-mean
    assert float(loss) == pytest.approx((-2.4 + 0.64 - 0.5) / 3, abs=1e-6)
    # algo.rollout_correction_mode=mask (AReaL's behav_imp_weight_cap): the weight above the cap becomes 0, the
    # token leaves the loss, and the denominator still counts it
    algo.rollout_correction_mode = "mask"
    masked = SimpleNamespace(length=3, extra={})
    metrics = rollout_correction([masked], {"sampled_mask": mask, "old_logprobs": proximal,
                                            "rollout_logprobs": behaviour}, algo)
    assert torch.allclose(masked.extra["tis_weights"], torch.tensor([0.0, 0.8, 1.0]))
    assert metrics["actor/tis_clamped_fraction"] == pytest.approx(1 / 3)
    loss, _ = core.ppo_policy_loss(current, proximal, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=3.0,
                                   weights=masked.extra["tis_weights"][None])
    assert float(loss) == pytest.approx((0.0 + 0.64 - 0.5) / 3, abs=1e-6)


class OwnLogprobs:
    """A decoder that samples with the trained model (transformers) and reports, as its log-probabilities, the
    trainer's own (`vagen.update.token_logprobs` over the episode with the new turn, as the update reads it)."""

    def __init__(self, model, encoder, temperature):
        from vagen.decoding_hf import HFDecoder

        self.model, self.encoder, self.temperature = model, encoder, temperature
        self.hf = HFDecoder(model, encoder, keep_cache=False)

    def start_rollout(self):
        self.hf.start_rollout()

    def any_rank(self, flag):
        return flag

    def generate(self, episodes, rows, sampling):
        import torch

        from vagen.update import token_logprobs

        out = self.hf.generate(episodes, rows, sampling)
        for episode, new in zip(episodes, out):
            ids, _ = self.encoder.finish_response(new.ids)
            start, sequence = len(episode.input_ids), episode.input_ids + ids
            loss_mask = torch.zeros(1, len(sequence))
            loss_mask[0, start:] = 1
            batch = {"input_ids": torch.tensor([sequence]), "attention_mask": torch.ones(1, len(sequence), dtype=torch.long),
                     "position_ids": torch.arange(len(sequence))[None], "loss_mask": loss_mask}
            with torch.no_grad():
                logprobs, _ = token_logprobs(self.model, batch, self.temperature, with_entropy=False,
                                             suppress_ids=self.encoder.suppress_ids)
            new.logprobs = logprobs[0, start:].tolist()
        return out


def test_weights_are_exactly_one_when_the_sampler_computes_the_trainers_logprobs(tiny_text):
    """k = 0: the proximal policy is the behaviour policy, so with a sampler whose log-probabilities are the
    trainer's own, decoupled PPO's weights are 1 exactly, not approximately. One turn per episode and one
    sequence per forward: the update then reads each sequence exactly as the sampler did (a later turn
    lengthens it, which changes the rounding of the earlier turns' log-probabilities in the last bit)."""
    import torch

    from vagen.trajectory import episode_samples
    from vagen.update import annotate, compute_advantages

    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    cfg = load_config("sokoban_text", ["rollout.max_turns=1", "rollout.max_new_tokens=12", "train.micro_batch_size=1",
                                       "algo.adv_estimator=grpo", "rollout.backend=vllm", "algo.rollout_correction=tis"])
    model.eval()
    torch.manual_seed(0)
    decoder = OwnLogprobs(model, encoder, cfg.rollout.temperature)
    episodes, _ = rollout(model, encoder, cfg, [5, 6], 2, decoder=decoder)
    samples = [s for i, ep in enumerate(episodes) for s in episode_samples(ep, encoder, model, i)]
    annotate(samples, model, None, None, cfg, encoder.pad_id, torch.device("cpu"), suppress_ids=encoder.suppress_ids)
    metrics = compute_advantages(samples, cfg)
    sampled = torch.cat([s.sampled_mask for s in samples]) > 0
    weights = torch.cat([s.extra["tis_weights"] for s in samples])[sampled]
    assert weights.numel() > 8 and bool((weights == 1.0).all()), weights
    assert metrics["rollout/inference_logprob_gap_max"] == 0.0 and metrics["actor/tis_clamped_fraction"] == 0.0


def test_a_run_resumed_after_a_drained_checkpoint_plays_what_the_uninterrupted_one_did(tiny_text):
    """k = 2: the rollout before a checkpoint ends every group it started, so the checkpoint holds no carried
    episode, and a run resumed from it (a new `Rollouts` at the next iteration) plays what the uninterrupted
    run played, group for group."""
    saved_after = 2  # train.save_every=3, train.iterations=9: the checkpoints after the updates of 2 and 8

    def played(source, versions):
        decoder, out = Answers(source.game.encoder), []
        for version in versions:
            episodes, stats = source.play(decoder, version, saves_in=_saves_in(version, {saved_after, 8}, 2))
            out.append([(ep.admission, ep.seed, [t.version for t in ep.turns], ep.input_ids) for ep in episodes])
            if version == saved_after:
                assert not source.game.groups and stats["rollout/carried_episodes"] == 0
        return out

    source = _rollouts(tiny_text, 2, turns=8)[0]
    uninterrupted = played(source, range(3))
    saved = source.admission.state_dict()  # what the checkpoint keeps (trainer_state.json)
    uninterrupted += played(source, range(3, 9))
    cfg = _config(turns=8)
    cfg.rollout.max_staleness = 2
    admission = Admission(4, 2)
    admission.load_state_dict(saved)
    resumed = played(Rollouts(ChatEncoder(tiny_text[2]), cfg, [Steps(8) for _ in range(4 * 2 * 3)],
                              start=saved_after + 1, admission=admission), range(3, 9))
    assert resumed == uninterrupted[3:]
    # episodes were carried after the resumption too: some trained ones span versions
    assert any(len(set(versions)) > 1 for part in resumed for _, _, versions, _ in part)


@pytest.mark.parametrize("overrides, says", [
    (["rollout.max_staleness=-1"], "must be >= 0"),
    (["rollout.max_staleness=1"], "rollout.backend=hf cannot.*set rollout.backend=vllm, or rollout.max_staleness=0"),
    (["rollout.max_staleness=1", "rollout.backend=vllm"], "decoupled PPO.*set algo.rollout_correction=tis"),
    (["rollout.max_staleness=2", "rollout.backend=vllm", "algo.rollout_correction=tis", "rollout.reuse_iterations=2"],
     "could be 3 updates old"),
])
def test_staleness_the_run_cannot_honour_is_refused_at_config_time(overrides, says):
    from vagen.config import ConfigError

    with pytest.raises(ConfigError, match=says):
        load_config("sokoban_visual", overrides)
    assert load_config("sokoban_visual", ["rollout.max_staleness=1", "rollout.backend=vllm",
                                          "algo.rollout_correction=tis"]).rollout.max_staleness == 1


def test_carried_turns_keep_the_logprobs_of_the_version_that_sampled_them(tiny_text):
    """k = 1 with a sampler whose log-probabilities are the trainer's own: after each update (here a perturbation
    of the weights), every trained turn's behaviour log-probs equal a recomputation under a kept snapshot of the
    version the turn records, including the turns of episodes carried over an update."""
    import copy

    import torch

    from vagen.update import token_logprobs

    _, base, tokenizer = tiny_text
    model, probe = copy.deepcopy(base).eval(), copy.deepcopy(base).eval()
    encoder = ChatEncoder(tokenizer)
    cfg = _config(groups=2)
    cfg.rollout.max_staleness = 1
    source = Rollouts(encoder, cfg, [Steps() for _ in range(2 * 2 * 2)])
    decoder = OwnLogprobs(model, encoder, cfg.rollout.temperature)
    snapshots, older, generator = {}, 0, torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for version in range(3):
        snapshots[version] = copy.deepcopy(model.state_dict())
        episodes, _ = source.play(decoder, version, saves_in=_saves_in(version, {2}, 1))
        for ep in episodes:
            for turn in ep.turns:
                probe.load_state_dict(snapshots[turn.version])
                start, end = turn.span
                loss_mask = torch.zeros(1, end)
                loss_mask[0, start:] = 1
                batch = {"input_ids": torch.tensor([ep.input_ids[:end]]),
                         "attention_mask": torch.ones(1, end, dtype=torch.long),
                         "position_ids": torch.arange(end)[None], "loss_mask": loss_mask}
                with torch.no_grad():
                    again, _ = token_logprobs(probe, batch, cfg.rollout.temperature, with_entropy=False,
                                              suppress_ids=encoder.suppress_ids)
                assert again[0, start : start + len(turn.sampled_logprobs)].tolist() == turn.sampled_logprobs
                older += turn.version < version
        with torch.no_grad():  # an update: every weight moves
            for param in model.parameters():
                param.add_(0.02 * torch.randn(param.shape, generator=generator))
    assert older > 0  # turns of carried episodes were checked against their own, older version


def test_proximal_logprobs_are_annotated_without_dropout(tiny_text):
    """`vagen.train.prepare` annotates in eval mode: with model.lora_dropout=0.5 (adapters with non-zero weights),
    two annotations of the same samples give the same proximal log-probs, those of the model in eval mode (in train
    mode they differed by up to 1.2 nats, noise that entered every decoupled-PPO weight), and the update that
    follows runs in train mode."""
    import copy
    from types import SimpleNamespace

    import torch

    import vagen.train as train
    from vagen.models.adapters import add_adapters
    from vagen.trajectory import collate, episode_samples
    from vagen.update import token_logprobs

    cfg = _config(groups=2)
    cfg.model.lora_rank, cfg.model.lora_dropout, cfg.algo.adv_estimator = 4, 0.5, "grpo"
    model = add_adapters(copy.deepcopy(tiny_text[1]), cfg.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # zero at creation: the adapters would add nothing, dropout or not
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    encoder = ChatEncoder(tiny_text[2])
    episodes, _ = rollout(None, encoder, cfg, [5, 6], 2, envs=[Steps() for _ in range(4)], decoder=Answers(encoder))

    class Engine:  # what prepare reads of a DeepSpeed engine: the module, and a forward
        def __init__(self, module):
            self.module = module

        def __call__(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    models = SimpleNamespace(actor=Engine(model), critic=None, reference=None, encoder=encoder)
    dist = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
    annotated = []
    for _ in range(2):
        model.train()  # as the previous update left it
        samples = [s for i, ep in enumerate(episodes) for s in episode_samples(ep, encoder, model, i)]
        train.prepare(samples, cfg, dist, models)
        annotated.append(torch.cat([s.extra["old_logprobs"] for s in samples]))
    assert torch.equal(annotated[0], annotated[1])
    sample = samples[0]
    batch = collate([sample], encoder.pad_id)
    with torch.no_grad():
        expected, _ = token_logprobs(model.eval(), batch, cfg.rollout.temperature, with_entropy=False,
                                     suppress_ids=encoder.suppress_ids)
    assert torch.allclose(expected[0], sample.extra["old_logprobs"], atol=1e-5)
    train.set_mode(models, training=True)
    assert model.training
