"""Loading a policy and its processor from a checkpoint directory (its family checked first), and what
every loaded model needs: dropout off, the image hooks its config asks for, pixel bounds."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vagen.models.adapters import without_wrapper
from vagen.models.builtin import _quiet_transformers
from vagen.models.families import family_of
from vagen.models.image_hooks import center_image_tokens, matmul_patch_embedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_policy(path: Path, dtype: str = "float32", min_pixels: int | None = None, max_pixels: int | None = None,
                attn_implementation: str = "sdpa"):
    """(model, processor) for a checkpoint directory; the processor of a text model is its tokenizer.
    `min_pixels` / `max_pixels` (`model.min_pixels` / `model.max_pixels`) replace the image
    processor's own bounds, for training and evaluation alike. `attn_implementation`
    (`model.attn_implementation`): the attention kernel of every layer, the vision tower's included. A
    checkpoint of a model family vagen does not know is refused before anything is read but its config."""
    from vagen.config import attn_implementation_error

    family = family_of(path)

    problem = attn_implementation_error(attn_implementation, dtype)
    if problem is None and attn_implementation == "flash_attention_2" and not torch.cuda.is_available():
        problem = ("model.attn_implementation=flash_attention_2 runs on CUDA GPUs only, and torch sees none here; "
                   "use model.attn_implementation=sdpa on this machine")
    if problem:
        raise ValueError(f"{problem} (loading {path})")
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    if family.vision:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=DTYPES[dtype],
                                                            attn_implementation=attn_implementation)
        center_image_tokens(model)
        matmul_patch_embedding(model)
        processor = AutoProcessor.from_pretrained(path)
        set_pixel_bounds(processor, min_pixels, max_pixels)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
        processor = AutoTokenizer.from_pretrained(path)
    disable_dropout(model)
    if _stored_as_named(model, path):
        # Built partitioned (ZeRO-3), transformers records its default key renamings as if the checkpoint
        # were in an older layout, and saving would rename keys that were never renamed.
        model._weight_conversions = []
    return model, processor


def _stored_as_named(model: nn.Module, path: Path) -> bool:
    """Whether every tensor of the checkpoint at `path` is stored under a name of `model`'s state dict."""
    from safetensors import safe_open

    keys = set()
    for shard in Path(path).glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            keys.update(handle.keys())
    return bool(keys) and keys <= set(model.state_dict())


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of `model` to 0, in its modules and its config. Rollouts sample from
    the model in eval mode; the update computes log-probabilities in train mode (gradient checkpointing
    runs only there), and with dropout those would be another function, so the first PPO ratio would
    not be 1 (Qwen2.5-VL has none; other checkpoints do)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    configs = [model.config] + [getattr(model.config, k) for k in ("text_config", "vision_config")
                                if hasattr(model.config, k)]
    for config in configs:
        for name, value in list(vars(config).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)


def tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer under the language-model head (returns hidden states, no logits); its LoRA layers,
    if any, stay in place and active."""
    return without_wrapper(model).model


def set_pixel_bounds(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """Override the image processor's pixel bounds (fewer pixels: fewer image tokens); None keeps one."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return
    size = dict(image_processor.size)
    if min_pixels:
        size["shortest_edge"] = min_pixels
    if max_pixels:
        size["longest_edge"] = max_pixels
    image_processor.size = size
