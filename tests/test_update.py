import copy

import pytest
import torch
from update_fixtures import answer_samples, response_logprob

from vagen.config import load_config
from vagen.episode import ChatEncoder
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


def _grpo_group_with_advantages(text_policy, distributed):
    """One group of four one-turn answers scored 1, 0, 1, 0, annotated, with GRPO advantages."""
    model, encoder = text_policy
    cfg = load_config("bandit_text", ["rollout.group_size=4", "rollout.env_groups=1", "train.mini_batch_size=4"])
    samples = answer_samples(encoder, ["Left", "Right", "Left", "Right"], [0, 0, 0, 0])
    for sample, score in zip(samples, [1.0, 0.0, 1.0, 0.0]):
        sample.group_id, sample.score = 0, score
    engine = make_engine(model, cfg, cfg.train.actor_lr, distributed)
    annotate(samples, engine, None, None, cfg, encoder.pad_id, distributed.device)
    compute_advantages(samples, cfg)
    return samples, encoder


def test_grpo_advantages_of_a_group_reach_its_tokens(text_policy, distributed):
    samples, _ = _grpo_group_with_advantages(text_policy, distributed)
    # scores 1,0,1,0: mean 0.5, unbiased std 0.5774 -> +-0.866 on every generated token
    for sample, sign in zip(samples, [1, -1, 1, -1]):
        generated = sample.extra["advantages"][sample.loss_mask > 0]
        assert torch.allclose(generated, torch.full_like(generated, sign * 0.5 / (0.5773503 + 1e-6)), atol=1e-4)
        assert torch.all(sample.extra["advantages"][sample.loss_mask == 0] == 0)


def _stepping(engine) -> list[str]:
    """Records, per engine.step() call, whether the optimizer stepped ('S') or only accumulated ('.')."""
    pattern = []
    step = engine.step

    def recording(*args, **kwargs):
        before = engine.global_steps
        step(*args, **kwargs)
        pattern.append("S" if engine.global_steps > before else ".")

    engine.step = recording
    return pattern


def test_one_optimizer_step_per_minibatch_whatever_its_micro_batch_count(text_policy, distributed):
    model, encoder = text_policy
    from ppo_reference import ADVANTAGES, ANSWERS, overrides

    cfg = load_config("bandit_text", overrides(mini=8, micro=4))
    engine = make_engine(model, cfg, cfg.train.actor_lr, distributed)
    samples = answer_samples(encoder, ANSWERS, ADVANTAGES)
    annotate(samples, engine, None, None, cfg, encoder.pad_id, distributed.device)
    pattern = _stepping(engine)
    calls = []
    for _ in range(3):  # 12 trajectories, mini-batches of 8 and 4: micro-batches [2, 1]
        start = len(pattern)
        ppo_update(engine, None, samples, cfg, encoder.pad_id, distributed.device, shuffle=False)
        calls.append("".join(pattern[start:]))
    assert calls == [".SS", ".SS", ".SS"]


def test_ppo_update_equals_a_plain_update_of_whole_minibatches(text_policy, distributed):
    """Mini-batches of 8 and 4 trajectories in micro-batches of 4 ([2, 1]): the update equals one SGD step
    per mini-batch on the token mean over the whole mini-batch."""
    model, encoder = text_policy
    from ppo_reference import ADVANTAGES, ANSWERS, assert_update_equals_plain, overrides

    cfg = load_config("bandit_text", overrides(mini=8, micro=4))
    reference = copy.deepcopy(model)
    samples = answer_samples(encoder, ANSWERS, ADVANTAGES)
    assert_update_equals_plain(model, reference, samples, cfg, encoder.pad_id, distributed)


