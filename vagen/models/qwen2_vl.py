"""Qwen2-VL and Qwen2.5-VL: a ViT with 14-pixel patches merged 2x2 into one token, M-RoPE positions, a
language model of full-attention layers (a key/value cache, where padding is inert)."""

from __future__ import annotations

from vagen.models.family import CHAT_TEMPLATE, Family, mrope_section, vision_special_ids
from vagen.models.image_hooks import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE


class Qwen2VL(Family):
    def build_tiny(self, spec, tokenizer, text: dict):
        from transformers import (
            Qwen2_5_VLConfig,
            Qwen2_5_VLForConditionalGeneration,
            Qwen2_5_VLProcessor,
            Qwen2VLImageProcessor,
            Qwen2VLVideoProcessor,
        )

        head_dim = spec.hidden_size // spec.num_heads
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section(head_dim)}
        config = Qwen2_5_VLConfig(
            text_config=dict(text, rope_parameters=rope),
            vision_config=dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden,
                               intermediate_size=2 * spec.vision_hidden, num_heads=spec.vision_heads,
                               out_hidden_size=spec.hidden_size, fullatt_block_indexes=[spec.vision_depth - 1],
                               window_size=112),
            tie_word_embeddings=True, **vision_special_ids(tokenizer))
        # Stored in config.json, so every checkpoint trained from this model keeps it; see
        # `vagen.models.image_hooks.center_image_tokens`.
        setattr(config, CENTER_IMAGE_TOKENS, spec.center_image_tokens)
        if spec.image_position_code:
            setattr(config, IMAGE_POSITION_CODE, True)
        bounds = dict(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
        processor = Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(**bounds), tokenizer=tokenizer,
                                        video_processor=Qwen2VLVideoProcessor(**bounds), chat_template=CHAT_TEMPLATE)
        return Qwen2_5_VLForConditionalGeneration(config), processor


QWEN2_VL = Qwen2VL(name="qwen2_vl", vision=True, builtin="builtin:tiny-vl",
                   architectures={"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                  "qwen2_vl": "Qwen2VLForConditionalGeneration"})
