"""The data of a rollout and the token ids it is made of, below every module that fills or reads them.

An episode's token sequence is the Qwen chat markup built turn by turn:

    <|im_start|>system\\n{system prompt}<|im_end|>\\n
    <|im_start|>user\\n{observation, images as <|vision_start|><|image_pad|>*n<|vision_end|>}<|im_end|>\\n
    <|im_start|>assistant\\n{generated ids}<|im_end|>            <- loss_mask = 1 here
    \\n<|im_start|>user\\n{next observation}...

Generated ids are kept as sampled (never re-tokenised from text). Frames are resized once, by
`ChatEncoder.resize` (Qwen's `smart_resize` under the processor's pixel bounds): the resized frame is
what the `transformers` processor, a vLLM engine and training all see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from envs_visual.base import IMAGE_PLACEHOLDER
from vagen.models import VISION_TOKENS, tokenizer_of

# Seeds at or above this are reserved for evaluation, so training and evaluation levels never overlap.
EVAL_SEED_BASE = 1_000_000_000


def train_seeds(iteration: int, env_groups: int, base_seed: int = 0) -> list[int]:
    """Level seeds of training iteration `iteration`: distinct across iterations, below EVAL_SEED_BASE."""
    start = (base_seed * 1_000_003 + iteration * env_groups) % (EVAL_SEED_BASE - env_groups)
    return [start + i for i in range(env_groups)]


def eval_seeds(n: int, offset: int = 0) -> list[int]:
    return [EVAL_SEED_BASE + offset + i for i in range(n)]


@dataclass
class Turn:
    """One turn of an episode: what the agent saw, what it answered, what the env returned."""

    observation: str
    images: list[Image.Image]
    response: str
    reward: float
    info: dict[str, Any]
    # [start, end) of the generated ids (closing <|im_end|> included) in Episode.input_ids, or with
    # rollout.context=window in the turn's own sequence, `context.input_ids`
    span: tuple[int, int]
    response_length: int  # generated tokens, the closing <|im_end|> included
    # Whether the policy sampled the closing <|im_end|> itself. When generation stopped at `</answer>`,
    # at rollout.max_new_tokens or on <|endoftext|>, the <|im_end|> was appended: it ends the turn for
    # rewards and values but was never drawn, so it gets no policy gradient, entropy or KL.
    end_sampled: bool = False
    # The decoding engine's log-probability of each generated id (without an appended <|im_end|>),
    # where the engine reports them (vLLM); the trainer's own are computed at the update.
    sampled_logprobs: list[float] | None = None
    # The environment's `info["state_key"]` of the state this turn started from (from `reset` for the
    # first turn, from the previous `step` after): the anchor state GiGPO groups turns by. None when the
    # environment gives none.
    state_key: Any = None
    # rollout.context=window: the sequence this turn was generated from and is trained on (its window of
    # earlier turns, its observation, its response); None with rollout.context=full, where it is the
    # episode's own
    context: TurnContext | None = None
    # The policy version that sampled this turn: the updates completed before it was generated. With
    # rollout.max_staleness > 0 an episode's turns may come from several versions; the update is this many
    # versions later or more, its staleness (`vagen.staleness`).
    version: int = 0


@dataclass
class TurnContext:
    """What one turn's policy saw and produced with rollout.context=window: the system prompt, the window's
    earlier turns (observations, frames and responses), the turn's observation and its response."""

    input_ids: list[int]
    pixel_values: list[torch.Tensor]  # one [n_patches, d] per image of the window
    image_grid_thw: list[torch.Tensor]  # one [3] per image


@dataclass
class Segment:
    """One observation as the model reads it (text with image placeholders, frames resized, their pixel
    values and grids) and the response ids that answered it (None until the turn closes). Kept per turn
    with rollout.context=window, to build later turns' windows without re-encoding frames."""

    text: str
    images: list[Image.Image]
    pixel_values: list[torch.Tensor]
    image_grid_thw: list[torch.Tensor]
    response_ids: list[int] | None = None


