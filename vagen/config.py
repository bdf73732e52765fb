"""Typed configuration: one dataclass tree two levels deep, YAML files of overrides, and
`section.key=value` overrides from the command line.

    cfg = load_config("sokoban_visual", ["rollout.group_size=8", "algo.adv_estimator=grpo"])

`python -m vagen.config sokoban_visual [overrides]` prints the resolved configuration with the help
text of every field. This module imports only the standard library and PyYAML so that a mistake
in a config is reported in well under a second, before torch or DeepSpeed load.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vagen.config_sections import (  # noqa: F401 (re-exported: the sections are vagen.config's)
    LORA_TARGETS,
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

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


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

CHOICES = {
    ("model", "dtype"): ("float32", "bfloat16"),
    ("model", "attn_implementation"): ("sdpa", "eager", "flash_attention_2"),
    ("env", "render_mode"): ("vision", "text"),
    ("sft", "lr_schedule"): ("constant", "cosine"),
    ("sft", "reasoning"): ("near", "path", "plan"),
    ("env", "prompt_format"): ("no_think", "free_think", "grounding", "worldmodeling", "grounding_worldmodeling"),
    ("rollout", "backend"): ("hf", "vllm"),
    ("rollout", "context"): ("full", "window"),
    ("algo", "rollout_correction"): ("none", "tis"),
    ("algo", "adv_estimator"): ("turn_gae", "gae", "grpo", "gigpo"),
    ("algo", "gigpo_norm"): ("mean_std", "mean"),
    ("algo", "token_selection"): ("all", "answer", "think_answer", "entropy"),
    ("algo", "filter_mode"): ("none", "std", "std_rev"),
    ("algo", "kl_kind"): ("k1", "k2", "k3", "abs"),
    ("algo", "state_reward"): ("none", "rules", "judge"),
    ("algo", "loss_agg"): ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
}


class ConfigError(ValueError):
    """A configuration mistake; the message says what was received and how to fix it."""


class ChecksFailed(ConfigError):
    """Several checks failed at once: `failures` holds one sentence each, and `lines` what else the check
    found (`check_config`: the memory estimate)."""

    def __init__(self, failures: list[str], lines: list[str] | None = None):
        super().__init__("\n".join(failures))
        self.failures, self.lines = list(failures), list(lines or [])


BUILTIN_MODELS = ("builtin:tiny-vl", "builtin:tiny-qwen3-vl", "builtin:tiny-qwen3.5", "builtin:tiny-text")

# Set while `load_configs(..., require_checkpoint=False)` validates: a model.path directory may be absent.
_CHECKPOINT_OPTIONAL: contextvars.ContextVar[bool] = contextvars.ContextVar("checkpoint_optional", default=False)


def checkpoints_dir() -> Path:
    """assets/checkpoints: the warm starts the repository ships (`model.path=assets:NAME`)."""
    from envs_visual.assets import ASSETS_DIR

    return ASSETS_DIR / "checkpoints"


def shipped_checkpoints() -> list[str]:
    """Names of the shipped warm starts (folders of assets/checkpoints with a config.json)."""
    root = checkpoints_dir()
    return sorted(p.name for p in root.iterdir() if (p / "config.json").exists()) if root.is_dir() else []


def model_path_error(path: str) -> str | None:
    """Why `path` names no checkpoint (None when it does): a built-in, a shipped warm start, or a
    directory with a config.json."""
    shipped = [f"assets:{name}" for name in shipped_checkpoints()]
    names = ", ".join([*BUILTIN_MODELS, *shipped])
    if path in BUILTIN_MODELS or path in shipped:
        return None
    if path.startswith(("builtin:", "assets:")):
        kind = "built-in model" if path.startswith("builtin:") else f"shipped warm start (in {checkpoints_dir()})"
        return f"model.path={path!r} is not a {kind}{_closest(path, [*BUILTIN_MODELS, *shipped])} choices: {names}"
    local = Path(path).expanduser()
    if (local / "config.json").exists():
        return None
    return (f"model.path={path!r} is not a checkpoint: no config.json in {local}; download the checkpoint beforehand "
            f"(e.g. Qwen/Qwen2.5-VL-3B-Instruct) and pass its directory, or use one of {names}")


def attn_implementation_error(name: str, dtype: str) -> str | None:
    """Why `model.attn_implementation=name` cannot run with `model.dtype=dtype` here (None when it can)."""
    if name != "flash_attention_2":
        return None
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        # transformers would otherwise fetch a kernel from the Hugging Face hub at load time
        return ("model.attn_implementation=flash_attention_2 needs the flash-attn package, which is not installed "
                "in this environment; install it (pip install flash-attn --no-build-isolation, on a machine with "
                "CUDA) or use model.attn_implementation=sdpa")
    import importlib.metadata

    try:
        installed = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        installed = "unknown"
    numbers = tuple(int(part) for part in installed.split("+")[0].split(".")[:3] if part.isdigit())
    if numbers < (2, 3, 3):  # transformers 5 takes older ones for absent, and then fetches a kernel too
        return (f"model.attn_implementation=flash_attention_2 needs flash-attn >= 2.3.3, found {installed}; "
                f"upgrade it (pip install -U flash-attn --no-build-isolation) or use model.attn_implementation=sdpa")
    if dtype != "bfloat16":
        return (f"model.attn_implementation=flash_attention_2 with model.dtype={dtype}: flash-attn computes in "
                f"float16/bfloat16 only; set model.dtype=bfloat16 (with a bf16 train.deepspeed_config) or use "
                f"model.attn_implementation=sdpa")
    return None


# Keys that no longer exist, and what to do instead.
REMOVED_KEYS = {
    "model.warm_start": "training no longer builds a warm start, it trains the checkpoint model.path names: start "
                        "from a shipped warm start (model.path=assets:NAME), or build one with `python -m vagen.sft "
                        "--config CONFIG --out DIR` and set model.path=DIR; model.path=builtin:tiny-vl starts random",
}


def _removed(key: str, source: str) -> None:
    if key in REMOVED_KEYS:
        shipped = ", ".join(f"assets:{n}" for n in shipped_checkpoints()) or "none yet"
        raise ConfigError(f"{key} in {source} was removed; {REMOVED_KEYS[key]} (shipped: {shipped})")


def _check_env(env) -> None:
    """env.name is an environment and every env.params key one of its parameters."""
    import envs_visual

    if env.name not in envs_visual.ENVS:
        raise ConfigError(f"env.name={env.name!r} is not an environment{_closest(env.name, envs_visual.ENVS)} "
                          f"choices: {', '.join(sorted(envs_visual.ENVS))}")
    accepted = sorted(envs_visual.parameters(env.name))
    for key in env.params:
        if key not in accepted:
            raise ConfigError(f"env.params.{key} is not a parameter of env {env.name!r}{_closest(str(key), accepted)} "
                              f"parameters: {', '.join(accepted)}")


def _closest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def validate(cfg: Config) -> None:
    """Cross-field checks; each message says how to fix the problem."""
    _check_env(cfg.env)
    problem = model_path_error(cfg.model.path)
    if problem and not (_CHECKPOINT_OPTIONAL.get() and not cfg.model.path.startswith(("builtin:", "assets:"))):
        raise ConfigError(problem)
    for (section, key), choices in CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise ConfigError(
                f"{section}.{key}={value!r} is not a valid choice{_closest(str(value), choices)} "
                f"choices: {', '.join(choices)}"
            )
    problem = attn_implementation_error(cfg.model.attn_implementation, cfg.model.dtype)
    if problem:
        raise ConfigError(problem)
    ro, algo, tr = cfg.rollout, cfg.algo, cfg.train
    positive = [("rollout", "env_groups"), ("rollout", "group_size"), ("rollout", "max_turns"),
                ("rollout", "max_new_tokens"), ("train", "ppo_epochs"), ("train", "mini_batch_size"),
                ("train", "micro_batch_size"), ("env", "max_actions_per_turn"), ("sft", "batch_size"), ("sft", "max_steps"),
                ("sft", "micro_batch_size"), ("sft", "length_window"), ("model", "builtin_layers"),
                ("train", "max_bad_steps"), ("rollout", "reuse_iterations")]
    for section, key in positive:
        value = getattr(getattr(cfg, section), key)
        if value < 1:
            raise ConfigError(f"{section}.{key}={value} must be >= 1")
    if set(cfg.sft.perception_axes) - {"row", "column"} or not cfg.sft.perception_axes:
        raise ConfigError(f"sft.perception_axes={cfg.sft.perception_axes} must name row, column or both")
    if cfg.sft.perception_steps < 0 or cfg.sft.perception_levels < 1 or cfg.sft.perception_batch_size < 1:
        raise ConfigError(f"sft.perception_steps={cfg.sft.perception_steps} must be >= 0, and "
                          f"sft.perception_levels={cfg.sft.perception_levels} and "
                          f"sft.perception_batch_size={cfg.sft.perception_batch_size} >= 1")
    if cfg.sft.perception_steps and cfg.env.render_mode != "vision":
        raise ConfigError(f"sft.perception_steps={cfg.sft.perception_steps} asks questions about frames, but "
                          f"env.render_mode={cfg.env.render_mode}; set sft.perception_steps=0 or env.render_mode=vision")
    if cfg.sft.on_policy_levels < 0 or cfg.sft.on_policy_steps < 1:
        raise ConfigError(f"sft.on_policy_levels={cfg.sft.on_policy_levels} must be >= 0 and sft.on_policy_steps="
                          f"{cfg.sft.on_policy_steps} >= 1")
    if cfg.sft.cell_questions < 0 or cfg.sft.cell_steps < 1 or cfg.sft.cell_batch_size < 1:
        raise ConfigError(f"sft.cell_questions={cfg.sft.cell_questions} must be >= 0, and sft.cell_steps="
                          f"{cfg.sft.cell_steps} and sft.cell_batch_size={cfg.sft.cell_batch_size} >= 1")
    if cfg.sft.cell_questions and (not cfg.sft.cell_moves or min(cfg.sft.cell_moves) < 1):
        raise ConfigError(f"sft.cell_moves={cfg.sft.cell_moves} must list move counts >= 1, e.g. [1, 2]")
    if cfg.sft.cell_questions and (cfg.env.name not in ("frozenlake", "sokoban") or cfg.env.render_mode != "vision"):
        raise ConfigError(f"sft.cell_questions={cfg.sft.cell_questions} asks about FrozenLake or Sokoban frames, but env.name="
                          f"{cfg.env.name} and env.render_mode={cfg.env.render_mode}; set sft.cell_questions=0")
    if algo.adv_estimator in ("grpo", "gigpo") and ro.group_size < 2:
        raise ConfigError(
            f"algo.adv_estimator={algo.adv_estimator} compares rollouts within a group, but rollout.group_size="
            f"{ro.group_size}; set rollout.group_size=2 or more (8-16 is usual)"
        )
    if not 0.0 <= algo.step_gamma <= 1.0:
        raise ConfigError(f"algo.step_gamma={algo.step_gamma} must be in [0, 1] (0.95 is usual)")
    if not (math.isfinite(algo.step_weight) and algo.step_weight >= 0.0):
        raise ConfigError(f"algo.step_weight={algo.step_weight} must be a finite number >= 0 (1.0 is usual; 0 leaves "
                          f"only the episode-level advantage, i.e. GRPO)")
    if algo.filter_mode != "none" and ro.group_size < 2:
        raise ConfigError(
            f"algo.filter_mode={algo.filter_mode} ranks groups by in-group reward std, which needs "
            f"rollout.group_size >= 2 (got {ro.group_size}); raise it or set algo.filter_mode=none"
        )
    if not 0.0 < algo.filter_keep_ratio <= 1.0:
        raise ConfigError(f"algo.filter_keep_ratio={algo.filter_keep_ratio} must be in (0, 1]")
    if not 0.0 < algo.top_ratio <= 1.0:
        raise ConfigError(f"algo.top_ratio={algo.top_ratio} must be in (0, 1]")
    if not (0.0 <= algo.clip_low < 1.0 and algo.clip_high >= 0.0):
        raise ConfigError(f"algo.clip_low={algo.clip_low} must be in [0, 1) and algo.clip_high >= 0")
    if algo.dual_clip <= 1.0:
        raise ConfigError(f"algo.dual_clip={algo.dual_clip} must be > 1 (3.0 is usual)")
    for key in ("gamma", "lam", "gamma_turn", "lam_turn"):
        if not 0.0 <= getattr(algo, key) <= 1.0:
            raise ConfigError(f"algo.{key}={getattr(algo, key)} must be in [0, 1]")
    if algo.kl_in_reward and algo.kl_coef > 0 and algo.adv_estimator in ("grpo", "gigpo"):
        uses = "each trajectory's score" if algo.adv_estimator == "grpo" else "each turn's reward"
        raise ConfigError(
            f"algo.kl_in_reward=true subtracts the KL penalty from per-token rewards, but algo.adv_estimator="
            f"{algo.adv_estimator} uses only {uses}, so the penalty would be ignored; set algo.kl_in_reward=false "
            "(KL as a loss term) or use algo.adv_estimator=turn_gae or gae"
        )
    _check_state_reward(cfg)
    _check_lora(cfg)
    _check_staleness(cfg)
    _check_tasks(cfg)
    if cfg.algo.rollout_correction == "tis" and cfg.rollout.backend != "vllm":
        raise ConfigError("algo.rollout_correction=tis corrects for the gap between the engine that samples and the "
                          f"trainer, but rollout.backend={cfg.rollout.backend} samples from the trained model itself; "
                          "set rollout.backend=vllm, or algo.rollout_correction=none")
    if not cfg.algo.rollout_correction_cap >= 1.0:
        raise ConfigError(f"algo.rollout_correction_cap={cfg.algo.rollout_correction_cap} must be >= 1 (a weight cap "
                          f"below 1 shrinks every on-policy token's gradient); use e.g. 2.0")
    _check_vllm(cfg)
    _check_trackers(cfg.log.trackers)
    if cfg.env.step_timeout is not None and not cfg.env.step_timeout > 0:
        raise ConfigError(f"env.step_timeout={cfg.env.step_timeout} must be > 0 seconds, or null for no limit")
    if cfg.env.workers < 0:
        raise ConfigError(f"env.workers={cfg.env.workers} must be >= 0 (0: environments step in the trainer's process)")
    _check_env_backend(cfg.env)
    if tr.keep_checkpoints is not None and tr.keep_checkpoints < 1:
        raise ConfigError(f"train.keep_checkpoints={tr.keep_checkpoints} must be >= 1, or null to keep every checkpoint")
    if tr.dist_timeout_minutes < 1:
        raise ConfigError(f"train.dist_timeout_minutes={tr.dist_timeout_minutes} must be >= 1 (minutes a rank waits "
                          f"for the others in a collective); 30 is usual, more where checkpoints are large")
    if algo.loss_norm_tokens is not None and algo.loss_norm_tokens < 1:
        raise ConfigError(f"algo.loss_norm_tokens={algo.loss_norm_tokens} must be >= 1, or null for "
                          f"rollout.max_turns x (rollout.max_new_tokens + 1)")
    if ro.window_turns < 0:
        raise ConfigError(f"rollout.window_turns={ro.window_turns} must be >= 0 (the earlier turns each prompt keeps; "
                          f"2 is usual)")
    if ro.top_k < 0:
        raise ConfigError(f"rollout.top_k={ro.top_k} must be >= 0 (0 = off)")
    if ro.temperature < 0 or not 0 < ro.top_p <= 1:
        raise ConfigError(f"rollout.temperature={ro.temperature} must be >= 0 and rollout.top_p={ro.top_p} in (0, 1]")
    batch = ro.env_groups * ro.group_size
    if tr.mini_batch_size > batch:
        raise ConfigError(
            f"train.mini_batch_size={tr.mini_batch_size} exceeds the {batch} trajectories of an iteration "
            f"(rollout.env_groups={ro.env_groups} x rollout.group_size={ro.group_size}); lower it to {batch}"
        )
    if cfg.model.path == "builtin:tiny-text" and cfg.env.render_mode == "vision":
        raise ConfigError(
            "model.path=builtin:tiny-text cannot see images but env.render_mode=vision; use "
            "model.path=builtin:tiny-vl or env.render_mode=text"
        )


def _check_env_backend(env: EnvConfig) -> None:
    """env.backend and its Ray settings (whether Ray is installed: `vagen.preflight.missing_packages`)."""
    if env.backend not in ("process", "ray"):
        raise ConfigError(f"env.backend={env.backend!r}{_closest(env.backend, ['process', 'ray'])} choices: process, ray")
    if env.backend == "process":
        return
    if env.workers < 1:
        raise ConfigError("env.backend=ray runs env.workers Ray actors, but env.workers=0 steps the environments in "
                          "the trainer's process; set env.workers to the number of actors (e.g. env.workers=2)")
    if not env.ray_cpus >= 0:
        raise ConfigError(f"env.ray_cpus={env.ray_cpus} must be >= 0 (CPUs each environment actor reserves; 1 is usual)")
    for name, amount in env.ray_resources.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory") or not isinstance(amount, (int, float)) \
                or isinstance(amount, bool) or not amount > 0:
            raise ConfigError(f"env.ray_resources={env.ray_resources}: each entry is a custom resource name and an "
                              f"amount > 0 per actor, e.g. {{env_host: 1}} (CPUs go in env.ray_cpus); got "
                              f"{name!r}: {amount!r}")
    if not env.ray_start_timeout > 0:
        raise ConfigError(f"env.ray_start_timeout={env.ray_start_timeout} must be > 0 seconds (60 is usual)")
    if not isinstance(env.ray_address, str) or not env.ray_address:
        raise ConfigError(f"env.ray_address={env.ray_address!r}: use local, auto, or a cluster's HOST:PORT")


def _check_tasks(cfg: Config) -> None:
    """rollout.tasks: resolved (load_configs), each named once with groups >= 1, their sum rollout.env_groups."""
    tasks = cfg.rollout.tasks
    if not tasks:
        return
    for i, task in enumerate(tasks):
        if not task.env or not task.name or sorted(task.rollout) != sorted(TASK_ROLLOUT_KEYS):
            raise ConfigError(f"rollout.tasks[{i}] ({task.config or 'no config'}) is not resolved: load the config "
                              f"with vagen.config.load_configs, which fills each task's env and lengths from its "
                              f"environment config")
        if task.groups < 1:
            raise ConfigError(f"rollout.tasks[{i}] ({task.name}) groups={task.groups} must be >= 1 (level groups of "
                              f"the task per iteration); drop the task instead")
        try:
            _check_env(EnvConfig(**task.env))
        except ConfigError as err:
            raise ConfigError(f"rollout.tasks[{i}] ({task.name}): {err}") from None
    names = [task.name for task in tasks]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"rollout.tasks names {', '.join(twice)} more than once (metrics and evaluations are kept "
                          f"per task name); merge their groups into one entry, or give one a name: {{config: ..., "
                          f"groups: ..., name: OTHER}}")
    if cfg.rollout.env_groups != sum(task.groups for task in tasks):
        raise ConfigError(f"rollout.env_groups={cfg.rollout.env_groups} but the groups of rollout.tasks sum to "
                          f"{sum(task.groups for task in tasks)}; with rollout.tasks set only the tasks' groups")
    shares = cfg.sft.task_shares
    if shares and (len(shares) != len(names)
                   or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in shares)):
        raise ConfigError(f"sft.task_shares={shares} must give a positive share to each of the {len(names)} tasks "
                          f"({', '.join(names)}), in that order, e.g. sft.task_shares=[{', '.join(['1'] * len(names))}]"
                          f"; or leave it empty for their level groups' shares")
    if cfg.algo.state_reward != "none":  # every task's prompt format must have the graded fields
        for name, sub in task_configs(cfg):
            try:
                _check_state_reward(sub)
            except ConfigError as err:
                raise ConfigError(f"rollout.tasks ({name}): {err}") from None


def _check_staleness(cfg: Config) -> None:
    k = cfg.rollout.max_staleness
    if k < 0:
        raise ConfigError(f"rollout.max_staleness={k} must be >= 0 (0 = synchronous rollouts)")
    if k == 0:
        return
    if cfg.rollout.backend != "vllm":
        raise ConfigError(
            f"rollout.max_staleness={k} carries unfinished episodes over updates, which rollout.backend="
            f"{cfg.rollout.backend} cannot: it samples from the trained model itself and reports no sampling "
            f"log-probabilities, so a carried turn's weight against the updated policy is unknown, and it plays "
            f"episodes turn by turn in one batch; set rollout.backend=vllm, or rollout.max_staleness=0")
    if cfg.algo.rollout_correction != "tis":
        raise ConfigError(
            f"rollout.max_staleness={k} trains turns sampled up to {k} update(s) before, which needs the "
            f"importance correction of decoupled PPO (old log-probs of the policy at the update, weights "
            f"min(p_old / p_sampler, C)); set algo.rollout_correction=tis")
    if cfg.rollout.reuse_iterations > 1:
        raise ConfigError(
            f"rollout.max_staleness={k} and rollout.reuse_iterations={cfg.rollout.reuse_iterations} both train "
            f"on turns of older weights, and together a turn could be {k + cfg.rollout.reuse_iterations - 1} "
            f"updates old; use one of them (rollout.reuse_iterations=1, or rollout.max_staleness=0)")


def _check_vllm(cfg: Config) -> None:
    """vLLM engine settings that would fail mid-run, refused before any work."""
    v, ro = cfg.vllm, cfg.rollout
    if v.tensor_parallel_size < 1 or v.max_model_len < 1 or not 0.0 < v.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"vllm.tensor_parallel_size={v.tensor_parallel_size} and vllm.max_model_len="
                          f"{v.max_model_len} must be >= 1, and vllm.gpu_memory_utilization="
                          f"{v.gpu_memory_utilization} in (0, 1]")
    if ro.backend == "vllm" and v.max_model_len < ro.max_trajectory_length:
        # A turn's request is its whole history plus rollout.max_new_tokens, which the rollout keeps within
        # rollout.max_trajectory_length; a longer request is refused by the engine of one rank while the
        # others wait for it in a collective.
        raise ConfigError(f"rollout.max_trajectory_length={ro.max_trajectory_length} exceeds vllm.max_model_len="
                          f"{v.max_model_len}, the longest request the engine accepts, so a long episode would stop "
                          f"the run mid-way; set vllm.max_model_len={ro.max_trajectory_length} (or more), or "
                          f"rollout.max_trajectory_length={v.max_model_len}")


def check_vllm_ranks(cfg: Config, world_size: int) -> None:
    """Tensor parallelism of the vLLM engine only for a run of one rank: each rank's engine owns its rank's GPU
    (and its share of the rollout), so engines split over several GPUs would take GPUs other ranks train on."""
    tp = cfg.vllm.tensor_parallel_size
    if cfg.rollout.backend == "vllm" and tp > 1 and world_size > 1:
        raise ConfigError(
            f"vllm.tensor_parallel_size={tp} with {world_size} ranks: every rank runs its own engine on its own GPU "
            f"and plays its own share of the episodes, so an engine split over {tp} GPUs would take the GPUs of "
            f"other ranks (each rank's workers would start on GPUs 0..{tp - 1}); use vllm.tensor_parallel_size=1 "
            f"(one engine per GPU; a 7B policy fits one 80 GB GPU beside its update with LoRA or ZeRO-3), or run "
            f"one rank (python vagen/train.py, every GPU visible) whose engine spans {tp} GPUs")


def _check_state_reward(cfg: Config) -> None:
    from envs_visual import PROMPT_FORMATS

    algo = cfg.algo
    if algo.state_judge_path and algo.state_reward != "judge":
        raise ConfigError(f"algo.state_judge_path={algo.state_judge_path!r} is used only with algo.state_reward=judge "
                          f"(got {algo.state_reward}); set algo.state_reward=judge or drop the path")
    if algo.state_reward == "none":
        return
    graded = [f for f in ("observation", "prediction") if f in (PROMPT_FORMATS.get(cfg.env.prompt_format) or ())]
    if not graded:
        raise ConfigError(
            f"algo.state_reward={algo.state_reward} grades <observation> and <prediction>, but env.prompt_format="
            f"{cfg.env.prompt_format} has neither; use env.prompt_format=grounding_worldmodeling (or grounding, "
            f"worldmodeling), or algo.state_reward=none")
    for key in ("grounding_coef", "worldmodeling_coef"):
        if getattr(algo, key) < 0:
            raise ConfigError(f"algo.{key}={getattr(algo, key)} must be >= 0 (0 turns that score off)")
    if algo.state_repeat_window < 1 or algo.state_repeat_states < 1:
        raise ConfigError(f"algo.state_repeat_window={algo.state_repeat_window} and algo.state_repeat_states="
                          f"{algo.state_repeat_states} must be >= 1")
    if algo.state_reward == "judge":
        if not algo.state_judge_path:
            raise ConfigError("algo.state_reward=judge scores descriptions with a local causal LM, but "
                              "algo.state_judge_path is not set; set it to the model's directory (with config.json "
                              "and tokenizer files), or use algo.state_reward=rules")
        judge = Path(algo.state_judge_path).expanduser()
        if not (judge / "config.json").exists():
            raise ConfigError(f"algo.state_judge_path={algo.state_judge_path!r} is not a model directory: no "
                              f"config.json in {judge}; download the model beforehand and pass its directory")


def _check_lora(cfg: Config) -> None:
    """LoRA settings in range, and the combinations it cannot train (what needs the model's architecture,
    such as target names that do not exist, is checked by `vagen.models.check_lora_targets`)."""
    m = cfg.model
    if m.lora_rank < 0:
        raise ConfigError(f"model.lora_rank={m.lora_rank} must be >= 0 (0 = full fine-tuning; 8-64 is usual for LoRA)")
    if m.lora_alpha <= 0:
        raise ConfigError(f"model.lora_alpha={m.lora_alpha} must be > 0 (16, or twice model.lora_rank, is usual)")
    if not 0.0 <= m.lora_dropout < 1.0:
        raise ConfigError(f"model.lora_dropout={m.lora_dropout} must be in [0, 1) (0 is the default)")
    if not m.lora_target_modules or not all(isinstance(n, str) and n for n in m.lora_target_modules):
        raise ConfigError(f"model.lora_target_modules={m.lora_target_modules} must list module names, e.g. "
                          f"[{', '.join(LORA_TARGETS)}]")
    if m.lora_rank == 0:
        return
    if m.path == "builtin:tiny-vl" and m.freeze_vision:
        raise ConfigError("model.path=builtin:tiny-vl is randomly initialised: its vision tower (whose image tokens "
                          "the built-in's hooks centre and position-code so that it can learn to read cells) has never "
                          f"learnt to read a frame, and model.lora_rank={m.lora_rank} with model.freeze_vision=true "
                          "would keep it frozen; start from a warm start whose tower is trained (model.path=assets:NAME, "
                          "e.g. assets:frozenlake_visual), or set model.freeze_vision=false to train the tower fully "
                          "beside the adapters")


def _check_trackers(names: list) -> None:
    from vagen.trackers import TRACKERS

    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"log.trackers={names}: {name!r} is not a tracker{_closest(str(name), TRACKERS)} "
                              f"choices: {', '.join(TRACKERS)}")
    if len(set(names)) < len(names):
        raise ConfigError(f"log.trackers={names} names a tracker twice; list each once")


def kept_groups(cfg: Config) -> int:
    """Level groups an iteration trains after the reward-std filter (all of them without it)."""
    if cfg.algo.filter_mode == "none":
        return cfg.rollout.env_groups
    # with rollout.tasks the filter keeps its share of each task's groups (vagen.update.plan_groups)
    counts = [task.groups for task in cfg.rollout.tasks] or [cfg.rollout.env_groups]
    return sum(max(1, math.ceil(cfg.algo.filter_keep_ratio * groups - 1e-9)) for groups in counts)


def check_ranks(cfg: Config, world_size: int) -> None:
    """Refuse, before any work, batch sizes that do not share out evenly over `world_size` ranks."""
    for key in ("rollout.env_groups", "train.mini_batch_size"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value % world_size:
            raise ConfigError(f"{key}={value} must be divisible by the {world_size} ranks (each rank plays and "
                              f"trains an equal share); use a multiple of {world_size}, or fewer ranks (deepspeed "
                              f"--num_gpus K; without --num_gpus the launcher starts one rank per GPU of the node)")
    for i, task in enumerate(cfg.rollout.tasks):
        if task.groups % world_size:
            raise ConfigError(f"rollout.tasks[{i}] ({task.name}) groups={task.groups} must be divisible by the "
                              f"{world_size} ranks (each rank plays an equal share of every task); use a multiple "
                              f"of {world_size}, or fewer ranks")
    kept = kept_groups(cfg)
    if kept < world_size:
        raise ConfigError(f"algo.filter_keep_ratio={cfg.algo.filter_keep_ratio} keeps {kept} of "
                          f"rollout.env_groups={cfg.rollout.env_groups} level groups, fewer than the {world_size} "
                          f"ranks that train them; raise rollout.env_groups or algo.filter_keep_ratio so that at "
                          f"least {world_size} groups are kept")
    check_vllm_ranks(cfg, world_size)


def check_training(cfg: Config) -> None:
    """Checks that apply to training only (evaluation may decode greedily or with a nucleus)."""
    ro = cfg.rollout
    if ro.temperature == 0:
        raise ConfigError(
            "rollout.temperature=0 makes training rollouts greedy: the members of a group play identical "
            "episodes and the update's ratios compare a distribution that was never sampled; set "
            "rollout.temperature between 0.7 and 1.0 (evaluation is greedy unless eval.do_sample=true)"
        )
    if (ro.top_p < 1.0 or ro.top_k > 0) and not ro.off_policy_sampling:
        raise ConfigError(
            f"rollout.top_p={ro.top_p} and rollout.top_k={ro.top_k} truncate the sampling distribution, but the "
            f"update's log-probabilities are those of the whole distribution at rollout.temperature, so every "
            f"ratio would be off-policy; set rollout.top_p=1.0 rollout.top_k=0, or rollout.off_policy_sampling=true "
            f"to train on it anyway"
        )
    path = CONFIGS_DIR / cfg.train.deepspeed_config
    if path.exists():
        import json

        try:
            settings = json.loads(path.read_text())
            bf16 = settings.get("bf16", {}).get("enabled", False)
            fp16 = settings.get("fp16", {}).get("enabled", False)
            stage = settings.get("zero_optimization", {}).get("stage", 0)
        except (json.JSONDecodeError, AttributeError) as err:
            raise ConfigError(f"train.deepspeed_config={cfg.train.deepspeed_config}: {path} is not a JSON object "
                              f"of DeepSpeed settings ({err})") from None
        if cfg.model.lora_rank > 0 and stage == 3 and cfg.model.gradient_checkpointing:
            problem = _frozen_recompute_problem(cfg)
            if problem:
                raise ConfigError(problem)
        if cfg.model.dtype == "float32" and (bf16 or fp16):
            half = "bfloat16" if bf16 else "float16"
            raise ConfigError(
                f"model.dtype=float32 with train.deepspeed_config={cfg.train.deepspeed_config}, which enables {half}: "
                f"DeepSpeed would cast the actor and critic to {half} while the reference (and vLLM) keep float32, "
                f"so the KL is not 0 at the first iteration and the reference takes twice the memory; use a float32 "
                f"DeepSpeed config (train.deepspeed_config=deepspeed/zero0_fp32.json or deepspeed/zero3_fp32.json)"
                + (", or set model.dtype=bfloat16 to train in it" if bf16 else "")
            )
        if cfg.model.dtype == "bfloat16" and not bf16:
            raise ConfigError(
                f"model.dtype=bfloat16 with train.deepspeed_config={cfg.train.deepspeed_config}, which does not enable "
                f"bf16: AdamW would update bfloat16 weights directly and round updates of 1e-6 away; use a config "
                f"with \"bf16\": {{\"enabled\": true}} (fp32 master weights), e.g. "
                f"train.deepspeed_config=deepspeed/zero2_bf16.json, or model.dtype=float32"
            )


def machine_problems(cfg: Config) -> list[str]:
    """What this environment and the checkpoint's config.json rule out, read before anything loads
    (`vagen.preflight`): a package the config's backend or extras import and this environment lacks (vllm,
    peft, a tracker's), a model family vagen does not know, vagen's image hooks under rollout.backend=vllm."""
    from vagen.preflight import checkpoint_problems, missing_packages

    return missing_packages(cfg) + checkpoint_problems(cfg)


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


# DeepSpeed keeps a frozen parameter that a checkpointed layer's recompute gathers until that layer's backward
# is done from this version on (deepspeedai/DeepSpeed#8148); before it, ZeRO-3 partitioned it again at once.
DEEPSPEED_FROZEN_RECOMPUTE = "0.19.3"


def _frozen_recompute_problem(cfg: Config) -> str | None:
    """Why LoRA (a frozen base) with gradient checkpointing under ZeRO-3 cannot train with the installed
    DeepSpeed, or None when it can."""
    import importlib.metadata

    from packaging.version import Version

    try:
        installed = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return None  # the engines' own import fails with its message
    if Version(installed) >= Version(DEEPSPEED_FROZEN_RECOMPUTE):
        return None
    return (f"model.lora_rank={cfg.model.lora_rank} with model.gradient_checkpointing=true and "
            f"train.deepspeed_config={cfg.train.deepspeed_config} (ZeRO stage 3) needs DeepSpeed >= "
            f"{DEEPSPEED_FROZEN_RECOMPUTE}, which keeps a frozen base weight gathered while backward recomputes a "
            f"checkpointed layer; DeepSpeed {installed} partitions it again, and backward fails. pip install "
            f"\"deepspeed>={DEEPSPEED_FROZEN_RECOMPUTE}\", or set model.gradient_checkpointing=false")


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


def config_names(names: str | list[str] | None) -> list[str]:
    """The configs `names` lists, in order: a name or path, a comma list of them, or a list of either."""
    if not names:
        return []
    out = []
    for entry in [names] if isinstance(names, str) else names:
        if Path(entry).suffix in (".yaml", ".yml") and Path(entry).exists():  # a path is never split
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
    entries, tasks_at = config_names(names), None
    for at, entry in enumerate(entries):
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
    for text in overrides or []:
        key, value = parse_override(text)
        _apply(raw, key, value, "command-line override")
    after = entries[tasks_at + 1:] if tasks_at is not None else []
    _resolve_tasks(raw, after, overrides or [], require_checkpoint)
    token = _CHECKPOINT_OPTIONAL.set(not require_checkpoint)
    try:
        return from_dict(raw, "+".join(parts) or "default")
    finally:
        _CHECKPOINT_OPTIONAL.reset(token)


# What each task of rollout.tasks keeps of its own environment config, besides its env section.
TASK_ROLLOUT_KEYS = ("max_turns", "max_new_tokens", "max_trajectory_length")


def _resolve_tasks(raw: dict, after: list[str], overrides: list[str], require_checkpoint: bool) -> None:
    """rollout.tasks: each task's environment config loaded as a run of its own would load it (then the configs
    `after` the one that lists the tasks, recipes among them, with the task's real_model section, and the
    command line's env.* and length overrides); its env section and TASK_ROLLOUT_KEYS go into the task. The
    run's env is the first task's and its lengths the largest (what sizes engines and buffers), and
    rollout.env_groups the sum of the tasks' groups. Tasks already resolved (a run's config.yaml) stay."""
    tasks = (raw.get("rollout") or {}).get("tasks")
    if not tasks:
        return
    own = [text for text in overrides
           if parse_override(text)[0].startswith("env.") or parse_override(text)[0] in
           [f"rollout.{key}" for key in TASK_ROLLOUT_KEYS]]
    resolved = []
    for i, task in enumerate(tasks):
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
            sub = load_configs([task.config, *after], own, require_checkpoint)
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


def task_configs(cfg: Config) -> list[tuple[str, Config]]:
    """Each task of rollout.tasks as the config its rollouts run under: the run's, with the task's env section,
    turns and lengths and its groups as rollout.env_groups (not validated again: a task's share of groups may
    be smaller than train.mini_batch_size). [] for a run of one environment."""
    import copy

    out = []
    for task in cfg.rollout.tasks:
        sub = copy.copy(cfg)  # no __post_init__: the run's config was validated whole
        sub.env = EnvConfig(**{**task.env, "params": dict(task.env.get("params") or {})})
        sub.rollout = dataclasses.replace(cfg.rollout, tasks=[], env_groups=task.groups, **task.rollout)
        sub.name = task.name
        out.append((task.name, sub))
    return out


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
