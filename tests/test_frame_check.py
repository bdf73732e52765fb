"""The frame check (vagen.frame_check): the gap per turn from known log-probs, the swap between level groups,
configs that show no frames, and the check on a real tiny model's episodes."""

import dataclasses
import math

import pytest
import torch

from vagen.config import ConfigError, load_config
from vagen.frame_check import (
    check_every,
    eval_frame_gap,
    frame_gaps,
    gap_metrics,
    gap_sums,
    swap_donors,
    swapped_logprobs,
    swapped_samples,
    turn_sums,
)


def test_turn_sums_add_each_turns_masked_log_probs():
    logprobs = torch.tensor([0.0, -1.0, -2.0, 0.0, -0.5, -0.25, -4.0])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 0])  # position 6 lies after the last turn's end
    ends = torch.tensor([0, 0, 1, 0, 0, 1, 0])
    assert turn_sums(logprobs, mask, ends).tolist() == [-3.0, -0.75]


def test_the_gap_and_its_positive_share_by_hand():
    # two trajectories of the task "a" (2 and 1 turns) and one of "b" (1 turn)
    own = [torch.tensor([-3.0, -1.0]), torch.tensor([-2.0]), torch.tensor([-5.0])]
    swapped = [torch.tensor([-7.0, -0.5]), torch.tensor([-2.0]), torch.tensor([-6.5])]
    sums = gap_sums(own, swapped, ["a", "a", "b"])
    # gaps: a: 4, -0.5, 0 (not positive); b: 1.5
    assert sums == {"a": [3.5, 1.0, 3.0], "b": [1.5, 1.0, 1.0]}
    metrics = gap_metrics(sums)
    assert metrics["rollout/frame_gap"] == pytest.approx(5.0 / 4)
    assert metrics["rollout/frame_gap_positive"] == pytest.approx(2 / 4)
    assert metrics["rollout/frame_gap_turns"] == 4.0
    assert metrics["rollout/a/frame_gap"] == pytest.approx(3.5 / 3)
    assert metrics["rollout/a/frame_gap_positive"] == pytest.approx(1 / 3)
    assert metrics["rollout/b/frame_gap"] == pytest.approx(1.5)
    # one unnamed task: no per-task keys; nothing scored: no keys at all
    assert sorted(gap_metrics({"": [2.0, 1.0, 2.0]}, prefix="")) == ["frame_gap", "frame_gap_positive",
                                                                       "frame_gap_turns"]
    assert gap_metrics({}) == {} and gap_metrics({"a": [0.0, 0.0, 0.0]}) == {}


GRID = (1, 4, 4)


def test_the_swap_gives_every_sample_another_groups_frames_deterministically():
    group_ids = [0, 0, 1, 1, 1, 2, 2, 3]
    tasks = [""] * 8
    grids = [[GRID] * (1 + i % 3) for i in range(8)]
    donors = swap_donors(group_ids, tasks, grids, seed=7)
    assert all(d is not None for d in donors)
    assert all(group_ids[d] != group_ids[i] for i, d in enumerate(donors))  # a derangement between groups
    # each group takes all its frames from one other group, and the groups form one cycle
    giver = {g: {group_ids[donors[i]] for i in range(8) if group_ids[i] == g} for g in set(group_ids)}
    assert all(len(v) == 1 for v in giver.values())
    g, seen = 0, []
    for _ in range(4):
        seen.append(g)
        g = next(iter(giver[g]))
    assert sorted(seen) == [0, 1, 2, 3] and g == 0
    assert swap_donors(group_ids, tasks, grids, seed=7) == donors
    assert len({tuple(swap_donors(group_ids, tasks, grids, seed=s)) for s in range(10)}) > 1


def test_unswappable_samples_are_not_scored():
    # task "b" has one group; sample 3 has frames of another size than its donor's; sample 4 has none
    group_ids = [0, 1, 2, 1, 3]
    tasks = ["a", "a", "b", "a", "a"]
    grids = [[GRID], [GRID], [GRID], [(1, 8, 8)], None]
    donors = swap_donors(group_ids, tasks, grids, seed=0)
    assert donors[2] is None and donors[3] is None and donors[4] is None
    assert donors[0] == 1 and donors[1] == 0


