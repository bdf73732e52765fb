"""The cross-field checks of vagen's config: `validate` runs when a `Config` is built (`Config.__post_init__`),
`check_training` and `check_ranks` before a run starts, `machine_problems` against this environment and the
checkpoint; each takes a `vagen.config.Config` (not imported here: `vagen.config` imports this module).
Each message says what was received, what was expected and how to fix it. Like `vagen.config`,
this module imports only the standard library and vagen's config sections, so that a mistake is reported
before torch or DeepSpeed load."""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import math
from pathlib import Path

from vagen.config_sections import CHOICES, CONFIGS_DIR, LORA_TARGETS, TASK_ROLLOUT_KEYS, EnvConfig


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


def validate(cfg) -> None:
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
    if tr.micro_batch_tokens < 0:
        raise ConfigError(f"train.micro_batch_tokens={tr.micro_batch_tokens} must be >= 0: the most tokens one "
                          f"forward/backward takes (e.g. 4096), or 0 to cut micro-batches by train.micro_batch_size")
    if set(cfg.sft.perception_axes) - {"row", "column"} or not cfg.sft.perception_axes:
        raise ConfigError(f"sft.perception_axes={cfg.sft.perception_axes} must name row, column or both")
    if cfg.sft.perception_steps < 0 or cfg.sft.perception_levels < 1 or cfg.sft.perception_batch_size < 1:
        raise ConfigError(f"sft.perception_steps={cfg.sft.perception_steps} must be >= 0, and "
                          f"sft.perception_levels={cfg.sft.perception_levels} and "
                          f"sft.perception_batch_size={cfg.sft.perception_batch_size} >= 1")
    if cfg.sft.perception_steps and cfg.env.render_mode != "vision":
        raise ConfigError(f"sft.perception_steps={cfg.sft.perception_steps} asks questions about frames, but "
                          f"env.render_mode={cfg.env.render_mode}; set sft.perception_steps=0 or env.render_mode=vision")
    if cfg.sft.teacher_slip is not None and not 0.0 <= cfg.sft.teacher_slip <= 1.0:
        raise ConfigError(f"sft.teacher_slip={cfg.sft.teacher_slip} is a share of actions: give a value in [0, 1], "
                          f"or null for the teacher's own")
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
    _check_frame_check(cfg)
    if cfg.rollout.env_wait_ms is not None and not cfg.rollout.env_wait_ms >= 0:
        raise ConfigError(f"rollout.env_wait_ms={cfg.rollout.env_wait_ms} must be >= 0 milliseconds (0: never wait "
                          f"while the engine has requests to run), or null to wait for every answer due")
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
    """env.step_timeout, env.workers, env.backend and its Ray or HTTP settings (whether Ray is installed:
    `vagen.preflight.missing_packages`)."""
    if env.step_timeout is not None and not env.step_timeout > 0:
        raise ConfigError(f"env.step_timeout={env.step_timeout} must be > 0 seconds, or null for no limit")
    if env.workers < 0:
        raise ConfigError(f"env.workers={env.workers} must be >= 0 (0: environments step in the trainer's process)")
    if env.backend not in ("process", "ray", "http"):
        raise ConfigError(f"env.backend={env.backend!r}{_closest(env.backend, ['process', 'ray', 'http'])} choices: "
                          f"process, ray, http")
    if env.backend == "process":
        return
    if env.backend == "http":
        if not env.urls or not all(isinstance(url, str) and url.startswith(("http://", "https://")) for url in env.urls):
            raise ConfigError(f"env.backend=http steps sessions on environment servers, but env.urls={env.urls!r}; "
                              f"give their addresses, e.g. env.urls=[http://127.0.0.1:8000] (start one with python -m "
                              f"vagen.env_server --config NAME --port 8000)")
        if not env.http_timeout > 0:
            raise ConfigError(f"env.http_timeout={env.http_timeout} must be > 0 seconds (120 is usual)")
        if env.api_key_env is not None and (not isinstance(env.api_key_env, str) or not env.api_key_env.isidentifier()):
            raise ConfigError(f"env.api_key_env={env.api_key_env!r} names an environment variable (e.g. GYM_API_KEY), "
                              f"never the key itself: export the key in that variable")
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


