"""Policies, critics and their processors: local Hugging Face checkpoints or the built-in tiny models.

`model.path` is a local checkpoint directory (Qwen2.5-VL / Qwen2-VL for vision configs, a
Qwen2.5/Qwen3-style causal LM for text configs), a warm start the repository ships,
`assets:NAME` (the checkpoint in assets/checkpoints/NAME, built by `python -m vagen.sft`, its
`card.json` saying how and how well it plays), or one of:

- `builtin:tiny-vl` — a real Qwen2.5-VL architecture with about 0.8 M parameters (text hidden 128 × 2
  layers, vision tower 2 × 64), the stock Qwen image processor with small pixel bounds, and a
  byte-level BPE tokenizer trained locally on the environments' own prompt text;
- `builtin:tiny-text` — the same tokenizer with a Qwen2 causal LM of the same text size.

Built-ins are random-initialised from a seed, built offline in seconds, saved with `save_pretrained`
into a cache directory keyed by their specification, and loaded back through the Auto classes like
any checkpoint. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (see below)
from torch import nn

from vagen.config import BUILTIN_MODELS
from vagen.distributed import partitioned_over_ranks

# torch._dynamo loads Triton, whose LLVM crashes the process (segfault) when Mesa's LLVM is already
# loaded by an EGL context, i.e. after a MuJoCo frame was rendered. Loading it first is safe.

BUILTINS = BUILTIN_MODELS  # the names, known to the config without torch

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

# The chat markup of Qwen models: `<|im_start|>role\ncontent<|im_end|>\n`, an image as
# `<|vision_start|><|image_pad|><|vision_end|>` (the processor expands the pad to one token per
# 28x28-pixel patch group).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a built-in model. Changing any field changes the cache key."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 4
    min_pixels: int = 56 * 56
    max_pixels: int = 224 * 224
    center_image_tokens: bool = True
    image_position_code: bool = False
    version: int = 2


def _quiet_transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


# -- tokenizer corpus ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def tokenizer_corpus() -> tuple[str, ...]:
    """Deterministic training text for the built-in tokenizer: every environment's system prompt in
    every format, observations of a few levels, and well-formed responses with every action name.
    Computed once per process (it builds every environment, ~1 s); the cache key hashes it."""
    import envs_visual
    from envs_visual.base import PROMPT_FORMATS

    texts: list[str] = []
    for name in envs_visual.ENVS:
        try:
            cls = envs_visual.env_class(name)
        except Exception:  # an environment whose optional dependency is missing adds no text
            continue
        for prompt_format in PROMPT_FORMATS:
            for render_mode in getattr(cls, "render_modes", ("text",)):
                try:
                    env = envs_visual.make(name, prompt_format=prompt_format, render_mode=render_mode)
                    texts.append(env.system_prompt())
                    for seed in range(3):
                        obs, _ = env.reset(seed=seed)
                        texts.append(obs.text)
                    if hasattr(env, "close"):
                        env.close()
                except Exception:
                    continue
        actions = list(getattr(cls, "action_names", ()))
        for i, action in enumerate(actions):
            other = actions[(i + 1) % len(actions)]
            texts.append(f"<think>I should go {action.lower()} first.</think><answer>{action}</answer>")
            texts.append(f"<answer>{action}, {other}</answer>")
            texts.append(
                f"<think><observation>The player is next to the target.</observation><reasoning>Moving "
                f"{action} helps.</reasoning><prediction>The player moves.</prediction></think>"
                f"<answer>{action},{other},{action}</answer>"
            )
    texts.append(" ".join(str(i) for i in range(200)) + " + - * / ( ) = ")
    return tuple(texts)


def _train_tokenizer(spec: TinySpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = tokenizer_corpus()
    tok.train_from_iterator(list(corpus) * 4, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
    )
    hf.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _save_on_any_rank(model: nn.Module, out: Path) -> None:
    """`model.save_pretrained(out)` as files any process can write: once a process group exists,
    transformers' `save_pretrained` writes nothing on ranks other than 0, but a built-in is built by
    whichever rank takes the lock first. Tied weights are stored once, under their first name."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state, seen = {}, set()
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state[key] = tensor.detach().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _build_tiny(name: str, out_dir: Path, seed: int, spec: TinySpec) -> None:
    _quiet_transformers()
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tokenizer = _train_tokenizer(spec)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab = len(tokenizer)
    head_dim = spec.hidden_size // spec.num_heads
    text = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=32768,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    if name == "builtin:tiny-vl":
        # M-RoPE splits each head's rotary frequencies between time, height and width; the three
        # sections must add up to head_dim / 2.
        half = head_dim // 2
        mrope = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope}
        config = Qwen2_5_VLConfig(
            text_config=text,
            vision_config=dict(
                depth=spec.vision_depth,
                hidden_size=spec.vision_hidden,
                intermediate_size=2 * spec.vision_hidden,
                num_heads=spec.vision_heads,
                out_hidden_size=spec.hidden_size,
                fullatt_block_indexes=[spec.vision_depth - 1],
                window_size=112,
            ),
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=True,
        )
        # Stored in config.json, so every checkpoint trained from this model keeps it; see
        # `center_image_tokens`.
        setattr(config, CENTER_IMAGE_TOKENS, spec.center_image_tokens)
        if spec.image_position_code:
            setattr(config, IMAGE_POSITION_CODE, True)
        model = Qwen2_5_VLForConditionalGeneration(config)
        bounds = dict(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
        processor = Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessor(**bounds),
            tokenizer=tokenizer,
            video_processor=Qwen2VLVideoProcessor(**bounds),
            chat_template=CHAT_TEMPLATE,
        )
    else:
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        model = Qwen2ForCausalLM(Qwen2Config(**text))
        processor = tokenizer
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    _save_on_any_rank(model, tmp)
    processor.save_pretrained(tmp)
    (tmp / "vagen_builtin.json").write_text(json.dumps({"name": name, "seed": seed, **spec.__dict__}))
    os.replace(tmp, out_dir)


