"""The supervised loop every warm-start stage trains with: the masked next-token loss, held-out answer
accuracy and frame dependence, the engine, length-grouped batches, and greedy or sampled play on levels.
`vagen.warmstart.sft` (the build) and `vagen.warmstart.stages` (its optional stages) both train with it."""

from __future__ import annotations

import dataclasses
import time
import types

import torch


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


# Reasoning that names every move (each move's cell): the frame check scores the whole response, since under
# teacher forcing the answer copies it. Not `view` reasoning, whose decision clause is worded at random, so that
# no whole response is the argmax (benchmarks/frame_gap.py measures what its frames change).
WHOLE_RESPONSE_REASONING = ("path",)


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
