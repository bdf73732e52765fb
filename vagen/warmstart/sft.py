"""Supervised warm start: fine-tune a policy on scripted demonstrations (vagen.warmstart.demos)
through the same tokenisation, masks and DeepSpeed engine as RL, with the loss on generated tokens
only. An explicit stage that writes a checkpoint; training never runs it (`model.path` names what
training starts from).

    python -m vagen.sft --config frozenlake_visual [--out DIR] [--eval 256] [section.key=value ...]
    python -m vagen.sft --config sokoban_visual --evaluate assets/checkpoints/sokoban_visual
    python -m vagen.sft --config sokoban_visual --base WARM_START --cells-only --out DIR sft.cell_steps=1500
    python -m vagen.sft --config sokoban_visual --base WARM_START --on-policy-only --out DIR sft.on_policy_levels=1000

Training runs until the answer accuracy on held-out demonstrations (teacher forcing: a turn counts
when every token of its `<answer>…</answer>` is the model's argmax) stops improving, so the warm
start is the demonstrator learned well. With `--eval N` the result is evaluated on N held-out levels
next to the teacher, the solver and a random policy, and `card.json` records it with the command,
the settings and the code revision.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import torch

from vagen.warmstart.loop import (  # noqa: F401 (re-exported: the build's loop)
    MIN_FRAME_GAIN,
    WHOLE_RESPONSE_REASONING,
    answer_accuracy,
    frame_dependence,
    length_grouped_batches,
    masked_logits,
    nll_loss,
    play_levels,
    sft_engine,
    task_batches,
    train_sft,
    with_other_frames,
)

STATE_FILE = "vagen_warm_start.json"


# -- data ---------------------------------------------------------------------------------------------

def demo_sets(cfg, policy: str):
    """(train, validation) demonstrations on distinct levels, none of them an evaluation level."""
    from vagen.warmstart.demos import collect_demos, eval_level_keys

    exclude = eval_level_keys(cfg.env, cfg.sft.exclude_eval)
    demos = collect_demos(cfg.env, policy, cfg.sft.demos + cfg.sft.val_demos, cfg.rollout.max_turns, exclude,
                          draw_style=cfg.sft.teacher_styles, kind=cfg.sft.reasoning, slip=cfg.sft.teacher_slip)
    return demos[: cfg.sft.demos], demos[cfg.sft.demos:]


def demo_samples(demos, cfg, encoder, model) -> list:
    """Training samples (`vagen.trajectory.Sample`) of the demonstrations, built as `rollout` would."""
    from vagen.rollout import make_env
    from vagen.trajectory import episode_to_sample
    from vagen.warmstart.demos import demo_episode

    env = make_env(cfg.env)
    samples = []
    for i, demo in enumerate(demos):
        episode = demo_episode(demo, env, encoder, group_id=i)
        longest = max(t.response_length for t in episode.turns) - 1  # without the closing <|im_end|>
        if longest > cfg.rollout.max_new_tokens:
            raise ValueError(
                f"a demonstration response has {longest} tokens but rollout.max_new_tokens="
                f"{cfg.rollout.max_new_tokens}, so RL could never sample it; raise rollout.max_new_tokens to "
                f"{longest} or more, or use a shorter env.prompt_format (now {cfg.env.prompt_format})")
        samples.append(episode_to_sample(episode, encoder, model))
    return samples


# -- training -----------------------------------------------------------------------------------------

def held_out_metrics(model, encoder, cfg, seeds: list[int], do_sample: bool, batch: int = 64,
                     sample_seed: int = 0, desc: str | None = None) -> dict[str, float]:
    """Success, return and format rate of `model` on `seeds` (one episode each), greedy or sampled
    with `rollout.temperature`; `successes` counts for `wilson_interval`. Sampling draws from
    `sample_seed`, so a checkpoint scores the same whatever ran before in the process, and the
    caller's random state is left as it was. With `desc`, a progress bar of that name counts episodes."""
    from vagen.rollout import rollout_metrics

    episodes = play_levels(model, encoder, cfg, seeds, do_sample, batch, sample_seed, desc)
    stats = rollout_metrics(episodes)
    return {"success": stats["rollout/success"], "return": stats["rollout/reward_mean"],
            "format_ok": stats["rollout/format_ok"], "successes": sum(ep.success for ep in episodes),
            "n": len(episodes)}


