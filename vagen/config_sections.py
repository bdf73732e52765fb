"""The sections of vagen's config tree (`vagen.config.Config`): one dataclass each, every field with its default
and a one-line help text, and the choices of the fields that take one of a few values. Data only; loading and
composition are in `vagen.config`, the cross-field checks in `vagen.config_checks`; `vagen.config` re-exports
every name here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


CHOICES = {
    ("model", "dtype"): ("float32", "bfloat16"),
    ("model", "attn_implementation"): ("sdpa", "eager", "flash_attention_2"),
    ("env", "render_mode"): ("vision", "text"),
    ("sft", "lr_schedule"): ("constant", "cosine"),
    ("sft", "reasoning"): ("near", "path", "plan", "view", "lookup"),
    ("env", "prompt_format"): ("no_think", "free_think", "grounding", "worldmodeling", "grounding_worldmodeling"),
    ("rollout", "backend"): ("hf", "vllm"),
    ("rollout", "context"): ("full", "window"),
    ("algo", "rollout_correction"): ("none", "tis"),
    ("algo", "rollout_correction_mode"): ("clamp", "mask"),
    ("algo", "adv_estimator"): ("turn_gae", "gae", "grpo", "gigpo"),
    ("algo", "gigpo_norm"): ("mean_std", "mean"),
    ("algo", "token_selection"): ("all", "answer", "think_answer", "entropy"),
    ("algo", "filter_mode"): ("none", "std", "std_rev"),
    ("algo", "kl_kind"): ("k1", "k2", "k3", "abs"),
    ("algo", "state_reward"): ("none", "rules", "judge"),
    ("algo", "loss_agg"): ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
}


# env.step_timeout's default, in seconds. The slowest legitimate reset or step of the shipped environments
# (benchmarks/bench_step_times.py, docs/benchmarks.md: a MuJoCo environment made with its renderer on its first
# reset) took 0.5 s on a loaded 2-core CPU; 60 s leaves a margin of over 100x for busier machines and slower
# renderers, and stays far below train.dist_timeout_minutes, which the other ranks wait in their next collective.
DEFAULT_STEP_TIMEOUT = 60.0


# What each task of rollout.tasks keeps of its own environment config, besides its env section.
TASK_ROLLOUT_KEYS = ("max_turns", "max_new_tokens", "max_trajectory_length")


def _f(default, help: str):
    """A field with a one-line help text; mutable defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# The language model's attention and MLP projections (Qwen2, Qwen2.5-VL, Qwen3): the default LoRA targets.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelConfig:
    path: str = _f("builtin:tiny-vl", "the checkpoint training starts from, trained as given: a local HF checkpoint "
                                      "dir (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, Qwen2/Qwen3 text), a shipped "
                                      "warm start assets:NAME (assets/checkpoints/NAME), or a random built-in "
                                      "builtin:tiny-vl / tiny-qwen3-vl / tiny-qwen3.5 / tiny-text")
    critic_path: str | None = _f(None, "critic init: a checkpoint the actor could start from (its weights, a new value "
                                       "head), or a critic vagen saved (runs/<run>/checkpoints/step_N[/critic], "
                                       "backbone and value head); null = the actor's weights")
    dtype: str = _f("float32", "parameter dtype: float32 | bfloat16")
    attn_implementation: str = _f("sdpa", "attention kernel of the policy, critic and reference: sdpa | eager | "
                                          "flash_attention_2 (needs the flash-attn package, a GPU and "
                                          "model.dtype=bfloat16); vLLM rollouts use vLLM's own")
    builtin_cache: str = _f("~/.cache/vagen", "where built-in tiny models are built and cached")
    builtin_seed: int = _f(0, "initialisation seed of a built-in model; not train.seed, so that training "
                              "seeds share one base")
    builtin_position_code: bool = _f(False, "built-in VLM: add a fixed code of its cell's row and column to each "
                                            "image token (vagen.models.image_position_code); other "
                                            "checkpoints ignore it")
    builtin_layers: int = _f(2, "decoder layers of a built-in model (each changes its cache key); other "
                                "checkpoints ignore it")
    min_pixels: int | None = _f(None, "image processor min_pixels; null = the checkpoint's own")
    max_pixels: int | None = _f(None, "image processor max_pixels; null = the checkpoint's own")
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    lora_rank: int = _f(0, "rank of the LoRA adapters (peft) on the language model; 0 = full fine-tuning. With LoRA the "
                           "base weights stay frozen, the critic gets adapters of its own, and the KL reference is "
                           "the actor with its adapters disabled (no second copy)")
    lora_alpha: int = _f(16, "LoRA scaling: each adapted weight is W + (lora_alpha / lora_rank) B A")
    lora_dropout: float = _f(0.0, "dropout on the adapters' inputs; 0 keeps the update's log-probabilities those of "
                                  "the policy that sampled (the first PPO ratio is 1)")
    lora_target_modules: list[str] = _f(list(LORA_TARGETS), "LoRA: names (last component) of the language model's "
                                                            "linear layers that get adapters, never the vision tower's; "
                                                            "default: every attention and MLP projection")
    freeze_vision: bool = _f(True, "LoRA: the vision tower and merger stay frozen; false trains them fully beside the "
                                   "adapters (saved with them). Full fine-tuning ignores it and trains the tower")


