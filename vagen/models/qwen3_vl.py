"""Qwen3-VL (dense): a ViT with 16-pixel patches merged 2x2 into one token (a token sees 32x32 pixels),
learnt position embeddings interpolated to each image, DeepStack (features of early vision layers added
to the first language layers' hidden states at the image tokens), interleaved M-RoPE, and a Qwen3
language model of full-attention layers: a key/value cache, where padding is inert.

Thinking checkpoints (Qwen3-VL-*-Thinking) open their answers with `<think>\\n` in their own chat
template's generation prompt; vagen writes its own markup (`<|im_start|>assistant\\n`, the response
format asked for by the environment's prompt), the same for every family."""

from __future__ import annotations

from vagen.models.family import CHAT_TEMPLATE, Family, mrope_section, vision_special_ids


def qwen3_vision_processor(spec, tokenizer):
    """The Qwen3-VL processor (Qwen3-VL and Qwen3.5 share it): 16-pixel patches, pixel bounds of `spec`."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    size = {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}
    image = Qwen2VLImageProcessor(size=size, patch_size=16, merge_size=2, temporal_patch_size=2,
                                  image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    video = Qwen3VLVideoProcessor(size=size, patch_size=16, merge_size=2, temporal_patch_size=2)
    return Qwen3VLProcessor(image_processor=image, tokenizer=tokenizer, video_processor=video,
                            chat_template=CHAT_TEMPLATE)


def qwen3_vision_config(spec) -> dict:
    return dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=2 * spec.vision_hidden,
                num_heads=spec.vision_heads, out_hidden_size=spec.hidden_size, patch_size=16, spatial_merge_size=2,
                num_position_embeddings=256)


class Qwen3VL(Family):
    def build_tiny(self, spec, tokenizer, text: dict):
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        head_dim = spec.hidden_size // spec.num_heads
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim),
                "mrope_interleaved": True}
        vision = dict(qwen3_vision_config(spec), deepstack_visual_indexes=[0])
        config = Qwen3VLConfig(text_config=dict(text, head_dim=head_dim, rope_parameters=rope),
                               vision_config=vision, tie_word_embeddings=True, **vision_special_ids(tokenizer))
        return Qwen3VLForConditionalGeneration(config), qwen3_vision_processor(spec, tokenizer)


QWEN3_VL = Qwen3VL(name="qwen3_vl", vision=True, builtin="builtin:tiny-qwen3-vl",
                   architectures={"qwen3_vl": "Qwen3VLForConditionalGeneration"})
