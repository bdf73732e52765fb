"""Running a policy: M-RoPE positions, the positions whose logits training reads, and the forward pass with
the prefix all rows share computed once."""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from vagen.distributed import partitioned_over_ranks
from vagen.models.adapters import without_wrapper
from vagen.models.families import family_of
from vagen.models.loading import backbone_of


def rope_positions(model, input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, image_pad_id) -> torch.Tensor:
    """M-RoPE position ids [3, L] of one unpadded sequence from the model's rope-index function."""
    if image_grid_thw is None or image_pad_id is None:
        return torch.arange(input_ids.shape[0]).expand(3, -1).clone()
    inner = backbone_of(model)
    ids = input_ids[None]
    mm_types = (ids == image_pad_id).int()
    positions, _ = inner.get_rope_index(ids, mm_token_type_ids=mm_types, image_grid_thw=image_grid_thw)
    return positions[:, 0].cpu()


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


def select_rows(cache, index: torch.Tensor) -> None:
    """Keep rows `index` [K] of `cache`, in that order (a row may repeat): `reorder_cache` is the one row
    selection every cache layer type has, linear-attention states included."""
    cache.reorder_cache(index)


@functools.cache
def cache_argument(module_type: type) -> str:
    """The keyword of the key/value cache: transformers renamed `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(module_type.forward).parameters else "past_key_values"


def _uses_gradient_checkpointing(module) -> bool:
    """Training with gradient checkpointing: transformers then refuses to build a key/value cache."""
    flag = "is_activation_checkpointing" if hasattr(type(module), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(module.training and getattr(module, flag, False))


def pack_inputs(inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A right-padded batch (`attention_mask` [B, L]) as one row of its samples' real tokens, back to back,
    and the (row, column) [N] of each packed token in the padded batch.

    Each sample keeps its own positions: M-RoPE positions [3, B, L] go in as [4, 1, N] with a first row
    of text positions that restart at 0 at each sample, which is how transformers' Qwen-VL models read a
    packed row (no attention mask: `create_causal_mask` finds the samples where the text positions restart,
    and attends within each; flash-attention reads the same boundaries as variable-length sequences).
    Text models' positions [B, L] go in as [1, N]. Images stay in order: the samples' frames were
    concatenated in row order, which is the order of their image tokens in the packed row."""
    mask = inputs["attention_mask"].bool()
    rows, columns = mask.nonzero(as_tuple=True)  # row-major: sample after sample, each from column 0
    packed = {"input_ids": inputs["input_ids"][rows, columns][None]}
    positions = inputs["position_ids"]
    if positions.dim() == 3:
        packed["position_ids"] = torch.cat([columns[None, None], positions[:, rows, columns][:, None]])
    else:
        packed["position_ids"] = columns[None]
    for name in ("pixel_values", "image_grid_thw"):
        if name in inputs:
            packed[name] = inputs[name]
    return packed, (rows, columns)


def forward_packed(model, inputs: dict[str, torch.Tensor], final_hidden: bool = False) -> torch.Tensor:
    """What `forward_shared_prefix` returns without `logits_to_keep` (the last hidden state [B, L, H], or
    with `final_hidden` the one the LM head reads), computed with the batch's samples packed into one row
    (`pack_inputs`): no compute or activation memory is spent on padding. Zeros at padding positions."""
    module = without_wrapper(getattr(model, "module", model))
    family = family_of(module)
    if not family.packs:
        raise ValueError(f"train.pack_sequences=true with a {family.name} model: its layers would carry state "
                         f"from one packed sample into the next; set train.pack_sequences=false")
    packed, (rows, columns) = pack_inputs(inputs)
    if final_hidden:
        extra = {"logits_to_keep": torch.zeros(0, dtype=torch.long, device=packed["input_ids"].device)}
        with _backbone_outputs(module) as caught:
            model(**packed, use_cache=False, **extra)
            hidden = caught.pop()
    else:
        hidden = model(**packed, use_cache=False).last_hidden_state
    batch, width = inputs["input_ids"].shape
    out = hidden.new_zeros(batch, width, hidden.shape[-1])
    return out.index_put((rows, columns), hidden[0])


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
    module = without_wrapper(getattr(model, "module", model))  # a DeepSpeed engine forwards to .module
    if final_hidden:
        assert logits_to_keep is None, "final_hidden returns hidden states, not logits"
        # The head computes no logits, and the backbone's output is caught on its way to the head:
        # `output_hidden_states` would keep every layer's hidden states alive until the call returns.
        extra = {"logits_to_keep": torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device)}
        with _backbone_outputs(module) as caught:
            return _forward_shared_prefix(model, module, inputs, None, extra, lambda out: caught.pop())
    extra = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    return _forward_shared_prefix(model, module, inputs, logits_to_keep, extra, lambda out: out.last_hidden_state)