@dataclass
class EnvConfig:
    name: str = _f("sokoban", "environment name passed to envs_visual.make")
    render_mode: str = _f("vision", "vision (frames as images) | text (symbol grid in the prompt)")
    prompt_format: str = _f("free_think", "no_think | free_think | grounding | worldmodeling | ...")
    max_actions_per_turn: int = _f(3, "actions executed per response at most")
    format_reward: float = _f(0.5, "reward for a response that parses with only valid actions")
    params: dict = _f({}, "env-specific parameters, e.g. {dim_room: [6, 6], num_boxes: 1}")
    step_timeout: float | None = _f(DEFAULT_STEP_TIMEOUT, "seconds an environment's reset or step may take before "
                                                          "its episode ends as failed (an alarm in the process that "
                                                          "steps it interrupts Python code; with env.workers a worker "
                                                          "stuck in a C call is replaced 2 s later); the default is "
                                                          "over 100x the slowest reset or step of the shipped "
                                                          "environments (docs/benchmarks.md); null = no limit, and a "
                                                          "hung environment then hangs the rank")
    workers: int = _f(0, "processes that hold the environments (and their renderers) and step them in parallel, "
                         "beside the trainer; a worker that raises, hangs past env.step_timeout or dies ends only the "
                         "episode whose step it ran and is replaced, and one found dead while idle is replaced before "
                         "its next step; 0 = step them in the trainer's process")
    backend: str = _f("process", "what the env.workers are: process (local processes) | ray (Ray actors, on any node "
                                 "of a Ray cluster; pip install -e \".[ray]\") | http (sessions on environment "
                                 "servers, env.urls; pip install -e \".[http]\"); the same answers, timeouts and "
                                 "replacement either way")
    ray_address: str = _f("local", "env.backend=ray: local (a private Ray instance that each rank starts and stops "
                                   "itself) | auto (the cluster `ray start` runs on this node) | the address of a "
                                   "running cluster's head, HOST:6379")
    ray_cpus: float = _f(1.0, "env.backend=ray: CPUs each actor reserves in Ray's accounting (fractions allowed)")
    ray_resources: dict = _f({}, "env.backend=ray: custom Ray resources each actor asks for, e.g. {env_host: 1}, "
                                 "so that actors run only on nodes started with ray start --resources")
    ray_start_timeout: float = _f(60.0, "env.backend=ray: seconds the actors may take to be placed and started "
                                        "before the run fails naming the resources it could not get")
    urls: list = _f([], "env.backend=http: the environment servers (python -m vagen.env_server, or VAGEN-Lite's), e.g. "
                        "[http://127.0.0.1:8000]; new sessions go to the one holding the fewest of this rank's")
    api_key_env: str | None = _f(None, "env.backend=http: name of the environment variable holding the servers' key "
                                       "(sent as X-API-Key); the key itself never goes in a config")
    replay: bool = _f(True, "env.backend=http: a lost session (404, server gone, no answer) is rebuilt in a new one "
                            "by replaying the episode's responses, each observation checked; false ends the episode "
                            "instead (servers that are not deterministic)")
    http_timeout: float = _f(120.0, "env.backend=http: seconds a request may wait for its answer; past it the "
                                    "session counts as lost (env.replay)")
    remote_config: dict = _f({}, "env.backend=http: the env_config sent to /connect in place of the environment's "
                                 "parameters (for servers of other projects, e.g. {eval_set: base}); empty = "
                                 "env.params with the prompt format, render mode, actions per turn and format reward")


