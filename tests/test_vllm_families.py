"""`rollout.backend=vllm` on the Qwen3-VL and Qwen3.5 built-ins against real vLLM (its CPU build, in the environment
scripts/vllm_env.sh builds), marked `vllm`:

    .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm_families.py

The engine's log-probability of every sampled token equals the trainer's, before and after a weight sync. Qwen3-VL
runs in float32. vLLM's CPU kernel of Qwen3.5's linear-attention layers takes bfloat16 only (and a head size of
128, which the built-in has), so Qwen3.5 is held to the bfloat16 gap of the Qwen2.5-VL built-in measured the same
way, in the same test."""

from __future__ import annotations

import copy

import pytest
import torch
from test_vllm import require_vllm, sampled_gaps, standard_copy

from vagen.config import load_config
from vagen.decoding_vllm import VLLMDecoder
from vagen.episode import ChatEncoder
from vagen.models import load_policy, resolve_model_path
from vagen.rollout import rollout
from vagen.trajectory import collate, episode_to_sample
from vagen.update import token_logprobs

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-4  # float32 on both sides


def _gaps_before_and_after_a_sync(path, dtype: str) -> tuple[list[float], list[float], list[float]]:
    """|engine - trainer| of every sampled token of two 2-turn episodes; the same after one AdamW step of the
    trainer's model synced into the engine; and the synced engine's tokens against the model before the step."""
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
        return (sampled_gaps(model, encoder, before, 1.0), sampled_gaps(updated, encoder, after, 1.0),
                sampled_gaps(model, encoder, after, 1.0))
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


def test_qwen3_5_samples_the_trainers_policy_in_bfloat16_within_qwen2_5_vls_gap(model_cache, tmp_path):
    require_vllm()
    path = resolve_model_path("builtin:tiny-qwen3.5", model_cache)
    with pytest.raises(ValueError, match="Qwen3.5 on the CPU in bfloat16 only .* set model.dtype=bfloat16"):
        VLLMDecoder(path, ChatEncoder(load_policy(path)[1]), dtype="float32")
    reference = standard_copy(resolve_model_path("builtin:tiny-vl", model_cache), tmp_path / "tiny-vl")
    qwen2_5_vl = [max(gaps) for gaps in _gaps_before_and_after_a_sync(reference, "bfloat16")[:2]]
    before, after, to_old = _gaps_before_and_after_a_sync(path, "bfloat16")
    print(f"bfloat16 max gaps before / after a sync: Qwen2.5-VL {qwen2_5_vl[0]:.1e} / {qwen2_5_vl[1]:.1e}; Qwen3.5 "
          f"{max(before):.1e} / {max(after):.1e}, {max(to_old):.1e} to the model before the step")
    # bfloat16 rounds both sides' logits to 8 bits of mantissa: the largest gaps over a few dozen tokens vary by
    # tens of percent between models and episodes (measured before a sync: 3.9e-3 Qwen2.5-VL, 4.8e-3 Qwen3.5)
    assert max(before) < 2 * qwen2_5_vl[0] and max(after) < 2 * qwen2_5_vl[1], (qwen2_5_vl, max(before), max(after))
    assert max(to_old) > 10 * max(qwen2_5_vl), f"the step moved the log-probs by only {max(to_old):.2e}"
