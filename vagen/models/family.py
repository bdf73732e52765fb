"""What is specific to a model family, behind one interface; each family is one file beside this one.

A family is chosen by the checkpoint's `model_type` (`vagen.models.families.family_of`). It owns the
architecture names vLLM and transformers know it by, the default LoRA targets, how positions are
computed, what its cache holds (and so whether padding in it is harmless), the vLLM engine options
its kernels need, and the built-in tiny model of its architecture. The chat markup is Qwen's for
every family vagen knows, and lives here.

This module imports no sibling, so every family file can import it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Qwen's chat markup: `<|im_start|>role\ncontent<|im_end|>\n`, an image as
# `<|vision_start|><|image_pad|><|vision_end|>` (the processor expands the pad to one token per
# merged patch group).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Tokens a random model may sample that must never appear in a response.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The language model's attention and MLP projections (Qwen2, Qwen2.5-VL, Qwen3, Qwen3-VL).
ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, eq=False)
class Family:
    """One model family. Subclasses (one file each) set the fields and build their tiny model."""

    name: str
    # config.json `model_type` -> the architecture (class name) transformers and vLLM know it by
    architectures: dict
    vision: bool
    builtin: str  # the name of its built-in tiny model
    lora_targets: tuple = ATTENTION_AND_MLP  # default `model.lora_target_modules`
    # Whether a padding token fed with attention mask 0 leaves the cache as if it were never fed. True
    # for key/value caches; False where a layer keeps a recurrent state (a convolution window, a
    # linear-attention state) that every fed token moves.
    inert_padding: bool = True
    # Whether a cache built under autograd can be continued under autograd: False where layers update
    # their states in place (the backward pass of the first call needs the state the second overwrote).
    cache_under_gradients: bool = True
    # Whether a micro-batch's samples may run packed in one row (`train.pack_sequences`): attention keeps to
    # each sample through the packed positions transformers reads. False where a layer's recurrent state
    # would run from one sample into the next with transformers' own kernels.
    packs: bool = True

    @property
    def model_types(self) -> tuple:
        return tuple(self.architectures)

    def architecture(self, model_type: str) -> str:
        return self.architectures[model_type]

    def vllm_options(self, on_gpu: bool, dtype: str) -> dict:
        """vLLM engine options this family's kernels need, over vagen's defaults; raises ValueError where
        its kernels cannot run `dtype` on this device."""
        return {}

    def build_tiny(self, spec, tokenizer, text: dict):
        """(model, processor) of the built-in tiny model: `text` holds the language model's config
        fields, `tokenizer` the built-in tokenizer; weights are drawn from torch's current seed."""
        raise NotImplementedError(f"the {self.name} family has no built-in tiny model")


def mrope_section(rotary_dim: int) -> list[int]:
    """M-RoPE's split of a head's rotary frequencies (`rotary_dim` / 2 of them) between time, height and
    width, in the proportions of Qwen2.5-VL's [16, 24, 24]."""
    half = rotary_dim // 2
    return [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]


def vision_special_ids(tokenizer) -> dict:
    """The config fields naming the vision tokens' ids."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
