"""Train a multi-turn agent with StarPO/TRICO.

    deepspeed vagen/train.py --config sokoban_visual [section.key=value ...]
    python vagen/train.py --config sokoban_visual [section.key=value ...]

Reads top to bottom like the algorithm: config → environments → policy and critic → DeepSpeed
engines, then per iteration: rollout → filter groups → annotate (old log-probs, values) →
advantages → PPO update → log → evaluate and save. This is the only module that creates DeepSpeed
engines.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, action="append",
                        help="name in configs/ or path of a YAML file; several (repeated, or a comma list) apply in "
                             "order, e.g. --config sokoban_visual --config recipes/qwen2.5-vl-3b")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from vagen.config import check_ranks, load_config_or_exit

    cfg = load_config_or_exit(args.config, args.overrides)  # fails fast, before torch loads
    if refused(lambda: check_before_loading(cfg)):
        return 2
    from vagen.distributed import init_distributed

    dist = init_distributed(timeout_minutes=cfg.train.dist_timeout_minutes)
    if refused(lambda: check_ranks(cfg, dist.world_size)) or refused(lambda: check_gpu_memory(cfg, dist)):
        return 2
    import torch

    from vagen import core
    from vagen.console import Progress
    from vagen.rollout import close_envs, make_decoder
    from vagen.run import RunDir, reduce_metrics
    from vagen.state_reward import state_rewarder
    from vagen.tasks import run_admission

    torch.manual_seed(cfg.train.seed + dist.rank)
    run = RunDir.create(cfg, dist)
    is_main_process = dist.rank == 0
    models = build_models(cfg, dist, run, is_main_process)
    monitor = core.CollapseMonitor(frame_gap_floor=cfg.log.frame_gap_floor)
    rewarder = state_rewarder(cfg, dist)
    # What a resumed run must restore besides the engines (the state reward's recent descriptions).
    tracked = {"state_reward": rewarder.tracker} if rewarder is not None else {}
    # and the count of level groups admitted and ended (rollout.max_staleness; each task's with rollout.tasks)
    admission = run_admission(cfg, dist.world_size)
    tracked["admission"] = EveryRank(admission, dist)
    start = run.maybe_resume(cfg, models.actor, models.critic, monitor, tracked)
    decoder = make_decoder(cfg, models.actor.module, models.encoder)
    generator = torch.Generator()
    source, envs = rollout_source(cfg, dist, models.encoder, f"{run.path.name}-rank{dist.rank}", start, admission)
    progress = Progress(start, cfg.train.iterations, enabled=is_main_process and cfg.log.progress)
    bad_steps_in_a_row, return_code, batch = 0, 0, None
    if start == 0:  # eval.before_training: the starting checkpoint (a resumed run has evaluated it already)
        stats = run.maybe_evaluate(-1, cfg, models.actor.module, models.encoder, decoder)
        if stats and is_main_process:
            run.log(-1, stats, [])

    for it in range(start, cfg.train.iterations):
        t_iter = time.perf_counter()
        # Seeded per iteration and rank: a run is reproducible, and a resumed run samples exactly as an
        # uninterrupted one would.
        torch.manual_seed((cfg.train.seed * 1_000_003 + it) * 1_009 + dist.rank)
        generator.manual_seed(cfg.train.seed * 1_000_003 + it)
        batch, stats = rollouts(batch, cfg, it, dist, models, decoder, source, rewarder)
        played, samples = batch.played, batch.samples
        stats.update(train_on(samples, cfg, it, dist, models, generator, bad_steps_in_a_row))
        bad_steps_in_a_row = int(stats["update/bad_steps_in_a_row"])  # the same on every rank
        stats.update(sync_decoder(decoder, models.actor))

        # -- collapse indicators, logging, evaluation, checkpoints ------------------------------------------
        if batch.sampled_at == it:  # the batch's indicators, logged once
            stats.update(indicators(samples, played))
        stats = reduce_metrics(stats, dist)
        warnings = monitor.update({k: stats[v] for k, v in WATCHED.items() if v in stats})
        stats["timing/iteration"] = time.perf_counter() - t_iter
        stats.update(run.maybe_evaluate(it, cfg, models.actor.module, models.encoder, decoder))
        if is_main_process:
            run.log(it, stats, warnings)
            progress.update(it, stats)
        # Steps that keep failing (a non-finite loss or gradient) end the run, with a checkpoint to look into.
        stop = bad_steps_in_a_row >= cfg.train.max_bad_steps
        run.maybe_save(it, cfg, models.actor, models.critic, models.processor, monitor, force=stop, tracked=tracked)
        if stop:
            report_bad_steps(cfg, it, bad_steps_in_a_row, run, is_main_process)
            return_code = 1
            break

    progress.close()
    close_envs(envs)
    if hasattr(decoder, "close"):  # a vLLM engine: its workers, and the folder of the adapter it last loaded
        decoder.close()
    run.finish()
    return return_code


def rollout_source(cfg, dist, encoder, owner: str, start: int, admission):
    """What plays the run's episodes, and the environments it steps. Environments live for the whole run
    (reset with new seeds each iteration): a MuJoCo renderer costs ~0.1 s to create and holds a GL context.
    With env.workers > 0, workers or Ray actors hold them (named after `owner`, the run and rank)."""
    from vagen.rollout import Rollouts, make_envs
    from vagen.tasks import TaskRollouts

    if cfg.rollout.tasks:  # several tasks: a rollout source and environments per task (vagen.tasks)
        source = TaskRollouts(encoder, cfg, dist.rank, dist.world_size, start, owner, admission)
        return source, source.all_envs()
    # rollout.max_staleness = k: up to k + 1 shares of groups in flight, the carried ones and the new ones
    envs = make_envs(cfg.env, admission.in_flight_limit * cfg.rollout.group_size, owner=owner)
    return Rollouts(encoder, cfg, envs, dist.rank, dist.world_size, start, admission), envs


def refused(check) -> bool:
    """Whether `check` (a callable) raised a ConfigError, which is then printed as a config error."""
    from vagen.config import ConfigError

    try:
        check()
    except ConfigError as err:
        for failure in getattr(err, "failures", [str(err)]):
            print(f"config error: {failure}", file=sys.stderr)
        return True
    return False


def check_before_loading(cfg) -> None:
    """The checks of training that need no rank: sampling settings, the DeepSpeed config, the packages the
    config needs and what the checkpoint's config.json says (`vagen.config.machine_problems`: all of them
    reported at once), LoRA's target names (a name that does not exist fails here, before anything is
    written)."""
    from vagen.config import ChecksFailed, check_training, machine_problems

    check_training(cfg)
    problems = machine_problems(cfg)
    if problems:
        raise ChecksFailed(problems)
    if cfg.model.lora_rank > 0:
        from vagen.models import check_lora_targets

        check_lora_targets(cfg.model)


def check_gpu_memory(cfg, dist) -> None:
    """On a GPU, the per-GPU memory estimate (`vagen.memory`) against this rank's GPU, refused before any model
    loads with the estimator's message (what does not fit, and what to change); nothing on the CPU."""
    if dist.device.type != "cuda":
        return
    import torch

    from vagen.memory import check_memory

    check_memory(cfg, dist.world_size, torch.cuda.mem_get_info(dist.device)[1] / 2**30)


