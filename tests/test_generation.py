import pytest
import torch

from vagen.config import load_config
from vagen.generation import TurnGenerator
from vagen.rollout import ChatEncoder, Episode, rollout


def _play(model, processor, config, reuse, *extra, seeds=(3, 4), group_size=3):
    cfg = load_config(config, ["rollout.max_new_tokens=10", "rollout.max_turns=3", f"rollout.reuse_cache={reuse}",
                               *extra])
    torch.manual_seed(0)
    episodes, _ = rollout(model, ChatEncoder(processor), cfg, list(seeds), group_size)
    return episodes


@pytest.mark.parametrize("config, fixture, extra", [
    ("frozenlake_visual", "tiny_vl", ["rollout.temperature=0"]),
    ("frozenlake_visual", "tiny_vl", ["rollout.temperature=0.7", "rollout.top_p=0.95"]),
    ("sokoban_text", "tiny_text", ["rollout.temperature=1.0", "rollout.top_p=1.0"]),
])
def test_a_cache_kept_across_turns_gives_the_episodes_of_generate_over_the_whole_history(config, fixture, extra,
                                                                                          request):
    _, model, processor = request.getfixturevalue(fixture)
    whole = _play(model, processor, config, False, *extra)
    cached = _play(model, processor, config, True, *extra)
    assert all(len(ep.turns) == 3 for ep in whole)
    assert [ep.input_ids for ep in cached] == [ep.input_ids for ep in whole]  # same tokens, same random draws
    assert [[t.response for t in ep.turns] for ep in cached] == [[t.response for t in ep.turns] for ep in whole]


def test_episodes_that_end_leave_the_cache_and_the_others_go_on(tiny_vl):
    from vagen.rollout import generate, make_env

    _, model, processor = tiny_vl
    encoder = ChatEncoder(processor)
    cfg = load_config("frozenlake_visual", [])
    env = make_env(cfg.env)
    episodes = []
    for seed in (1, 2, 3):
        obs, _ = env.reset(seed=seed)
        episode = Episode("frozenlake", seed, 0, env.system_prompt())
        ids, pixels, grids = encoder.user_segment(obs.text, obs.images, first=True, system=episode.system_prompt)
        episode.input_ids, episode.pixel_values, episode.image_grid_thw = ids, pixels, grids
        episodes.append(episode)
    generator = TurnGenerator(model, encoder)
    options = dict(max_new_tokens=6, temperature=0.0, top_p=1.0, top_k=0)
    first = generator.generate(episodes, [0, 1, 2], **options)
    assert first == generate(model, encoder, episodes, **options)
    # the middle episode ends; the others get their answer closed and a second frame
    for k in (0, 2):
        ids, _ = encoder.finish_response(first[k])
        obs, _ = env.reset(seed=10 + k)
        more, pixels, grids = encoder.user_segment(obs.text, obs.images, first=False, system=None)
        episodes[k].input_ids += ids + more
        episodes[k].pixel_values += pixels
        episodes[k].image_grid_thw += grids
    going_on = [episodes[0], episodes[2]]
    assert generator.generate(going_on, [0, 2], **options) == generate(model, encoder, going_on, **options)
    assert generator.rows == [0, 2] and generator.mask.shape[0] == 2


def _episode(encoder, text: str) -> Episode:
    episode = Episode("sokoban", 0, 0, "You play a game.")
    episode.input_ids, _, _ = encoder.user_segment(text, [], first=True, system=episode.system_prompt)
    return episode


def test_the_cache_refuses_histories_it_cannot_continue(tiny_text):
    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    episodes = [_episode(encoder, "Left is free."), _episode(encoder, "Up is a wall.")]
    generator = TurnGenerator(model, encoder)
    for episode, new in zip(episodes, generator.generate(episodes, [0, 1], 4, temperature=0.0, top_p=1.0, top_k=0)):
        episode.input_ids += encoder.finish_response(new)[0] + encoder.encode_text("\n<|im_start|>user\nAgain.")
    generator.generate(episodes[1:], [1], 4, temperature=0.0, top_p=1.0, top_k=0)
    with pytest.raises(ValueError, match=r"episodes \[0\] are not in the cache"):
        generator.generate(episodes, [0, 1], 4, temperature=0.0, top_p=1.0, top_k=0)
    episodes[1].input_ids = encoder.encode_text("a different history")
    with pytest.raises(RuntimeError, match="no longer starts with the tokens in the cache"):
        generator.generate(episodes[1:], [1], 4, temperature=0.0, top_p=1.0, top_k=0)
