"""The built-in tiny models: one per model family (`builtin:tiny-vl` is Qwen2.5-VL, `builtin:tiny-qwen3-vl`,
`builtin:tiny-qwen3.5`, `builtin:tiny-text` a Qwen2 causal LM), random-initialised from a seed with a
byte-level BPE tokenizer trained locally on the environments' own prompt text, built offline in seconds
and cached by their specification; and where a `model.path` resolves to."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vagen.config import BUILTIN_MODELS
from vagen.models.families import builtin_family
from vagen.models.family import CHAT_TEMPLATE, SPECIAL_TOKENS

BUILTINS = BUILTIN_MODELS  # the names, known to the config without torch


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
    family = builtin_family(name)
    tokenizer = _train_tokenizer(spec)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
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
    model, processor = family.build_tiny(spec, tokenizer, text)
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