@dataclass
class TaskConfig:
    """One task of a run over several (`rollout.tasks`): an environment config and its share of level groups.
    `env` and `rollout` are filled when the run's config loads (`load_configs`), from the task's config (after
    the recipes that follow the run's config, through its real_model section, and the command line's env.*
    and length overrides): a run's saved config.yaml holds them, so loading it alone reproduces the tasks."""
    config: str = _f("", "the task's environment config (a name in configs/ or a path): its env section, turns, "
                         "tokens per turn and trajectory length")
    groups: int = _f(1, "level groups of this task per iteration, over all ranks (a multiple of the rank count)")
    name: str = _f("", "the task's name in metrics (rollout/<name>/success) and evaluations; empty = the config's")
    overrides: list = _f([], "env.* and length overrides (rollout.max_turns, max_new_tokens, max_trajectory_length) "
                             "for this task alone, applied right after its config (before a recipe and the command line): "
                             "[env.params.image_width=112, env.params.image_height=112]")
    env: dict = _f({}, "filled when the config loads: the task's env section")
    rollout: dict = _f({}, "filled when the config loads: the task's rollout.max_turns, max_new_tokens and "
                           "max_trajectory_length")


@dataclass
class RolloutConfig:
    backend: str = _f("hf", "decoding engine: hf (the transformers model being trained, one cache across turns) | "
                            "vllm (an in-process vLLM engine per rank, weights synced after each update; settings "
                            "in the vllm section)")
    env_groups: int = _f(4, "distinct level seeds per iteration")
    group_size: int = _f(4, "rollouts per level seed (members of a group share the seed)")
    max_turns: int = _f(3, "turns per episode at most")
    max_new_tokens: int = _f(64, "generated tokens per turn at most")
    temperature: float = _f(0.7, "sampling temperature (the update's log-probabilities use the same); 0 = greedy, "
                                 "which training refuses")
    top_p: float = _f(1.0, "nucleus sampling threshold; 1 = off, the only setting whose log-probabilities the update "
                           "reproduces (others need rollout.off_policy_sampling=true)")
    top_k: int = _f(0, "top-k sampling; 0 = off (transformers would otherwise use 50); like top_p, training needs 0 "
                       "unless rollout.off_policy_sampling=true")
    off_policy_sampling: bool = _f(False, "let training rollouts sample with top_p < 1 or top_k > 0, whose truncated "
                                          "distribution the update's log-probabilities do not model")
    max_trajectory_length: int = _f(4096, "tokens per trajectory at most; whole turns are dropped")
    reuse_cache: bool = _f(True, "keep each episode's keys and values across turns, so a turn feeds only its "
                                 "new tokens; false = transformers' generate over the whole history every turn")
    context: str = _f("full", "what each turn's prompt holds: full (the whole episode so far; one training sequence "
                              "per trajectory) | window (the system prompt, the last rollout.window_turns turns and "
                              "the new observation; each turn is its own training sample)")
    window_turns: int = _f(2, "rollout.context=window: earlier turns (observation, frames and response) kept in each "
                              "turn's prompt; 0 = the new observation alone")
    reuse_iterations: int = _f(1, "rollout freshness: each batch of rollouts trains this many consecutive "
                                  "iterations (1 = fresh rollouts every iteration); the reused iterations keep the "
                                  "sampling policy's old log-probs and advantages; rollout/staleness_mean and _max "
                                  "count the updates since a trained token was sampled")
    max_staleness: int = _f(0, "k: updates a trained turn may lag the policy it is trained by (rollout.backend=vllm). "
                               "0 = synchronous: every episode ends before the update. k > 0: a rollout ends once this "
                               "rank's share of groups has ended, up to (k + 1) x that share of groups are in flight, "
                               "and unfinished episodes go on after the update with the new weights; needs "
                               "algo.rollout_correction=tis (decoupled PPO), (k + 1) x the environments")
    env_wait_ms: float | None = _f(10.0, "rollout.backend=vllm with env.workers: milliseconds the agent loop waits "
                                         "before each engine pass for the environment answers due; the pass runs "
                                         "with those that came, later ones join a later pass, so environments step "
                                         "while the engine decodes (docs/benchmarks.md); null = wait for every "
                                         "answer due: the in-process loop's passes, whatever the timing")
    tasks: list[TaskConfig] = _f([], "several tasks in one run: a list of {config: ENV_CONFIG, groups: N} (each "
                                     "environment config keeps its env, turns and lengths; rollout.env_groups is "
                                     "then the sum of the groups, env and the lengths those of the tasks: "
                                     "docs/training.md, \"Several tasks in one run\"); [] = one environment")


