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

import dataclasses
import hashlib
import itertools
import json
import os
import subprocess
import time
import types
from pathlib import Path

import torch

STATE_FILE = "vagen_warm_start.json"


# -- data ---------------------------------------------------------------------------------------------

def demo_sets(cfg, policy: str):
    """(train, validation) demonstrations on distinct levels, none of them an evaluation level."""
    from vagen.warmstart.demos import collect_demos, eval_level_keys

    exclude = eval_level_keys(cfg.env, cfg.sft.exclude_eval)
    demos = collect_demos(cfg.env, policy, cfg.sft.demos + cfg.sft.val_demos, cfg.rollout.max_turns, exclude,
                          draw_style=cfg.sft.teacher_styles, kind=cfg.sft.reasoning)
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

def masked_logits(model, batch, device):
    """Logits that predict generated tokens (the language-model head over every position costs as
    much as the rest of the tiny model), with the shared prompt prefix computed once. Returns
    (logits [B, K, V], targets [B, K], mask [B, K]) for the K positions after which some row has a
    generated token."""
    from vagen.models import forward_shared_prefix, generated_positions
    from vagen.trajectory import model_inputs

    wanted = generated_positions(batch["loss_mask"])
    logits = forward_shared_prefix(model, model_inputs(batch, device), logits_to_keep=wanted.to(device))
    targets = batch["input_ids"][:, wanted + 1].to(device)
    mask = batch["loss_mask"][:, wanted + 1].to(device)
    return logits, targets, mask


