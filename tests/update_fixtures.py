"""A fixed batch of text trajectories for update tests (shared by the in-process tests and the
data-parallel worker launched under the DeepSpeed launcher)."""

from __future__ import annotations

import torch

from vagen.episode import ChatEncoder, Episode, Turn
from vagen.trajectory import episode_to_sample

PROMPT = "Which way? Answer Left or Right."


def answer_samples(encoder: ChatEncoder, answers: list[str], advantages: list[float]):
    """One single-turn sample per answer, with a constant advantage on its generated tokens."""
    samples = []
    for i, (answer, advantage) in enumerate(zip(answers, advantages)):
        episode = Episode("bandit", seed=i, group_id=i, system_prompt="Choose.")
        ids, _, _ = encoder.user_segment(PROMPT, [], first=True, system="Choose.")
        generated, text = encoder.finish_response(encoder.encode_text(f"<answer>{answer}</answer>"))
        episode.input_ids = ids + generated
        episode.turns.append(Turn(PROMPT, [], text, 0.0, {}, (len(ids), len(ids) + len(generated)), len(generated)))
        sample = episode_to_sample(episode, encoder)
        sample.extra["advantages"] = sample.loss_mask * advantage
        sample.extra["adv_mask"] = sample.loss_mask.clone()
        sample.extra["returns"] = torch.zeros_like(sample.loss_mask)
        samples.append(sample)
    return samples


def response_logprob(samples) -> list[float]:
    return [float((s.extra["old_logprobs"] * s.loss_mask).sum()) for s in samples]


def visual_samples(encoder: ChatEncoder, model, answers: list[str], advantages: list[float], max_turns: int = 3):
    """One Sokoban trajectory per answer, 1 to `max_turns` turns (cycling), each turn a real frame of the level
    (168x168, 36 image tokens) and the answer, with a constant advantage on its generated tokens: sequences
    of unequal lengths and unequal frame counts, with M-RoPE positions from `model`."""
    import envs_visual
    from vagen.config import load_config
    from vagen.warmstart.demos import Demo, demo_episode

    cfg = load_config("sokoban_visual")
    env = envs_visual.make(cfg.env.name, **cfg.env.params)
    samples = []
    for i, (answer, advantage) in enumerate(zip(answers, advantages)):
        turns = 1 + i % max_turns
        demo = Demo(seed=i, level="", responses=[f"<answer>{answer}</answer>"] * turns, rewards=[None] * turns)
        episode = demo_episode(demo, env, encoder, group_id=i)
        sample = episode_to_sample(episode, encoder, model)
        sample.extra["advantages"] = sample.loss_mask * advantage
        sample.extra["adv_mask"] = sample.loss_mask.clone()
        sample.extra["returns"] = torch.zeros_like(sample.loss_mask)
        samples.append(sample)
    return samples