@dataclass
class AlgoConfig:
    adv_estimator: str = _f("turn_gae", "turn_gae (TRICO) | gae (PPO) | grpo | gigpo (GRPO over episode returns "
                                        "plus step groups of turns that start from the same environment state; no "
                                        "critic)")
    token_selection: str = _f("all", "tokens that get policy gradient: all | answer | think_answer | entropy")
    top_ratio: float = _f(0.2, "entropy selection: share of generated tokens kept per sequence")
    gamma: float = _f(1.0, "token-level discount (gae, and token level of turn_gae)")
    lam: float = _f(1.0, "token-level GAE lambda (gae, and token level of turn_gae)")
    gamma_turn: float = _f(0.95, "turn-level discount of turn_gae")
    lam_turn: float = _f(1.0, "turn-level GAE lambda of turn_gae")
    grpo_norm_by_std: bool = _f(True, "grpo: divide by in-group std (false = Dr.GRPO)")
    step_gamma: float = _f(0.95, "gigpo: discount of each turn's return-to-go, the score its step group compares")
    step_weight: float = _f(1.0, "gigpo: weight omega of the step-level advantage in A_episode + omega x A_step")
    gigpo_norm: str = _f("mean_std", "gigpo: normalisation within episode groups and step groups alike: mean_std "
                                     "(minus the group mean, over the group std) | mean (minus the group mean only)")
    whiten_advantages: bool = _f(True, "gae/turn_gae: whiten advantages over the batch")
    filter_mode: str = _f("none", "reward-std group filter: none | std | std_rev")
    filter_keep_ratio: float = _f(0.25, "share of groups kept by the reward-std filter")
    clip_low: float = _f(0.2, "PPO ratio clip below 1")
    clip_high: float = _f(0.2, "PPO ratio clip above 1 (clip-higher: 0.28)")
    dual_clip: float = _f(3.0, "dual-clip bound c for negative advantages")
    entropy_coef: float = _f(0.001, "entropy bonus coefficient")
    vf_coef: float = _f(1.0, "value loss coefficient")
    value_clip: float = _f(0.5, "value clip range")
    kl_coef: float = _f(0.0, "KL coefficient to the reference model; 0 = no reference model")
    kl_kind: str = _f("k3", "KL estimator: k1 | k2 | k3 | abs")
    kl_in_reward: bool = _f(False, "true: KL as a per-token reward penalty; false: as a loss term")
    loss_agg: str = _f("token-mean", "how a mini-batch's per-token losses become one: token-mean (over all its selected "
                                     "tokens, across micro-batches and ranks) | seq-mean-token-sum | seq-mean-token-mean "
                                     "| seq-mean-token-sum-norm (token sums / algo.loss_norm_tokens, Dr. GRPO)")
    loss_norm_tokens: int | None = _f(None, "seq-mean-token-sum-norm: the constant each trajectory's token sum is "
                                            "divided by, whatever the padding of a micro-batch; null = the most tokens "
                                            "a trajectory can generate, rollout.max_turns x (rollout.max_new_tokens + 1)")
    rollout_correction: str = _f("none", "rollout.backend=vllm: none | tis (importance sampling: each sampled "
                                         "token's policy loss weighted by p_trainer / p_vllm, capped as "
                                         "algo.rollout_correction_mode says, for the gap between the engines; "
                                         "required at rollout.max_staleness > 0, where it is decoupled PPO's "
                                         "behaviour weight and corrects for the staleness too)")
    rollout_correction_cap: float = _f(2.0, "algo.rollout_correction=tis: the largest weight C")
    rollout_correction_mode: str = _f("clamp", "algo.rollout_correction=tis: what a weight above the cap C becomes: "
                                               "clamp (C: truncated importance sampling, verl's TIS) | mask (0: the "
                                               "token leaves the loss, AReaL's decoupled PPO with behav_imp_weight_cap)")
    state_reward: str = _f("none", "grade the agent's <observation> (against the state before its actions) and "
                                   "<prediction> (the state after): none | rules (deterministic F1 of described "
                                   "relations) | judge (a local causal LM at algo.state_judge_path)")
    grounding_coef: float = _f(0.5, "turn reward += this x the <observation> score in [0, 1]")
    worldmodeling_coef: float = _f(0.5, "turn reward += this x the <prediction> score in [0, 1]")
    state_judge_path: str | None = _f(None, "algo.state_reward=judge: directory of a Hugging Face causal LM "
                                            "(config.json, tokenizer); nothing is downloaded")
    state_repeat_window: int = _f(512, "anti-hacking: the last N graded descriptions a repeat is looked for in")
    state_repeat_states: int = _f(3, "anti-hacking: a description written verbatim for more than this many different "
                                     "true states within the window scores 0")