WATCHED = {"grad_norm": "actor/grad_norm", "entropy_mean": "actor/entropy_mean",
           "reward_std_in_group": "rollout/in_group_reward_std", "format_ok": "rollout/format_ok",
           "frame_gap": "rollout/frame_gap"}


@dataclass
class Models:
    actor: object  # DeepSpeed engine of the policy
    critic: object | None  # DeepSpeed engine of the value model (gae, turn_gae)
    reference: object | None  # frozen policy for the KL term (algo.kl_coef > 0); with LoRA the actor, adapters off
    processor: object
    encoder: object  # vagen.episode.ChatEncoder


def build_models(cfg, dist, run, is_main_process: bool) -> Models:
    """Policy, critic and reference from `model.path` (trained as given: a warm start is built beforehand,
    python -m vagen.sft), wrapped in their DeepSpeed engines. Under ZeRO-3 every model is built
    partitioned (`partitioned_build`), and without a KL term no reference is loaded at all."""
    from vagen.episode import ChatEncoder
    from vagen.models import AdaptersOff, add_adapters, base_checkpoint, load_policy

    path = base_checkpoint(cfg.model)
    if is_main_process:
        run.announce(cfg, path)
    lora = cfg.model.lora_rank > 0  # the reference is then the actor with its adapters off: no copy is loaded
    with partitioned_build(cfg, dist) as partitioned:
        actor, processor = load_policy(path, cfg.model.dtype, cfg.model.min_pixels, cfg.model.max_pixels,
                                       attn_implementation=cfg.model.attn_implementation)
        if cfg.model.gradient_checkpointing:
            # Non-reentrant checkpointing: gradients reach the weights even where no input requires grad.
            actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        actor = add_adapters(actor, cfg.model) if lora else actor
        critic = build_critic(cfg, path) if cfg.algo.adv_estimator in ("gae", "turn_gae") else None
        reference = (load_policy(path, cfg.model.dtype, attn_implementation=cfg.model.attn_implementation)[0]
                     if cfg.algo.kl_coef > 0 and not lora else None)
    encoder = ChatEncoder(processor)
    if reference is not None:
        reference.eval().requires_grad_(False)
        # a partitioned model runs only inside an engine, which gathers each layer's parameters for its call
        reference = make_engine(reference, cfg, 0.0, dist, frozen=True) if partitioned else reference.to(dist.device)
    actor_engine = make_engine(actor, cfg, cfg.train.actor_lr, dist, universal=run.universal)
    critic_engine = (make_engine(critic, cfg, cfg.train.critic_lr, dist, universal=run.universal)
                     if critic is not None else None)
    if lora and cfg.algo.kl_coef > 0:
        reference = AdaptersOff(actor_engine)
    return Models(actor_engine, critic_engine, reference, processor, encoder)


