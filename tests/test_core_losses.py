"""vagen.core losses: hand-checked cases, naive-loop equality, mask invariance, errors."""

import math

import pytest
import torch
from core_reference import (
    aggregate_ref,
    entropy_ref,
    kl_penalty_ref,
    logprobs_ref,
    ppo_policy_loss_ref,
    value_loss_ref,
)

from vagen.core import (
    AGG_MODES,
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    ppo_policy_loss,
    value_loss,
)


def random_tokens(seed: int, batch: int = 5, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, length, generator=g, dtype=torch.float64) * 3
    old_logprobs = logprobs + torch.randn(batch, length, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=g) < 0.6
    mask[0] = False
    return logprobs, old_logprobs, advantages, mask


def junk_where_out(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    junk = torch.full_like(x, float("nan"))
    junk[..., ::2] = 1e6
    return torch.where(mask, x, junk)


# ----------------------------------------------------------------------------- aggregate_loss


def test_aggregate_loss_hand_checked():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # third row empty: not counted
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(7 / 3)  # (1+2+4)/3
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == 3.5  # (3 + 4)/2
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == 2.75  # (1.5 + 4)/2
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(
        7 / 6
    )  # (3/3 + 4/3)/2


def test_aggregate_loss_matches_naive_loop_and_is_mask_invariant():
    for seed in range(4):
        _, _, loss, mask = random_tokens(seed)
        for mode in AGG_MODES:
            got = aggregate_loss(loss, mask, mode)
            assert got.item() == pytest.approx(aggregate_ref(loss.tolist(), mask.tolist(), mode), rel=1e-12)
            assert torch.equal(aggregate_loss(junk_where_out(loss, mask), mask, mode), got)


def test_aggregate_loss_empty_mask_is_zero_with_gradient():
    loss = torch.ones(2, 3, requires_grad=True)
    for mode in AGG_MODES:
        out = aggregate_loss(loss, torch.zeros(2, 3), mode)
        out.backward()
        assert out.item() == 0.0 and torch.equal(loss.grad, torch.zeros(2, 3))


def test_aggregate_loss_errors():
    with pytest.raises(ValueError, match=r"aggregate_loss: unknown mode 'mean'; choices: 'token-mean', "):
        aggregate_loss(torch.ones(2, 3), torch.ones(2, 3), "mean")
    with pytest.raises(
        ValueError, match=r"aggregate_loss: mask has shape \(2, 4\) but loss has shape \(2, 3\)"
    ):
        aggregate_loss(torch.ones(2, 3), torch.ones(2, 4), "token-mean")


# ----------------------------------------------------------------------------- ppo_policy_loss


def test_ppo_policy_loss_hand_checked():
    ratios = torch.tensor([[1.5, 0.5, 5.0, 1.0]], dtype=torch.float64)
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]], dtype=torch.float64)
    old_logprobs = torch.full((1, 4), -1.0, dtype=torch.float64)
    logprobs = old_logprobs + ratios.log()
    mask = torch.ones(1, 4)
    loss, metrics = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, 0.2, 0.2, 3.0)
    # token 0: A=+1, r=1.5: max(-1.5, -1.2) = -1.2                  (clipped)
    # token 1: A=-1, r=0.5: max(0.5, 0.8) = 0.8, below dual 3        (clipped)
    # token 2: A=-1, r=5.0: max(5.0, 1.2) = 5.0 > 3 -> 3             (dual clip)
    # token 3: A=+1, r=1.0: -1
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 1.0) / 4)
    assert metrics["clipfrac"] == 0.5 and metrics["clipfrac_lower"] == 0.25
    kl = [(r - 1) - math.log(r) for r in (1.5, 0.5, 5.0, 1.0)]
    assert metrics["approx_kl"] == pytest.approx(sum(kl) / 4)
    # clip-higher: token 0 clipped at 1.28 instead of 1.2; no dual clip: token 2 keeps 5.0
    loss, _ = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, 0.2, 0.28, None)
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 5.0 - 1.0) / 4)


def test_ppo_policy_loss_log_ratio_clamped_and_gradient():
    logprobs = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old_logprobs = torch.tensor([[-100.0, 0.0]])
    loss, metrics = ppo_policy_loss(logprobs, old_logprobs, torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx((3.0 - 1.0) / 2)
    assert metrics["approx_kl"] == pytest.approx((math.exp(20) - 21) / 2)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, -0.5]]  # dual-clipped token gets no gradient


@pytest.mark.parametrize("agg", AGG_MODES)
def test_ppo_policy_loss_matches_naive_loop_and_is_mask_invariant(agg):
    for seed in range(4):
        logprobs, old_logprobs, advantages, mask = random_tokens(seed)
        for clip_low, clip_high, dual in [(0.2, 0.2, 3.0), (0.2, 0.28, None), (0.1, 0.3, 1.5)]:
            loss, metrics = ppo_policy_loss(
                logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual, agg
            )
            loss_ref, metrics_ref = ppo_policy_loss_ref(
                logprobs, old_logprobs, advantages, mask, clip_low, clip_high, dual, agg
            )
            assert loss.item() == pytest.approx(loss_ref, rel=1e-10, abs=1e-12)
            assert metrics == pytest.approx(metrics_ref, rel=1e-10, abs=1e-12)
        junk = [junk_where_out(x, mask) for x in (logprobs, old_logprobs, advantages)]
        loss2, metrics2 = ppo_policy_loss(*junk, mask, agg=agg)
        loss1, metrics1 = ppo_policy_loss(logprobs, old_logprobs, advantages, mask, agg=agg)
        assert torch.equal(loss1, loss2) and metrics1 == metrics2