@dataclass
class VLLMConfig:
    gpu_memory_utilization: float = _f(0.5, "share of a GPU's memory the engine may take (weights, activations, "
                                            "KV cache)")
    max_model_len: int = _f(8192, "longest sequence (history + new tokens) the engine accepts")
    enforce_eager: bool | None = _f(None, "true: no CUDA graphs (slower decoding, faster start, less memory); "
                                          "null = false on a GPU (graphs captured once at start-up), true on the CPU")
    tensor_parallel_size: int = _f(1, "GPUs per engine (the model split across them); 1 = one engine per rank on the "
                                      "rank's own GPU. Above 1 only for a run of one rank (python vagen/train.py)")
    sleep_mode: bool = _f(True, "on a GPU, release the engine's memory during the update (weights and KV cache "
                                "dropped, not copied to the host) and restore it after, weights first")
    cpu_kv_cache_gib: float = _f(1.0, "on the CPU, GiB of memory for the engine's KV cache")
    sync_group_mb: int = _f(512, "MB of actor weights loaded into the engine at a time after each update (under "
                                 "ZeRO-3 gathered a group at a time)")
    seeded_requests: bool = _f(True, "seed every request from the iteration's seed and the episode's row, so that an "
                                     "episode samples the same tokens whatever shares its batch; false = the engine's "
                                     "one generator (reproducible only for the same batches in the same order), which "
                                     "saves vLLM's per-request sampling loop (docs/training.md, vLLM rollouts)")