# -- building a warm start --------------------------------------------------------------------------

def demonstration_code(env_name: str, perception: bool = False) -> str:
    """Hash of the code that writes the demonstrations: `vagen.warmstart.demos` and the env's module
    (its teacher, solver, dynamics, frames and prompts) with its own teacher and question modules where it
    has them, and with `perception` `vagen.warmstart.perception`; recorded with each build, so a card says which demonstrations it learned."""
    import importlib
    import importlib.util
    import inspect

    import envs_visual
    from vagen.warmstart import demos
    from vagen.warmstart import perception as questions

    env_module = inspect.getmodule(envs_visual.env_class(env_name))
    modules = (demos, env_module) + ((questions,) if perception else ())
    # the env's teacher and question modules, where it has its own (envs_visual/NAME_teacher.py, QUESTION_MODULES)
    for name in (f"{env_module.__name__}_teacher", questions.QUESTION_MODULES.get(env_name)):
        if name and importlib.util.find_spec(name) is not None:
            modules += (importlib.import_module(name),)
    text = "".join(inspect.getsource(module) for module in modules)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def code_revision() -> str:
    """The commit this code runs from, with `+dirty` when vagen/, envs_visual/ or configs/ differ
    from it; `unknown` outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "vagen", "envs_visual",
                                  "configs"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def base_path_of(cfg) -> str:
    """What a warm start fine-tunes: `sft.base`, else the built-in model of `env.render_mode` (never
    `model.path`, which names the checkpoint training starts from, often a shipped warm start)."""
    if cfg.sft.base:
        return cfg.sft.base
    return "builtin:tiny-vl" if cfg.env.render_mode == "vision" else "builtin:tiny-text"


def default_out(cfg, policy: str) -> Path:
    return Path(cfg.train.run_dir) / "warm_starts" / f"{cfg.name}-{policy}-{time.strftime('%Y%m%d-%H%M%S')}"


def build_warm_start(cfg, base_path: Path, out: Path, policy: str, dist, log=print,
                     cells_only: bool = False, command: str | None = None,
                     on_policy_only: bool = False) -> dict[str, float]:
    """SFT `base_path` on `policy`'s demonstrations and save the result (HF format) to `out`, with
    `STATE_FILE` recording the command, code revision, settings and build metrics. With
    `cells_only` (`on_policy_only`), `base_path` is a warm start already and only the cell-question
    (on-policy) stage runs on it, with its demonstrations mixed in as in a full build."""
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy

    if cells_only and on_policy_only:
        raise ValueError("cells_only and on_policy_only each run one stage alone: choose one")
    if cells_only and not cfg.sft.cell_questions:
        raise ValueError("a cells-only build runs the cell-question stage, but sft.cell_questions=0; "
                         "set sft.cell_questions (e.g. 3000) or build all stages")
    if on_policy_only and not cfg.sft.on_policy_levels:
        raise ValueError("an on-policy-only build runs the on-policy stage, but sft.on_policy_levels=0; "
                         "set sft.on_policy_levels (e.g. 1000) or build all stages")
    t0 = time.perf_counter()
    questions = bool(cfg.sft.perception_steps or cfg.sft.cell_questions)
    # The code the demonstrations are written by, read before they are: the checkout may change during a build.
    revision, demo_code = code_revision(), demonstration_code(cfg.env.name, questions)
    torch.manual_seed(0)
    model, processor = load_policy(Path(base_path), cfg.model.dtype, cfg.model.min_pixels, cfg.model.max_pixels,
                                   cfg.model.attn_implementation)
    encoder = ChatEncoder(processor)
    train_demos, val_demos = demo_sets(cfg, policy)
    train_samples = demo_samples(train_demos, cfg, encoder, model)
    val_samples = demo_samples(val_demos, cfg, encoder, model)
    data_s = time.perf_counter() - t0
    log(f"warm start: {len(train_samples)} {policy} demonstrations ({sum(d.success for d in train_demos)} "
        f"successful) in {data_s:.1f}s; training on {dist.device}")
    stats = {}
    if not (cells_only or on_policy_only):
        if cfg.sft.perception_steps:
            stats.update(perception_stage(model, encoder, cfg, dist, log))
        engine = sft_engine(model, cfg, dist)
        stats.update(train_sft(engine, train_samples, val_samples, cfg, encoder.pad_id, dist.device, log=log,
                               desc="sft: demonstrations"))
        model = engine.module
    if cfg.sft.cell_questions and not on_policy_only:
        engine, cell_stats = cell_question_stage(model, encoder, cfg, dist, train_samples, val_samples, log)
        stats.update(cell_stats)
        model = engine.module
    if cfg.sft.on_policy_levels and not cells_only:
        engine, on_policy_stats = on_policy_stage(model, encoder, cfg, dist, train_samples, policy, log)
        stats.update(on_policy_stats)
        # the demonstrations' held-out accuracy after it (the check the other stages end on)
        stats.update(answer_accuracy(engine.module, val_samples, encoder.pad_id, dist.device,
                                     cfg.sft.micro_batch_size))
    if val_samples and val_samples[0].pixel_values is not None:
        stats.update(frame_dependence(engine.module, val_samples, stats["sft/val_answer_accuracy"], encoder.pad_id,
                                      dist.device, cfg.sft.micro_batch_size, log, cfg.sft.reasoning in WHOLE_RESPONSE_REASONING))
    stats.update({"sft/data_seconds": data_s, "sft/build_seconds": time.perf_counter() - t0,
                  "sft/demo_success": sum(d.success for d in train_demos) / len(train_demos)})
    settings = {s: cfg.to_dict()[s] for s in ("model", "env", "rollout", "sft")}
    save_warm_start(engine.module, processor, out, {
        "config": cfg.name, "command": command, "code_revision": revision, "demonstration_code": demo_code,
        "base": str(base_path), **base_build(base_path),
        "policy": policy, "stages": "cells" if cells_only else "on_policy" if on_policy_only else "all",
        "settings": settings, **stats}, log)
    return stats


def base_build(base_path) -> dict:
    """{"base_build": how the base was built} when the base is a warm start (its `STATE_FILE`: the command, code,
    stages, its own base_build and its metrics), so that a card of a later stage (`--on-policy-only`) says every
    command behind it; {} for the built-in model or a checkpoint from elsewhere."""
    path = Path(base_path) / STATE_FILE
    if not path.exists():
        return {}
    state = json.loads(path.read_text())
    return {"base_build": {k: v for k, v in state.items() if k != "settings"}}


def save_warm_start(model, processor, out: Path, state: dict, log=print) -> None:
    """`model` and `processor` saved (HF format) to `out` with `state` as its `STATE_FILE`, written beside it first
    and moved into place, so a reader never finds half a checkpoint; an earlier one at `out` is replaced whole."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    log(f"warm start saved to {out} ({state['sft/build_seconds']:.0f}s)")


