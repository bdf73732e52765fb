"""The built-in VLM's image hooks (each image's tokens centred, a code of each token's cell added), turned
on by flags in its config.json, and the vision tower's patch embedding as one matrix product."""

from __future__ import annotations

import functools

import torch
from torch import nn

# config.json flags of the built-in VLM: subtract each image's mean token from its image tokens, and
# add to each image token a fixed code of its cell's row and column.
CENTER_IMAGE_TOKENS = "vagen_center_image_tokens"
IMAGE_POSITION_CODE = "vagen_image_position_code"
POSITION_FREQUENCIES = 8


@functools.lru_cache(maxsize=32)
def image_position_code(rows: int, cols: int, dim: int, frequencies: int = POSITION_FREQUENCIES) -> torch.Tensor:
    """[rows * cols, dim] codes of the cells of a rows x cols token grid in raster order: the sine and
    cosine of the row index, then of the column index, at angular steps pi/2, pi/4, ... (periods 4,
    8, ...), in the first 4 * `frequencies` features; the other features are 0. Computed once per grid
    (every forward of the vision tower asks for it); the result is shared, so never modify it."""
    if dim < 4 * frequencies:
        raise ValueError(f"an image position code of {frequencies} frequencies needs {4 * frequencies} features, "
                         f"but image tokens have {dim}")
    steps = torch.pi / 2 ** torch.arange(1, frequencies + 1, dtype=torch.float64)
    row = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols)[:, None] * steps
    col = torch.arange(cols, dtype=torch.float64).repeat(rows)[:, None] * steps
    code = torch.zeros(rows * cols, dim, dtype=torch.float64)
    code[:, : 4 * frequencies] = torch.cat([row.sin(), row.cos(), col.sin(), col.cos()], 1)
    return code.float()


def _prepare_image_tokens(visual: nn.Module, args, kwargs, output):
    grid_thw = kwargs["grid_thw"] if "grid_thw" in kwargs else args[1]
    merge = visual.spatial_merge_size
    tokens = output.pooler_output
    parts = []
    for part, (t, h, w) in zip(tokens.split((grid_thw.prod(-1) // merge**2).tolist()), grid_thw.tolist()):
        if visual._vagen_center:
            part = part - part.mean(0, keepdim=True)
        if visual._vagen_position_code:
            scale = part.detach().pow(2).mean().sqrt()
            part = part + scale * image_position_code(h // merge, w // merge, part.shape[1]).to(part).repeat(t, 1)
        parts.append(part)
    output.pooler_output = torch.cat(parts)
    return output


def center_image_tokens(model: nn.Module) -> bool:
    """Prepare each image's merged tokens before they enter the language model, as the built-in VLM's
    config asks: subtract the image's mean token (`vagen_center_image_tokens`), then add a fixed
    code of each token's row and column, scaled to the image's token magnitude
    (`vagen_image_position_code`, `image_position_code`).

    A grid-world frame is mostly background, so every image token of a tiny randomly initialised
    VLM carries the same large component and the cells that matter differ from it by little;
    without centring the built-in model does not learn to read a cell's content at its position
    (`benchmarks/vision_probe.py` stays at chance). And nothing in a random vision tower tells a
    token where its cell is (rotary positions only bias which tokens attend to which), so a question
    about where the player is has no gradient toward its answer until the model stumbles on one:
    with the code the probe learns in fewer steps and on frames it otherwise does not learn at all.
    Both are per image, so a frame's features do not depend on what else is in the batch (rollout
    and update see the same numbers). Applied by `load_policy` to checkpoints whose config carries
    the flags (the built-in VLM and everything trained from it); such a checkpoint loads in plain
    transformers but computes without them there. Returns whether the hook is installed."""
    visual = getattr(getattr(model, "model", None), "visual", None)
    center = bool(getattr(model.config, CENTER_IMAGE_TOKENS, False))
    code = bool(getattr(model.config, IMAGE_POSITION_CODE, False))
    if visual is None or not (center or code):
        return False
    visual._vagen_center, visual._vagen_position_code = center, code
    if not getattr(visual, "_vagen_prepared", False):
        visual.register_forward_hook(_prepare_image_tokens, with_kwargs=True)
        visual._vagen_prepared = True
    return True


class _MatmulPatchEmbed:
    """Mixin over a vision tower's patch embedding whose `proj` is a Conv3d with stride equal to its
    kernel and no padding: the processor already cut the frames into flattened patches, so the
    convolution is one matrix product with the flattened kernel (the same numbers to rounding)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if weight.numel() == 0 and hasattr(weight, "ds_id"):
            # A ZeRO-3 partition that is not gathered: DeepSpeed gathers the parameters of a module that
            # runs, and of others on access only within the whole model's forward; transformers'
            # `generate` runs the vision tower before that (`get_image_features`), and `proj` never runs.
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.proj.parameters())):
                return self.forward(hidden_states)
        flat = hidden_states.to(weight.dtype).reshape(-1, weight[0].numel())
        out = flat @ weight.reshape(weight.shape[0], -1).t()
        return out if self.proj.bias is None else out + self.proj.bias


@functools.cache
def _matmul_class(cls: type) -> type:
    return type(f"Matmul{cls.__name__}", (_MatmulPatchEmbed, cls), {})


def matmul_patch_embedding(model: nn.Module) -> bool:
    """Compute the vision tower's patch embedding as a matrix product instead of transformers'
    Conv3d over the patches reshaped into 2x14x14 volumes: on the CPU the built-in VLM's vision tower
    then runs forward and backward 1.5x as fast (`benchmarks/bench_train.py`). Same weights, same
    state dict, saved and loaded as before. Returns whether the embedding was replaced: only a
    stride-equals-kernel, unpadded, ungrouped Conv3d is."""
    embed = getattr(getattr(getattr(model, "model", None), "visual", None), "patch_embed", None)
    proj = getattr(embed, "proj", None)
    if not isinstance(proj, nn.Conv3d):
        return False
    if isinstance(embed, _MatmulPatchEmbed):
        return True
    if tuple(proj.kernel_size) != tuple(proj.stride) or any(proj.padding) or proj.groups != 1:
        return False
    embed.__class__ = _matmul_class(type(embed))
    return True
