"""Typed configuration: one dataclass tree two levels deep, YAML files of overrides, and
`section.key=value` overrides from the command line.

    cfg = load_config("sokoban_visual", ["rollout.group_size=8", "algo.adv_estimator=grpo"])

`python -m vagen.config sokoban_visual [overrides]` prints the resolved configuration with the help
text of every field. The sections are `vagen.config_sections`, the cross-field checks `vagen.config_checks`;
this module composes and loads, and re-exports both. It imports only the standard library and PyYAML, so
that a mistake in a config is reported in well under a second, before torch or DeepSpeed load.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vagen.config_checks import (  # noqa: F401 (re-exported: the checks are vagen.config's too)
    _CHECKPOINT_OPTIONAL,
    BUILTIN_MODELS,
    DEEPSPEED_FROZEN_RECOMPUTE,
    REMOVED_KEYS,
    ChecksFailed,
    ConfigError,
    _closest,
    _removed,
    attn_implementation_error,
    check_ranks,
    check_training,
    check_vllm_ranks,
    checkpoints_dir,
    kept_groups,
    machine_problems,
    model_path_error,
    shipped_checkpoints,
    task_configs,
    validate,
)
from vagen.config_sections import (  # noqa: F401 (re-exported: the sections are vagen.config's)
    CHOICES,
    CONFIGS_DIR,
    LORA_TARGETS,
    TASK_ROLLOUT_KEYS,
    AlgoConfig,
    EnvConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    RolloutConfig,
    SFTConfig,
    TaskConfig,
    TrainConfig,
    VLLMConfig,
)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    log: LogConfig = field(default_factory=LogConfig)
    name: str = "default"

    def __post_init__(self):
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = [f.name for f in dataclasses.fields(Config) if f.name != "name"]


def check_config(names: str | list[str] | None, overrides: list[str] | None, ranks: int,
                 gpu_gib: float | None = None) -> tuple[Config, list[str]]:
    """Every check `vagen/train.py` runs before it loads a model, for `ranks` ranks (the packages the config
    needs and its checkpoint's family among them: `machine_problems`), and the per-GPU memory estimate of
    the model states (`vagen.memory`); with `gpu_gib`, whether they fit a GPU of that many GiB beside vLLM's
    share, DeepSpeed's buckets and a margin. A model.path directory that is not on this machine is accepted,
    and its parameters counted from the published shape its name gives. Returns the config and the
    estimate's lines; a config that does not load raises ConfigError, and failing checks raise ChecksFailed
    with every failure and the estimate."""
    if ranks < 1:
        raise ConfigError(f"--ranks {ranks}: the number of ranks (GPUs over all nodes) must be >= 1")
    if gpu_gib is not None and not gpu_gib > 0:
        raise ConfigError(f"--gpu-gib {gpu_gib}: the memory of one GPU in GiB must be > 0, e.g. --gpu-gib 80")
    cfg = load_configs(names, overrides, require_checkpoint=False)
    failures = []
    for check in (check_training, lambda c: check_ranks(c, ranks)):
        try:
            check(cfg)
        except ConfigError as err:
            failures.append(str(err))
    failures += machine_problems(cfg)
    path = CONFIGS_DIR / cfg.train.deepspeed_config
    if not path.is_file():
        choices = ", ".join(sorted(str(p.relative_to(CONFIGS_DIR)) for p in CONFIGS_DIR.glob("deepspeed/*")))
        raise ChecksFailed([*failures, f"train.deepspeed_config={cfg.train.deepspeed_config}: no file {path}; choose "
                                       f"one of {choices}"])
    import json

    from vagen.memory import estimate

    result = estimate(cfg, ranks, json.loads(path.read_text()), gpu_gib)
    lines = result.lines
    if result.problem:
        failures.append(result.problem)
    if cfg.model.lora_rank > 0:
        lines.append("  not checked here: model.lora_target_modules against the model's layers (train.py does, "
                     "once the checkpoint loads)")
    if failures:
        raise ChecksFailed(failures, lines)
    return cfg, lines


# -- typed assignment ------------------------------------------------------------------------------

def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, where: str) -> Any:
    """Convert `value` to type `tp` or raise ConfigError naming the key, the value and the type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    expected = origin or tp
    if expected is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off"):
            return value.lower() in ("true", "yes", "on")
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif expected is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        if number is not None:
            raise ConfigError(f"{where}: expected a finite number, received {value!r}; fix the value in the YAML "
                              f"file or override, e.g. {where}=0.5")
    elif expected is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif expected is list:
        item = (typing.get_args(tp) or (None,))[0]
        if isinstance(value, (list, tuple)) and dataclasses.is_dataclass(item):
            return [_coerce_entry(entry, item, f"{where}[{i}]") for i, entry in enumerate(value)]
        if isinstance(value, (list, tuple)):
            return list(value)
    elif expected is dict:
        if isinstance(value, dict):
            return dict(value)
    raise ConfigError(
        f"{where}: expected {_type_name(tp)}, received {value!r} ({type(value).__name__}); "
        f"fix the value in the YAML file or override, e.g. {where}=<{_type_name(tp)}>"
    )


def _coerce_entry(value: Any, cls, where: str):
    """A list entry of dataclass `cls` (a rollout.tasks entry) from a mapping, its keys checked and typed."""
    if isinstance(value, cls):
        return value
    fields = _section_fields(cls)
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {', '.join(fields)}, received {value!r}; e.g. "
                          f"{{config: sokoban_visual, groups: 2}}")
    types_ = _section_types(cls)
    for key in value:
        if key not in fields:
            raise ConfigError(f"{where}: unknown key {key!r}{_closest(str(key), fields)} keys: {', '.join(fields)}")
    return cls(**{key: _coerce(item, types_[key], f"{where}.{key}") for key, item in value.items()})


