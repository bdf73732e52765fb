"""vagen.core advantages: hand-checked cases, naive-loop equality, mask invariance, errors."""

import math

import pytest
import torch
from core_reference import gae_ref, grpo_ref, masked_whiten_ref, turn_level_gae_ref

from vagen.core import gae, grpo_advantages, masked_whiten, turn_level_gae

GAMMA_LAMBDAS = [(0.99, 0.95), (1.0, 1.0), (0.5, 0.0), (0.0, 0.7), (0.3, 0.9)]


def ragged_batch(seed: int, batch: int = 7, length: int = 40):
    """Random ragged layout: empty rows, one-token turns, truncated last turns, gaps."""
    g = torch.Generator().manual_seed(seed)
    token_rewards = torch.randn(batch, length, generator=g)
    values = torch.randn(batch, length, generator=g)
    loss_mask = torch.rand(batch, length, generator=g) < 0.6
    loss_mask[0] = False  # empty row
    loss_mask[1] = True  # every token generated
    turn_end_mask = loss_mask & (torch.rand(batch, length, generator=g) < 0.25)
    turn_end_mask[2] = loss_mask[2]  # every turn is one token
    turn_end_mask[3] = False  # one truncated turn only
    return token_rewards, values, loss_mask, turn_end_mask


def perturb_masked_out(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    junk = torch.randn(x.shape, generator=g) * 1e6
    junk[..., ::3] = float("nan")
    return torch.where(mask, x, junk)


# ----------------------------------------------------------------------------- gae


def test_gae_hand_checked():
    # Positions 1, 2, 4 are generated; 0 and 3 are prompt/observation (values 9 are ignored).
    token_rewards = torch.tensor([[9.0, 0.0, 1.0, 9.0, 2.0]])
    values = torch.tensor([[9.0, 1.0, 2.0, 9.0, 3.0]])
    mask = torch.tensor([[0, 1, 1, 0, 1]])
    adv, ret = gae(token_rewards, values, mask, gamma=0.5, lam=0.5)
    # t=4: delta = 2 + 0.5*0 - 3 = -1          A = -1
    # t=2: delta = 1 + 0.5*3 - 2 = 0.5         A = 0.5 + 0.25*(-1) = 0.25   (skips t=3)
    # t=1: delta = 0 + 0.5*2 - 1 = 0           A = 0 + 0.25*0.25 = 0.0625
    assert adv.tolist() == [[0.0, 0.0625, 0.25, 0.0, -1.0]]
    assert ret.tolist() == [[0.0, 1.0625, 2.25, 0.0, 2.0]]
    assert adv.dtype == torch.float32


@pytest.mark.parametrize("gamma,lam", GAMMA_LAMBDAS)
def test_gae_matches_naive_loop(gamma, lam):
    for seed in range(8):
        token_rewards, values, loss_mask, _ = ragged_batch(seed)
        adv, ret = gae(token_rewards, values, loss_mask, gamma, lam)
        adv_ref, ret_ref = gae_ref(token_rewards, values, loss_mask, gamma, lam)
        torch.testing.assert_close(adv, adv_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret, ret_ref, rtol=1e-5, atol=1e-5)


def test_gae_long_span_small_discount_is_stable():
    # 3000 generated tokens with gamma*lam = 0.15: naive powers c^-t would overflow float64.
    g = torch.Generator().manual_seed(1)
    token_rewards, values = torch.randn(2, 3100, generator=g), torch.randn(2, 3100, generator=g)
    mask = torch.zeros(2, 3100, dtype=torch.bool)
    mask[:, 50:3050] = True
    for gamma, lam in [(0.3, 0.5), (1.0, 1.0), (0.999, 0.999)]:
        adv, ret = gae(token_rewards, values, mask, gamma, lam)
        adv_ref, ret_ref = gae_ref(token_rewards, values, mask, gamma, lam)
        assert torch.isfinite(adv).all()
        torch.testing.assert_close(adv, adv_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret, ret_ref, rtol=1e-5, atol=1e-5)


def test_gae_mask_invariance():
    token_rewards, values, loss_mask, _ = ragged_batch(3)
    adv, ret = gae(token_rewards, values, loss_mask, 0.9, 0.8)
    adv2, ret2 = gae(
        perturb_masked_out(token_rewards, loss_mask, 1),
        perturb_masked_out(values, loss_mask, 2),
        loss_mask,
        0.9,
        0.8,
    )
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv[~loss_mask] == 0).all() and (ret[~loss_mask] == 0).all()