@contextlib.contextmanager
def partitioned_build(cfg, dist):
    """Inside, under ZeRO-3, `from_pretrained` builds models partitioned over the ranks from the start
    (transformers runs it under `deepspeed.zero.Init` while an `HfDeepSpeedConfig` lives): no rank ever
    holds a whole model on the host, which at 3B in float32 was 30-45 GB per rank. Yields whether it does.
    `torch.nn.functional.linear` is restored on the way out: `deepspeed.zero.Init` replaces it with
    DeepSpeed's own autograd function and leaves it replaced for the whole process, where the vLLM engine's
    linear layers (which look `F.linear` up at every call, CUDA-graph capture included) would run it too."""
    ds = deepspeed_config(cfg, cfg.train.actor_lr, dist.world_size, dist.device.type == "cuda")
    if ds.get("zero_optimization", {}).get("stage", 0) != 3:
        yield False
        return
    import torch
    from transformers.integrations import HfDeepSpeedConfig

    linear = torch.nn.functional.linear
    marker = HfDeepSpeedConfig(ds)  # held by a weak reference in transformers: alive inside only
    try:
        yield True
    finally:
        del marker
        torch.nn.functional.linear = linear


def build_critic(cfg, policy_path):
    """The value model: the policy's architecture with a value head. `model.critic_path` is a critic vagen
    saved (its backbone and head are restored), or a checkpoint to start the backbone from with a
    zero-initialised head; without it the policy's weights and a zero head. With LoRA the backbone is
    frozen under adapters of its own (docs/training.md, "LoRA")."""
    from vagen.models import ValueModel, add_adapters, base_checkpoint, load_policy, saved_critic

    saved = saved_critic(cfg.model.critic_path) if cfg.model.critic_path else None
    path = base_checkpoint(cfg.model, cfg.model.critic_path) if cfg.model.critic_path and not saved else policy_path
    backbone, _ = load_policy(path, cfg.model.dtype, attn_implementation=cfg.model.attn_implementation)
    if cfg.model.gradient_checkpointing:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    critic = ValueModel(backbone)
    if cfg.model.lora_rank > 0:  # adapters of its own on a frozen copy of the base; the value head trains whole
        critic.backbone = add_adapters(critic.backbone, cfg.model)
    if saved is not None:
        partitioned = [p for p in critic.parameters() if hasattr(p, "ds_id")]
        if partitioned:  # ZeRO-3: every rank's share is written from the whole tensors rank 0 loads
            import deepspeed

            with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
                critic.load(saved)
        else:
            critic.load(saved)
    return critic


def play(cfg, it: int, dist, models: Models, decoder, source, rewarder):
    """This rank's rollout before the update of iteration `it` (`vagen.rollout.Rollouts`: its share of the
    iteration's level seeds, and with rollout.max_staleness > 0 the groups carried from earlier rollouts;
    exactly the rank's share of groups is trained, and every group ends before a checkpoint), played; the state reward applied (before any use of the rewards)
    and the rollout's metrics. Returns the episodes with at least one turn."""
    import torch

    from vagen.distributed import all_reduce
    from vagen.rollout import rollout_metrics

    models.actor.module.eval()
    episodes, stats = source.play(decoder, version=it, saves_in=rollouts_to_save(it, cfg))
    # episodes left waiting for the next weights, over all ranks
    stats["rollout/carried_episodes"] = float(all_reduce(torch.tensor([stats["rollout/carried_episodes"]]))[0])
    if rewarder is not None:
        stats.update(rewarder(episodes))
    stats.update(rollout_metrics(episodes, source.graded()))  # each task's turns by its own prompt format
    for ep in episodes:  # an environment that raised ended only its own episode
        if ep.error is not None:
            print(f"[env error] rank {dist.rank}, iteration {it}, {ep.env_name} level {ep.seed}: {ep.error}",
                  file=sys.stderr, flush=True)
    return [ep for ep in episodes if ep.turns], stats


