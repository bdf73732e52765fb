"""vagen.core selection: hand-checked cases, naive-loop equality, mask invariance, errors."""

import pytest
import torch
from core_reference import filter_groups_ref, select_critical_tokens_ref

from vagen.core import SELECT_MODES, filter_groups_by_reward_std, select_critical_tokens

# ----------------------------------------------------------------------------- select_critical_tokens


def hand_case():
    #                            0  1  2  3  4  5  6  7
    loss_mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0]])
    think_mask = torch.tensor([[0, 1, 1, 0, 0, 0, 0, 0]])
    answer_mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0]])  # position 6 is not generated
    entropies = torch.tensor([[9.0, 0.5, 0.9, 0.1, 0.9, 0.2, 9.0, 9.0]])  # 9s are masked out
    return loss_mask, answer_mask, think_mask, entropies


def selected(mode, top_ratio=0.2):
    return select_critical_tokens(*hand_case(), mode, top_ratio)[0].nonzero()[:, 0].tolist()


def test_select_critical_tokens_hand_checked():
    assert selected("all") == [1, 2, 3, 4, 5]
    assert selected("answer") == [5]
    assert selected("think_answer") == [1, 2, 5]
    # 5 generated tokens, top_ratio 0.2 -> k = 1: positions 2 and 4 tie at 0.9, the earlier wins
    assert selected("entropy", 0.2) == [2, 5]
    assert selected("entropy", 0.4) == [2, 4, 5]  # k = 2
    assert selected("entropy", 0.5) == [1, 2, 4, 5]  # k = ceil(2.5) = 3
    assert selected("entropy", 0.0) == [5]
    assert selected("entropy", 1.0) == [1, 2, 3, 4, 5]
    out = select_critical_tokens(*hand_case(), "all")
    assert out.dtype == torch.int64


def test_select_critical_tokens_ratio_rounding():
    # 0.1 * 30 = 3.0000000000000004 in floats; k must be 3, not 4
    loss_mask = torch.ones(1, 30, dtype=torch.bool)
    entropies = torch.arange(30.0).flip(0)[None]
    zeros = torch.zeros(1, 30, dtype=torch.bool)
    out = select_critical_tokens(loss_mask, zeros, zeros, entropies, "entropy", 0.1)
    assert out[0].nonzero()[:, 0].tolist() == [0, 1, 2]


def random_spans(seed: int, batch: int = 8, length: int = 30):
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.rand(batch, length, generator=g) < 0.7
    loss_mask[0] = False
    answer_mask = torch.rand(batch, length, generator=g) < 0.2
    think_mask = torch.rand(batch, length, generator=g) < 0.4
    entropies = torch.randint(0, 5, (batch, length), generator=g).float() / 4  # many ties
    return loss_mask, answer_mask, think_mask, entropies


@pytest.mark.parametrize("mode", SELECT_MODES)
def test_select_critical_tokens_matches_naive_loop_and_is_mask_invariant(mode):
    for seed in range(6):
        loss_mask, answer_mask, think_mask, entropies = random_spans(seed)
        for ratio in (0.0, 0.1, 0.2, 0.35, 1.0):
            got = select_critical_tokens(loss_mask, answer_mask, think_mask, entropies, mode, ratio)
            want = select_critical_tokens_ref(loss_mask, answer_mask, think_mask, entropies, mode, ratio)
            assert torch.equal(got, want)
            assert not (got & ~loss_mask).any()
        junk = torch.where(loss_mask, entropies, torch.full_like(entropies, 1e9))
        junk[:, ::4] = torch.where(loss_mask[:, ::4], junk[:, ::4], float("nan"))
        spans = (answer_mask | ~loss_mask, think_mask | ~loss_mask)
        assert torch.equal(
            select_critical_tokens(loss_mask, *spans, junk, mode),
            select_critical_tokens(loss_mask, answer_mask, think_mask, entropies, mode),
        )


