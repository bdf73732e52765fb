"""Text-only Qwen causal LMs: Qwen2, Qwen2.5 (model_type qwen2) and Qwen3 (qwen3)."""

from __future__ import annotations

from vagen.models.family import Family


class QwenText(Family):
    def build_tiny(self, spec, tokenizer, text: dict):
        from transformers import Qwen2Config, Qwen2ForCausalLM

        text = dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        return Qwen2ForCausalLM(Qwen2Config(**text)), tokenizer


QWEN_TEXT = QwenText(name="qwen_text", architectures={"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"},
                     vision=False, builtin="builtin:tiny-text")
