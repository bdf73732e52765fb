"""From episodes to training tensors: one token sequence per trajectory with its masks.

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

import functools
import inspect
from dataclasses import dataclass, field

import torch

from vagen.rollout import ChatEncoder, Episode

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


def rope_positions(model, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, image_pad_id) -> torch.Tensor:
    """M-RoPE position ids [3, L] of one unpadded sequence from the model's rope-index function."""
    if image_grid_thw is None or image_pad_id is None:
        return torch.arange(input_ids.shape[0]).expand(3, -1).clone()
    inner = model.model
    ids = input_ids[None]
    mm_types = (ids == image_pad_id).int()
    positions, _ = inner.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=image_grid_thw)
    return positions[:, 0].cpu()


def episode_to_sample(episode: Episode, encoder: ChatEncoder, model=None) -> Sample:
    ids = torch.tensor(episode.input_ids, dtype=torch.long)
    L = ids.shape[0]
    masks = {name: torch.zeros(L) for name in TOKEN_FIELDS}
    for turn in episode.turns:
        start, end = turn.span
        masks["loss_mask"][start:end] = 1
        masks["sampled_mask"][start : end if turn.end_sampled else end - 1] = 1
        masks["turn_end_mask"][end - 1] = 1
        masks["token_rewards"][end - 1] = turn.reward
        generated = episode.input_ids[start : end - 1]  # without the closing <|im_end|>
        text = encoder.tokenizer.decode(generated, skip_special_tokens=True)
        offsets = char_offsets(encoder.tokenizer, generated)
        for name, tag in (("answer_mask", "answer"), ("think_mask", "think")):
            masks[name][start : end - 1] = torch.tensor(span_token_mask(offsets, tag_span(text, tag)), dtype=torch.float)
    grids = torch.stack(episode.image_grid_thw) if episode.image_grid_thw else None
    pixel_values = torch.cat(episode.pixel_values) if episode.pixel_values else None
    if encoder.is_vision and model is not None:
        position_ids = rope_positions(model, ids, grids, encoder.image_pad_id)
    else:
        position_ids = torch.arange(L)
    return Sample(ids, position_ids, pixel_values=pixel_values, image_grid_thw=grids, group_id=episode.group_id,
                  score=episode.total_reward, seed=episode.seed, **masks)


