"""vagen.core monitor: collapse indicators and the CollapseMonitor warnings."""

import math

import pytest
import torch

from vagen.core import CollapseMonitor, collapse_indicators, distinct_n, echo_rate


def test_collapse_indicators_hand_checked():
    metrics = collapse_indicators(
        scores=torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0]),
        group_ids=torch.tensor([0, 0, 1, 1, 2]),  # group 2 has one member: left out of the std mean
        entropies=torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0], [9.0] * 3, [9.0] * 3, [9.0] * 3]),
        mask=torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]),
        response_lengths=torch.tensor([2, 1, 0, 5, 2]),
        reasoning_texts=["go left", "go left", "push up", "go  left ", ""],
        seeds=[1, 2, 3, 1, 4],
    )
    # group 0 std = sqrt(0.5), group 1 std = 0 -> mean sqrt(0.5) / 2
    assert metrics["reward_std_in_group"] == pytest.approx(math.sqrt(0.5) / 2)
    assert metrics["entropy_mean"] == 2.0  # (1 + 2 + 3) / 3
    assert metrics["response_length_mean"] == 2.0  # 10 / 5
    # "go left" (whitespace collapsed) was written for seeds {1, 2}: trajectories 0, 1, 3 echo
    assert metrics["echo_rate"] == 3 / 5
    # bigrams: (go, left) x3, (push, up) -> 2 distinct of 4
    assert metrics["distinct_2"] == 0.5


def test_echo_and_distinct_match_naive_definitions():
    g = torch.Generator().manual_seed(0)
    words = ["left", "right", "up", "down"]
    for _ in range(5):
        texts = [
            " ".join(words[i] for i in torch.randint(0, 4, (3,), generator=g).tolist()) for _ in range(20)
        ]
        seeds = torch.randint(0, 5, (20,), generator=g).tolist()
        echoed = [any(texts[j] == texts[i] and seeds[j] != seeds[i] for j in range(20)) for i in range(20)]
        assert echo_rate(texts, seeds) == sum(echoed) / 20
        bigrams = [(t.split()[i], t.split()[i + 1]) for t in texts for i in range(2)]
        assert distinct_n(texts, 2) == len(set(bigrams)) / len(bigrams)
    assert distinct_n(["one", ""], 2) == 0.0 and echo_rate([], []) == 0.0
    assert echo_rate(["a", "a"], [5, 5]) == 0.0  # same seed, same text: not an echo


