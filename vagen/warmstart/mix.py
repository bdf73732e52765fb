"""A warm start for a run over several tasks (`rollout.tasks`): one model fine-tuned on the union of the tasks'
demonstrations, in one schedule.

    python -m vagen.sft --config multitask_visual --out DIR --eval 256

Each task's demonstrations are written as its own warm start's are (its environment config's env section, turns,
tokens per turn and `sft` section: `sft.demos`, `sft.reasoning`, ...; `sft.*` on the command line applies to
every task too), each in its own prompt format. A task whose own build opens with a perception stage
(`sft.perception_steps`, Sokoban) gets that stage first, on the shared model, when the base is a built-in model
(a warm start as `sft.base` had its own). Then one schedule, the run config's
`sft` section (`sft.max_steps`, `sft.lr_schedule`, ...), on the union: every batch holds one task's
demonstrations, the task drawn with its share (`sft.task_shares`, by default its share of `rollout.tasks`' level
groups; `vagen.warmstart.sft.task_batches`).
The cell-question and on-policy stages of the single-task builds are not run here.

All tasks share one model, so they must share a modality; the base is the built-in model of the run's
`model.builtin_*` settings (its tokenizer is trained on every environment's prompts), or `sft.base`.
`--eval N` plays each task's N held-out levels and writes a card with, for each task, the rows a single-task
card has and the single-task warm start's own rows (from the card of the checkpoint its config starts from).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from vagen.config import load_config, parse_override, task_configs


def mixed_tasks(cfg, overrides: list[str] = ()) -> list[tuple[str, object, float]]:
    """(name, config, share) of each task: the config its rollouts run under (`vagen.config.task_configs`) with
    the `sft` section of the task's own environment config, after the command line's `sft.*` overrides; the
    share is the task's level groups over all tasks'."""
    own = [text for text in overrides if parse_override(text)[0].startswith("sft.")]
    weights = cfg.sft.task_shares or [task.groups for task in cfg.rollout.tasks]  # checked by vagen.config
    out = []
    for task, (name, sub), weight in zip(cfg.rollout.tasks, task_configs(cfg), weights):
        sub.sft = load_config(task.config, own).sft  # sub is task_configs' own copy
        out.append((name, sub, weight / sum(weights)))
    modes = {sub.env.render_mode for _, sub, _ in out}
    if len(modes) > 1:
        raise ValueError(f"the tasks of {cfg.name} observe in {' and '.join(sorted(modes))} "
                         f"({', '.join(f'{name}: {sub.env.render_mode}' for name, sub, _ in out)}), but one warm "
                         f"start is one model of one modality; list tasks of one env.render_mode, or build each "
                         f"task's warm start with its own config")
    return out


def task_demo_samples(tasks, encoder, model, policy: str, log=print) -> list[tuple[list, list, float]]:
    """(train samples, held-out samples, the demonstrations' success rate) of each task's demonstrations
    (`vagen.warmstart.sft.demo_sets`), each in its task's prompt format."""
    from vagen.warmstart.sft import demo_samples, demo_sets

    out = []
    for name, sub, _ in tasks:
        t0 = time.perf_counter()
        train, val = demo_sets(sub, policy)
        successful = sum(d.success for d in train)
        out.append((demo_samples(train, sub, encoder, model), demo_samples(val, sub, encoder, model),
                    successful / len(train)))
        log(f"{name}: {len(train)} {policy} demonstrations ({successful} successful, reasoning {sub.sft.reasoning}) "
            f"in {time.perf_counter() - t0:.1f}s")
    return out


def build_mixed_warm_start(cfg, tasks, base_path: Path, out: Path, policy: str, dist, log=print,
                           command: str | None = None, from_builtin: bool = False) -> dict[str, float]:
    """SFT `base_path` on the union of `tasks`' demonstrations (`mixed_tasks`) in one schedule (`cfg.sft`) and save
    it to `out` with `STATE_FILE`, as `vagen.warmstart.sft.build_warm_start` does; per-task metrics are under
    sft/<task>/. Each task's perception stage runs only on a built-in (random) base (`from_builtin`): a warm
    start as the base had its own."""
    import torch

    from vagen.episode import ChatEncoder
    from vagen.models import load_policy
    from vagen.warmstart.sft import (
        answer_accuracy,
        code_revision,
        demonstration_code,
        frame_dependence,
        perception_stage,
        save_warm_start,
        sft_engine,
        train_sft,
    )

    t0 = time.perf_counter()
    revision = code_revision()
    demo_code = {name: demonstration_code(sub.env.name, bool(sub.sft.perception_steps)) for name, sub, _ in tasks}
    torch.manual_seed(0)
    model, processor = load_policy(Path(base_path), cfg.model.dtype, cfg.model.min_pixels, cfg.model.max_pixels,
                                   cfg.model.attn_implementation)
    encoder = ChatEncoder(processor)
    data = task_demo_samples(tasks, encoder, model, policy, log)
    data_s = time.perf_counter() - t0
    stats: dict[str, float] = {}
    for name, sub, _ in tasks:
        if sub.sft.perception_steps and from_builtin:
            part = perception_stage(model, encoder, sub, dist, lambda line, name=name: log(f"{name}: {line}"))
            stats.update({f"sft/{name}/{key.removeprefix('sft/')}": value for key, value in part.items()})
    train = [sample for samples, _, _ in data for sample in samples]
    val = [sample for _, samples, _ in data for sample in samples]
    task_of = [k for k, (samples, _, _) in enumerate(data) for _ in samples]
    log(f"mix: {len(train)} demonstrations of {len(tasks)} tasks, batches drawn "
        + ", ".join(f"{name} {share:.2f}" for name, _, share in tasks) + f"; training on {dist.device}")
    engine = sft_engine(model, cfg, dist)
    stats.update(train_sft(engine, train, val, cfg, encoder.pad_id, dist.device, log=log, tasks=task_of,
                           shares=[share for _, _, share in tasks], desc="sft: demonstrations of every task"))
    for (name, sub, _), (_, held_out, success) in zip(tasks, data):
        part = answer_accuracy(engine.module, held_out, encoder.pad_id, dist.device, cfg.sft.micro_batch_size)
        if held_out and held_out[0].pixel_values is not None:
            part.update(frame_dependence(engine.module, held_out, part["sft/val_answer_accuracy"], encoder.pad_id,
                                         dist.device, cfg.sft.micro_batch_size,
                                         lambda line, name=name: log(f"{name}: {line}"), sub.sft.reasoning == "path"))
        part["sft/demo_success"] = success
        log(f"{name}: " + " ".join(f"{key}={value:.4g}" for key, value in part.items()))
        stats.update({f"sft/{name}/{key.removeprefix('sft/')}": value for key, value in part.items()})
    stats.update({"sft/data_seconds": data_s, "sft/build_seconds": time.perf_counter() - t0})
    settings = {s: cfg.to_dict()[s] for s in ("model", "rollout", "sft")}
    settings["tasks"] = {name: {"share": share, "env": sub.to_dict()["env"], "rollout": sub.to_dict()["rollout"],
                                "sft": sub.to_dict()["sft"]} for name, sub, share in tasks}
    save_warm_start(engine.module, processor, out, {
        "config": cfg.name, "command": command, "code_revision": revision, "demonstration_code": demo_code,
        "base": str(base_path), "policy": policy, "stages": "all", "settings": settings, **stats}, log)
    return stats


def single_task_rows(task_config: str) -> dict:
    """The checkpoint the task's own config starts from (its `model.path`) and the greedy and sampled rows of
    its card, when it is a shipped warm start with one; else {}."""
    from vagen.config import checkpoints_dir
    from vagen.warmstart.sft import CARD_FILE

    path = load_config(task_config).model.path
    card = checkpoints_dir() / path.removeprefix("assets:") / CARD_FILE
    if not path.startswith("assets:") or not card.exists():
        return {}
    rows = json.loads(card.read_text())["evaluation"]["rows"]
    return {"checkpoint": path, "rows": {key: rows[key] for key in ("sft greedy", "sft sampled") if key in rows}}


def write_mixed_card(cfg, tasks, checkpoint: Path, n: int) -> dict:
    """`checkpoint/card.json` of a mixed warm start: for each task, `vagen.warmstart.sft.report`'s rows on its
    own `n` held-out levels (95% Wilson intervals) and the single-task warm start's (`single_task_rows`)."""
    from vagen.warmstart.sft import CARD_FILE, card_head, card_rows, report

    checkpoint = Path(checkpoint)
    card = card_head(cfg, checkpoint, n)
    card["evaluation"]["tasks"] = {}
    for task, (name, sub, _) in zip(cfg.rollout.tasks, tasks):
        print(f"{name}:", flush=True)
        card["evaluation"]["tasks"][name] = {"rows": card_rows(report(sub, checkpoint, n)),
                                             "single_task_warm_start": single_task_rows(task.config)}
    (checkpoint / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
    return card