def test_ppo_policy_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"ppo_policy_loss: advantages has shape \(2, 2\) but logprobs has shape"
    ):
        ppo_policy_loss(x, x, torch.zeros(2, 2), x)
    with pytest.raises(
        ValueError, match=r"ppo_policy_loss: unknown agg 'sum'; choices: 'token-mean', 'seq-mean-token-sum'"
    ):
        ppo_policy_loss(x, x, x, x, agg="sum")
    with pytest.raises(ValueError, match=r"dual_clip must be > 1.0 or None, got 0.5"):
        ppo_policy_loss(x, x, x, x, dual_clip=0.5)


# ----------------------------------------------------------------------------- value_loss


def test_value_loss_hand_checked():
    values = torch.tensor([[1.0, 2.5]])
    old_values = torch.tensor([[0.0, 1.5]])
    returns = torch.tensor([[0.0, 3.0]])
    loss, metrics = value_loss(values, old_values, returns, torch.ones(1, 2), clip=0.5)
    # token 0: (1-0)^2 = 1, clipped V = 0.5 -> 0.25; max 1 -> 0.5
    # token 1: (2.5-3)^2 = 0.25, clipped V = 2.0 -> 1.0 (clipped is larger); max 1 -> 0.5
    assert loss.item() == 0.5 and metrics["clipfrac"] == 0.5 and metrics["values_mean"] == 1.75
    loss, metrics = value_loss(values, old_values, returns, torch.ones(1, 2), clip=None)
    assert loss.item() == (0.5 * 1.0 + 0.5 * 0.25) / 2 and metrics["clipfrac"] == 0.0


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_matches_naive_loop_and_is_mask_invariant(agg):
    for seed in range(4):
        values, old_values, returns, mask = random_tokens(seed)
        for clip in (0.5, 0.1, None):
            loss, metrics = value_loss(values, old_values, returns, mask, clip, agg)
            loss_ref, metrics_ref = value_loss_ref(values, old_values, returns, mask, clip, agg)
            assert loss.item() == pytest.approx(loss_ref, rel=1e-10, abs=1e-12)
            assert metrics["clipfrac"] == pytest.approx(metrics_ref["clipfrac"])
        junk = [junk_where_out(x, mask) for x in (values, old_values, returns)]
        assert value_loss(*junk, mask, agg=agg) == value_loss(values, old_values, returns, mask, agg=agg)


def test_value_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"value_loss: returns must have 2 dims, got shape \(3,\); expected \[B, L\]"
    ):
        value_loss(x, x, torch.zeros(3), x)
    with pytest.raises(ValueError, match=r"value_loss: unknown agg 'x'; choices: 'token-mean'"):
        value_loss(x, x, x, x, agg="x")


# ----------------------------------------------------------------------------- kl_penalty


def test_kl_penalty_hand_checked():
    logprobs = torch.tensor([[math.log(0.5), 0.0]], dtype=torch.float64)
    ref_logprobs = torch.tensor([[math.log(0.25), 30.0]], dtype=torch.float64)
    d = math.log(2.0)
    assert kl_penalty(logprobs, ref_logprobs, "k1")[0].tolist() == pytest.approx([d, -30.0])
    assert kl_penalty(logprobs, ref_logprobs, "abs")[0].tolist() == pytest.approx([d, 30.0])
    assert kl_penalty(logprobs, ref_logprobs, "k2")[0].tolist() == pytest.approx([0.5 * d * d, 450.0])
    # k3 = exp(-d) + d - 1 = 0.5 + ln 2 - 1; second token: exp(20) - 21 clamped to 10
    assert kl_penalty(logprobs, ref_logprobs, "k3")[0].tolist() == pytest.approx([0.5 + d - 1.0, 10.0])


def test_kl_penalty_matches_naive_loop():
    logprobs, ref_logprobs, _, _ = random_tokens(0)
    for kind in ("k1", "k2", "k3", "abs"):
        torch.testing.assert_close(
            kl_penalty(logprobs, ref_logprobs, kind), kl_penalty_ref(logprobs, ref_logprobs, kind)
        )


def test_kl_penalty_errors():
    with pytest.raises(ValueError, match=r"kl_penalty: unknown kind 'k4'; choices: 'k1', 'k2', 'k3', 'abs'"):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "k4")
    with pytest.raises(
        ValueError, match=r"kl_penalty: ref_logprobs has shape \(2, 2\) but logprobs has shape \(2, 3\)"
    ):
        kl_penalty(torch.zeros(2, 3), torch.zeros(2, 2), "k1")