@contextlib.contextmanager
def _backbone_outputs(module):
    """Inside, each forward of `module`'s backbone leaves its last hidden state in the yielded list."""
    caught: list[torch.Tensor] = []
    handle = backbone_of(module).register_forward_hook(lambda _m, _a, out: caught.append(out.last_hidden_state))
    try:
        yield caught
    finally:
        handle.remove()


def _can_share_a_cache(module) -> bool:
    """Whether the prefix's cache can be built once and continued by every row: not with gradient
    checkpointing in training (no cache), not under ZeRO-3, and not under gradients for a family whose
    layers update their cache states in place (the first call's backward needs the state the second
    overwrites)."""
    if _uses_gradient_checkpointing(module) or partitioned_over_ranks(module):
        return False
    return family_of(module).cache_under_gradients or not torch.is_grad_enabled()


def _forward_shared_prefix(model, module, inputs, logits_to_keep, extra, hidden_of):
    config = module.config
    stop_ids = tuple(getattr(config, name) for name in ("vision_start_token_id", "image_token_id", "video_token_id")
                     if getattr(config, name, None) is not None)

    input_ids, position_ids = inputs["input_ids"], inputs.get("position_ids")
    batch_size, width = input_ids.shape
    prefix = 0
    if position_ids is not None:  # without them the model derives positions from the attention mask
        mask = inputs.get("attention_mask")
        lengths = mask.sum(1) if mask is not None else torch.full((batch_size,), width)
        inputs = {k: v for k, v in inputs.items() if k != "attention_mask"}
        limit = int(logits_to_keep.min()) if logits_to_keep is not None and logits_to_keep.numel() else None
        if batch_size > 1 and _can_share_a_cache(module):
            prefix = shared_prefix_length(input_ids, lengths, stop_ids, limit)
    if prefix < MIN_SHARED_PREFIX:
        out = model(**inputs, use_cache=False, **extra)
        return out.logits if logits_to_keep is not None else hidden_of(out)
    head = {"input_ids": input_ids[:1, :prefix], "position_ids": position_ids[..., :1, :prefix]}
    head.update({"logits_to_keep": 1} if logits_to_keep is not None else extra)
    first = model(**head, use_cache=True)
    first_hidden = hidden_of(first) if logits_to_keep is None else None
    cache = getattr(first, "cache", None) or first.past_key_values
    select_rows(cache, torch.zeros(batch_size, dtype=torch.long, device=input_ids.device))
    rest = dict(inputs, input_ids=input_ids[:, prefix:], position_ids=position_ids[..., prefix:])
    rest.update({"logits_to_keep": logits_to_keep - prefix} if logits_to_keep is not None else extra)
    out = model(**rest, use_cache=False, **{cache_argument(type(module)): cache})
    if logits_to_keep is not None:
        return out.logits
    return torch.cat([first_hidden.expand(batch_size, -1, -1), hidden_of(out)], dim=1)
