import copy

import pytest
import torch
from update_fixtures import answer_samples, response_logprob

from vagen.config import load_config
from vagen.rollout import ChatEncoder
from vagen.train import make_engine
from vagen.update import annotate, compute_advantages, ppo_update


@pytest.fixture()
def text_policy(tiny_text):
    _, model, tokenizer = tiny_text
    return copy.deepcopy(model), ChatEncoder(tokenizer)


def test_ppo_update_raises_positive_and_lowers_negative_advantage_answers(text_policy, distributed):
    model, encoder = text_policy
    cfg = load_config("bandit_text", ["train.actor_lr=1e-3", "algo.entropy_coef=0", "train.mini_batch_size=4",
                                      "train.micro_batch_size=2", "rollout.temperature=1.0", "rollout.group_size=4",
                                      "rollout.env_groups=1", "train.ppo_epochs=2"])
    engine = make_engine(model, cfg, cfg.train.actor_lr, distributed)
    samples = answer_samples(encoder, ["Left", "Right", "Left", "Right"], [1.0, -1.0, 1.0, -1.0])
    annotate(samples, engine, None, None, cfg, encoder.pad_id, distributed.device)
    # the decision: the first generated position where the two answers differ
    left, right = samples[0].input_ids, samples[1].input_ids
    decision = next(i for i in range(min(len(left), len(right))) if left[i] != right[i])
    before = [float(s.extra["old_logprobs"][decision]) for s in samples]
    metrics = ppo_update(engine, None, samples, cfg, encoder.pad_id, distributed.device, shuffle=False)
    annotate(samples, engine, None, None, cfg, encoder.pad_id, distributed.device)
    after = [float(s.extra["old_logprobs"][decision]) for s in samples]
    assert after[0] > before[0] + 0.1 and after[2] > before[2] + 0.1  # "Left": positive advantage
    assert after[1] < before[1] - 0.1 and after[3] < before[3] - 0.1  # "Right": negative advantage
    # the mean over the whole response moves the same way
    assert response_logprob(samples)[0] - response_logprob(samples)[1] > 0
    assert metrics["actor/grad_norm"] > 0
    assert 0 <= metrics["actor/clipfrac"] <= 1


def test_grpo_advantages_of_a_group_reach_its_tokens(text_policy, distributed):
    model, encoder = text_policy
    cfg = load_config("bandit_text", ["rollout.group_size=4", "rollout.env_groups=1", "train.mini_batch_size=4"])
    samples = answer_samples(encoder, ["Left", "Right", "Left", "Right"], [0, 0, 0, 0])
    for sample, score in zip(samples, [1.0, 0.0, 1.0, 0.0]):
        sample.group_id, sample.score = 0, score
    engine = make_engine(model, cfg, cfg.train.actor_lr, distributed)
    annotate(samples, engine, None, None, cfg, encoder.pad_id, distributed.device)
    compute_advantages(samples, cfg)
    # scores 1,0,1,0: mean 0.5, unbiased std 0.5774 -> +-0.866 on every generated token
    for sample, sign in zip(samples, [1, -1, 1, -1]):
        generated = sample.extra["advantages"][sample.loss_mask > 0]
        assert torch.allclose(generated, torch.full_like(generated, sign * 0.5 / (0.5773503 + 1e-6)), atol=1e-4)
        assert torch.all(sample.extra["advantages"][sample.loss_mask == 0] == 0)