@dataclass
class TrainConfig:
    iterations: int = _f(100, "rollout + update iterations")
    seed: int = _f(0, "seed for sampling, level seeds and mini-batch order (a built-in's weights: model.builtin_seed; "
                      "the critic's value head starts at zero)")
    actor_lr: float = _f(1e-6, "actor learning rate")
    critic_lr: float = _f(1e-5, "critic learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(0, "linear learning-rate warm-up in optimizer steps")
    lr_decay_steps: int = _f(0, "after warm-up, lower the learning rate along a cosine to 0 at this optimizer "
                                "step; 0 = constant")
    grad_clip: float = _f(1.0, "gradient norm clip")
    ppo_epochs: int = _f(1, "passes over each rollout batch")
    mini_batch_size: int = _f(16, "trajectories per optimizer step (global); with rollout.context=window, every turn "
                                   "sample of that many trajectories")
    micro_batch_size: int = _f(4, "sequences per forward/backward (per rank): trajectories, or turn samples with "
                                  "rollout.context=window; unused when train.micro_batch_tokens > 0")
    micro_batch_tokens: int = _f(0, "cut each rank's mini-batch into micro-batches by tokens instead of by count: "
                                    "at most this many tokens (text and image tokens; padded width x rows, or the "
                                    "sum of lengths with train.pack_sequences) per forward/backward, a longer "
                                    "sequence alone; 0 = train.micro_batch_size sequences")
    pack_sequences: bool = _f(False, "run each micro-batch's sequences back to back in one row, without padding "
                                     "(attention stays within each sequence, each keeps its positions and frames; "
                                     "same log-probs and values as padded); refused for Qwen3.5")
    deepspeed_config: str = _f("deepspeed/zero0_fp32.json", "DeepSpeed JSON, relative to configs/")
    run_dir: str = _f("runs", "parent directory of run directories")
    run_name: str | None = _f(None, "run directory name; null = <config>-<time>")
    resume: str | None = _f(None, "auto (latest in this run name) | PATH of a checkpoint | null")
    save_every: int = _f(0, "checkpoint every N iterations; 0 = only at the end")
    save_last: bool = _f(True, "checkpoint after the last iteration; false: only train.save_every's (a smoke run or "
                               "a benchmark that keeps no weights)")
    keep_checkpoints: int | None = _f(None, "keep only the newest N checkpoints of a run; null = all")
    dist_timeout_minutes: int = _f(30, "how long a rank waits in a collective for the others (process-group "
                                       "timeout): the longest any rank works alone, e.g. rank 0 writing a "
                                       "checkpoint or converting one at resume")
    critic_warmup: int = _f(0, "iterations that update only the critic")
    max_bad_steps: int = _f(3, "optimizer steps in a row skipped for a non-finite loss or gradient after which the "
                               "run saves a checkpoint and stops")


@dataclass
class SFTConfig:
    base: str | None = _f(None, "what `python -m vagen.sft` fine-tunes (a model.path value); null = the random "
                                "built-in of env.render_mode (builtin:tiny-vl or builtin:tiny-text), built with "
                                "the model.builtin_* settings")
    demos: int = _f(1500, "warm start: demonstrated episodes on distinct levels (none from evaluation)")
    exclude_eval: int = _f(1024, "levels of the first N evaluation seeds are never demonstrated")
    max_steps: int = _f(1500, "optimizer steps at most")
    min_steps: int = _f(300, "optimizer steps before early stopping may end training")
    batch_size: int = _f(16, "episodes per optimizer step")
    micro_batch_size: int = _f(16, "episodes per forward/backward")
    length_window: int = _f(4, "batches drawn at once and regrouped by episode length, so that rows of a batch "
                               "pad less (FrozenLake: 25% padding -> 7%); 1 = plain random batches")
    lr: float = _f(1e-3, "learning rate (peak, after warm-up)")
    lr_schedule: str = _f("constant", "after warm-up: constant | cosine (down to 0 at sft.max_steps)")
    warmup_steps: int = _f(20, "linear learning-rate warm-up steps")
    check_every: int = _f(50, "steps between checks of answer accuracy on held-out demonstrations")
    patience: int = _f(4, "stop after this many checks without a better held-out answer accuracy")
    val_demos: int = _f(128, "held-out demonstrations for the convergence check")
    teacher_styles: bool = _f(False, "draw the teacher's style per episode (FrozenLake: rows or columns first) "
                                     "and state it in the reasoning; false: its default style, unstated")
    reasoning: str = _f("near", "what a demonstration's <think> says: near (where the goal or box is, what is next to "
                                "the player, the first move) | path (a clause per move of the answer, from the cell it "
                                "starts on: 'row 0, column 1: hole below, so right.', 'row 4, column 2: push up.') | plan "
                                "(Sokoban: path, naming the cell the teacher walks to in order to push from it: "
                                "'row 2, column 3: to row 4, column 2, go down.') | view (navigation: what the turn's "
                                "frame shows, in words it can show: 'The red table is on my left. 2 steps free ahead. "
                                "So I take rotateleft.', vagen.warmstart.navigation_questions) | lookup (manipulation: near, with the "
                                "listing's line of each object the answer goes to before the first primitive: 'purple "
                                "cube (-60, -23, 20), goal (-142, -113, 0).')")
    teacher_slip: float | None = _f(None, "share of the teacher's actions that slip, in the demonstrations and the "
                                          "on-policy stage's labels: navigation's random moves (its own: 0.15), "
                                          "manipulation's jittered millimetres (its own: 1; 0 = every action copies "
                                          "the listed centres); null = the teacher's own")
    perception_steps: int = _f(0, "steps at most of a first stage on questions about the env's frames ('Which row "
                                  "is the box in?', vagen.warmstart.perception; navigation: 'Where is the red table?' "
                                  "and the free steps ahead, vagen.warmstart.navigation_questions) before the "
                                  "demonstrations; 0 = none")
    perception_levels: int = _f(2000, "levels (one question each) for the perception stage")
    perception_objects: list = _f(["player"], "what the perception questions ask about (state() keys of one-cell "
                                              "objects: player, boxes, targets)")
    perception_axes: list = _f(["row"], "which coordinates the perception questions ask for: row, column")
    perception_batch_size: int = _f(32, "questions per optimizer step of the perception stage")
    cell_questions: int = _f(0, "FrozenLake and Sokoban frames: questions 'what is on the cell the player reaches by "
                                "moving Right, then Down?' mixed into a last stage on the demonstrations "
                                "(vagen.warmstart.perception.cell_probes); 0 = no such stage")
    cell_moves: list = _f([1, 2], "how many moves from the player the cell questions look (drawn per question)")
    cell_steps: int = _f(2000, "optimizer steps of the cell-question stage (new optimizer, a cosine from sft.lr)")
    cell_batch_size: int = _f(32, "demonstrations and questions per optimizer step of the cell-question stage")
    on_policy_levels: int = _f(0, "a last stage on the model's own episodes: it plays this many training levels "
                                  "(sampled at rollout.temperature), each of its turns after the first is answered "
                                  "by the teacher from the state the model reached, after the model's own earlier "
                                  "turns, and those answers are learned mixed with the demonstrations; 0 = no such stage")
    on_policy_steps: int = _f(400, "optimizer steps of the on-policy stage (new optimizer, a cosine from sft.lr)")
    task_shares: list = _f([], "a warm start of several tasks (rollout.tasks): each task's share of the batches, in "
                               "the tasks' order (any positive scale); empty = their shares of the level groups")


@dataclass
class EvalConfig:
    every: int = _f(0, "evaluate every N iterations; 0 = never during training")
    before_training: bool = _f(False, "evaluate the starting checkpoint before the first iteration (eval/step_0, the "
                                      "metrics record of iteration -1); a resumed run does not repeat it")
    episodes: int = _f(16, "evaluation episodes (held-out seeds)")
    videos: int = _f(2, "episode videos written per evaluation")
    do_sample: bool = _f(False, "sample during evaluation (false = greedy)")
    sample_seed: int = _f(0, "a sampled evaluation draws from this seed (+ the rank): reruns play the same episodes")


@dataclass
class LogConfig:
    tensorboard: bool = _f(True, "write tensorboard events")
    progress: bool = _f(True, "show a progress bar")
    trackers: list[str] = _f(["tensorboard"], "where metrics go besides metrics.jsonl: any of tensorboard (needs "
                                              "log.tensorboard=true), wandb, mlflow, trackio (vagen.trackers)")
    frame_check_every: int = _f(-1, "every N iterations, score the batch's responses again with frames swapped between "
                                    "level groups and log rollout/frame_gap (nats per turn) and frame_gap_positive "
                                    "(vagen.frame_check); 0 = never; -1 = every iteration for a visual config, never "
                                    "for a text one")
    frame_gap_floor: float = _f(3.0, "the collapse monitor warns when rollout/frame_gap falls below this many nats "
                                     "per turn while rollout/format_ok stays >= 0.8: a policy that answers without "
                                     "looking (calibrated on the built-in warm starts: docs/algorithms.md)")