def test_gae_all_empty_and_zero_length():
    adv, ret = gae(torch.ones(3, 5), torch.ones(3, 5), torch.zeros(3, 5), 0.9, 0.9)
    assert torch.equal(adv, torch.zeros(3, 5)) and torch.equal(ret, torch.zeros(3, 5))
    adv, _ = gae(torch.ones(0, 5), torch.ones(0, 5), torch.zeros(0, 5), 0.9, 0.9)
    assert adv.shape == (0, 5)


def test_gae_errors():
    with pytest.raises(
        ValueError, match=r"gae: values has shape \(2, 4\) but token_rewards has shape \(2, 5\)"
    ):
        gae(torch.ones(2, 5), torch.ones(2, 4), torch.ones(2, 5), 0.9, 0.9)
    with pytest.raises(ValueError, match=r"gae: token_rewards must have 2 dims, got shape \(5,\)"):
        gae(torch.ones(5), torch.ones(5), torch.ones(5), 0.9, 0.9)
    with pytest.raises(ValueError, match=r"gae: lam must be a float in \[0, 1\], got 1.5"):
        gae(torch.ones(2, 5), torch.ones(2, 5), torch.ones(2, 5), 0.9, 1.5)


# ----------------------------------------------------------------------------- turn_level_gae


def test_turn_level_gae_hand_checked_three_turns():
    # pos:          0       1    2=e1   3      4     5    6=e2   7     8=e3   9
    #               prompt  gen  gen    obs    gen   gen  gen    obs   gen    pad
    token_rewards = torch.tensor([[100.0, 0.0, 1.0, 100.0, -0.5, 0.0, 0.0, 100.0, 2.0, 100.0]])
    values = torch.tensor([[100.0, 0.5, 1.0, 100.0, 0.25, 0.375, 0.5, 100.0, 1.0, 100.0]])
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0, 1, 0]])
    turn_end_mask = torch.tensor([[0, 0, 1, 0, 0, 0, 1, 0, 1, 0]])
    adv, ret = turn_level_gae(
        token_rewards,
        values,
        loss_mask,
        turn_end_mask,
        gamma_turn=0.5,
        lam_turn=0.5,
        gamma_token=1.0,
        lam_token=0.5,
    )
    # Turn level (gamma_turn * lam_turn = 0.25), turn ends e1=2, e2=6, e3=8:
    #   k=3: delta = 2 + 0.5*0   - 1.0 = 1.0     A3 = 1.0
    #   k=2: delta = 0 + 0.5*1.0 - 0.5 = 0.0     A2 = 0.0  + 0.25*1.0  = 0.25
    #   k=1: delta = 1 + 0.5*0.5 - 1.0 = 0.25    A1 = 0.25 + 0.25*0.25 = 0.3125
    # Token level (gamma_token = 1, gamma_token * lam_token = 0.5), restarting at turn ends:
    #   pos 8 (e3): A = A3 = 1.0
    #   pos 6 (e2): A = A2 = 0.25
    #   pos 5: delta =  0   + 0.5   - 0.375 = 0.125   A = 0.125  + 0.5*0.25   = 0.25
    #   pos 4: delta = -0.5 + 0.375 - 0.25  = -0.375  A = -0.375 + 0.5*0.25   = -0.25
    #   pos 2 (e1): A = A1 = 0.3125
    #   pos 1: delta =  0   + 1.0   - 0.5   = 0.5     A = 0.5    + 0.5*0.3125 = 0.65625
    expected_adv = [0.0, 0.65625, 0.3125, 0.0, -0.25, 0.25, 0.25, 0.0, 1.0, 0.0]
    # returns = advantages + values at generated positions, 0 elsewhere
    expected_ret = [0.0, 1.15625, 1.3125, 0.0, 0.0, 0.625, 0.75, 0.0, 2.0, 0.0]
    assert adv.tolist() == [expected_adv]
    assert ret.tolist() == [expected_ret]

    # The same sequence cut before its last turn end: position 8 is still treated as e3.
    truncated = turn_end_mask.clone()
    truncated[0, 8] = 0
    adv_t, ret_t = turn_level_gae(token_rewards, values, loss_mask, truncated, 0.5, 0.5, 1.0, 0.5)
    assert adv_t.tolist() == [expected_adv] and ret_t.tolist() == [expected_ret]