def kept_samples(cfg, dist, models: Models, played: list):
    """StarPO-S over all ranks (`vagen.batch_plan.plan_groups`), then the kept groups' episodes as training
    samples (one per trajectory, or per turn with rollout.context=window), shared out so that ranks hold equal
    numbers of groups. Only kept episodes are converted; they are returned too, as played here."""
    from vagen.batch_plan import plan_groups, share_groups
    from vagen.trajectory import episode_samples

    plan = plan_groups([ep.total_reward for ep in played], [ep.group_id for ep in played], cfg, dist.rank,
                       dist.world_size, tasks=[ep.task for ep in played])  # groups ranked within their task
    samples = [sample for index, ep in enumerate(played) if plan.keeps(dist.rank, ep.group_id)
               for sample in episode_samples(ep, models.encoder, models.actor.module, index)]
    samples = share_groups(samples, plan, dist.rank, dist.world_size)
    stats = {f"rollout/filter_{k}": v for k, v in plan.stats.items()}
    stats["update/tokens"] = float(sum(s.length for s in samples))  # trajectory tokens this rank trains on
    return samples, stats, [ep for ep in played if plan.keeps(dist.rank, ep.group_id)]


def indicators(samples: list, played: list) -> dict[str, float]:
    """Collapse indicators over every played episode (before filtering) and the trained samples."""
    import torch

    from vagen.update import batch_indicators

    scores = torch.tensor([ep.total_reward for ep in played])
    group_ids = torch.tensor([ep.group_id for ep in played])
    return batch_indicators(scores, group_ids, samples, played)


@dataclass
class Batch:
    """The rollouts an iteration trains on: this rank's played episodes, the kept samples (annotated, with
    advantages), the iteration that sampled them (`rollout.reuse_iterations` trains a batch again) and the
    token-weighted mean and largest age of its trained turns then (`staleness`)."""
    played: list
    samples: list
    sampled_at: int
    staleness: tuple[float, float] = (0.0, 0.0)


def rollouts(batch: Batch | None, cfg, it: int, dist, models: Models, decoder, source, rewarder):
    """The batch iteration `it` trains on, and its metrics: fresh rollouts (played, filtered over all ranks,
    annotated by the sampling policy), or, for `rollout.reuse_iterations` iterations in all, the last batch
    again with its old log-probs and advantages. `rollout/staleness_mean` and `_max`: the updates since a
    trained token was sampled (token-weighted), which grow by one with each reuse."""
    from vagen.frame_check import check_every, run_frame_check

    if batch is not None and it - batch.sampled_at < cfg.rollout.reuse_iterations:
        stats = {"update/tokens": float(sum(s.length for s in batch.samples))}
        rest(decoder)
    else:
        played, stats = play(cfg, it, dist, models, decoder, source, rewarder)  # this rank's share of the levels
        samples, filter_stats, kept = kept_samples(cfg, dist, models, played)  # StarPO-S over all ranks
        stats.update(filter_stats)
        rest(decoder)  # a vLLM engine on a GPU gives its memory to the update
        stats.update(prepare(samples, cfg, dist, models))
        if check_every(cfg) and it % check_every(cfg) == 0:  # does the policy look at its frames? (on fresh batches)
            stats.update(run_frame_check(samples, cfg, it, models, dist))
        age = staleness(kept, it, dist)
        stats["rollout/cross_version_episodes"] = age.pop("cross_version_episodes")
        batch = Batch(played, samples, it, (age["mean"], age["max"]))
    stats["rollout/staleness_mean"] = batch.staleness[0] + (it - batch.sampled_at)
    stats["rollout/staleness_max"] = batch.staleness[1] + (it - batch.sampled_at)
    return batch, stats