# -- the card of a warm start -------------------------------------------------------------------------

CARD_FILE = "card.json"


def write_card(cfg, checkpoint: Path, rows: dict, n: int, revision: str | None = None) -> dict:
    """`checkpoint/card.json`: how the warm start was built (from its `STATE_FILE`) and its held-out
    success on `n` evaluation levels next to the scripted baselines (`report`'s rows), each with a 95%
    Wilson interval; `revision` is the code that evaluated it (default: this checkout's)."""
    checkpoint = Path(checkpoint)
    card = card_head(cfg, checkpoint, n, revision)
    card["evaluation"]["rows"] = card_rows(rows)
    (checkpoint / CARD_FILE).write_text(json.dumps(card, indent=1) + "\n")
    return card


def card_head(cfg, checkpoint: Path, n: int, revision: str | None = None) -> dict:
    """A card without its rows: the build (from `checkpoint`'s `STATE_FILE`) and what evaluated it."""
    state = json.loads((checkpoint / STATE_FILE).read_text()) if (checkpoint / STATE_FILE).exists() else {}
    build = {k: state.get(k) for k in ("config", "command", "code_revision", "demonstration_code", "base", "policy",
                                      "stages", "settings")}
    if "base_build" in state:
        build["base_build"] = state["base_build"]
    return {"name": checkpoint.name, "config": cfg.name, "build": build,
            "build_metrics": {k: v for k, v in state.items() if k.startswith("sft/")},
            "evaluation": {"levels": n, "seeds": f"vagen.warmstart.demos.distinct_eval_seeds(env, {n})",
                           "code_revision": revision or code_revision()}}