def test_select_critical_tokens_errors():
    m = torch.ones(2, 3)
    with pytest.raises(
        ValueError, match=r"unknown mode 'topk'; choices: 'all', 'answer', 'think_answer', 'entropy'"
    ):
        select_critical_tokens(m, m, m, m, "topk")
    with pytest.raises(
        ValueError, match=r"select_critical_tokens: entropies has shape \(2, 4\) but loss_mask"
    ):
        select_critical_tokens(m, m, m, torch.ones(2, 4), "all")
    with pytest.raises(ValueError, match=r"top_ratio must be in \[0, 1\], got 1.5"):
        select_critical_tokens(m, m, m, m, "entropy", 1.5)


# ----------------------------------------------------------------------------- filter_groups_by_reward_std


def filter_hand_case():
    scores = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 2.0, 1.0, 1.0, 5.0])
    group_ids = torch.tensor([3, 3, 1, 1, 7, 7, 2, 2, 9])
    return scores, group_ids


def test_filter_groups_hand_checked():
    scores, group_ids = filter_hand_case()
    # groups in id order 1, 2, 3, 7, 9 with stds 0, 0, 0.7071, 1.4142, 0 (a group of one has 0);
    # n_keep = max(1, ceil(0.25 * 5)) = 2
    indices, metrics = filter_groups_by_reward_std(scores, group_ids, 0.25, "std")
    assert indices.tolist() == [0, 1, 4, 5]  # groups 3 and 7
    assert indices.dtype == torch.long
    assert (
        metrics["kept_groups"] == 2.0
        and metrics["total_groups"] == 5.0
        and metrics["kept_trajectories"] == 4.0
    )
    assert metrics["reward_std_before"] == pytest.approx((0.5**0.5 + 2**0.5) / 5)
    assert metrics["reward_std_after"] == pytest.approx((0.5**0.5 + 2**0.5) / 2)
    indices, metrics = filter_groups_by_reward_std(scores, group_ids, 0.25, "std_rev")
    assert indices.tolist() == [2, 3, 6, 7]  # groups 1 and 2: std 0 ties go to the lower ids
    assert metrics["reward_std_after"] == 0.0
    indices, _ = filter_groups_by_reward_std(scores, group_ids, 0.01, "std")
    assert indices.tolist() == [4, 5]  # at least one group: 7
    indices, metrics = filter_groups_by_reward_std(scores, group_ids, 0.25, "none")
    assert indices.tolist() == list(range(9)) and metrics["kept_groups"] == 5.0
    # 0.2 * 5 = 1 exactly, 0.6 * 5 = 3.0000000000000004 -> 3
    assert filter_groups_by_reward_std(scores, group_ids, 0.2)[1]["kept_groups"] == 1.0
    assert filter_groups_by_reward_std(scores, group_ids, 0.6)[1]["kept_groups"] == 3.0


@pytest.mark.parametrize("mode", ["std", "std_rev", "none"])
def test_filter_groups_matches_naive_loop(mode):
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        scores = torch.randint(0, 3, (24,), generator=g).float()
        group_ids = torch.randint(0, 8, (24,), generator=g) * 2
        for ratio in (0.1, 0.25, 0.5, 1.0):
            indices, metrics = filter_groups_by_reward_std(scores, group_ids, ratio, mode)
            want_indices, want_metrics = filter_groups_ref(scores, group_ids, ratio, mode)
            assert indices.tolist() == want_indices
            assert metrics == pytest.approx(want_metrics)


def test_filter_groups_errors():
    scores, group_ids = filter_hand_case()
    with pytest.raises(ValueError, match=r"unknown mode 'top'; choices: 'std', 'std_rev', 'none'"):
        filter_groups_by_reward_std(scores, group_ids, 0.25, "top")
    with pytest.raises(ValueError, match=r"keep_ratio must be in \(0, 1\], got 0.0"):
        filter_groups_by_reward_std(scores, group_ids, 0.0)
    with pytest.raises(ValueError, match=r"group_ids has shape \(2,\) but scores has shape \(9,\)"):
        filter_groups_by_reward_std(scores, group_ids[:2])
