"""`rollout.backend=vllm` on the Qwen3-VL and Qwen3.5 built-ins against real vLLM (its CPU build, in the environment
scripts/vllm_env.sh builds), marked `vllm`:

    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_families.py

The engine's log-probability of every sampled token equals the trainer's, before and after a weight sync. Qwen3-VL
runs in float32. vLLM's CPU kernel of Qwen3.5's linear-attention layers takes bfloat16 only (and a head size of
128, which the built-in has), so Qwen3.5 is held to what bfloat16 can represent: each token's gap within
`BF16_STEPS` steps of bfloat16 at the largest logit of the row it was drawn from (`bf16_steps`), a bound that
does not depend on the processor's bfloat16 kernels."""

from __future__ import annotations

import copy

import pytest
import torch
from test_vllm import BF16_STEPS, bf16_steps, require_vllm, sampled_gaps

from vagen.config import load_config
from vagen.decoding_vllm import VLLMDecoder
from vagen.episode import ChatEncoder
from vagen.models import load_policy, resolve_model_path
from vagen.rollout import rollout
from vagen.trajectory import collate, episode_to_sample
from vagen.update import token_logprobs

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-4  # float32 on both sides


def _gaps_before_and_after_a_sync(path, dtype: str, with_steps: bool = False):
    """|engine - trainer| of every sampled token of two 2-turn episodes; the same after one AdamW step of the
    trainer's model synced into the engine; and the synced engine's tokens against the model before the step.
    `with_steps`: each as a tensor divided by `bf16_steps` of the trainer's model that sampled it."""
    model, processor = load_policy(path, dtype)
    model.eval()
    encoder = ChatEncoder(processor)
    decoder = VLLMDecoder(path, encoder, dtype=dtype, seed=0)
    cfg = load_config(None, ["rollout.max_turns=2", "rollout.max_new_tokens=12", "rollout.temperature=1.0",
                             "env.name=sokoban", "env.render_mode=vision"])
    played = dict(seeds=[5], group_size=2, decoder=decoder, sample_seed=3)
    try:
        before, _ = rollout(model, encoder, cfg, **played)
        updated = copy.deepcopy(model).train()
        batch = collate([episode_to_sample(ep, encoder, updated) for ep in before], encoder.pad_id)
        logprobs, _ = token_logprobs(updated, batch, 1.0, with_entropy=False, suppress_ids=encoder.suppress_ids)
        (-(logprobs * batch["loss_mask"]).sum()).backward()
        torch.optim.AdamW(updated.parameters(), lr=1e-2).step()
        updated.eval()
        decoder.sync_weights(updated)
        after, _ = rollout(updated, encoder, cfg, **played)
        gaps = (sampled_gaps(model, encoder, before, 1.0), sampled_gaps(updated, encoder, after, 1.0),
                sampled_gaps(model, encoder, after, 1.0))
        if not with_steps:
            return gaps
        steps = (bf16_steps(model, encoder, before), bf16_steps(updated, encoder, after), bf16_steps(model, encoder, after))
        return tuple(torch.tensor(gap) / step for gap, step in zip(gaps, steps))
    finally:
        decoder.close()


def test_qwen3_vl_samples_the_trainers_policy_before_and_after_a_sync(model_cache):
    require_vllm()
    before, after, to_old = _gaps_before_and_after_a_sync(resolve_model_path("builtin:tiny-qwen3-vl", model_cache),
                                                          "float32")
    assert len(before) >= 12 and max(before) < TOLERANCE, f"max |vLLM - trainer| {max(before):.2e}"
    assert max(after) < TOLERANCE, f"after the sync: max |vLLM - updated trainer| {max(after):.2e}"
    assert max(to_old) > 100 * TOLERANCE, f"the step moved the log-probs by only {max(to_old):.2e}"
    print(f"Qwen3-VL float32: max gap {max(before):.1e} before, {max(after):.1e} after a sync")


def test_qwen3_5_samples_the_trainers_policy_within_what_bfloat16_represents(model_cache):
    require_vllm()
    path = resolve_model_path("builtin:tiny-qwen3.5", model_cache)
    with pytest.raises(ValueError, match="Qwen3.5 on the CPU in bfloat16 only .* set model.dtype=bfloat16"):
        VLLMDecoder(path, ChatEncoder(load_policy(path)[1]), dtype="float32")
    before, after, to_old = _gaps_before_and_after_a_sync(path, "bfloat16", with_steps=True)
    print(f"Qwen3.5 bfloat16: largest gap {before.max():.2f} bfloat16 steps before a sync, {after.max():.2f} after; "
          f"{to_old.max():.1f} to the model before the step")
    assert len(before) >= 12 and before.max() < BF16_STEPS, f"{before.max():.2f} bfloat16 steps (bound {BF16_STEPS})"
    assert after.max() < BF16_STEPS, f"after the sync: {after.max():.2f} bfloat16 steps (bound {BF16_STEPS})"
    assert to_old.max() > 5 * BF16_STEPS, f"the step moved the log-probs by only {to_old.max():.2f} bfloat16 steps"