@dataclass
class Episode:
    """One played episode. `input_ids`, `pixel_values`, `image_grid_thw` and `images` are what the decoder
    reads for the next turn: the whole history with rollout.context=full (the episode's training sequence),
    the current turn's window with rollout.context=window (each turn's own sequence is `Turn.context`)."""

    env_name: str
    seed: int
    group_id: int
    system_prompt: str
    input_ids: list[int] = field(default_factory=list)
    pixel_values: list[torch.Tensor] = field(default_factory=list)  # one [n_patches, d] per image
    image_grid_thw: list[torch.Tensor] = field(default_factory=list)  # one [3] per image
    images: list[Image.Image] = field(default_factory=list)  # the frames as resized for the model, in order
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    success: bool = False
    truncated_by_length: bool = False
    initial_observation: Any = None
    initial_state_key: Any = None  # the environment's `info["state_key"]` after `reset`
    error: str | None = None  # the environment raised: its exception in one line; the episode ended there
    # A served model's request failed on every try (`vagen.api_policy`): the episode ended there, unscored
    model_error: str | None = None
    segments: list[Segment] = field(default_factory=list)  # rollout.context=window: every observation so far
    # This rank's number of the episode's group, counted over the run in admission order (rollout.max_staleness)
    admission: int = 0
    task: str = ""  # rollout.tasks: the name of the task the episode belongs to ("" in a run of one environment)

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))


class ChatEncoder:
    """Builds token ids of chat segments exactly as the checkpoint's chat template would, with image
    placeholders expanded to the processor's token count for each image."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = tokenizer_of(processor)
        self.is_vision = hasattr(processor, "image_processor")
        tok = self.tokenizer
        self.im_end_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
        self.stop_ids = {self.im_end_id, tok.convert_tokens_to_ids("<|endoftext|>")}
        self.image_pad_id = tok.convert_tokens_to_ids("<|image_pad|>") if self.is_vision else None
        if self.is_vision:
            self.merge = processor.image_processor.merge_size
        suppressed = ["<|im_start|>"] + list(VISION_TOKENS)
        vocab = tok.get_vocab()
        self.suppress_ids = sorted({vocab[t] for t in suppressed if t in vocab})

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def resize(self, image: Image.Image) -> Image.Image:
        """`image` at the size the model reads it: sides multiples of the patch group (28 pixels for
        Qwen2.5-VL), area within the processor's pixel bounds, aspect kept (Qwen's `smart_resize`).
        The processor leaves a frame of that size as it is, so every backend sees these pixels."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        image_processor = self.processor.image_processor
        size = image_processor.size
        factor = image_processor.patch_size * image_processor.merge_size
        height, width = smart_resize(image.height, image.width, factor=factor,
                                     min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])
        image = image.convert("RGB")
        return image if (width, height) == image.size else image.resize((width, height), Image.BICUBIC)

    def images_to_inputs(self, images: list[Image.Image]):
        """Pixel values [n_patches, d] and grid [3] of each image, which must be resized already."""
        if not images:
            return [], []
        out = self.processor.image_processor(images=images, return_tensors="pt")
        grids = list(out["image_grid_thw"])
        counts = [int(g.prod()) for g in grids]
        pixel_values = list(torch.split(out["pixel_values"], counts))
        return pixel_values, grids

    def user_segment(self, text: str, images: list[Image.Image], first: bool, system: str | None):
        """Token ids of a user turn followed by the assistant header, and its image inputs. Frames are
        resized here unless they come resized already (`resize` leaves those as they are)."""
        if images and not self.is_vision:
            raise ValueError("this model has no vision tower but the environment returned images; "
                             "set env.render_mode=text or use a vision-language checkpoint")
        images = [self.resize(image) for image in images]
        pixel_values, grids = self.images_to_inputs(images)
        return self.segment_ids(text, grids, first, system), pixel_values, grids

    def segment_ids(self, text: str, grids: list[torch.Tensor], first: bool, system: str | None) -> list[int]:
        """Token ids of a user turn whose images have grids `grids` (image placeholders expanded to each
        image's token count), followed by the assistant header; `first` opens with the system prompt."""
        parts = text.split(IMAGE_PLACEHOLDER)
        assert len(parts) == len(grids) + 1, f"{len(parts) - 1=} placeholders, {len(grids)=} images"
        content = parts[0]
        for grid, part in zip(grids, parts[1:]):
            n = int(grid.prod()) // (self.merge**2)
            content += "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" + part
        prefix = f"<|im_start|>system\n{system}<|im_end|>\n" if first else "\n"
        segment = f"{prefix}<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
        return self.encode_text(segment)

    def finish_response(self, generated: list[int]) -> tuple[list[int], str]:
        """Cut generated ids at the first stop token and close the turn with <|im_end|>; return the
        ids and the response text up to and including the first `</answer>`."""
        ids = []
        for token in generated:
            if token in self.stop_ids:
                break
            ids.append(int(token))
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = text.find("</answer>")
        if cut >= 0:
            text = text[: cut + len("</answer>")]
        return ids + [self.im_end_id], text

    def sampled_end(self, generated: list[int]) -> bool:
        """Whether the first stop token of `generated` is <|im_end|>, i.e. the turn's closing token was
        sampled rather than appended by `finish_response`."""
        for token in generated:
            if token in self.stop_ids:
                return token == self.im_end_id
        return False
