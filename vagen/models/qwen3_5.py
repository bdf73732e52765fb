"""Qwen3.5 (dense): natively multimodal, Qwen3-VL's vision tower (without DeepStack), and a hybrid
language model: Gated DeltaNet linear-attention layers (a causal convolution over the last few tokens and
a recurrent state) between full-attention layers (gated output, partial rotary M-RoPE).

What the hybrid layers change:
- Every token fed moves a linear layer's state, padding included (its hidden state is zeroed, but the
  convolution window shifts and the recurrent state decays): padding is not inert, so the `hf` decoder
  does not keep the cache across turns (`inert_padding`).
- The layers update their cache states in place, so a cache built under autograd cannot be continued
  under autograd: the shared-prefix forward runs whole when gradients are on (`cache_under_gradients`).
- Packed micro-batches (`train.pack_sequences`) are refused: transformers' torch kernel of the linear layers
  carries the recurrent state from one packed sample into the next (only its flash-linear-attention path
  reads sequence boundaries).
- LoRA targets add the linear layers' projections (`in_proj_qkv`, `in_proj_z`, `in_proj_a`, `in_proj_b`,
  `out_proj`) to the attention and MLP ones.
- vLLM keeps one state per sequence for the linear layers; with prefix caching it needs chunked prefill.
  Its CPU kernels for them want bfloat16 and a linear-attention head size of 128."""

from __future__ import annotations

from vagen.models.family import ATTENTION_AND_MLP, Family, mrope_section, vision_special_ids
from vagen.models.qwen3_vl import qwen3_vision_config, qwen3_vision_processor

LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")


class Qwen3_5(Family):
    def vllm_options(self, on_gpu: bool, dtype: str) -> dict:
        if not on_gpu and dtype != "bfloat16":
            raise ValueError(f"rollout.backend=vllm runs Qwen3.5 on the CPU in bfloat16 only (vLLM's CPU kernel of its "
                             f"linear-attention layers), not model.dtype={dtype}; set model.dtype=bfloat16, or use "
                             f"rollout.backend=hf")
        # Prefix caching keeps the linear layers' state at block boundaries ("align" mode), which vLLM
        # computes only with chunked prefill.
        return {"enable_chunked_prefill": True}

    def build_tiny(self, spec, tokenizer, text: dict):
        from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

        head_dim = spec.hidden_size // spec.num_heads
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "mrope_section": mrope_section(head_dim // 2), "mrope_interleaved": True}
        layer_types = ["linear_attention" if (k + 1) % 2 else "full_attention" for k in range(spec.num_layers)]
        # vLLM's CPU kernels of the linear layers take head size 128 only
        linear = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                      linear_num_value_heads=2, linear_conv_kernel_dim=4)
        config = Qwen3_5Config(text_config=dict(text, head_dim=head_dim, rope_parameters=rope,
                                                layer_types=layer_types, **linear),
                               vision_config=qwen3_vision_config(spec), tie_word_embeddings=True,
                               **vision_special_ids(tokenizer))
        return Qwen3_5ForConditionalGeneration(config), qwen3_vision_processor(spec, tokenizer)


QWEN3_5 = Qwen3_5(name="qwen3_5", vision=True, builtin="builtin:tiny-qwen3.5",
                  architectures={"qwen3_5": "Qwen3_5ForConditionalGeneration"},
                  lora_targets=ATTENTION_AND_MLP + LINEAR_ATTENTION, inert_padding=False, cache_under_gradients=False,
                  packs=False)