def _policy_loss_and_grads(model, batch):
    from vagen.update import token_logprobs

    model.zero_grad()
    logprobs, entropies = token_logprobs(model, batch, temperature=0.8, with_entropy=True)
    mask = batch["sampled_mask"]
    loss = -(logprobs * mask).sum() / mask.sum() - 0.01 * (entropies * mask).sum() / mask.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_vl):
    """The shared-prefix forward needs a key/value cache, which transformers does not build while
    checkpointing in training: the batch then runs whole, with equal results."""
    from vagen.trajectory import collate

    _, model, processor = tiny_vl
    encoder = ChatEncoder(processor)
    samples = answer_samples(encoder, ["Left", "Right, Up", "Down"], [1.0, -1.0, 0.5])
    batch = collate(samples, encoder.pad_id)
    plain = copy.deepcopy(model).train()
    checkpointed = copy.deepcopy(model).train()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, grads = _policy_loss_and_grads(plain, batch)
    loss_ckpt, grads_ckpt = _policy_loss_and_grads(checkpointed, batch)
    torch.testing.assert_close(loss_ckpt, loss, atol=1e-5, rtol=0)
    assert grads.keys() == grads_ckpt.keys() and len(grads) > 10
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_logprobs_at_real_vocabulary_size_peak_within_twice_the_bf16_logits():
    """One forward and backward of a Qwen2.5-VL-shaped bf16 model with the real 151,936-entry vocabulary:
    the log-probabilities and entropies never hold the whole [positions, vocab] logits in float32."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from child_env import child_env

    worker = Path(__file__).parent / "memory_worker.py"
    # Fixed mmap threshold: freed tensors go back to the system at once, so resident memory follows the
    # live tensors instead of what malloc keeps in its arenas.
    env = child_env(MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["positions"] == 512 and measured["finite"]
    assert measured["rise"] <= 2 * measured["bf16_logits"], measured


def test_appended_im_end_keeps_its_advantage_but_gets_no_policy_gradient(text_policy, distributed):
    samples, encoder = _grpo_group_with_advantages(text_policy, distributed)  # bandit_text uses GRPO
    for sample in samples:
        end = int(sample.turn_end_mask.nonzero()[-1])  # the <|im_end|> that `answer_samples` appended
        generated = sample.loss_mask.nonzero().squeeze(-1)
        assert sample.input_ids[end] == encoder.im_end_id and sample.loss_mask[end] == 1
        assert sample.extra["advantages"][end] != 0 and sample.extra["adv_mask"][end] == 0
        assert torch.equal(sample.extra["adv_mask"][generated[:-1]], torch.ones(len(generated) - 1))


def test_filter_keeps_the_groups_of_highest_reward_std_and_makes_their_ids_global(text_policy):
    from vagen.batch_plan import filter_groups

    _, encoder = text_policy
    cfg = load_config("bandit_text", ["rollout.group_size=2", "rollout.env_groups=4", "train.mini_batch_size=4",
                                      "algo.filter_mode=std", "algo.filter_keep_ratio=0.5"])
    samples = answer_samples(encoder, ["Left"] * 8, [0.0] * 8)
    scores = [0, 0, 1, 0, 0, 3, 2, 2]  # in-group stds: 0, 0.71, 2.1, 0
    for i, (sample, score) in enumerate(zip(samples, scores)):
        sample.group_id, sample.score = i // 2, float(score)
    kept, stats = filter_groups(samples, cfg, rank=0, world_size=1)
    assert [s.group_id for s in kept] == [1, 1, 2, 2]
    assert stats["kept_groups"] == 2 and stats["total_groups"] == 4


@pytest.mark.parametrize("deepspeed_config, dtype", [("deepspeed/zero0_fp32.json", "float32"),
                                                     ("deepspeed/zero2_bf16.json", "bfloat16")])
def test_a_nan_loss_skips_the_step_and_leaves_the_weights_as_they_were(text_policy, distributed, monkeypatch,
                                                                        deepspeed_config, dtype):
    import vagen.update

    model, encoder = text_policy
    model = model.to(getattr(torch, dtype))
    cfg = load_config("bandit_text", ["train.actor_lr=1e-3", "train.mini_batch_size=4", "train.micro_batch_size=2",
                                      "rollout.group_size=4", "rollout.env_groups=1", f"model.dtype={dtype}",
                                      f"train.deepspeed_config={deepspeed_config}"])
    engine = make_engine(model, cfg, cfg.train.actor_lr, distributed)
    samples = answer_samples(encoder, ["Left", "Right", "Left, Up", "Down"], [1.0, -1.0, 0.5, -0.5])
    annotate(samples, engine, None, None, cfg, encoder.pad_id, distributed.device)
    real = vagen.update.core.ppo_policy_loss
    calls = []

    def second_micro_batch_nan(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 2 else loss), metrics

    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(vagen.update.core, "ppo_policy_loss", second_micro_batch_nan)
    metrics = ppo_update(engine, None, samples, cfg, encoder.pad_id, distributed.device, shuffle=False,
                         bad_steps_in_a_row=1)
    assert len(calls) == 2 and metrics["actor/skipped_steps"] == 1 and metrics["update/bad_steps_in_a_row"] == 2
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    monkeypatch.setattr(vagen.update.core, "ppo_policy_loss", real)
    metrics = ppo_update(engine, None, samples, cfg, encoder.pad_id, distributed.device, shuffle=False,
                         bad_steps_in_a_row=2)
    assert metrics["actor/skipped_steps"] == 0 and metrics["update/bad_steps_in_a_row"] == 0
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the run goes on