# ----------------------------------------------------------------------------- entropy / logprobs


def test_entropy_hand_checked_and_stable():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -math.inf, -math.inf], [1e4, 1e4, 1e4, 1e4]]])
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([[math.log(4), math.log(2), math.log(4)]])
    )
    one_hot = torch.tensor([[[0.0, -math.inf, -math.inf]]])
    assert entropy_from_logits(one_hot).tolist() == [[0.0]]


def test_entropy_gradient_is_finite_with_masked_vocabulary_entries():
    """The update masks tokens sampling never draws with -inf: their gradient is 0, the others' finite."""
    logits = torch.tensor([[[1.0, float("-inf"), 0.5]]], requires_grad=True)
    entropy_from_logits(logits).sum().backward()
    p = torch.softmax(torch.tensor([1.0, 0.5]), -1)
    # dH/dz_i = -p_i (log p_i + H) over the two finite entries
    h = -(p * p.log()).sum()
    expected = -p * (p.log() + h)
    assert logits.grad[0, 0, 1] == 0.0
    assert torch.allclose(logits.grad[0, 0, [0, 2]], expected, atol=1e-6)


def test_entropy_matches_naive_loop():
    logits = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    torch.testing.assert_close(entropy_from_logits(logits), entropy_ref(logits))
    half = entropy_from_logits(logits.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(
        half.double(), entropy_ref(logits.to(torch.bfloat16).double()), rtol=1e-2, atol=1e-2
    )


def test_logprobs_hand_checked():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], dtype=torch.float64)
    got = logprobs_from_logits(logits, torch.tensor([[1, 0]]))
    assert got[0].tolist() == pytest.approx([math.log(0.75), math.log(0.25)])


def test_logprobs_matches_naive_loop_and_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 6, 11, generator=g) * 5
    labels = torch.randint(0, 11, (5, 6), generator=g)
    got = logprobs_from_logits(logits, labels)
    torch.testing.assert_close(got.double(), logprobs_ref(logits, labels), rtol=1e-5, atol=1e-5)
    expected = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(got, expected)
    half = logits.to(torch.bfloat16)
    got_half = logprobs_from_logits(half, labels, chunk_rows=2)
    assert got_half.dtype == torch.float32
    torch.testing.assert_close(
        got_half, torch.log_softmax(half.float(), -1).gather(-1, labels[..., None])[..., 0]
    )


def test_entropy_and_logprobs_errors():
    with pytest.raises(ValueError, match=r"entropy_from_logits: logits must be \[B, L, V\], got \(2, 3\)"):
        entropy_from_logits(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"labels has shape \(2, 4\), expected \(2, 3\)"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must be an integer tensor, got torch.float32"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 3))


def test_seq_mean_token_sum_norm_divides_by_a_constant_not_the_padded_width():
    loss = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    wider = torch.nn.functional.pad(loss, (0, 6)), torch.nn.functional.pad(mask, (0, 6))
    # (6 + 4) / (2 sequences * 5 tokens)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_tokens=5).item() == pytest.approx(1.0)
    assert aggregate_loss(*wider, "seq-mean-token-sum-norm", norm_tokens=5).item() == pytest.approx(1.0)
    assert aggregate_loss(*wider, "seq-mean-token-sum-norm").item() != pytest.approx(1.0)  # the width: 10


def test_micro_batch_losses_with_the_global_denominator_add_up_to_the_whole_batch():
    from vagen.core import loss_denominator

    torch.manual_seed(0)
    loss = torch.rand(6, 5)
    mask = (torch.rand(6, 5) > 0.4).long()
    mask[4] = 0  # a row with nothing selected counts in no denominator
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = aggregate_loss(loss, mask, mode, norm_tokens=5)
        total = loss_denominator(mask, mode)
        parts = sum(aggregate_loss(loss[i : i + 2], mask[i : i + 2], mode, norm_tokens=5, denominator=total)
                    for i in (0, 2, 4))
        assert parts.item() == pytest.approx(whole.item(), abs=1e-6), mode
        assert loss_denominator(mask, mode) == (float(mask.sum()) if mode == "token-mean" else 5.0)


def test_ppo_policy_loss_weights_scale_each_tokens_loss():
    """Truncated importance sampling: a token's loss times its weight, before aggregation."""
    logprobs = torch.tensor([[-1.0, -2.0]])
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    plain, _ = ppo_policy_loss(logprobs, logprobs, advantages, mask, agg="token-mean")
    weighted, _ = ppo_policy_loss(logprobs, logprobs, advantages, mask, agg="token-mean",
                                  weights=torch.tensor([[2.0, 0.5]]))
    # ratio 1: per-token losses -1 and +1; token-mean (-1 + 1) / 2 = 0 plain, (-2 + 0.5) / 2 weighted
    assert float(plain) == 0.0 and float(weighted) == -0.75
    with pytest.raises(ValueError, match="weights"):
        ppo_policy_loss(logprobs, logprobs, advantages, mask, weights=torch.ones(1, 3))