def _check_tasks(cfg) -> None:
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
            _check_env_backend(EnvConfig(**task.env))
        except ConfigError as err:
            raise ConfigError(f"rollout.tasks[{i}] ({task.name}): {err}") from None
    # The tasks' Ray actors share one connection per process (vagen.tasks.shared_ray): one cluster for all.
    addresses = {}
    for task in tasks:
        env = EnvConfig(**task.env)
        if env.workers > 0 and env.backend == "ray":
            addresses.setdefault(env.ray_address, []).append(task.name)
    if len(addresses) > 1:
        named = "; ".join(f"env.ray_address={address} for {', '.join(names)}" for address, names in addresses.items())
        raise ConfigError(f"rollout.tasks run Ray actors on different clusters ({named}), but a trainer's process "
                          f"connects to one Ray cluster for every task; give the tasks one env.ray_address (e.g. "
                          f"env.ray_address={next(iter(addresses))} on the command line sets every task's), or "
                          f"env.backend=process for some")
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


def _check_staleness(cfg) -> None:
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


def _check_vllm(cfg) -> None:
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


def check_vllm_ranks(cfg, world_size: int) -> None:
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


def _check_state_reward(cfg) -> None:
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


def _check_lora(cfg) -> None:
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


def kept_groups(cfg) -> int:
    """Level groups an iteration trains after the reward-std filter (all of them without it)."""
    if cfg.algo.filter_mode == "none":
        return cfg.rollout.env_groups
    # with rollout.tasks the filter keeps its share of each task's groups (vagen.batch_plan.plan_groups)
    counts = [task.groups for task in cfg.rollout.tasks] or [cfg.rollout.env_groups]
    return sum(max(1, math.ceil(cfg.algo.filter_keep_ratio * groups - 1e-9)) for groups in counts)


def check_ranks(cfg, world_size: int) -> None:
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


def _check_frame_check(cfg) -> None:
    """log.frame_check_every: -1 (auto), 0 (never) or a period; a period only where the policy sees frames."""
    every = cfg.log.frame_check_every
    if every < -1:
        raise ConfigError(f"log.frame_check_every={every} must be -1 (every iteration for a visual config), 0 (never) "
                          f"or a period of iterations >= 1")
    if every > 0 and not cfg.rollout.tasks and cfg.env.render_mode != "vision":
        raise ConfigError(f"log.frame_check_every={every} swaps the frames of a visual environment, but "
                          f"env.render_mode={cfg.env.render_mode} shows none; set log.frame_check_every=0 (or -1, "
                          f"which is off for text)")


def check_training(cfg) -> None:
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


def machine_problems(cfg) -> list[str]:
    """What this environment and the checkpoint's config.json rule out, read before anything loads
    (`vagen.preflight`): a package the config's backend or extras import and this environment lacks (vllm,
    peft, a tracker's), a model family vagen does not know, vagen's image hooks under rollout.backend=vllm."""
    from vagen.preflight import checkpoint_problems, missing_packages, packing_problems

    return missing_packages(cfg) + checkpoint_problems(cfg) + packing_problems(cfg)


# DeepSpeed keeps a frozen parameter that a checkpointed layer's recompute gathers until that layer's backward
# is done from this version on (deepspeedai/DeepSpeed#8148); before it, ZeRO-3 partitioned it again at once.
DEEPSPEED_FROZEN_RECOMPUTE = "0.19.3"


def _frozen_recompute_problem(cfg) -> str | None:
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


def task_configs(cfg) -> list[tuple[str, object]]:
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