def _section_fields(section_cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _section_types(section_cls) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _all_keys() -> list[str]:
    keys = []
    for section in SECTIONS:
        keys += [f"{section}.{k}" for k in _section_fields(_section_class(section))]
    return keys


def _section_class(section: str):
    return typing.get_type_hints(Config)[section]


def _apply(raw: dict, key: str, value: Any, source: str) -> None:
    """Set dotted `key` (section.field, or env.params.<name>) in the nested dict `raw`."""
    parts = key.split(".")
    if parts[0] not in SECTIONS or len(parts) < 2:
        raise ConfigError(
            f"unknown config key {key!r} in {source}{_closest(key, _all_keys())} "
            f"keys have the form section.field with section one of: {', '.join(SECTIONS)}"
        )
    section, name = parts[0], parts[1]
    _removed(f"{section}.{name}", source)
    fields = _section_fields(_section_class(section))
    if name not in fields:
        raise ConfigError(
            f"unknown config key {key!r} in {source}{_closest(key, _all_keys())} "
            f"valid keys of [{section}]: {', '.join(fields)}"
        )
    tp = _section_types(_section_class(section))[name]
    if len(parts) > 2:
        if typing.get_origin(tp) is not dict and tp is not dict:
            raise ConfigError(f"{section}.{name} is not a mapping; {key!r} in {source} cannot set a sub-key")
        raw.setdefault(section, {}).setdefault(name, {})
        raw[section][name][".".join(parts[2:])] = value
        return
    raw.setdefault(section, {})[name] = _coerce(value, tp, f"{section}.{name}")


def _flatten(data: dict, source: str) -> list[tuple[str, Any]]:
    items = []
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown config section {section!r} in {source}{_closest(str(section), SECTIONS)} "
                f"sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(body, dict):
            raise ConfigError(f"section {section!r} in {source} must be a mapping, received {body!r}")
        items += [(f"{section}.{key}", value) for key, value in body.items()]
    return items


def available_configs() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def resolve_config_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    candidate = CONFIGS_DIR / f"{name_or_path}.yaml"
    if candidate.exists():
        return candidate
    names = available_configs()
    raise ConfigError(
        f"unknown config {name_or_path!r}{_closest(name_or_path, names)} configs in {CONFIGS_DIR}: "
        f"{', '.join(names) or '(none)'}; or pass the path of a .yaml file"
    )


def parse_override(text: str) -> tuple[str, Any]:
    """`section.key=value` -> (key, value) with YAML typing: 3 -> int, 1e-3 -> float, true, null, [1, 2]."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} has no '='; write it as section.key=value, e.g. rollout.group_size=8")
    key, _, value = text.partition("=")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip(), parsed


class TaskOverride(str):
    """An entry of `load_configs`' names that is a task's own `section.key=value` (rollout.tasks[i].overrides):
    applied where it stands, after the task's config and before the configs that follow it (recipes)."""


def config_names(names: str | list[str] | None) -> list[str]:
    """The configs `names` lists, in order: a name or path, a comma list of them, or a list of either."""
    if not names:
        return []
    out = []
    for entry in [names] if isinstance(names, str) else names:
        if isinstance(entry, TaskOverride):
            out.append(entry)
        elif Path(entry).suffix in (".yaml", ".yml") and Path(entry).exists():  # a path is never split
            out.append(entry)
        else:
            out += [part.strip() for part in entry.split(",") if part.strip()]
    return out


# A recipe (configs/recipes/) names its model family at the top (`family: qwen3_vl`): vagen.models' family
# names, checked against them by tests/test_recipes.py (this module does not import torch).
MODEL_FAMILIES = ("qwen2_vl", "qwen3_vl", "qwen3_5", "qwen_text")
# What an environment config's real_model section must set: a real checkpoint's budgets in that environment.
REAL_MODEL_KEYS = ("rollout.max_turns", "rollout.max_new_tokens", "rollout.max_trajectory_length")


def _recipe_family(family, path: Path) -> str | None:
    if family is None or family in MODEL_FAMILIES:
        return family
    raise ConfigError(f"family: {family!r} in {path} is not a model family{_closest(str(family), MODEL_FAMILIES)} "
                      f"choices: {', '.join(MODEL_FAMILIES)} (a recipe names the family of the checkpoint it trains)")


def _check_recipe_family(raw: dict, family: str, recipe: Path) -> None:
    """Refuse a checkpoint (model.path, where it is on this machine) of another family than the recipe's."""
    from vagen.preflight import recipe_family_problem

    model = raw.get("model") or {}
    checkpoint = (family, str(recipe), str(model.get("path", ModelConfig.path)),
                  bool(model.get("builtin_position_code", False)))
    if recipe_family_problem(*checkpoint) is None:
        return
    recipes: dict[str, list[str]] = {}  # the shipped recipes of each family, for the message
    for path in sorted((CONFIGS_DIR / "recipes").glob("*.yaml"), key=lambda p: p.stem):
        recipes.setdefault((yaml.safe_load(path.read_text()) or {}).get("family"), []).append(f"recipes/{path.stem}")
    raise ConfigError(recipe_family_problem(*checkpoint, recipes))


def _real_model_section(section, path: Path) -> dict:
    """An environment config's `real_model` section, checked: config sections with the keys REAL_MODEL_KEYS
    at least, and per model family (MODEL_FAMILIES) sections applied over them for a recipe of that family."""
    if not isinstance(section, dict):
        raise ConfigError(f"real_model in {path} must be a mapping of config sections, received {section!r}")
    common = {k: v for k, v in section.items() if k not in MODEL_FAMILIES}
    keys = [key for key, _ in _flatten(common, f"{path} (real_model)")]
    missing = [key for key in REAL_MODEL_KEYS if key not in keys]
    if missing:
        raise ConfigError(f"real_model in {path} does not set {', '.join(missing)}: it holds a real checkpoint's "
                          f"turns and lengths in this environment ({', '.join(REAL_MODEL_KEYS)}), which a recipe "
                          f"applied after it takes; add them")
    for family in MODEL_FAMILIES:
        if family in section:
            if not isinstance(section[family], dict):
                raise ConfigError(f"real_model.{family} in {path} must be a mapping of config sections, received "
                                  f"{section[family]!r}")
            _flatten(section[family], f"{path} (real_model.{family})")
    return section


def _apply_real_model(raw: dict, family: str, recipe: Path, profile, before: list[str]) -> None:
    """After a recipe: the real_model section of the environment config before it (its `family` part last),
    so that the environment keeps its own turns and lengths at a real checkpoint's scale."""
    if profile is None:
        if before:  # a recipe alone, or first, composes over the defaults
            raise ConfigError(f"recipe {recipe} takes a real checkpoint's turns and lengths from the environment "
                              f"config before it, but {' + '.join(before)} has no real_model section; add one "
                              f"({', '.join(REAL_MODEL_KEYS)}, as configs/sokoban_visual.yaml does) to that "
                              f"config or a copy of it")
        return
    path, section = profile
    common = {k: v for k, v in section.items() if k not in MODEL_FAMILIES}
    for key, value in _flatten(common, f"{path} (real_model)") + _flatten(section.get(family, {}),
                                                                       f"{path} (real_model.{family})"):
        _apply(raw, key, value, f"{path} (real_model)")


def load_configs(names: str | list[str] | None = None, overrides: list[str] | None = None,
                 require_checkpoint: bool = True) -> Config:
    """Defaults, then each config of `names` in order (`configs/<name>.yaml`, a path, or a comma list of
    them; each sets only the keys it holds, over those before it), then `section.key=value` overrides.

        load_configs(["sokoban_visual", "recipes/qwen2.5-vl-3b"], ["train.iterations=50"])

    A recipe (a file with a top-level `family`) holds the model, the optimizer and the scale; right after
    it come the real_model section of the environment config before it (a real checkpoint's turns, tokens
    per turn and trajectory length there) and that section's part for the recipe's family (image geometry),
    so that every environment keeps its own budgets whatever recipe follows it.

    The config's name joins the files' names with `+` (sokoban_visual+qwen2.5-vl-3b); a run's saved
    config.yaml holds every key and that name, so loading it alone reproduces the run. With
    `require_checkpoint=False` a model.path that is a directory not on this machine is accepted (the
    checks of `python -m vagen.config --ranks N` run where the checkpoint is not)."""
    raw: dict = {}
    parts = []
    profile = None  # (path, real_model section) of the last config before the current one that has one
    recipe = None  # (family, path) of the last recipe
    entries, tasks_at = config_names(names), None
    for at, entry in enumerate(entries):
        if isinstance(entry, TaskOverride):
            _apply(raw, *parse_override(entry), "the task's overrides")
            continue
        path = resolve_config_path(entry)
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, received {type(data).__name__}")
        # a run's saved config.yaml keeps the name of the config(s) it came from
        parts.append(data.pop("name") if isinstance(data.get("name"), str) else path.stem)
        family = _recipe_family(data.pop("family", None), path)
        if "real_model" in data:
            profile = (path, _real_model_section(data.pop("real_model"), path))
        for key, value in _flatten(data, str(path)):
            _apply(raw, key, value, str(path))
        if "tasks" in (data.get("rollout") or {}):
            tasks_at = at
        if family is not None and tasks_at is None:  # several tasks: each task's real_model, in _resolve_tasks
            _apply_real_model(raw, family, path, profile, before=parts[:-1])
        if family is not None:
            recipe = (family, path)
    for text in overrides or []:
        key, value = parse_override(text)
        _apply(raw, key, value, "command-line override")
    if recipe is not None:
        _check_recipe_family(raw, *recipe)
    after = entries[tasks_at + 1:] if tasks_at is not None else []
    _resolve_tasks(raw, after, overrides or [], require_checkpoint)
    token = _CHECKPOINT_OPTIONAL.set(not require_checkpoint)
    try:
        return from_dict(raw, "+".join(parts) or "default")
    finally:
        _CHECKPOINT_OPTIONAL.reset(token)


def _resolve_tasks(raw: dict, after: list[str], overrides: list[str], require_checkpoint: bool) -> None:
    """rollout.tasks: each task's environment config loaded as a run of its own would load it (then the configs
    `after` the one that lists the tasks, recipes among them, with the task's real_model section, the task's own
    `overrides` right after its config, and the command line's env.* and length overrides); its env section and TASK_ROLLOUT_KEYS go into the task. The
    run's env is the first task's and its lengths the largest (what sizes engines and buffers), and
    rollout.env_groups the sum of the tasks' groups. Tasks already resolved (a run's config.yaml) stay."""
    tasks = (raw.get("rollout") or {}).get("tasks")
    if not tasks:
        return
    def task_level(text: str) -> bool:
        key = parse_override(text)[0]
        return key.startswith("env.") or key in [f"rollout.{k}" for k in TASK_ROLLOUT_KEYS]

    own = [text for text in overrides if task_level(text)]
    resolved = []
    for i, task in enumerate(tasks):
        wrong = [text for text in task.overrides if not isinstance(text, str) or not task_level(text)]
        if wrong:
            raise ConfigError(f"rollout.tasks[{i}] ({task.name or task.config}) overrides {wrong}: a task's overrides "
                              f"set env.* and rollout.{', rollout.'.join(TASK_ROLLOUT_KEYS)} only, as strings "
                              f"section.key=value; set other sections for the whole run")
        if task.env:  # resolved before (a run's config.yaml): the command line's env.* and lengths still apply
            values = {"env": dict(task.env), "rollout": dict(task.rollout)}
            for text in own:
                _apply(values, *parse_override(text), "command-line override")
            values["env"]["params"] = _nest(values["env"].get("params") or {})
            resolved.append(dataclasses.replace(task, **values))
            continue
        if task.groups < 1:
            raise ConfigError(f"rollout.tasks[{i}] ({task.name or task.config}) groups={task.groups} must be >= 1 "
                              f"(level groups of the task per iteration); drop the task instead")
        if not task.config:
            raise ConfigError(f"rollout.tasks[{i}] names no environment config; write each task as "
                              f"{{config: sokoban_visual, groups: 2}} (configs: {', '.join(available_configs())})")
        try:
            sub = load_configs([task.config, *map(TaskOverride, task.overrides), *after], own, require_checkpoint)
        except ConfigError as err:
            raise ConfigError(f"rollout.tasks[{i}] (config: {task.config}): {err}") from None
        if sub.rollout.tasks:
            raise ConfigError(f"rollout.tasks[{i}] (config: {task.config}) lists tasks of its own; a task names an "
                              f"environment config (one env, its turns and lengths), not a run over several")
        resolved.append(dataclasses.replace(task, name=task.name or Path(task.config).stem,
                                            env=dataclasses.asdict(sub.env),
                                            rollout={key: getattr(sub.rollout, key) for key in TASK_ROLLOUT_KEYS}))
    total = sum(task.groups for task in resolved)
    wanted = raw["rollout"].get("env_groups", total)
    if wanted != total:  # set by a recipe or an override: shared out in the tasks' proportions
        if any(task.groups * wanted % total for task in resolved):
            shares = ", ".join(f"{task.name} {task.groups}" for task in resolved)
            raise ConfigError(f"rollout.env_groups={wanted} cannot be shared out in the proportions of rollout.tasks "
                              f"({shares} of {total}) in whole groups; set rollout.env_groups to a multiple of "
                              f"{total // math.gcd(total, *[task.groups for task in resolved])}, or set the tasks' "
                              f"groups themselves")
        resolved = [dataclasses.replace(task, groups=task.groups * wanted // total) for task in resolved]
        total = wanted
    raw["rollout"].update(tasks=resolved, env_groups=total,
                          **{key: max(task.rollout[key] for task in resolved) for key in TASK_ROLLOUT_KEYS})
    raw["env"] = dict(resolved[0].env)


def load_config(name_or_path: str | list[str] | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then `configs/<name>.yaml` (or a path, or several: `load_configs`), then `section.key=value`
    overrides."""
    return load_configs(name_or_path, overrides)


def load_config_or_exit(name_or_path: str | list[str] | None, overrides: list[str] | None = None) -> Config:
    """`load_config` for command-line entry points: a config error is printed and exits with status 2."""
    try:
        return load_config(name_or_path, overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def from_dict(raw: dict, name: str = "default") -> Config:
    """Build a Config from a nested dict (e.g. a run's saved config.yaml)."""
    sections = {}
    for section in SECTIONS:
        cls = _section_class(section)
        values = {}
        types_ = _section_types(cls)
        for key, value in (raw.get(section) or {}).items():
            _removed(f"{section}.{key}", "the config")
            if key not in types_:
                raise ConfigError(f"unknown config key '{section}.{key}'{_closest(f'{section}.{key}', _all_keys())}")
            values[key] = _coerce(value, types_[key], f"{section}.{key}")
        if "params" in values and section == "env":
            values["params"] = _nest(values["params"])
        sections[section] = cls(**values)
    return Config(**sections, name=name)


def _nest(params: dict) -> dict:
    """{"a.b": 1} -> {"a": {"b": 1}} so env.params.x.y=... overrides build nested params."""
    out: dict = {}
    for key, value in params.items():
        node = out
        *head, last = str(key).split(".")
        for part in head:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def to_yaml(cfg: Config, with_help: bool = False) -> str:
    """The resolved config as YAML; with `with_help`, each field carries its help as a comment."""
    if not with_help:
        return yaml.safe_dump({"name": cfg.name, **{s: cfg.to_dict()[s] for s in SECTIONS}}, sort_keys=False)
    lines = [f"# resolved config: {cfg.name}"]
    for section in SECTIONS:
        lines.append(f"{section}:")
        obj = getattr(cfg, section)
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
                value = [dataclasses.asdict(entry) for entry in value]  # rollout.tasks
            value = yaml.safe_dump(value, default_flow_style=True).strip()
            value = value.removesuffix("\n...").removesuffix("...").strip()
            entry = f"  {f.name}: {value}"
            lines.append(f"{entry:<50} # {f.metadata.get('help', '')}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m vagen.config",
        description="Print the resolved configuration (defaults, then the config file, then the overrides) with "
                    "the help text of every field; a mistake is reported as one line, before torch loads.",
        epilog=f"configs: {', '.join(available_configs())}")
    parser.add_argument("config", nargs="?", help="name in configs/ or path of a YAML file (or a comma list)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--config", dest="more", action="append", default=[],
                        help="a further config applied after the first, e.g. --config recipes/qwen2.5-vl-3b; repeat")
    parser.add_argument("--ranks", type=int, default=None,
                        help="run every check train.py runs for this many ranks (GPUs over all nodes) and print a "
                             "per-GPU memory estimate instead of the config; a model.path not on this machine is "
                             "accepted when its name is a known checkpoint")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="with --ranks: the memory of one GPU in GiB (default: the visible GPU's, where there is "
                             "one); the estimate adds vLLM's share, DeepSpeed's buckets and a margin, and refuses "
                             "what does not fit")
    args = parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    names = ([args.config] if args.config else []) + args.more
    if not names:
        parser.print_help()
        return 0
    if args.ranks is None:
        if args.gpu_gib is not None:
            parser.error("--gpu-gib G sizes the check of --ranks N: give both, e.g. --ranks 8 --gpu-gib 80")
        print(to_yaml(load_config_or_exit(names, args.overrides), with_help=True), end="")
        return 0
    gpu_gib = args.gpu_gib
    if gpu_gib is None:
        from vagen.memory import visible_gpu_gib

        gpu_gib = visible_gpu_gib()
    try:
        cfg, lines = check_config(names, args.overrides, args.ranks, gpu_gib)
    except ChecksFailed as err:
        count = len(err.failures)
        print(f"{count} of the checks train.py runs before loading the model fail{'s' if count == 1 else ''} for "
              f"{args.ranks} rank(s):", file=sys.stderr)
        print("\n".join(f"config error: {failure}" for failure in err.failures), file=sys.stderr)
        if err.lines:
            print("\n".join(err.lines))
        return 2
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(f"{cfg.name}: every check train.py runs before loading the model passes for {args.ranks} rank(s)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