def _sample(group_id: int, frames: list[float]):
    from vagen.trajectory import Sample

    n = len(frames)
    zeros = torch.zeros(4)
    pixels = torch.cat([torch.full((16, 3), value) for value in frames])
    return Sample(torch.arange(4), torch.arange(4), zeros, zeros, zeros, zeros, zeros, pixels,
                  torch.tensor([GRID] * n), group_id, 0.0, group_id)


def test_swapped_samples_take_the_donors_frames_in_turn():
    samples = [_sample(0, [1.0, 2.0, 3.0]), _sample(1, [7.0, 8.0])]
    out = swapped_samples(samples, [1, 0])
    # frame k of a sample is its donor's frame k mod the donor's count
    assert [float(f[0, 0]) for f in out[0].pixel_values.split(16)] == [7.0, 8.0, 7.0]
    assert [float(f[0, 0]) for f in out[1].pixel_values.split(16)] == [1.0, 2.0]
    assert torch.equal(out[0].input_ids, samples[0].input_ids) and out[0].group_id == 0
    assert torch.equal(samples[0].pixel_values[:16], torch.ones(16, 3))  # the originals are left as they were


def test_text_configs_run_no_check_and_refuse_one():
    assert check_every(load_config("sokoban_text")) == 0
    assert check_every(load_config("sokoban_visual")) == 1
    assert check_every(load_config("sokoban_visual", ["log.frame_check_every=3"])) == 3
    assert check_every(load_config("sokoban_visual", ["log.frame_check_every=0"])) == 0
    with pytest.raises(ConfigError, match="env.render_mode=text shows none; set log.frame_check_every=0"):
        load_config("sokoban_text", ["log.frame_check_every=2"])
    with pytest.raises(ConfigError, match="log.frame_check_every=-2 must be -1"):
        load_config("sokoban_visual", ["log.frame_check_every=-2"])


@pytest.fixture(scope="module")
def played(tiny_vl):
    from vagen.episode import ChatEncoder
    from vagen.rollout import rollout
    from vagen.trajectory import episode_samples

    _, model, processor = tiny_vl
    cfg = load_config("sokoban_visual", ["rollout.max_turns=2", "rollout.max_new_tokens=6"])
    encoder = ChatEncoder(processor)
    episodes, _ = rollout(model, encoder, cfg, [11, 12, 13], group_size=2, sample_seed=3)
    samples = [s for k, ep in enumerate(episodes) for s in episode_samples(ep, encoder, model, k)]
    return model, encoder, cfg, episodes, samples


def _own(model, encoder, samples):
    return swapped_logprobs(model, samples, samples, 0.7, encoder.pad_id, "cpu", 2, encoder.suppress_ids)


def test_frames_that_are_the_same_in_every_group_give_no_gap(played):
    model, encoder, _, _, samples = played
    first = samples[0].pixel_values.split(int(samples[0].image_grid_thw[0].prod()))[0]
    same = [dataclasses.replace(s, pixel_values=first.repeat(len(s.image_grid_thw), 1)) for s in samples]
    sums = frame_gaps(model, same, _own(model, encoder, same), 0, 0.7, encoder.pad_id, "cpu", 2, encoder.suppress_ids)
    turns = sum(int(s.turn_end_mask.sum()) for s in same)
    assert sums == {"": [0.0, 0.0, float(turns)]}


def test_the_check_scores_every_turn_of_a_real_models_episodes(played):
    model, encoder, cfg, episodes, samples = played
    sums = frame_gaps(model, samples, _own(model, encoder, samples), 0, 0.7, encoder.pad_id, "cpu", 2,
                      encoder.suppress_ids)
    turns = sum(len(ep.turns) for ep in episodes)
    gap, positive, scored = sums[""]
    assert scored == turns and math.isfinite(gap) and gap != 0.0 and 0 <= positive <= turns
    # evaluation: each episode its own group, both sides scored there
    metrics = eval_frame_gap(model, encoder, cfg, episodes)
    assert metrics["frame_gap_turns"] == turns and math.isfinite(metrics["frame_gap"])
    assert 0.0 <= metrics["frame_gap_positive"] <= 1.0