def staleness(episodes: list, version: int, dist) -> dict[str, float]:
    """How many updates before the update of `version` the turns of `episodes` (this rank's trained ones) were
    sampled, over every rank: the token-weighted mean, the largest, and the share of episodes whose turns
    come from more than one version (rollout.max_staleness > 0)."""
    import torch

    from vagen.distributed import all_reduce
    from vagen.staleness import token_staleness

    total, tokens, oldest = token_staleness([(t.response_length, t.version) for ep in episodes for t in ep.turns],
                                            version)
    crossing = sum(len({t.version for t in ep.turns}) > 1 for ep in episodes)
    sums = all_reduce(torch.tensor([total, tokens, crossing, len(episodes)], dtype=torch.float64), "sum").tolist()
    most = float(all_reduce(torch.tensor([oldest], dtype=torch.float64), "max")[0])
    return {"mean": sums[0] / max(sums[1], 1.0), "max": most, "cross_version_episodes": sums[2] / max(sums[3], 1.0)}


@dataclass
class EveryRank:
    """A rank's own state in the checkpoint (`tracked`): every rank's, gathered when saved (a collective: every
    rank saves together), and each rank's own taken back. From a checkpoint of another number of ranks the owner
    reads every rank's (`load_ranks`, as the admission counts do: `vagen.staleness.Admission.load_ranks`)."""
    owner: object
    dist: object

    def state_dict(self) -> dict:
        from vagen.distributed import gather_objects

        return {"ranks": gather_objects(self.owner.state_dict(), active=self.dist.world_size > 1)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["ranks"]) == self.dist.world_size:
            self.owner.load_state_dict(state["ranks"][self.dist.rank])
        else:
            self.owner.load_ranks(state["ranks"])


def saves_at(it: int, cfg) -> bool:
    """Whether iteration `it` ends with a checkpoint (`vagen.run.RunDir.maybe_save`, unless forced by failing
    steps): its rollout then ends every group it started, so that the checkpoint holds no carried episode
    (`rollouts_to_save`). A forced save holds the groups in flight then; a run resumed from it skips their levels
    (`vagen.staleness.Admission.load_state_dict`)."""
    every = cfg.train.save_every
    return it + 1 == cfg.train.iterations or (every > 0 and (it + 1) % every == 0)


def rollouts_to_save(it: int, cfg) -> int:
    """The rollouts from iteration `it`'s to the one before the next scheduled checkpoint, both counted (1: this
    iteration saves), looking k + 1 ahead at rollout.max_staleness = k; 0 when none is that near. The admission
    winds down over them (`vagen.staleness.Admission.limit`), so that the checkpoint holds no carried episode
    while every update trains the same number of groups."""
    for ahead in range(cfg.rollout.max_staleness + 1):
        if it + ahead < cfg.train.iterations and saves_at(it + ahead, cfg):
            return ahead + 1
    return 0


def prepare(samples: list, cfg, dist, models: Models) -> dict:
    """Old log-probs, values and reference log-probs of the sampling policy, then advantages and token
    selection; returns their metrics and timing."""
    from vagen.update import annotate, compute_advantages

    t0 = time.perf_counter()
    # Eval mode: dropout (model.lora_dropout) would otherwise put noise into the proximal policy's log-probs, and
    # so into every decoupled-PPO weight and the first PPO ratio, and into the critic's values.
    set_mode(models, training=False)
    annotate(samples, models.actor, models.critic, models.reference, cfg, models.encoder.pad_id, dist.device,
             suppress_ids=models.encoder.suppress_ids)
    stats = compute_advantages(samples, cfg)
    stats["timing/annotate"] = time.perf_counter() - t0
    return stats


def set_mode(models: Models, training: bool) -> None:
    """The actor and the critic in train mode (the update) or eval mode (annotation); the reference is always in
    eval mode."""
    for engine in (models.actor, models.critic):
        if engine is not None:
            engine.module.train(training)


def train_on(samples: list, cfg, it: int, dist, models: Models, generator, bad_steps_in_a_row: int) -> dict:
    """The PPO update over prepared samples (the critic alone during `train.critic_warmup`); returns its
    metrics and timing."""
    from vagen.update import ppo_update

    set_mode(models, training=True)
    t0 = time.perf_counter()
    stats = dict(ppo_update(models.actor, models.critic, samples, cfg, models.encoder.pad_id, dist.device,
                            dist.world_size, generator, update_actor=it >= cfg.train.critic_warmup,
                            bad_steps_in_a_row=bad_steps_in_a_row, suppress_ids=models.encoder.suppress_ids))
    stats["timing/update"] = time.perf_counter() - t0
    return stats