def nll_loss(model, batch, device) -> torch.Tensor:
    """Token-mean negative log-likelihood of the generated tokens of `batch`."""
    from vagen import core

    logits, targets, mask = masked_logits(model, batch, device)
    logprobs = core.logprobs_from_logits(logits.float(), targets)
    return -(logprobs * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def answer_accuracy(model, samples, pad_id: int, device, micro_batch_size: int = 16,
                    whole_response: bool = False) -> dict[str, float]:
    """Teacher-forced held-out metrics: share of turns whose whole answer is the argmax (with
    `whole_response`, every generated token of the turn: `sft/val_response_accuracy`), and the
    mean negative log-likelihood of generated tokens."""
    from vagen import core
    from vagen.batch_plan import chunks
    from vagen.models import generated_positions
    from vagen.trajectory import collate

    was_training = model.training
    model.eval()
    correct = turns = 0
    nll = tokens = 0.0
    for group in chunks(samples, micro_batch_size):
        batch = collate(group, pad_id)
        logits, targets, mask = masked_logits(model, batch, device)
        nll += float(-(core.logprobs_from_logits(logits.float(), targets) * mask).sum())
        tokens += float(mask.sum())
        wanted = generated_positions(batch["loss_mask"]) + 1
        hit = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
        hit[:, wanted] = (logits.argmax(-1) == targets).cpu()
        for row, sample in enumerate(group):
            turn_ids = torch.cumsum(sample.turn_end_mask, 0) - sample.turn_end_mask  # turn index of each token
            answer = (sample.loss_mask if whole_response else sample.answer_mask) > 0
            for k in range(int(sample.turn_end_mask.sum())):
                sel = answer & (turn_ids == k)
                turns += 1
                correct += bool(hit[row, : sample.length][sel].all()) and bool(sel.any())
    model.train(was_training)
    key = "sft/val_response_accuracy" if whole_response else "sft/val_answer_accuracy"
    return {key: correct / max(turns, 1), "sft/val_nll": nll / max(tokens, 1.0)}


def with_other_frames(samples: list) -> list:
    """Copies of `samples` in which each one's frames are another sample's (the next one with the same
    image grids, in order): the text and answers stay, the frames show another level. Answer accuracy
    on them is what the model gets right without looking; a sample with no such partner keeps its own."""
    by_grids: dict[tuple, list[int]] = {}
    for i, sample in enumerate(samples):
        if sample.pixel_values is not None:
            by_grids.setdefault(tuple(map(tuple, sample.image_grid_thw.tolist())), []).append(i)
    out = list(samples)
    for members in by_grids.values():
        for k, i in enumerate(members):
            donor = samples[members[(k + 1) % len(members)]]
            out[i] = dataclasses.replace(samples[i], pixel_values=donor.pixel_values)
    return out


# Held-out answer accuracy must drop by at least this much when the frames show another level, or the
# warm start has learned the format and the common moves but not to look.
MIN_FRAME_GAIN = 0.05


def frame_dependence(model, val_samples, accuracy: float, pad_id: int, device, micro_batch_size: int,
                     log=print, whole_response: bool = False) -> dict[str, float]:
    """Held-out answer accuracy with each demonstration's frames replaced by another level's, and a
    warning when the answers barely depend on the frame. With `whole_response` (reasoning that names
    every move, `sft.reasoning=path`, so the answer copies it under teacher forcing) both sides score
    every generated token of a turn instead, and `accuracy` is measured here."""
    key = "sft/val_response_accuracy" if whole_response else "sft/val_answer_accuracy"
    if whole_response:
        accuracy = answer_accuracy(model, val_samples, pad_id, device, micro_batch_size, True)[key]
    other = answer_accuracy(model, with_other_frames(val_samples), pad_id, device, micro_batch_size,
                            whole_response)[key]
    if accuracy - other < MIN_FRAME_GAIN:
        what = "response" if whole_response else "answer"
        log(f"warning: the warm start does not read the frame: held-out {what} accuracy is {accuracy:.3f} with "
            f"each level's own frames and {other:.3f} with another level's, so RL from it starts blind. Whether "
            f"a built-in model learns to look depends on its initialisation: build again with another "
            f"model.builtin_seed (README, 'Warm start on demonstrations'), or train longer (sft.max_steps)")
    return {key: accuracy, key + "_other_frames": other}


def sft_engine(model, cfg, dist):
    """The RL DeepSpeed engine factory (`vagen.train.make_engine`) with the SFT batch sizes."""
    from vagen.train import make_engine

    sft = cfg.sft
    train = dataclasses.replace(cfg.train, mini_batch_size=sft.batch_size, micro_batch_size=sft.micro_batch_size,
                                warmup_steps=sft.warmup_steps,
                                lr_decay_steps=sft.max_steps if sft.lr_schedule == "cosine" else 0)
    return make_engine(model, types.SimpleNamespace(train=train), sft.lr, dist)


def length_grouped_batches(lengths: list[int], batch_size: int, window: int,
                           generator: torch.Generator) -> list[list[int]]:
    """`window` batches of `batch_size` indices drawn uniformly (with replacement) from
    range(len(lengths)), regrouped so that each batch holds draws of similar length, in random order.
    Every sample is drawn as often as with plain random batches; only the grouping within a window
    changes, and padded tokens are fewer."""
    picked = torch.randint(len(lengths), (batch_size * window,), generator=generator).tolist()
    picked.sort(key=lambda i: lengths[i])
    groups = [picked[start:start + batch_size] for start in range(0, len(picked), batch_size)]
    return [groups[i] for i in torch.randperm(window, generator=generator).tolist()]


def task_batches(lengths: list[int], tasks: list[int], shares: list[float], batch_size: int, window: int,
                 generator: torch.Generator) -> list[list[int]]:
    """`window` batches, each of one task's samples (`tasks[i]` is sample i's task): each batch's task is
    drawn with probability its share (`shares`, one per task, any positive scale), then its samples as
    `length_grouped_batches` draws them from that task's alone. A task's share of the steps is its share,
    whatever its number of samples, and a batch's rows share their task's system prompt."""
    members = [[i for i, task in enumerate(tasks) if task == k] for k in range(len(shares))]
    assert all(members), f"every task needs samples: {[len(m) for m in members]=}"
    picks = torch.multinomial(torch.tensor(shares, dtype=torch.float64), window, replacement=True,
                              generator=generator).tolist()
    batches = []
    for k in sorted(set(picks)):
        drawn = length_grouped_batches([lengths[i] for i in members[k]], batch_size, picks.count(k), generator)
        batches += [[members[k][i] for i in batch] for batch in drawn]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def train_sft(engine, train_samples, val_samples, cfg, pad_id: int, device, log=print, seed: int = 0,
              max_steps: int | None = None, min_steps: int | None = None, time_budget_s: float | None = None,
              on_check=None, target_accuracy: float = 1.0, desc: str | None = None,
              tasks: list[int] | None = None, shares: list[float] | None = None) -> dict[str, float]:
    """Optimizer steps of the token-mean NLL of generated tokens on random batches of `train_samples`
    until, from `min_steps` on, held-out answer accuracy stops improving or reaches `target_accuracy`
    (or `max_steps` / `time_budget_s` run out). Returns stats; `on_check(step, metrics)` is called at every
    check. With `desc`, a progress bar of that name counts the steps toward `max_steps` (with its ETA).
    With `tasks` (each sample's task index) and `shares` (one per task), batches are drawn by `task_batches`."""
    from vagen.batch_plan import chunks
    from vagen.console import progress_bar
    from vagen.trajectory import collate

    sft = cfg.sft
    max_steps = sft.max_steps if max_steps is None else max_steps
    min_steps = sft.min_steps if min_steps is None else min_steps
    generator = torch.Generator().manual_seed(seed)
    best, stale, step = -1.0, 0, 0
    t0 = time.perf_counter()
    metrics: dict[str, float] = {}
    losses = []
    lengths = [s.length for s in train_samples]
    queue: list[list[int]] = []
    bar = progress_bar(max_steps, desc, "step")
    if bar is not None and log is print:
        log = bar.write  # check lines above the bar, not through it
    engine.module.train()
    while step < max_steps:
        if not queue:
            queue = (length_grouped_batches(lengths, sft.batch_size, sft.length_window, generator) if tasks is None
                     else task_batches(lengths, tasks, shares, sft.batch_size, sft.length_window, generator))
        for group in chunks(queue.pop(), sft.micro_batch_size):
            loss = nll_loss(engine, collate([train_samples[i] for i in group], pad_id), device)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        step += 1
        if bar is not None:
            bar.update(1)
        out_of_time = time_budget_s is not None and time.perf_counter() - t0 >= time_budget_s
        if step % sft.check_every == 0 or step == max_steps or out_of_time:
            metrics = answer_accuracy(engine.module, val_samples, pad_id, device, sft.micro_batch_size)
            metrics.update({"sft/step": step, "sft/train_nll": sum(losses) / len(losses),
                            "sft/seconds": time.perf_counter() - t0})
            losses = []
            log(" ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            if on_check is not None:
                on_check(step, metrics)
            accuracy = metrics["sft/val_answer_accuracy"]
            if accuracy > best + 0.002:
                best, stale = accuracy, 0
            else:
                stale += 1
            if bar is not None:
                bar.set_postfix(accuracy=f"{accuracy:.3f}", refresh=False)
            if step >= min_steps and (stale >= sft.patience or accuracy >= target_accuracy):
                break
        if out_of_time:
            break
    if bar is not None:
        bar.close()
    metrics["sft/steps_per_second"] = step / max(time.perf_counter() - t0, 1e-9)
    return metrics


# Held-out accuracy at which the perception stage has done its job (it needs no more steps).
PERCEPTION_TARGET = 0.98
PERCEPTION_VAL_LEVELS = 200
CELL_VAL_START = 10**6  # held-out cell questions are drawn from seeds from here (levels still distinct from evaluation)


def perception_stage(model, encoder, cfg, dist, log=print) -> dict[str, float]:
    """The first stage of a warm start from frames: up to `sft.perception_steps` steps (constant
    learning rate, `sft.lr`) on `vagen.warmstart.perception` questions about `sft.perception_levels` levels,
    until held-out accuracy reaches PERCEPTION_TARGET. Trains `model` in place; returns stats."""
    from vagen.warmstart.demos import eval_level_keys
    from vagen.warmstart.perception import perception_probes, question_sample

    t0 = time.perf_counter()
    sft = cfg.sft
    exclude = eval_level_keys(cfg.env, sft.exclude_eval)
    moves = cfg.rollout.max_turns * cfg.env.max_actions_per_turn - 1  # any frame an episode can show
    probes = perception_probes(cfg.env, sft.perception_levels + PERCEPTION_VAL_LEVELS, moves, exclude,
                               objects=tuple(sft.perception_objects), axes=tuple(sft.perception_axes))
    samples = [question_sample(encoder, model, p.frame, p.question, p.answer, p.seed) for p in probes]
    train, val = samples[: sft.perception_levels], samples[sft.perception_levels:]
    answers = [p.answer for p in probes[sft.perception_levels:]]
    majority = max(answers.count(a) for a in set(answers)) / len(answers)
    log(f"perception: {len(train)} questions on the env's frames in {time.perf_counter() - t0:.1f}s; always "
        f"answering the most common digit scores {majority:.3f} on {len(val)} held-out levels")
    steps = sft.perception_steps
    # accuracy sits at the majority answer's level for hundreds of steps before the model looks: no patience
    stage = dataclasses.replace(cfg, sft=dataclasses.replace(
        sft, lr_schedule="constant", max_steps=steps, min_steps=0, patience=steps, length_window=1,
        batch_size=sft.perception_batch_size, micro_batch_size=sft.perception_batch_size))
    engine = sft_engine(model, stage, dist)
    stats = train_sft(engine, train, val, stage, encoder.pad_id, dist.device, log=lambda s: log(f"perception: {s}"),
                      target_accuracy=PERCEPTION_TARGET, desc="sft: perception")
    accuracy = stats["sft/val_answer_accuracy"]
    if accuracy < majority + MIN_FRAME_GAIN:
        log(f"warning: the perception stage ended at held-out accuracy {accuracy:.3f} after {stats['sft/step']} steps, "
            f"no better than always giving the most common answer ({majority:.3f}): the model has not learned to "
            f"read the frames, and the demonstrations will likely be learned blind. Raise sft.perception_steps, "
            f"or build again with another model.builtin_seed")
    return {"sft/perception_accuracy": stats["sft/val_answer_accuracy"], "sft/perception_steps": stats["sft/step"],
            "sft/perception_majority": majority, "sft/perception_seconds": time.perf_counter() - t0}


# -- held-out evaluation ----------------------------------------------------------------------------

def play_levels(model, encoder, cfg, seeds: list[int], do_sample: bool, batch: int = 64, sample_seed: int = 0,
                desc: str | None = None) -> list:
    """One episode of `model` on each of `seeds`, `batch` at a time, greedy or sampled with
    `rollout.temperature` from `sample_seed` (the caller's random state is left as it was). With
    `desc`, a progress bar of that name counts episodes."""
    from vagen.console import progress_bar
    from vagen.decoding import own_draws
    from vagen.rollout import rollout

    model.eval()
    episodes = []
    bar = progress_bar(len(seeds), desc, "episode")
    with own_draws(sample_seed):
        for start in range(0, len(seeds), batch):
            played, _ = rollout(model, encoder, cfg, seeds[start:start + batch], 1, do_sample=do_sample)
            episodes += played
            if bar is not None:
                bar.update(len(played))
    if bar is not None:
        bar.close()
    return episodes


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


def cell_question_samples(cfg, encoder, model) -> tuple[list, list, float]:
    """`sft.cell_questions` training samples of `vagen.warmstart.perception.cell_probes` questions, held-out
    ones on other levels, and the held-out score of always giving the most common answer. No level
    is one of the first `sft.exclude_eval` evaluation levels."""
    from vagen.warmstart.demos import eval_level_keys
    from vagen.warmstart.perception import cell_probes, question_sample

    exclude = eval_level_keys(cfg.env, cfg.sft.exclude_eval)
    moves = tuple(cfg.sft.cell_moves)
    train = cell_probes(cfg.env, cfg.sft.cell_questions, moves, exclude)
    held_out = cell_probes(cfg.env, PERCEPTION_VAL_LEVELS, moves, exclude, start_seed=CELL_VAL_START)
    answers = [p.answer for p in held_out]

    def samples(probes):
        return [question_sample(encoder, model, p.frame, p.question, p.answer, p.seed) for p in probes]

    return samples(train), samples(held_out), max(answers.count(a) for a in set(answers)) / len(answers)


def cell_stage_settings(sft):
    """`sft` (an SFTConfig) as the cell-question stage trains: `sft.cell_steps` steps, all of them
    (no early stopping), batches of `sft.cell_batch_size`, a cosine from `sft.lr` to 0 whatever the
    first stage's schedule (it ends settled, like a converged build)."""
    return dataclasses.replace(sft, max_steps=sft.cell_steps, min_steps=sft.cell_steps, batch_size=sft.cell_batch_size,
                               micro_batch_size=min(sft.micro_batch_size, sft.cell_batch_size), lr_schedule="cosine")


def cell_question_stage(model, encoder, cfg, dist, train_samples, val_samples, log=print):
    """The last stage of a FrozenLake or Sokoban warm start: `sft.cell_steps` more steps (a new optimizer and
    cosine schedule, batch `sft.cell_batch_size`) on the demonstrations mixed with
    `sft.cell_questions` questions about the cells 1 or 2 moves from the player
    (`vagen.warmstart.perception.cell_probes`). The demonstrations name only the cells next to the player;
    these questions make the model read the cells that a turn's later moves enter. Returns the
    engine and stats."""
    sft = cfg.sft
    t0 = time.perf_counter()
    questions, val, majority = cell_question_samples(cfg, encoder, model)
    log(f"cells: {len(questions)} questions mixed into {len(train_samples)} demonstrations in "
        f"{time.perf_counter() - t0:.1f}s; always the most common answer scores {majority:.3f} held out")
    stage = dataclasses.replace(cfg, sft=cell_stage_settings(sft))
    engine = sft_engine(model, stage, dist)
    accuracy = {}

    def check(step, metrics):
        accuracy.update(answer_accuracy(engine.module, val, encoder.pad_id, dist.device, sft.micro_batch_size))
        log(f"cells: step {step} held-out question accuracy {accuracy['sft/val_answer_accuracy']:.3f}")

    stats = train_sft(engine, train_samples + questions, val_samples, stage, encoder.pad_id, dist.device, log=log,
                      on_check=check, desc="sft: cells")
    stats.update({"sft/cell_accuracy": accuracy["sft/val_answer_accuracy"], "sft/cell_majority": majority,
                  "sft/cell_seconds": time.perf_counter() - t0})
    return engine, stats


ON_POLICY_START = 2 * 10**6  # the on-policy stage plays training levels from these seeds (distinct from evaluation)
ON_POLICY_VAL_LEVELS = 128  # held-out levels of the on-policy stage at most (an eighth of its levels, at least 4)


def relabelled_samples(episodes, cfg, encoder, model, policy: str = "teacher") -> list:
    """For each turn after the first of each of `episodes` (played by the model), a training sample
    whose context is the model's own episode up to that turn, token for token (its earlier responses,
    the env's replies and frames), and whose one learned response is `policy`'s from the state the
    model reached (found by replaying the model's responses in the env's text mode)."""
    import numpy as np

    from vagen.episode import Episode, Turn
    from vagen.rollout import make_env
    from vagen.trajectory import episode_to_sample
    from vagen.warmstart.demos import demo_response

    env = make_env(cfg.env, {"render_mode": "text"})
    samples = []
    for episode in episodes:
        if episode.error or len(episode.turns) < 2:
            continue
        env.reset(seed=episode.seed)
        for t in range(1, len(episode.turns)):
            _, _, terminated, truncated, _ = env.step(episode.turns[t - 1].response)
            if terminated or truncated:  # the env ended where the rollout did not: nothing to relabel
                break
            turn = episode.turns[t]
            target = demo_response(env, policy, np.random.default_rng([episode.seed, 13, t]), kind=cfg.sft.reasoning)
            generated, text = encoder.finish_response(encoder.encode_text(target))
            start, images = turn.span[0], sum(len(earlier.images) for earlier in episode.turns[: t + 1])
            relabelled = Episode(episode.env_name, episode.seed, len(samples), episode.system_prompt,
                                 input_ids=episode.input_ids[:start] + generated,
                                 pixel_values=episode.pixel_values[:images],
                                 image_grid_thw=episode.image_grid_thw[:images])
            relabelled.turns.append(Turn(turn.observation, turn.images, text, 0.0, {},
                                         (start, start + len(generated)), len(generated)))
            samples.append(episode_to_sample(relabelled, encoder, model))
    return samples


def on_policy_stage(model, encoder, cfg, dist, train_samples, policy: str = "teacher", log=print):
    """The last stage of a warm start: the model plays `sft.on_policy_levels` training levels (sampled at
    `rollout.temperature`, none of them an evaluation level), `relabelled_samples` turns each of its
    later turns into `policy`'s answer after the model's own history, and `sft.on_policy_steps` steps
    (a new optimizer and a cosine from `sft.lr`, batch `sft.batch_size`) learn them mixed with the
    demonstrations. Demonstrations alone show only the teacher's own histories, while RL samples
    after the model's; this stage trains on those. Returns the engine and stats."""
    from vagen.rollout import make_env, rollout_metrics
    from vagen.warmstart.demos import distinct_levels, eval_level_keys

    sft = cfg.sft
    t0 = time.perf_counter()
    exclude = eval_level_keys(cfg.env, sft.exclude_eval)
    env = make_env(cfg.env, {"render_mode": "text"})
    val_levels = min(ON_POLICY_VAL_LEVELS, max(4, sft.on_policy_levels // 8))
    seeds = list(distinct_levels(env, sft.on_policy_levels + val_levels, itertools.count(ON_POLICY_START),
                                 exclude, fix="lower sft.on_policy_levels"))
    episodes = play_levels(model, encoder, cfg, seeds, do_sample=True, sample_seed=1)
    played = rollout_metrics(episodes)
    cut = sft.on_policy_levels
    train = relabelled_samples(episodes[:cut], cfg, encoder, model, policy)
    val = relabelled_samples(episodes[cut:], cfg, encoder, model, policy)
    if not train or not val:
        raise RuntimeError(f"the on-policy stage found {len(train)} training and {len(val)} held-out turns after the "
                           f"first: the model's episodes end in one turn (rollout.max_turns={cfg.rollout.max_turns}); "
                           f"set sft.on_policy_levels=0")
    log(f"on-policy: the model played {len(episodes)} levels (format ok {played['rollout/format_ok']:.3f}, success "
        f"{played['rollout/success']:.3f}); {len(train)} later turns relabelled by the {policy}, mixed into "
        f"{len(train_samples)} demonstrations ({time.perf_counter() - t0:.0f}s)")
    stage = dataclasses.replace(cfg, sft=dataclasses.replace(
        sft, max_steps=sft.on_policy_steps, min_steps=sft.on_policy_steps, lr_schedule="cosine"))
    engine = sft_engine(model, stage, dist)
    stats = train_sft(engine, train_samples + train, val, stage, encoder.pad_id, dist.device,
                      log=lambda line: log(f"on-policy: {line}"), desc="sft: on-policy")
    return engine, {"sft/on_policy_format_ok": played["rollout/format_ok"],
                    "sft/on_policy_success": played["rollout/success"], "sft/on_policy_turns": len(train),
                    "sft/on_policy_accuracy": stats["sft/val_answer_accuracy"],
                    "sft/on_policy_seconds": time.perf_counter() - t0}


# -- building a warm start --------------------------------------------------------------------------

def demonstration_code(env_name: str, perception: bool = False) -> str:
    """Hash of the code that writes the demonstrations: `vagen.warmstart.demos` and the env's module
    (its teacher, solver, dynamics, frames and prompts), and with `perception`
    `vagen.warmstart.perception`; recorded with each build, so a card says which demonstrations it learned."""
    import inspect

    import envs_visual
    from vagen.warmstart import demos
    from vagen.warmstart import perception as questions

    env_module = inspect.getmodule(envs_visual.env_class(env_name))
    modules = (demos, env_module) + ((questions,) if perception else ())
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
                                      dist.device, cfg.sft.micro_batch_size, log, cfg.sft.reasoning == "path"))
    stats.update({"sft/data_seconds": data_s, "sft/build_seconds": time.perf_counter() - t0,
                  "sft/demo_success": sum(d.success for d in train_demos) / len(train_demos)})
    settings = {s: cfg.to_dict()[s] for s in ("model", "env", "rollout", "sft")}
    save_warm_start(engine.module, processor, out, {
        "config": cfg.name, "command": command, "code_revision": revision, "demonstration_code": demo_code,
        "base": str(base_path),
        "policy": policy, "stages": "cells" if cells_only else "on_policy" if on_policy_only else "all",
        "settings": settings, **stats}, log)
    return stats


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