def resolve_model_path(path: str, cache_dir: str = "~/.cache/vagen", seed: int = 0,
                       spec: TinySpec | None = None) -> Path:
    """A checkpoint directory for `path`: built-ins are built once per (spec, seed, prompts) and
    cached; `assets:NAME` is assets/checkpoints/NAME; anything else must be an existing local directory."""
    from vagen.config import checkpoints_dir, model_path_error

    if path in BUILTINS:
        spec = spec or TinySpec()
        corpus_hash = hashlib.sha256("\n".join(tokenizer_corpus()).encode()).hexdigest()
        # the position code off leaves the key (and the cache entry) of models built before it existed
        fields = {k: v for k, v in spec.__dict__.items() if k != "image_position_code" or v}
        key = hashlib.sha256(json.dumps([path, fields, corpus_hash]).encode()).hexdigest()[:12]
        root = Path(os.path.expanduser(cache_dir))
        root.mkdir(parents=True, exist_ok=True)
        out = root / f"{path.split(':')[1]}-{key}-seed{seed}"
        with _file_lock(root / f".{out.name}.lock"):
            if not (out / "config.json").exists():
                _build_tiny(path, out, seed, spec)
        return out
    problem = model_path_error(path)
    if problem:
        raise (ValueError if path.startswith(("builtin:", "assets:")) else FileNotFoundError)(problem)
    if path.startswith("assets:"):
        return checkpoints_dir() / path.removeprefix("assets:")
    return Path(os.path.expanduser(path))


def base_checkpoint(model_cfg, path: str | None = None) -> Path:
    """`resolve_model_path` for the `model` config section: `path` (default `model.path`) with the
    section's built-in seed, cache, depth and image position code."""
    spec = TinySpec(num_layers=model_cfg.builtin_layers, image_position_code=model_cfg.builtin_position_code)
    return resolve_model_path(path or model_cfg.path, model_cfg.builtin_cache, model_cfg.builtin_seed, spec)


@contextlib.contextmanager
def _file_lock(path: Path):
    """Several ranks may ask for the same built-in at once: one builds, the others wait."""
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_vision_checkpoint(path: Path) -> bool:
    config = json.loads((Path(path) / "config.json").read_text())
    return "vision_config" in config


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

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


