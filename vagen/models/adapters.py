"""LoRA adapters (peft) on a policy's language model: which layers, how they are added, and the reference
(the policy with its adapters off)."""

from __future__ import annotations

import torch
from torch import nn

from vagen.config import LORA_TARGETS
from vagen.models.builtin import _quiet_transformers, base_checkpoint, is_vision_checkpoint
from vagen.models.families import family_of


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


def target_names(model_cfg, model) -> list[str]:
    """`model.lora_target_modules`, or where it is left at its default, the default targets of `model`'s
    family (Qwen3.5 adds its linear-attention projections to the attention and MLP ones)."""
    names = list(model_cfg.lora_target_modules)
    return list(family_of(model).lora_targets) if names == list(LORA_TARGETS) else names


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
        lora_targets(skeleton, target_names(model_cfg, skeleton))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def add_adapters(model: nn.Module, model_cfg) -> nn.Module:
    """`model` as a peft `PeftModel` with LoRA adapters (`model.lora_*`) on its language model's target
    layers; every base weight frozen. With `model.freeze_vision=false` the vision tower (merger
    included) trains fully as one of peft's `modules_to_save`: a trainable copy saved with the adapters,
    while `disable_adapter()` runs the original (the reference)."""
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(model, target_names(model_cfg, model))
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