def test_decoy_frames_show_another_levels_frames_beside_the_played_levels_text():
    import envs_visual
    from vagen.frame_check import DecoyFrames, decoy_seeds

    assert decoy_seeds([5, 6, 7]) == {5: 6, 6: 7, 7: 5} and decoy_seeds([9]) == {9: 10}
    params = load_config("frozenlake_visual").env.params
    wrapped = DecoyFrames(envs_visual.make("frozenlake", **params), envs_visual.make("frozenlake", **params), 22)
    own, decoy = envs_visual.make("frozenlake", **params), envs_visual.make("frozenlake", **params)
    shown, _ = wrapped.reset(seed=21)
    obs, _ = own.reset(seed=21)
    other, _ = decoy.reset(seed=22)
    assert shown.text == obs.text and len(shown.images) == 1
    assert shown.images[0].tobytes() == other.images[0].tobytes() != obs.images[0].tobytes()
    response = "<think>go</think><answer>Right</answer>"
    shown, reward, *_ = wrapped.step(response)
    obs, expected, *_ = own.step(response)
    other, *_ = decoy.step(response)
    assert shown.text == obs.text and reward == expected  # the played level's text and reward
    assert shown.images[0].tobytes() == other.images[0].tobytes()  # the decoy level after the same move
    assert wrapped.system_prompt() == own.system_prompt()


def test_decoy_frames_of_a_text_config_are_refused(capsys):
    from vagen.eval import main

    assert main(["--config", "sokoban_text", "--checkpoint", "assets:sokoban_text", "--decoy-frames"]) == 2
    assert "--decoy-frames swaps the frames of a visual environment" in capsys.readouterr().err


@pytest.mark.slow  # two ranks under the DeepSpeed launcher: about 45 CPU-seconds, minutes on a loaded machine
def test_the_check_under_zero3_on_two_ranks_is_the_whole_models(tmp_path, model_cache):
    """tests/frame_check_worker.py: rank 0 scores three level groups, rank 1 none; under ZeRO-3 both run the same
    forward passes, and the metrics are those of the whole model on each rank, added over the ranks."""
    from pathlib import Path

    from test_zero3 import _launch

    _launch(2, tmp_path, model_cache, Path(__file__).parent / "frame_check_worker.py", timeout=300)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    assert ranks[1]["whole"] == {} and ranks[0]["whole"][""][2] == 12  # 6 episodes of 2 turns
    assert ranks[0]["forwards"] == ranks[1]["forwards"] > 0, [r["forwards"] for r in ranks]
    expected = gap_metrics(ranks[0]["whole"])
    for rank in ranks:
        metrics = {k: v for k, v in rank["metrics"].items() if not k.startswith("timing/")}
        assert metrics.keys() == expected.keys()
        for key, value in expected.items():
            assert metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key


@pytest.mark.parametrize("name", ["builtin:tiny-qwen3-vl", "builtin:tiny-qwen3.5"])
def test_the_check_scores_the_frames_of_each_model_family(name, model_cache):
    """Qwen3-VL and Qwen3.5 lay out their frames' patches as Qwen2.5-VL does (one row per patch, image_grid_thw per
    frame): frames swapped between two groups change the log-probs, the same frames in both change nothing."""
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy, resolve_model_path
    from vagen.rollout import rollout
    from vagen.trajectory import episode_samples

    model, processor = load_policy(resolve_model_path(name, model_cache, seed=0))
    encoder = ChatEncoder(processor)
    cfg = load_config("sokoban_visual", [f"model.path={name}", "rollout.max_turns=2", "rollout.max_new_tokens=4"])
    episodes, _ = rollout(model, encoder, cfg, [11, 12], group_size=1, sample_seed=3)
    samples = [s for k, ep in enumerate(episodes) for s in episode_samples(ep, encoder, model, k)]
    turns = sum(len(ep.turns) for ep in episodes)
    gap, positive, scored = frame_gaps(model, samples, _own(model, encoder, samples), 0, 0.7, encoder.pad_id, "cpu",
                                       2, encoder.suppress_ids)[""]
    assert scored == turns and math.isfinite(gap) and gap != 0.0
    first = samples[0].pixel_values.split(int(samples[0].image_grid_thw[0].prod()))[0]
    same = [dataclasses.replace(s, pixel_values=first.repeat(len(s.image_grid_thw), 1)) for s in samples]
    assert frame_gaps(model, same, _own(model, encoder, same), 0, 0.7, encoder.pad_id, "cpu", 2,
                      encoder.suppress_ids) == {"": [0.0, 0.0, float(turns)]}