def load_policy(path: Path, dtype: str = "float32", min_pixels: int | None = None, max_pixels: int | None = None,
                attn_implementation: str = "sdpa"):
    """(model, processor) for a checkpoint directory; the processor of a text model is its tokenizer.
    `min_pixels` / `max_pixels` (`model.min_pixels` / `model.max_pixels`) replace the image
    processor's own bounds, for training and evaluation alike. `attn_implementation`
    (`model.attn_implementation`): the attention kernel of every layer, the vision tower's included."""
    from vagen.config import attn_implementation_error

    problem = attn_implementation_error(attn_implementation, dtype)
    if problem is None and attn_implementation == "flash_attention_2" and not torch.cuda.is_available():
        problem = ("model.attn_implementation=flash_attention_2 runs on CUDA GPUs only, and torch sees none here; "
                   "use model.attn_implementation=sdpa on this machine")
    if problem:
        raise ValueError(f"{problem} (loading {path})")
    _quiet_transformers()
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    if is_vision_checkpoint(path):
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=DTYPES[dtype],
                                                            attn_implementation=attn_implementation)
        center_image_tokens(model)
        matmul_patch_embedding(model)
        processor = AutoProcessor.from_pretrained(path)
        set_pixel_bounds(processor, min_pixels, max_pixels)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation=attn_implementation)
        processor = AutoTokenizer.from_pretrained(path)
    disable_dropout(model)
    if _stored_as_named(model, path):
        # Built partitioned (ZeRO-3), transformers records its default key renamings as if the checkpoint
        # were in an older layout, and saving would rename keys that were never renamed.
        model._weight_conversions = []
    return model, processor


def _stored_as_named(model: nn.Module, path: Path) -> bool:
    """Whether every tensor of the checkpoint at `path` is stored under a name of `model`'s state dict."""
    from safetensors import safe_open

    keys = set()
    for shard in Path(path).glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            keys.update(handle.keys())
    return bool(keys) and keys <= set(model.state_dict())


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of `model` to 0, in its modules and its config. Rollouts sample from
    the model in eval mode; the update computes log-probabilities in train mode (gradient checkpointing
    runs only there), and with dropout those would be another function, so the first PPO ratio would
    not be 1 (Qwen2.5-VL has none; other checkpoints do)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    configs = [model.config] + [getattr(model.config, k) for k in ("text_config", "vision_config")
                                if hasattr(model.config, k)]
    for config in configs:
        for name, value in list(vars(config).items()):
            if "dropout" in name and isinstance(value, float):
                setattr(config, name, 0.0)


def tokenizer_of(processor):
    return getattr(processor, "tokenizer", processor)


def backbone_of(model: nn.Module) -> nn.Module:
    """The transformer under the language-model head (returns hidden states, no logits); its LoRA layers,
    if any, stay in place and active."""
    return without_wrapper(model).model


# -- LoRA adapters (peft) ------------------------------------------------------------------------------

def _is_peft(model) -> bool:
    return type(model).__module__.startswith("peft.")