@pytest.mark.parametrize("gamma_turn,lam_turn", GAMMA_LAMBDAS)
def test_turn_level_gae_matches_naive_loop(gamma_turn, lam_turn):
    for seed in range(8):
        token_rewards, values, loss_mask, turn_end_mask = ragged_batch(seed)
        for gamma_token, lam_token in [(1.0, 0.95), (0.9, 0.0), (0.0, 1.0)]:
            args = (gamma_turn, lam_turn, gamma_token, lam_token)
            adv, ret = turn_level_gae(token_rewards, values, loss_mask, turn_end_mask, *args)
            adv_ref, ret_ref = turn_level_gae_ref(token_rewards, values, loss_mask, turn_end_mask, *args)
            torch.testing.assert_close(adv, adv_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ret, ret_ref, rtol=1e-5, atol=1e-5)


def test_turn_level_gae_all_ones_equals_gae():
    for seed in range(5):
        token_rewards, values, loss_mask, turn_end_mask = ragged_batch(seed)
        # Rewards only at turn ends (and the truncation point), as the tokenizer places them.
        last = torch.zeros_like(loss_mask)
        counts = loss_mask.sum(1)
        rows = (counts > 0).nonzero(as_tuple=True)[0]
        last[rows, (loss_mask.cumsum(1) == counts[:, None]).float().argmax(1)[rows]] = True
        token_rewards = torch.where(turn_end_mask | last, token_rewards, torch.zeros_like(token_rewards))
        adv, ret = turn_level_gae(token_rewards, values, loss_mask, turn_end_mask, 1.0, 1.0, 1.0, 1.0)
        adv_gae, ret_gae = gae(token_rewards, values, loss_mask, 1.0, 1.0)
        torch.testing.assert_close(adv, adv_gae, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ret, ret_gae, rtol=1e-5, atol=1e-5)


def test_turn_level_gae_mask_invariance():
    token_rewards, values, loss_mask, turn_end_mask = ragged_batch(4)
    args = (0.95, 0.9, 1.0, 0.95)
    adv, ret = turn_level_gae(token_rewards, values, loss_mask, turn_end_mask, *args)
    adv2, ret2 = turn_level_gae(
        perturb_masked_out(token_rewards, loss_mask, 1),
        perturb_masked_out(values, loss_mask, 2),
        loss_mask,
        turn_end_mask,
        *args,
    )
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv[~loss_mask] == 0).all()


def test_turn_level_gae_errors():
    ones = torch.ones(2, 5)
    with pytest.raises(
        ValueError, match=r"turn_level_gae: turn_end_mask has shape \(2, 4\) but token_rewards"
    ):
        turn_level_gae(ones, ones, ones, torch.ones(2, 4), 0.9, 0.9, 1.0, 1.0)
    loss_mask = torch.tensor([[0, 1, 1, 1, 0]] * 2)
    turn_end_mask = torch.tensor([[0, 0, 0, 1, 1]] * 2)
    with pytest.raises(ValueError, match=r"turn_end_mask has 2 position\(s\) where loss_mask is 0"):
        turn_level_gae(ones, ones, loss_mask, turn_end_mask, 0.9, 0.9, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"gamma_token must be a float in \[0, 1\], got -0.1"):
        turn_level_gae(ones, ones, ones, ones, 0.9, 0.9, -0.1, 1.0)


