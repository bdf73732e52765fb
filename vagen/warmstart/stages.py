"""The stages of a warm start after (or before) its demonstrations, each on the model the last one left:

- `perception_stage`: one-turn questions about the env's frames before the demonstrations
  (`vagen.warmstart.perception.stage_probes`: the env's own question module where it has one);
- `cell_question_stage`: the demonstrations mixed with questions about the cells a turn's later moves
  enter (FrozenLake, Sokoban);
- `on_policy_stage`: the model's own episodes, each later turn relabelled by the teacher.

`vagen.warmstart.sft.build_warm_start` runs them in that order around the demonstrations; they train with
its loop (`train_sft`), engine and checks, and `vagen.warmstart.sft` re-exports them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

# Held-out accuracy at which the perception stage has done its job (it needs no more steps).
PERCEPTION_TARGET = 0.98
PERCEPTION_VAL_LEVELS = 200
CELL_VAL_START = 10**6  # held-out cell questions are drawn from seeds from here (levels still distinct from evaluation)


def perception_stage(model, encoder, cfg, dist, log=print) -> dict[str, float]:
    """The first stage of a warm start from frames: up to `sft.perception_steps` steps (constant
    learning rate, `sft.lr`) on `vagen.warmstart.perception` questions about `sft.perception_levels` levels,
    until held-out accuracy reaches PERCEPTION_TARGET. Trains `model` in place; returns stats."""
    from vagen.warmstart import loop as warm
    from vagen.warmstart.demos import eval_level_keys
    from vagen.warmstart.perception import question_sample, stage_probes

    t0 = time.perf_counter()
    sft = cfg.sft
    exclude = eval_level_keys(cfg.env, sft.exclude_eval)
    probes = stage_probes(cfg, sft.perception_levels + PERCEPTION_VAL_LEVELS, exclude)
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
    engine = warm.sft_engine(model, stage, dist)
    stats = warm.train_sft(engine, train, val, stage, encoder.pad_id, dist.device, log=lambda s: log(f"perception: {s}"),
                      target_accuracy=PERCEPTION_TARGET, desc="sft: perception")
    accuracy = stats["sft/val_answer_accuracy"]
    if accuracy < majority + warm.MIN_FRAME_GAIN:
        log(f"warning: the perception stage ended at held-out accuracy {accuracy:.3f} after {stats['sft/step']} steps, "
            f"no better than always giving the most common answer ({majority:.3f}): the model has not learned to "
            f"read the frames, and the demonstrations will likely be learned blind. Raise sft.perception_steps, "
            f"or build again with another model.builtin_seed")
    return {"sft/perception_accuracy": stats["sft/val_answer_accuracy"], "sft/perception_steps": stats["sft/step"],
            "sft/perception_majority": majority, "sft/perception_seconds": time.perf_counter() - t0}


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
    from vagen.warmstart import loop as warm

    sft = cfg.sft
    t0 = time.perf_counter()
    questions, val, majority = cell_question_samples(cfg, encoder, model)
    log(f"cells: {len(questions)} questions mixed into {len(train_samples)} demonstrations in "
        f"{time.perf_counter() - t0:.1f}s; always the most common answer scores {majority:.3f} held out")
    stage = dataclasses.replace(cfg, sft=cell_stage_settings(sft))
    engine = warm.sft_engine(model, stage, dist)
    accuracy = {}

    def check(step, metrics):
        accuracy.update(warm.answer_accuracy(engine.module, val, encoder.pad_id, dist.device, sft.micro_batch_size))
        log(f"cells: step {step} held-out question accuracy {accuracy['sft/val_answer_accuracy']:.3f}")

    stats = warm.train_sft(engine, train_samples + questions, val_samples, stage, encoder.pad_id, dist.device, log=log,
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
            target = demo_response(env, policy, np.random.default_rng([episode.seed, 13, t]), kind=cfg.sft.reasoning,
                                   slip=cfg.sft.teacher_slip)
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
    from vagen.warmstart import loop as warm
    from vagen.warmstart.demos import distinct_levels, eval_level_keys

    sft = cfg.sft
    t0 = time.perf_counter()
    exclude = eval_level_keys(cfg.env, sft.exclude_eval)
    env = make_env(cfg.env, {"render_mode": "text"})
    val_levels = min(ON_POLICY_VAL_LEVELS, max(4, sft.on_policy_levels // 8))
    seeds = list(distinct_levels(env, sft.on_policy_levels + val_levels, itertools.count(ON_POLICY_START),
                                 exclude, fix="lower sft.on_policy_levels"))
    episodes = warm.play_levels(model, encoder, cfg, seeds, do_sample=True, sample_seed=1)
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
    engine = warm.sft_engine(model, stage, dist)
    stats = warm.train_sft(engine, train_samples + train, val, stage, encoder.pad_id, dist.device,
                      log=lambda line: log(f"on-policy: {line}"), desc="sft: on-policy")
    return engine, {"sft/on_policy_format_ok": played["rollout/format_ok"],
                    "sft/on_policy_success": played["rollout/success"], "sft/on_policy_turns": len(train),
                    "sft/on_policy_accuracy": stats["sft/val_answer_accuracy"],
                    "sft/on_policy_seconds": time.perf_counter() - t0}