def card_rows(rows: dict) -> dict:
    """`report`'s rows as a card keeps them, each with its 95% Wilson interval."""
    from vagen.eval import wilson_interval

    evaluation = {}
    for name, row in rows.items():
        low, high = wilson_interval(row["successes"], row["n"])
        evaluation[name] = {"success": row["success"], "interval_95": [round(low, 4), round(high, 4)],
                            "successes": row["successes"], "n": row["n"], "return": row["return"],
                            **({"format_ok": row["format_ok"]} if "format_ok" in row else {})}
    return evaluation


def zero_stage(cfg) -> int:
    """The ZeRO stage of the DeepSpeed config `train.deepspeed_config` names (read as the engine reads it)."""
    from vagen.train import deepspeed_config

    return int(deepspeed_config(cfg, cfg.sft.lr, 1, False).get("zero_optimization", {}).get("stage", 0))


def report(cfg, checkpoint: Path, n: int) -> dict:
    """Held-out greedy and sampled success of `checkpoint` next to the teacher's (and, for a teacher
    with styles, its best style per level), the solver's, a random policy's and the best blind plan's
    (`vagen.warmstart.demos.blind_success`) on the same evaluation levels."""
    from vagen.episode import ChatEncoder
    from vagen.eval import wilson_interval
    from vagen.models import load_policy
    from vagen.warmstart.demos import distinct_eval_seeds, scripted_baselines

    seeds = distinct_eval_seeds(cfg.env, n)
    model, processor = load_policy(checkpoint, cfg.model.dtype, attn_implementation=cfg.model.attn_implementation)
    encoder = ChatEncoder(processor)
    rows = {}
    for name, sample in (("sft greedy", False), ("sft sampled", True)):
        rows[name] = held_out_metrics(model, encoder, cfg, seeds, do_sample=sample, desc=f"eval: {name}")
    rows.update(scripted_baselines(cfg, seeds))
    for name, row in rows.items():
        low, high = wilson_interval(row["successes"], row["n"])
        print(f"{name:12s} success {row['success']:.3f} [{low:.3f}, {high:.3f}]  return {row['return']:.3f}  "
              f"format_ok {row.get('format_ok', 1.0):.3f}  (n={row['n']})", flush=True)
    return rows


# the stages live in their own module, which trains with this one's loop: imported last
from vagen.warmstart.stages import (  # noqa: E402, F401
    CELL_VAL_START,
    ON_POLICY_START,
    ON_POLICY_VAL_LEVELS,
    PERCEPTION_TARGET,
    PERCEPTION_VAL_LEVELS,
    cell_question_samples,
    cell_question_stage,
    cell_stage_settings,
    on_policy_stage,
    perception_stage,
    relabelled_samples,
)