def without_wrapper(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft `PeftModel` (its LoRA layers are injected in place, so they
    stay active: only the wrapper is left out); any other model itself."""
    return model.get_base_model() if _is_peft(model) else model


def has_adapters(model) -> bool:
    """Whether `model` (or the DeepSpeed engine around it) is a peft `PeftModel`."""
    return _is_peft(getattr(model, "module", model))


def _in_vision_tower(name: str) -> bool:
    return "visual" in name.split(".")


def lora_targets(model: nn.Module, names: list[str]) -> list[str]:
    """Full names of the language model's linear layers whose last name component is in `names` (the
    vision tower's and the LM head are never adapted). Raises ValueError naming the valid names when one
    of `names` matches nothing."""
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not _in_vision_tower(n)
              and n.rsplit(".", 1)[-1] != "lm_head"]
    valid = sorted({n.rsplit(".", 1)[-1] for n in linear})
    missing = [name for name in names if name not in valid]
    if missing:
        raise ValueError(f"model.lora_target_modules={list(names)}: {missing} name no linear layer of "
                         f"{type(model).__name__}'s language model; valid names: {', '.join(valid)}; set "
                         f"model.lora_target_modules to some of them")
    return [n for n in linear if n.rsplit(".", 1)[-1] in names]


def check_lora_targets(model_cfg) -> None:
    """`model.lora_target_modules` against the linear layers of `model.path`'s language model, before any
    work: the architecture is built from the checkpoint's config.json on the meta device (no weights are
    read or allocated, at any size), and nothing is written. Raises ConfigError naming the valid names."""
    from vagen.config import ConfigError

    _quiet_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    path = base_checkpoint(model_cfg)
    auto = AutoModelForImageTextToText if is_vision_checkpoint(path) else AutoModelForCausalLM
    with torch.device("meta"):
        skeleton = auto.from_config(AutoConfig.from_pretrained(path))
    try:
        lora_targets(skeleton, model_cfg.lora_target_modules)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def add_adapters(model: nn.Module, model_cfg) -> nn.Module:
    """`model` as a peft `PeftModel` with LoRA adapters (`model.lora_*`) on its language model's target
    layers; every base weight frozen. With `model.freeze_vision=false` the vision tower (merger
    included) trains fully as one of peft's `modules_to_save`: a trainable copy saved with the adapters,
    while `disable_adapter()` runs the original (the reference)."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, model_cfg.lora_target_modules)
    has_tower = any(_in_vision_tower(n) for n, _ in model.named_modules())
    config = LoraConfig(r=model_cfg.lora_rank, lora_alpha=model_cfg.lora_alpha, lora_dropout=model_cfg.lora_dropout,
                        target_modules=targets, bias="none",
                        modules_to_save=["visual"] if has_tower and not model_cfg.freeze_vision else None)
    # Adapters in the base's dtype (peft would make them float32 under a bfloat16 base): DeepSpeed keeps float32
    # master weights itself, and ZeRO-3 flattens a module's trainable parameters into one buffer of one dtype.
    return get_peft_model(model, config, autocast_adapter_dtype=False)


class AdaptersOff:
    """The KL reference of a LoRA policy: the actor's engine (or model) called with its adapters disabled
    (peft's `disable_adapter()`), i.e. the base model, at no memory beyond the actor's. Passes for the
    model wherever log-probabilities are computed (`vagen.update.token_logprobs`)."""

    def __init__(self, model):
        self.model = model
        self.module = getattr(model, "module", model)

    def __call__(self, *args, **kwargs):
        with self.module.disable_adapter():
            return self.model(*args, **kwargs)


# -- running models ----------------------------------------------------------------------------------

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


