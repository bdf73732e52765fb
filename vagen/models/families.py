"""The model families vagen knows, and the one a checkpoint belongs to (by its config's `model_type`).
Adding a family: one file beside `family.py` and a line here."""

from __future__ import annotations

import json
from pathlib import Path

from vagen.models.family import Family
from vagen.models.qwen2_vl import QWEN2_VL
from vagen.models.qwen3_5 import QWEN3_5
from vagen.models.qwen3_vl import QWEN3_VL
from vagen.models.qwen_text import QWEN_TEXT

FAMILIES: tuple[Family, ...] = (QWEN2_VL, QWEN3_VL, QWEN3_5, QWEN_TEXT)


def known_model_types() -> list[str]:
    return sorted(t for family in FAMILIES for t in family.model_types)


def family_of(source) -> Family:
    """The family of a checkpoint: `source` is its directory (config.json is read), a config dict, a
    transformers config or a model. Raises ValueError naming the known model types for any other."""
    if isinstance(source, (str, Path)):
        source = json.loads((Path(source) / "config.json").read_text())
    if not isinstance(source, dict):  # a DeepSpeed engine, a model, a config
        source = getattr(getattr(source, "module", source), "config", source)
    model_type = source.get("model_type") if isinstance(source, dict) else getattr(source, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(f"model_type {model_type!r} is not a model family vagen knows; known: "
                     f"{', '.join(known_model_types())}. Use a checkpoint of one of them (model.path), or add the "
                     f"family: one file in vagen/models/ (see vagen/models/family.py) and a line in FAMILIES")


def builtin_family(name: str) -> Family:
    """The family of a built-in tiny model's name (`builtin:tiny-vl`, ...)."""
    for family in FAMILIES:
        if family.builtin == name:
            return family
    raise ValueError(f"{name!r} is not a built-in model; choices: {', '.join(f.builtin for f in FAMILIES)}")