def test_collapse_indicators_is_mask_invariant_and_checks_input():
    kwargs = dict(
        scores=torch.tensor([1.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        entropies=torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        mask=torch.tensor([[1, 0], [1, 1]]),
        response_lengths=torch.tensor([1, 2]),
        reasoning_texts=["a b", "a c"],
        seeds=[0, 1],
    )
    base = collapse_indicators(**kwargs)
    assert base["entropy_mean"] == pytest.approx(8 / 3)
    kwargs["entropies"] = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    assert collapse_indicators(**kwargs) == base
    kwargs["seeds"] = [0]
    with pytest.raises(
        ValueError,
        match=r"batch sizes differ: scores 2, reasoning_texts 2, seeds 1; need one text and one seed",
    ):
        collapse_indicators(**kwargs)
    kwargs["seeds"] = [0, 1]
    flat = dict(
        kwargs, entropies=torch.tensor([[1.0, 3.0, 4.0]]), mask=torch.ones(1, 3)
    )  # concatenated tokens
    assert collapse_indicators(**flat) == base
    kwargs["mask"] = torch.ones(2, 3)
    with pytest.raises(
        ValueError, match=r"collapse_indicators: mask has shape \(2, 3\) but entropies has shape"
    ):
        collapse_indicators(**kwargs)


def test_monitor_grad_norm_spike():
    monitor = CollapseMonitor(window=5, k=3.0)
    for g in (1.0, 2.0, 1.0):
        assert monitor.update({"grad_norm": g}) == []  # building history (min_history=3)
    assert monitor.update({"grad_norm": 2.9}) == []  # 2.9 <= 3 x median 1
    warnings = monitor.update({"grad_norm": 7.0})  # history 1, 2, 1, 2.9 -> median 1.5; 7 > 4.5
    assert warnings == ["step 4: gradient-norm spike: grad_norm 7 > 3 x running median 1.5 (last 4 steps)"]


def test_monitor_entropy_collapse_uses_peak():
    monitor = CollapseMonitor(entropy_frac=0.25)
    assert monitor.update({"entropy_mean": 1.0}) == []
    assert monitor.update({"entropy_mean": 2.0}) == []  # new peak
    assert monitor.update({"entropy_mean": 0.5}) == []  # 0.5 = 0.25 x 2, not below
    assert monitor.update({"entropy_mean": 0.4}) == [
        "step 3: entropy collapse: entropy_mean 0.4 < 0.25 x peak 2"
    ]


def test_monitor_in_group_std_drop_and_floor():
    monitor = CollapseMonitor(window=3, std_frac=0.25)
    for s in (0.4, 0.5, 0.6):
        assert monitor.update({"reward_std_in_group": s}) == []
    assert monitor.update({"reward_std_in_group": 0.1}) == [
        "step 3: in-group reward std drop: reward_std_in_group 0.1 < 0.25 x running median 0.5 (last 3 steps)"
    ]
    # window 3 now holds 0.5, 0.6, 0.1 -> median 0.5
    assert monitor.update({"reward_std_in_group": 0.0}) == [
        "step 4: in-group reward std collapsed: reward_std_in_group 0 <= floor 1e-06 (no learning signal)"
    ]
    assert (
        CollapseMonitor()
        .update({"reward_std_in_group": 0.0})[0]
        .startswith("step 0: in-group reward std collapsed")
    )


def test_monitor_format_collapse_uses_peak():
    monitor = CollapseMonitor(format_frac=0.5)
    assert monitor.update({"format_ok": 0.9}) == []
    assert monitor.update({"format_ok": 0.96}) == []  # new peak
    assert monitor.update({"format_ok": 0.48}) == []  # exactly half the peak, not below
    assert monitor.update({"format_ok": 0.3}) == [
        "step 3: format collapse: format_ok 0.3 < 0.5 x peak 0.96 (answers stop parsing)"
    ]


NOT_LOOKING = ("step {step}: the policy does not look at its frames: frame_gap {gap} nats/turn < floor 3 while "
               "format_ok {format_ok} >= 0.8 (its responses are about as likely with another level's frames; "
               "docs/algorithms.md, \"Does the policy look?\")")


def test_monitor_warns_when_a_policy_in_the_format_stops_looking():
    monitor = CollapseMonitor(frame_gap_floor=3.0, format_high=0.8)
    assert monitor.update({"frame_gap": 9.1, "format_ok": 1.0}) == []  # reads (FrozenLake's warm start)
    assert monitor.update({"frame_gap": 3.0, "format_ok": 1.0}) == []  # at the floor, not below
    assert monitor.update({"frame_gap": 1.3, "format_ok": 0.96}) == [NOT_LOOKING.format(step=2, gap=1.3,
                                                                                          format_ok=0.96)]
    assert monitor.update({"frame_gap": 0.9, "format_ok": 0.97}) == []  # still below: warned once
    assert monitor.update({"format_ok": 0.97}) == []  # an iteration without a check
    assert monitor.update({"frame_gap": 4.0, "format_ok": 0.97}) == []  # looks again
    assert monitor.update({"frame_gap": -0.5, "format_ok": 0.8}) == [NOT_LOOKING.format(step=6, gap=-0.5,
                                                                                         format_ok=0.8)]
    # answers that mostly do not parse: no frame warning (the format's own indicator speaks), whatever the gap
    fresh = CollapseMonitor()
    assert fresh.update({"frame_gap": 0.1, "format_ok": 0.79}) == [] and fresh.update({"frame_gap": 0.1}) == []
    # a blind start warns at the first check
    assert CollapseMonitor().update({"frame_gap": 1.33, "format_ok": 0.96}) == [
        NOT_LOOKING.format(step=0, gap=1.33, format_ok=0.96)]


def test_monitor_loads_a_state_saved_before_the_format_indicator():
    monitor = CollapseMonitor()
    monitor.load_state_dict({"grad_norms": [1.0], "stds": [0.5], "entropy_peak": 2.0, "step": 7})
    assert monitor.update({"format_ok": 0.1}) == []  # no peak yet: the first value sets it
    assert monitor.update({"format_ok": 0.01}) == [
        "step 8: format collapse: format_ok 0.01 < 0.5 x peak 0.1 (answers stop parsing)"
    ]


def test_monitor_ignores_missing_keys_and_checks_arguments():
    monitor = CollapseMonitor()
    assert monitor.update({}) == [] and monitor.update({"actor/lr": 1e-6}) == []
    with pytest.raises(ValueError, match=r"need window >= 1 and k > 0, got window=0, k=3.0"):
        CollapseMonitor(window=0)


def test_echo_rate_ignores_empty_reasoning():
    from vagen.core import echo_rate

    assert echo_rate(["", "", "push left", "push left"], [1, 2, 3, 4]) == 0.5


def test_monitor_state_round_trips():
    from vagen.core import CollapseMonitor

    first = CollapseMonitor(window=4, min_history=2)
    for g in (1.0, 1.1, 0.9):
        first.update({"grad_norm": g, "entropy_mean": 2.0, "reward_std_in_group": 0.5, "format_ok": 1.0})
    second = CollapseMonitor(window=4, min_history=2)
    second.load_state_dict(first.state_dict())
    spike = {"grad_norm": 10.0, "entropy_mean": 0.1, "reward_std_in_group": 0.0, "format_ok": 0.2}
    assert first.update(dict(spike)) == second.update(dict(spike))
    assert len(second.update(dict(spike))) == 4  # all four indicators fire
    below = {"frame_gap": 0.5, "format_ok": 1.0}
    assert len(first.update(dict(below))) == 1
    third = CollapseMonitor()
    third.load_state_dict(first.state_dict())
    assert third.update(dict(below)) == first.update(dict(below)) == []  # the warning is not repeated
