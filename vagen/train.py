"""Train a multi-turn agent with StarPO/TRICO.

    deepspeed vagen/train.py --config sokoban_visual [section.key=value ...]
    python vagen/train.py --config sokoban_visual [section.key=value ...]

Reads top to bottom like the algorithm: config → environments → policy and critic → DeepSpeed
engines, then per iteration: rollout → filter groups → annotate (old log-probs, values) →
advantages → PPO update → log → evaluate and save. This is the only module that touches DeepSpeed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="name in configs/ or path of a YAML file")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the DeepSpeed launcher")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from vagen.config import ConfigError, check_training, kept_groups, load_config_or_exit

    cfg = load_config_or_exit(args.config, args.overrides)  # fails fast, before torch loads
    try:
        check_training(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2

    dist = init_distributed()
    for key in ("rollout.env_groups", "train.mini_batch_size"):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value % dist.world_size:
            raise SystemExit(f"config error: {key}={value} must be divisible by the {dist.world_size} ranks "
                             f"(each rank plays and trains an equal share); use a multiple of {dist.world_size}")
    kept = kept_groups(cfg)
    if kept < dist.world_size:
        raise SystemExit(f"config error: algo.filter_keep_ratio={cfg.algo.filter_keep_ratio} keeps {kept} of "
                         f"rollout.env_groups={cfg.rollout.env_groups} level groups, fewer than the {dist.world_size} "
                         f"ranks that train them; raise rollout.env_groups or algo.filter_keep_ratio so that at least "
                         f"{dist.world_size} groups are kept")
    import torch

    from vagen import core
    from vagen.models import ValueModel, base_checkpoint, load_policy, set_pixel_bounds
    from vagen.rollout import ChatEncoder, make_env, rollout, rollout_metrics, train_seeds
    from vagen.run import RunDir, reduce_metrics
    from vagen.state_reward import state_rewarder
    from vagen.trajectory import episode_to_sample
    from vagen.update import annotate, batch_indicators, compute_advantages, filter_groups, ppo_update

    torch.manual_seed(cfg.train.seed + dist.rank)
    run = RunDir.create(cfg, dist)
    is_main_process = dist.rank == 0

    # -- policy, critic, reference, engines ---------------------------------------------------------
    path = base_checkpoint(cfg.model)  # trained as given: a warm start is built beforehand (python -m vagen.sft)
    if is_main_process:
        run.announce(cfg, path)
    actor, processor = load_policy(path, cfg.model.dtype)
    # Non-reentrant checkpointing: gradients reach the weights even where no input requires grad.
    checkpointing = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if cfg.model.gradient_checkpointing:
        actor.gradient_checkpointing_enable(**checkpointing)
    encoder = ChatEncoder(processor)
    if cfg.model.min_pixels or cfg.model.max_pixels:
        set_pixel_bounds(processor, cfg.model.min_pixels, cfg.model.max_pixels)
    use_critic = cfg.algo.adv_estimator in ("gae", "turn_gae")
    critic = None
    if use_critic:
        critic_init, _ = load_policy(base_checkpoint(cfg.model, cfg.model.critic_path) if cfg.model.critic_path else path,
                                     cfg.model.dtype)
        if cfg.model.gradient_checkpointing:
            critic_init.gradient_checkpointing_enable(**checkpointing)
        critic = ValueModel(critic_init)
    reference = None
    if cfg.algo.kl_coef > 0:
        reference, _ = load_policy(path, cfg.model.dtype)
        reference.eval().requires_grad_(False).to(dist.device)
    actor_engine = make_engine(actor, cfg, cfg.train.actor_lr, dist)
    critic_engine = make_engine(critic, cfg, cfg.train.critic_lr, dist) if critic is not None else None
    monitor = core.CollapseMonitor()
    rewarder = state_rewarder(cfg, dist)
    # What a resumed run must restore besides the engines (the state reward's recent descriptions).
    tracked = {"state_reward": rewarder.tracker} if rewarder is not None else {}
    start = run.maybe_resume(cfg, actor_engine, critic_engine, monitor, tracked)
    generator = torch.Generator()
    groups_per_rank = cfg.rollout.env_groups // dist.world_size
    # Environments live for the whole run (reset with new seeds each iteration): a MuJoCo renderer
    # costs ~0.1 s to create and holds a GL context.
    envs = [make_env(cfg.env) for _ in range(groups_per_rank * cfg.rollout.group_size)]
    progress = run.progress(start, cfg.train.iterations, enabled=is_main_process and cfg.log.progress)
    bad_steps_in_a_row, return_code = 0, 0

    for it in range(start, cfg.train.iterations):
        t_iter = time.perf_counter()
        # Seeded per iteration and rank: a run is reproducible, and a resumed run samples exactly as an
        # uninterrupted one would.
        torch.manual_seed((cfg.train.seed * 1_000_003 + it) * 1_009 + dist.rank)
        generator.manual_seed(cfg.train.seed * 1_000_003 + it)
        # -- rollout: this rank plays its share of the iteration's level seeds -------------------------
        seeds = train_seeds(it, cfg.rollout.env_groups, cfg.train.seed)
        my_seeds = seeds[dist.rank * groups_per_rank : (dist.rank + 1) * groups_per_rank]
        actor_engine.module.eval()
        episodes, stats = rollout(actor_engine.module, encoder, cfg, my_seeds, cfg.rollout.group_size, envs=envs)
        if rewarder is not None:  # before any use of the rewards
            stats.update(rewarder(episodes))
        stats.update(rollout_metrics(episodes))
        for ep in episodes:  # an environment that raised ended only its own episode
            if ep.error is not None:
                print(f"[env error] rank {dist.rank}, iteration {it}, {ep.env_name} level {ep.seed}: {ep.error}",
                      file=sys.stderr, flush=True)
        played = [ep for ep in episodes if ep.turns]
        samples = [episode_to_sample(ep, encoder, actor_engine.module) for ep in played]

        # -- filter groups by in-group reward std over all ranks (StarPO-S), kept groups shared out -------
        scores = torch.tensor([s.score for s in samples])
        group_ids = torch.tensor([s.group_id for s in samples])
        samples, filter_stats = filter_groups(samples, cfg, dist.rank, dist.world_size)
        stats.update({f"rollout/filter_{k}": v for k, v in filter_stats.items()})
        stats["update/tokens"] = float(sum(s.length for s in samples))  # trajectory tokens this rank trains on

        # -- old log-probs, values, advantages, token selection -------------------------------------------
        t0 = time.perf_counter()
        actor_engine.module.train()
        annotate(samples, actor_engine, critic_engine, reference, cfg, encoder.pad_id, dist.device)
        stats.update(compute_advantages(samples, cfg))
        stats["timing/annotate"] = time.perf_counter() - t0

        # -- PPO update ------------------------------------------------------------------------------------
        t0 = time.perf_counter()
        update_actor = it >= cfg.train.critic_warmup
        update_stats = ppo_update(actor_engine, critic_engine, samples, cfg, encoder.pad_id, dist.device,
                                  dist.world_size, generator, update_actor=update_actor,
                                  bad_steps_in_a_row=bad_steps_in_a_row)
        bad_steps_in_a_row = int(update_stats["update/bad_steps_in_a_row"])  # the same on every rank
        stats.update(update_stats)
        stats["timing/update"] = time.perf_counter() - t0

        # -- collapse indicators -------------------------------------------------------------------------
        stats.update(batch_indicators(scores, group_ids, samples, played))
        stats = reduce_metrics(stats, dist)
        watched = {"grad_norm": "actor/grad_norm", "entropy_mean": "actor/entropy_mean",
                   "reward_std_in_group": "rollout/in_group_reward_std", "format_ok": "rollout/format_ok"}
        warnings = monitor.update({k: stats[v] for k, v in watched.items() if v in stats})
        stats["timing/iteration"] = time.perf_counter() - t_iter
        stats.update(run.maybe_evaluate(it, cfg, actor_engine.module, encoder))

        if is_main_process:
            run.log(it, stats, warnings)
            progress.update(it, stats)
        # Steps that keep failing (a non-finite loss or gradient) end the run, with a checkpoint to look into.
        stop = bad_steps_in_a_row >= cfg.train.max_bad_steps
        run.maybe_save(it, cfg, actor_engine, critic_engine, processor, monitor, force=stop, tracked=tracked)
        if stop:
            if is_main_process:
                print(f"stopping at iteration {it}: the last {bad_steps_in_a_row} optimizer steps were skipped for a "
                      f"non-finite loss or gradient (train.max_bad_steps={cfg.train.max_bad_steps}); the weights are "
                      f"those before them, saved in {run.path / 'checkpoints' / f'step_{it + 1}'}; see the "
                      f"actor/skipped_steps and critic/skipped_steps metrics in {run.path / 'metrics.jsonl'}",
                      file=sys.stderr, flush=True)
            return_code = 1
            break

    progress.close()
    for env in envs:
        if hasattr(env, "close"):
            env.close()
    run.finish()
    return return_code


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _unlink_shm_workspace(rank: int) -> None:
    """Remove the name of this rank's shared-memory all-reduce workspace once every rank has mapped it.

    DeepSpeed's CPU communication op creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    (66 MB) when all ranks share a machine and never unlinks it, so each run used to leave that much
    memory behind until reboot. The mappings stay valid after the unlink; the memory goes with the
    last process that maps it, even one that is killed."""
    import torch.distributed as torch_dist

    torch_dist.barrier()  # every rank has opened every other rank's workspace by now
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:  # the op was not built, or the ranks span machines
        pass


def init_distributed():
    """Join the process group the DeepSpeed launcher describes (or a group of one under plain
    `python`): gloo and `vagen.run.cpu_threads` threads each on CPU, NCCL with one GPU per rank on GPUs."""
    import torch

    from vagen.run import Dist, cpu_threads

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Two processes on two cores with default threading measured 4.6x slower than one thread each.
        torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", verbose=False)
    if not on_gpu:
        _unlink_shm_workspace(rank)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    return Dist(rank, world, local_rank, device)


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
    if cfg.train.lr_decay_steps > 0:
        ds["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": cfg.train.lr_decay_steps, "warmup_num_steps": max(1, cfg.train.warmup_steps),
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.0}}
    elif cfg.train.warmup_steps > 0:
        ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                                           "warmup_num_steps": cfg.train.warmup_steps}}
    return ds


def make_engine(module, cfg, lr: float, dist):
    import deepspeed

    config = deepspeed_config(cfg, lr, dist.world_size, dist.device.type == "cuda")
    params = [p for p in module.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=config)
    return engine


if __name__ == "__main__":
    # `deepspeed vagen/train.py` puts vagen/ first on sys.path, where our modules would shadow
    # top-level ones of the same name: import the package from the repository root instead.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, os.path.dirname(here))
    from vagen.run import leave_process_group

    raise SystemExit(leave_process_group(main()))
