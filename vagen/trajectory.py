"""From episodes to training tensors: one token sequence per trajectory with its masks, or with
`rollout.context=window` one per turn (the turn's window, its observation and its response: `Turn.context`).

Per trajectory, aligned with `input_ids` (length L):
- `loss_mask`     1 on generated tokens (each turn's closing `<|im_end|>` included): the positions
                  of values, returns and advantages
- `sampled_mask`  1 on the tokens the policy drew: `loss_mask` without each closing `<|im_end|>`
                  that the rollout appended (after `</answer>`, at `max_new_tokens`, or in place of
                  `<|endoftext|>`); only these get policy gradient, entropy and KL
- `turn_end_mask` 1 on the last generated token of each turn (its `<|im_end|>`)
- `answer_mask`   1 on generated tokens overlapping `<answer>…</answer>`
- `think_mask`    1 on generated tokens overlapping `<think>…</think>`
- `token_rewards` each turn's reward at its turn end, 0 elsewhere
- `position_ids`  M-RoPE positions [3, L] from the model's own rope-index function (vision models)
                  or 0..L-1 (text models)
Per-token quantities computed later (old log-probabilities, values, advantages, …) are stored on the
sample under the same names and padded the same way by `collate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vagen.episode import ChatEncoder, Episode
from vagen.models import rope_positions

TOKEN_FIELDS = ("loss_mask", "sampled_mask", "turn_end_mask", "answer_mask", "think_mask", "token_rewards")


@dataclass
class Sample:
    input_ids: torch.Tensor  # [L]
    position_ids: torch.Tensor  # [3, L] or [L]
    loss_mask: torch.Tensor
    turn_end_mask: torch.Tensor
    answer_mask: torch.Tensor
    think_mask: torch.Tensor
    token_rewards: torch.Tensor
    pixel_values: torch.Tensor | None  # [n_patches, d] for all images in order
    image_grid_thw: torch.Tensor | None  # [n_images, 3]
    group_id: int
    score: float
    seed: int
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # old_logprobs, values, advantages, ...
    sampled_mask: torch.Tensor | None = None  # None: every generated token was sampled (= loss_mask)
    state_keys: list | None = None  # per turn, the environment's key of the state it started from (Turn.state_key)
    # rollout.context=window: the episode's index among the rank's played episodes and the turn's index in it;
    # with the group id they gather an episode's turn samples back into its trajectory (`vagen.update`)
    episode_index: int | None = None
    turn_index: int | None = None
    task: str = ""  # rollout.tasks: the episode's task, whose samples are whitened together (`vagen.update`)

    def __post_init__(self):
        if self.sampled_mask is None:
            self.sampled_mask = self.loss_mask.clone()

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def char_offsets(tokenizer, ids: list[int]) -> list[int]:
    """End character offset of each token in the decoded text of `ids`."""
    return [len(tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]


def tag_span(text: str, tag: str) -> tuple[int, int] | None:
    """[start, end) of the first `<tag>…</tag>` in text, tags included."""
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    end = text.find(f"</{tag}>", start)
    return (start, end + len(tag) + 3) if end >= 0 else None


def span_token_mask(offsets: list[int], span: tuple[int, int] | None) -> list[int]:
    if span is None:
        return [0] * len(offsets)
    mask, begin = [], 0
    for end in offsets:
        mask.append(int(end > span[0] and begin < span[1] and end > begin))
        begin = end
    return mask


def episode_samples(episode: Episode, encoder: ChatEncoder, model=None, index: int = 0) -> list[Sample]:
    """The training samples of an episode: its whole sequence (`rollout.context=full`), or one per turn, each
    the turn's own sequence (`rollout.context=window`), tagged with `index` (the episode's) and the turn's."""
    if not any(turn.context is not None for turn in episode.turns):
        return [episode_to_sample(episode, encoder, model)]
    return [_sample(episode, [turn], turn.context.input_ids, turn.context.pixel_values, turn.context.image_grid_thw,
                    encoder, model, episode_index=index, turn_index=k) for k, turn in enumerate(episode.turns)]