def collate(samples: list[Sample], pad_id: int, fields: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Right-padded batch [B, Lmax] of the samples' model inputs, masks and the `fields` in
    `sample.extra` (zeros at padding)."""
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
    pixel_values = [s.pixel_values for s in samples if s.pixel_values is not None]
    if pixel_values:
        batch["pixel_values"] = torch.cat(pixel_values)
        batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in samples if s.image_grid_thw is not None])
    return batch


MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw")


def model_inputs(batch: dict[str, torch.Tensor], device=None) -> dict[str, torch.Tensor]:
    return {k: (v.to(device) if device is not None else v) for k, v in batch.items() if k in MODEL_INPUTS}


def generated_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions t [K] whose next token t + 1 is generated in some row of `loss_mask` [B, L]: the
    only positions whose logits training reads."""
    return loss_mask[:, 1:].any(0).nonzero().squeeze(-1)


MIN_SHARED_PREFIX = 8  # below this the second call costs more than the shared prefix saves


def shared_prefix_length(input_ids: torch.Tensor, lengths: torch.Tensor, stop_ids: tuple[int, ...] = (),
                         limit: int | None = None) -> int:
    """Length of the token prefix that all rows of `input_ids` [B, L] share, kept shorter than every
    row (`lengths` [B]), than `limit`, and ending before the first of `stop_ids` (image tokens stay
    with their rows: the vision tower runs once over all of a batch's images)."""
    same = (input_ids == input_ids[:1]).all(0)
    if stop_ids:
        same &= ~torch.isin(input_ids[0], torch.tensor(stop_ids, device=input_ids.device))
    shared = int(same.long().cumprod(0).sum())
    return max(0, min(shared, int(lengths.min()) - 1, limit if limit is not None else shared))


@functools.cache
def cache_argument(module_type: type) -> str:
    """The keyword of the key/value cache: transformers renamed `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(module_type.forward).parameters else "past_key_values"


def _uses_gradient_checkpointing(module) -> bool:
    """Training with gradient checkpointing: transformers then refuses to build a key/value cache."""
    flag = "is_activation_checkpointing" if hasattr(type(module), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(module.training and getattr(module, flag, False))


def _partitioned_over_ranks(module) -> bool:
    """ZeRO-3 over several ranks: every forward pass is collective, so a batch must take the same
    number of passes on every rank (a shared prefix adds one, a one-row filler batch has none)."""
    first = next(module.parameters(), None)
    return (first is not None and hasattr(first, "ds_id") and torch.distributed.is_available()
            and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1)


def forward_shared_prefix(model, inputs: dict[str, torch.Tensor], logits_to_keep: torch.Tensor | None = None,
                          final_hidden: bool = False):
    """`model(**inputs)` on a right-padded batch, with the prefix that all rows share computed once.

    Training sequences open with the same system prompt (156 of ~340 tokens for FrozenLake), so the
    prefix runs at batch size 1, its keys and values are repeated for every row, and the rows run from
    the first token where they differ; gradients flow through the repeated cache into the prefix.
    No attention mask is passed: attention is causal and padding is on the right, so real tokens
    never see it (outputs at padding positions are meaningless, as they were with the mask).
    With gradient checkpointing in training there is no cache to share, and the batch runs whole.

    `model` is a causal LM (or its DeepSpeed engine) when `logits_to_keep` is given: 1-D positions,
    returns `.logits` at them [B, K, V]; or with `final_hidden`: returns the hidden states the LM head
    reads [B, L, H] (the head itself does not run). Otherwise `model` is a backbone: returns its last
    hidden state [B, L, H].
    """
    module = getattr(model, "module", model)  # a DeepSpeed engine forwards to .module
    config = module.config
    stop_ids = tuple(getattr(config, name) for name in ("vision_start_token_id", "image_token_id", "video_token_id")
                     if getattr(config, name, None) is not None)
    if final_hidden:
        assert logits_to_keep is None, "final_hidden returns hidden states, not logits"
        extra = {"logits_to_keep": torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device),
                 "output_hidden_states": True}
    else:
        extra = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}

    def hidden_of(out):
        return out.hidden_states[-1] if final_hidden else out.last_hidden_state

    input_ids, position_ids = inputs["input_ids"], inputs.get("position_ids")
    batch_size, width = input_ids.shape
    prefix = 0
    if position_ids is not None:  # without them the model derives positions from the attention mask
        mask = inputs.get("attention_mask")
        lengths = mask.sum(1) if mask is not None else torch.full((batch_size,), width)
        inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        limit = int(logits_to_keep.min()) if logits_to_keep is not None and logits_to_keep.numel() else None
        if batch_size > 1 and not _uses_gradient_checkpointing(module) and not _partitioned_over_ranks(module):
            prefix = shared_prefix_length(input_ids, lengths, stop_ids, limit)
    if prefix < MIN_SHARED_PREFIX:
        out = model(**inputs, use_cache=False, **extra)
        return out.logits if logits_to_keep is not None else hidden_of(out)
    head = {"input_ids": input_ids[:1, :prefix], "position_ids": position_ids[..., :1, :prefix]}
    if logits_to_keep is not None:
        head["logits_to_keep"] = 1
    elif final_hidden:
        head.update(extra)
    first = model(**head, use_cache=True)
    cache = getattr(first, "cache", None) or first.past_key_values
    cache.batch_repeat_interleave(batch_size)
    rest = dict(inputs, input_ids=input_ids[:, prefix:], position_ids=position_ids[..., prefix:])
    if logits_to_keep is not None:
        rest["logits_to_keep"] = logits_to_keep - prefix
    elif final_hidden:
        rest.update(extra)
    out = model(**rest, use_cache=False, **{cache_argument(type(module)): cache})
    if logits_to_keep is not None:
        return out.logits
    return torch.cat([hidden_of(first).expand(batch_size, -1, -1), hidden_of(out)], dim=1)
