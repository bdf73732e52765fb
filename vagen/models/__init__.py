"""Policies, critics and their processors: local Hugging Face checkpoints or the built-in tiny models.

`model.path` is a local checkpoint directory of a model family vagen knows (`families.py`: Qwen2-VL and
Qwen2.5-VL, Qwen3-VL, Qwen3.5, and the text-only Qwen2/Qwen3 causal LMs; chosen by config.json's
`model_type`, any other refused), a warm start the repository ships, `assets:NAME` (the checkpoint in
assets/checkpoints/NAME, built by `python -m vagen.sft`, its `card.json` saying how and how well it
plays), or a built-in tiny model of a family:

- `builtin:tiny-vl` — a real Qwen2.5-VL architecture with about 0.8 M parameters (text hidden 128 × 2
  layers, vision tower 2 × 64), the stock Qwen image processor with small pixel bounds, and a
  byte-level BPE tokenizer trained locally on the environments' own prompt text;
- `builtin:tiny-qwen3-vl`, `builtin:tiny-qwen3.5` — Qwen3-VL and Qwen3.5 (one linear-attention and one
  full-attention layer) of the same sizes and tokenizer, with the Qwen3-VL processor;
- `builtin:tiny-text` — the same tokenizer with a Qwen2 causal LM of the same text size.

Built-ins are random-initialised from a seed, built offline in seconds, saved with `save_pretrained`
into a cache directory keyed by their specification, and loaded back through the Auto classes like
any checkpoint. Nothing is ever downloaded.

The package's files: `family.py` (what a model family owns) with one file per family and `families.py`
(the known ones, `family_of`); `builtin.py` (the built-ins, `resolve_model_path`); `loading.py`
(`load_policy`); `image_hooks.py` (the built-in VLM's image hooks); `adapters.py` (LoRA); `forward.py`
(positions, the shared-prefix forward); `critic.py` (`ValueModel`).
"""

import torch._dynamo  # noqa: F401

# torch._dynamo loads Triton, whose LLVM crashes the process (segfault) when Mesa's LLVM is already
# loaded by an EGL context, i.e. after a MuJoCo frame was rendered. Loading it first is safe.
from vagen.models.adapters import (  # noqa: E402
    AdaptersOff,
    add_adapters,
    check_lora_targets,
    has_adapters,
    lora_targets,
    target_names,
    without_wrapper,
)
from vagen.models.builtin import (  # noqa: E402
    BUILTINS,
    TinySpec,
    base_checkpoint,
    is_vision_checkpoint,
    resolve_model_path,
    tokenizer_corpus,
)
from vagen.models.critic import ValueModel, saved_critic  # noqa: E402
from vagen.models.families import FAMILIES, builtin_family, family_of, known_model_types  # noqa: E402
from vagen.models.family import CHAT_TEMPLATE, SPECIAL_TOKENS, VISION_TOKENS, Family  # noqa: E402
from vagen.models.forward import (  # noqa: E402
    MIN_SHARED_PREFIX,
    cache_argument,
    forward_packed,
    forward_shared_prefix,
    generated_positions,
    rope_positions,
    select_rows,
    shared_prefix_length,
)
from vagen.models.image_hooks import (  # noqa: E402
    CENTER_IMAGE_TOKENS,
    IMAGE_POSITION_CODE,
    POSITION_FREQUENCIES,
    center_image_tokens,
    image_position_code,
    matmul_patch_embedding,
)
from vagen.models.loading import (  # noqa: E402
    DTYPES,
    backbone_of,
    disable_dropout,
    load_policy,
    set_pixel_bounds,
    tokenizer_of,
)

__all__ = [
    "AdaptersOff", "BUILTINS", "CENTER_IMAGE_TOKENS", "CHAT_TEMPLATE", "DTYPES", "FAMILIES", "Family",
    "IMAGE_POSITION_CODE", "MIN_SHARED_PREFIX", "POSITION_FREQUENCIES", "SPECIAL_TOKENS", "TinySpec",
    "VISION_TOKENS", "ValueModel", "add_adapters", "backbone_of", "base_checkpoint", "builtin_family",
    "cache_argument", "center_image_tokens", "check_lora_targets", "disable_dropout", "family_of",
    "forward_packed", "forward_shared_prefix", "generated_positions", "has_adapters", "image_position_code", "is_vision_checkpoint",
    "known_model_types", "load_policy", "lora_targets", "matmul_patch_embedding", "resolve_model_path",
    "rope_positions", "saved_critic", "select_rows", "set_pixel_bounds", "shared_prefix_length", "target_names",
    "tokenizer_corpus", "tokenizer_of", "without_wrapper",
]