# ----------------------------------------------------------------------------- grpo


def test_grpo_hand_checked():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 4.0, 4.0])
    group_ids = torch.tensor([0, 0, 0, 7, 3, 3])
    # group 0: mean 2, unbiased std 1; group 7: one member -> 0; group 3: zero std -> 0
    adv = grpo_advantages(scores, group_ids, eps=0.0)
    assert adv.tolist() == [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    adv = grpo_advantages(scores, group_ids, eps=1.0)
    assert adv.tolist() == [-0.5, 0.0, 0.5, 0.0, 0.0, 0.0]
    adv = grpo_advantages(torch.tensor([1.0, 3.0, 0.0, 0.0]), torch.tensor([1, 1, 2, 2]), norm_by_std=False)
    assert adv.tolist() == [-1.0, 1.0, 0.0, 0.0]


def test_grpo_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        scores = torch.randint(0, 4, (30,), generator=g).float() * 0.5  # ties and zero-std groups
        group_ids = torch.randint(0, 9, (30,), generator=g) * 3 - 5  # arbitrary labels
        for norm in (True, False):
            got = grpo_advantages(scores, group_ids, eps=1e-6, norm_by_std=norm)
            torch.testing.assert_close(
                got.double(), grpo_ref(scores, group_ids, 1e-6, norm), rtol=1e-6, atol=1e-6
            )


def test_grpo_errors_and_empty():
    with pytest.raises(
        ValueError, match=r"grpo_advantages: group_ids has shape \(3,\) but scores has shape \(4,\)"
    ):
        grpo_advantages(torch.ones(4), torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"scores must have 1 dims, got shape \(2, 2\)"):
        grpo_advantages(torch.ones(2, 2), torch.ones(2, 2, dtype=torch.long))
    assert grpo_advantages(torch.ones(0), torch.ones(0, dtype=torch.long)).shape == (0,)


# ----------------------------------------------------------------------------- masked_whiten


def test_masked_whiten_hand_checked():
    x = torch.tensor([[1.0, 2.0], [3.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    # masked-in {1, 2, 3}: mean 2, unbiased var (1 + 0 + 1) / 2 = 1
    assert masked_whiten(x, mask, eps=0.0).tolist() == [[-1.0, 0.0], [1.0, 0.0]]
    assert masked_whiten(x, mask, shift_mean=False, eps=0.0).tolist() == [[1.0, 2.0], [3.0, 0.0]]
    assert masked_whiten(x, torch.zeros(2, 2)).tolist() == [[0.0, 0.0], [0.0, 0.0]]
    one = masked_whiten(x, torch.tensor([[0, 1], [0, 0]]))  # one entry: var 0 -> (x - mean) = 0
    assert one.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_masked_whiten_matches_naive_loop_and_is_mask_invariant():
    for seed in range(5):
        _, values, loss_mask, _ = ragged_batch(seed)
        for shift in (True, False):
            got = masked_whiten(values, loss_mask, shift_mean=shift)
            torch.testing.assert_close(
                got.double(), masked_whiten_ref(values, loss_mask, shift), rtol=1e-5, atol=1e-5
            )
            again = masked_whiten(perturb_masked_out(values, loss_mask, seed), loss_mask, shift_mean=shift)
            assert torch.equal(got, again)
    with pytest.raises(ValueError, match=r"masked_whiten: mask has shape \(2, 3\) but x has shape \(2, 2\)"):
        masked_whiten(torch.ones(2, 2), torch.ones(2, 3))


def test_masked_whiten_is_batch_global():
    x = torch.tensor([[0.0, 2.0], [10.0, 12.0]])
    y = masked_whiten(x, torch.ones(2, 2), eps=0.0)
    std = math.sqrt(sum((v - 6.0) ** 2 for v in (0.0, 2.0, 10.0, 12.0)) / 3)
    torch.testing.assert_close(y, (x - 6.0) / std)