def rest(decoder) -> None:
    """Engines that hold memory of their own (vLLM on a GPU, `vllm.sleep_mode`) release it during the update."""
    if hasattr(decoder, "sleep"):
        decoder.sleep()


def sync_decoder(decoder, actor_engine) -> dict[str, float]:
    """Engines with weights of their own (vLLM) load the updated actor's, gathered a group at a time under
    ZeRO-3 (every rank takes part), waking up as they do; `timing/weight_sync` is logged."""
    if not hasattr(decoder, "sync_weights"):
        return {}
    return {"timing/weight_sync": float(decoder.sync_weights(actor_engine))}


def report_bad_steps(cfg, it: int, bad_steps_in_a_row: int, run, is_main_process: bool) -> None:
    if is_main_process:
        print(f"stopping at iteration {it}: the last {bad_steps_in_a_row} optimizer steps were skipped for a "
              f"non-finite loss or gradient (train.max_bad_steps={cfg.train.max_bad_steps}); the weights are "
              f"those before them, saved in {run.path / 'checkpoints' / f'step_{it + 1}'}; see the "
              f"actor/skipped_steps and critic/skipped_steps metrics in {run.path / 'metrics.jsonl'}",
              file=sys.stderr, flush=True)


def deepspeed_config(cfg, lr: float, world_size: int, on_gpu: bool) -> dict:
    """configs/<train.deepspeed_config> with batch sizes, learning rate and clipping from the config."""
    import json

    from vagen.config import CONFIGS_DIR

    path = CONFIGS_DIR / cfg.train.deepspeed_config
    if not path.exists():
        choices = ", ".join(sorted(p.name for p in (CONFIGS_DIR / "deepspeed").glob("*.json")))
        raise FileNotFoundError(f"train.deepspeed_config={cfg.train.deepspeed_config!r} not found at {path}; "
                                f"files in configs/deepspeed: {choices}")
    ds = json.loads(path.read_text())
    micro = cfg.train.micro_batch_size
    per_rank = max(1, cfg.train.mini_batch_size // world_size)
    accumulation = -(-per_rank // micro)
    ds.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation,
              train_batch_size=micro * accumulation * world_size, gradient_clipping=cfg.train.grad_clip)
    optimizer = ds.setdefault("optimizer", {"type": "AdamW", "params": {}})
    optimizer.setdefault("params", {}).update(lr=lr, weight_decay=cfg.train.weight_decay)
    # torch's own AdamW, fused on CUDA: DeepSpeed's FusedAdam is compiled by nvcc on first use, which
    # needs a CUDA toolkit beside the driver and failed on an H200 whose TORCH_CUDA_ARCH_LIST says "9.0a".
    optimizer["params"].update(torch_adam=True, fused=on_gpu)
    # DeepSpeed's warm-ups rise logarithmically unless told otherwise (half the peak after a tenth of the
    # steps); `train.warmup_steps` is linear.
    if cfg.train.lr_decay_steps > 0:
        ds["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": cfg.train.lr_decay_steps, "warmup_num_steps": max(1, cfg.train.warmup_steps),
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0, "warmup_type": "linear"}}
    elif cfg.train.warmup_steps > 0:
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                           "warmup_num_steps": cfg.train.warmup_steps,
                                                           "warmup_type": "linear"}}
    return ds


def make_engine(module, cfg, lr: float, dist, frozen: bool = False, universal: bool = False):
    """A DeepSpeed engine of `module` with `train.deepspeed_config`; `frozen`: no optimizer or schedule
    (a reference model that only runs forward); `universal`: it loads its states from a universal checkpoint
    (vagen.run.to_universal: saved on another rank count)."""
    import deepspeed

    config = deepspeed_config(cfg, lr, dist.world_size, dist.device.type == "cuda")
    if universal:
        config["checkpoint"] = {"load_universal": True}
    if frozen:
        config.pop("optimizer", None)
        config.pop("scheduler", None)
        engine, *_ = deepspeed.initialize(model=module, config=config)
        engine.eval()  # DeepSpeed's eval returns None, not the engine
        return engine
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=config)
    return engine


if __name__ == "__main__":
    # `deepspeed vagen/train.py` puts vagen/ first on sys.path, where our modules would shadow
    # top-level ones of the same name: import the package from the repository root instead.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, os.path.dirname(here))
    from vagen.distributed import leave_process_group

    raise SystemExit(leave_process_group(main()))
