"""`model.attn_implementation`: the attention kernel of the policy, critic and reference.

sdpa (the default) and eager must compute the same numbers on every path vagen runs: the decoder's
cache kept across turns with its left-padded turns and masked slots, and the training forward over a
right-padded batch with M-RoPE positions and a shared prefix. flash_attention_2 is refused where the
flash-attn package is missing (transformers would fetch a kernel from the hub instead) or the dtype is
float32."""

import importlib.metadata
import importlib.util

import pytest
import torch

from vagen.config import ConfigError, load_config
from vagen.episode import ChatEncoder
from vagen.models import load_policy, resolve_model_path
from vagen.rollout import rollout
from vagen.trajectory import episode_to_sample
from vagen.update import annotate


def _played(model, processor, cfg):
    encoder = ChatEncoder(processor)
    torch.manual_seed(3)  # transformers' decoding draws from the global generator
    episodes, _ = rollout(model, encoder, cfg, [0, 1], group_size=1)
    samples = [episode_to_sample(ep, encoder, model) for ep in episodes]
    annotate(samples, model, None, None, cfg, encoder.pad_id, torch.device("cpu"))
    return episodes, samples


def test_sdpa_and_eager_play_and_score_the_same_tokens():
    # the shipped warm start ends episodes at different turns and answers at different lengths
    path = resolve_model_path("assets:frozenlake_visual")
    cfg = load_config("frozenlake_visual", ["rollout.max_turns=2", "train.micro_batch_size=4"])
    assert cfg.model.attn_implementation == "sdpa"
    sdpa, processor = load_policy(path, attn_implementation=cfg.model.attn_implementation)
    eager, _ = load_policy(path, attn_implementation="eager")
    for model, name in ((sdpa, "sdpa"), (eager, "eager")):  # the vision tower's attention too
        assert model.config.text_config._attn_implementation == model.config.vision_config._attn_implementation == name
    with torch.no_grad():
        sdpa_episodes, sdpa_samples = _played(sdpa, processor, cfg)
        eager_episodes, eager_samples = _played(eager, processor, cfg)
    # the same draws from the same seed: decoding with the cache across turns agrees token for token
    assert [ep.input_ids for ep in sdpa_episodes] == [ep.input_ids for ep in eager_episodes]
    # rows that leave the decoder's cache early, and rows of different lengths in the training batch
    assert [len(ep.turns) for ep in sdpa_episodes] == [1, 2]
    assert len({len(s.input_ids) for s in sdpa_samples}) == 2
    for a, b in zip(sdpa_samples, eager_samples):
        torch.testing.assert_close(b.extra["old_logprobs"], a.extra["old_logprobs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(b.extra["entropies"], a.extra["entropies"], atol=1e-5, rtol=0)
    assert sum(int(s.loss_mask.sum()) for s in sdpa_samples) > 50


@pytest.fixture
def flash_attn(monkeypatch):
    """Set `.version` (None: not installed) to make the flash-attn package look installed at that version or
    missing, and CUDA absent, whatever this machine has."""
    real_spec, real_version = importlib.util.find_spec, importlib.metadata.version

    class Package:
        version = None

    def find_spec(name, *args, **kwargs):
        if name == "flash_attn":
            return None if Package.version is None else real_spec("json")  # any spec stands for the package
        return real_spec(name, *args, **kwargs)

    def version(name):
        return Package.version if name == "flash-attn" else real_version(name)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return Package


BF16 = ["model.dtype=bfloat16", "train.deepspeed_config=deepspeed/zero2_bf16.json"]
FLASH = ["model.attn_implementation=flash_attention_2"]


def test_flash_attention_2_is_refused_without_flash_attn_a_gpu_or_bfloat16(flash_attn):
    path = resolve_model_path("assets:frozenlake_visual")  # refused before anything loads
    missing = ("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not installed in "
               "this environment; install it .* or use model.attn_implementation=sdpa")
    with pytest.raises(ConfigError, match=missing):
        load_config("sokoban_visual", FLASH + BF16)
    with pytest.raises(ValueError, match=missing + rf" \(loading {path}\)"):
        load_policy(path, "bfloat16", attn_implementation="flash_attention_2")
    flash_attn.version = "2.3.2"  # transformers 5 treats it as absent and would fetch a kernel from the hub
    with pytest.raises(ConfigError, match=r"needs flash-attn >= 2.3.3, found 2.3.2; upgrade it"):
        load_config("sokoban_visual", FLASH + BF16)
    flash_attn.version = "2.8.3"
    assert load_config("sokoban_visual", FLASH + BF16).model.attn_implementation == "flash_attention_2"
    with pytest.raises(ConfigError, match="flash_attention_2 with model.dtype=float32: flash-attn computes in "
                                          "float16/bfloat16 only; set model.dtype=bfloat16"):
        load_config("sokoban_visual", FLASH)
    with pytest.raises(ValueError, match="flash_attention_2 runs on CUDA GPUs only, and torch sees none here"):
        load_policy(path, "bfloat16", attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match="'flash_attention' is not a valid choice; did you mean 'flash_attention_2'"):
        load_config("sokoban_visual", ["model.attn_implementation=flash_attention"])