@functools.cache
def cache_argument(module_type: type) -> str:
    """The keyword of the key/value cache: transformers renamed `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(module_type.forward).parameters else "past_key_values"


def _uses_gradient_checkpointing(module) -> bool:
    """Training with gradient checkpointing: transformers then refuses to build a key/value cache."""
    flag = "is_activation_checkpointing" if hasattr(type(module), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(module.training and getattr(module, flag, False))


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
        if batch_size > 1 and not _uses_gradient_checkpointing(module) and not partitioned_over_ranks(module):
            prefix = shared_prefix_length(input_ids, lengths, stop_ids, limit)
    if prefix < MIN_SHARED_PREFIX:
        out = model(**inputs, use_cache=False, **extra)
        return out.logits if logits_to_keep is not None else hidden_of(out)
    head = {"input_ids": input_ids[:1, :prefix], "position_ids": position_ids[..., :1, :prefix]}
    head.update({"logits_to_keep": 1} if logits_to_keep is not None else extra)
    first = model(**head, use_cache=True)
    first_hidden = hidden_of(first) if logits_to_keep is None else None
    cache = getattr(first, "cache", None) or first.past_key_values
    cache.batch_repeat_interleave(batch_size)
    rest = dict(inputs, input_ids=input_ids[:, prefix:], position_ids=position_ids[..., prefix:])
    rest.update({"logits_to_keep": logits_to_keep - prefix} if logits_to_keep is not None else extra)
    out = model(**rest, use_cache=False, **{cache_argument(type(module)): cache})
    if logits_to_keep is not None:
        return out.logits
    return torch.cat([first_hidden.expand(batch_size, -1, -1), hidden_of(out)], dim=1)


class ValueModel(nn.Module):
    """Critic: the policy's architecture and weights with a scalar head on the last hidden state.

    `forward` takes the same inputs as the policy and returns values [B, L] where
    `values[:, t]` estimates the return from the state in which token t is chosen (the hidden state
    at position t - 1); `values[:, 0]` is 0.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.backbone = backbone_of(policy)
        hidden = policy.config.get_text_config().hidden_size
        # in the backbone's dtype: ZeRO-3 flattens a module's parameters into one buffer of one dtype
        self.value_head = nn.Linear(hidden, 1, dtype=policy.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, **inputs) -> torch.Tensor:
        hidden = forward_shared_prefix(self.backbone, inputs)
        values = self.value_head(hidden[:, :-1].to(self.value_head.weight.dtype)).squeeze(-1)
        return torch.nn.functional.pad(values, (1, 0))

    def save(self, out_dir: Path, state_dict: dict | None = None) -> None:
        """Backbone in HF format and the head's weights; `state_dict` is the full critic state when
        the live parameters are partitioned (ZeRO-3)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        backbone_state = head_state = None
        if state_dict is not None:
            backbone_state = {k[len("backbone."):]: v for k, v in state_dict.items() if k.startswith("backbone.")}
            head_state = {k[len("value_head."):]: v for k, v in state_dict.items() if k.startswith("value_head.")}
        self.backbone.save_pretrained(out_dir / "backbone", state_dict=backbone_state)
        torch.save(head_state or self.value_head.state_dict(), out_dir / "value_head.pt")

    def load(self, out_dir: Path) -> None:
        """The backbone and value head `save` wrote into `out_dir`."""
        from safetensors.torch import load_file

        out_dir = Path(out_dir)
        state = {}
        for shard in sorted((out_dir / "backbone").glob("*.safetensors")):
            state.update(load_file(shard))
        saved_adapters = (out_dir / "backbone" / "adapter_config.json").exists()
        if saved_adapters != has_adapters(self.backbone):
            raise RuntimeError(f"critic checkpoint {out_dir} was saved {'with' if saved_adapters else 'without'} LoRA "
                               f"adapters, but this critic is built {'with' if has_adapters(self.backbone) else 'without'} "
                               f"them; set model.lora_rank as the run that saved it did, or leave model.critic_path unset")
        if saved_adapters:  # the adapters (peft format); the frozen base is model.path's
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.backbone, state)
            missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
            unexpected = list(result.unexpected_keys)
        else:
            missing, unexpected = self.backbone.load_state_dict(state, strict=False)
        if unexpected or missing:
            raise RuntimeError(f"critic checkpoint {out_dir} does not match the model: unexpected {unexpected[:5]}, "
                               f"missing {missing[:5]}; pass a critic saved from the same architecture")
        self.value_head.load_state_dict(torch.load(out_dir / "value_head.pt", weights_only=True))


def saved_critic(path: str | Path) -> Path | None:
    """The critic directory (backbone/ and value_head.pt, as `ValueModel.save` writes it) that `path`
    names: itself, a checkpoint's `critic/`, or the latest checkpoint's of a run directory; None when
    `path` holds no saved critic."""
    p = Path(os.path.expanduser(str(path)))
    if (p / "checkpoints" / "latest").exists():
        p = p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()
    for candidate in (p, p / "critic"):
        if (candidate / "value_head.pt").exists() and (candidate / "backbone").is_dir():
            return candidate
    return None


def set_pixel_bounds(processor, min_pixels: int | None, max_pixels: int | None) -> None:
    """Override the image processor's pixel bounds (fewer pixels: fewer image tokens); None keeps one."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return
    size = dict(image_processor.size)
    if min_pixels:
        size["shortest_edge"] = min_pixels
    if max_pixels:
        size["longest_edge"] = max_pixels
    image_processor.size = size