def episode_to_sample(episode: Episode, encoder: ChatEncoder, model=None) -> Sample:
    """The whole episode as one training sequence (`rollout.context=full`)."""
    return _sample(episode, episode.turns, episode.input_ids, episode.pixel_values, episode.image_grid_thw, encoder,
                   model)


def _sample(episode: Episode, turns: list, input_ids: list[int], pixel_values: list, image_grid_thw: list,
            encoder: ChatEncoder, model=None, **where) -> Sample:
    """A sample of the sequence `input_ids` (with its images), trained on the responses of `turns` (whose spans
    are in it); group, seed and score are the episode's."""
    ids = torch.tensor(input_ids, dtype=torch.long)
    L = ids.shape[0]
    masks = {name: torch.zeros(L) for name in TOKEN_FIELDS}
    for turn in turns:
        start, end = turn.span
        masks["loss_mask"][start:end] = 1
        masks["sampled_mask"][start : end if turn.end_sampled else end - 1] = 1
        masks["turn_end_mask"][end - 1] = 1
        masks["token_rewards"][end - 1] = turn.reward
        generated = input_ids[start : end - 1]  # without the closing <|im_end|>
        text = encoder.tokenizer.decode(generated, skip_special_tokens=True)
        offsets = char_offsets(encoder.tokenizer, generated)
        for name, tag in (("answer_mask", "answer"), ("think_mask", "think")):
            masks[name][start : end - 1] = torch.tensor(span_token_mask(offsets, tag_span(text, tag)), dtype=torch.float)
    grids = torch.stack(image_grid_thw) if image_grid_thw else None
    pixels = torch.cat(pixel_values) if pixel_values else None
    extra = {}
    if turns and all(t.sampled_logprobs is not None for t in turns):
        # the decoding engine's log-probabilities of the sampled tokens, where it reported them (vLLM)
        rollout_logprobs = torch.zeros(L)
        for turn in turns:
            start = turn.span[0]
            rollout_logprobs[start : start + len(turn.sampled_logprobs)] = torch.tensor(turn.sampled_logprobs)
        extra["rollout_logprobs"] = rollout_logprobs
    if encoder.is_vision and model is not None:
        position_ids = rope_positions(model, ids, grids, encoder.image_pad_id)
    else:
        position_ids = torch.arange(L)
    return Sample(ids, position_ids, pixel_values=pixels, image_grid_thw=grids, group_id=episode.group_id,
                  score=episode.total_reward, seed=episode.seed, extra=extra,
                  state_keys=[turn.state_key for turn in turns], task=episode.task, **where, **masks)


def collate(samples: list[Sample], pad_id: int, fields: tuple[str, ...] = (),
            with_images: bool = True) -> dict[str, torch.Tensor]:
    """Right-padded batch [B, Lmax] of the samples' model inputs, masks and the `fields` in
    `sample.extra` (zeros at padding); `with_images=False` leaves the pixel values out (for callers
    that read only masks and per-token values)."""
    B, width = len(samples), max(s.length for s in samples)
    batch = {
        "input_ids": torch.full((B, width), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((B, width), dtype=torch.long),
    }
    vision = samples[0].position_ids.dim() == 2
    batch["position_ids"] = torch.zeros((3, B, width) if vision else (B, width), dtype=torch.long)
    for name in TOKEN_FIELDS + tuple(fields):
        batch[name] = torch.zeros((B, width))
    for row, s in enumerate(samples):
        n = s.length
        batch["input_ids"][row, :n] = s.input_ids
        batch["attention_mask"][row, :n] = 1
        if vision:
            batch["position_ids"][:, row, :n] = s.position_ids
        else:
            batch["position_ids"][row, :n] = s.position_ids
        for name in TOKEN_FIELDS:
            batch[name][row, :n] = getattr(s, name)
        for name in fields:
            batch[name][row, :n] = s.extra[name]
    pixel_values = [s.pixel_values for s in samples if s.pixel_values is not None] if with_images else []
    if pixel_values:
        batch["pixel_values"] = torch.cat(pixel_values)
        batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in samples if s.image_grid_thw is not None])
    return batch


MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw")


def model_inputs(batch: dict[str, torch.Tensor], device=None) -> dict[str, torch.Tensor]:
    return {k: (v.to(device) if device is not None else v) for k, v in batch.items() if k in MODEL_INPUTS}
