import types

import pytest
import torch
from hf_generate import GenerateDecoder, decode, generate

from vagen.config import load_config
from vagen.decoding_hf import HFDecoder
from vagen.episode import ChatEncoder, Episode
from vagen.rollout import rollout


def _play(model, processor, config, reuse, *extra, seeds=(3, 4), group_size=3, decoder=None):
    cfg = load_config(config, ["rollout.max_new_tokens=10", "rollout.max_turns=3", f"rollout.reuse_cache={reuse}",
                               *extra])
    torch.manual_seed(0)
    episodes, _ = rollout(model, ChatEncoder(processor), cfg, list(seeds), group_size, decoder=decoder)
    return episodes


@pytest.mark.parametrize("config, fixture, extra", [
    ("frozenlake_visual", "tiny_vl", ["rollout.temperature=0"]),
    ("frozenlake_visual", "tiny_vl", ["rollout.temperature=0.7", "rollout.top_p=0.95"]),
    ("sokoban_text", "tiny_text", ["rollout.temperature=1.0", "rollout.top_p=1.0"]),
])
def test_a_cache_kept_across_turns_gives_the_episodes_of_generate_over_the_whole_history(config, fixture, extra,
                                                                                          request):
    _, model, processor = request.getfixturevalue(fixture)
    whole = _play(model, processor, config, True, *extra, decoder=GenerateDecoder(model, ChatEncoder(processor)))
    cached = _play(model, processor, config, True, *extra)
    uncached = _play(model, processor, config, False, *extra)  # rollout.reuse_cache=false: the cache goes every turn
    assert all(len(ep.turns) == 3 for ep in whole)
    for played in (cached, uncached):
        assert [ep.input_ids for ep in played] == [ep.input_ids for ep in whole]  # same tokens, same random draws
        assert [[t.response for t in ep.turns] for ep in played] == [[t.response for t in ep.turns] for ep in whole]


def test_episodes_that_end_leave_the_cache_and_the_others_go_on(tiny_vl):
    from vagen.rollout import make_env

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
    generator = HFDecoder(model, encoder)
    options = dict(max_new_tokens=6, temperature=0.0, top_p=1.0, top_k=0)
    first = decode(generator, episodes, [0, 1, 2], **options)
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
    assert decode(generator, going_on, [0, 2], **options) == generate(model, encoder, going_on, **options)
    assert generator.rows == [0, 2] and generator.mask.shape[0] == 2


def _episode(encoder, text: str) -> Episode:
    episode = Episode("sokoban", 0, 0, "You play a game.")
    episode.input_ids, _, _ = encoder.user_segment(text, [], first=True, system=episode.system_prompt)
    return episode


def test_the_cache_refuses_histories_it_cannot_continue(tiny_text):
    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    episodes = [_episode(encoder, "Left is free."), _episode(encoder, "Up is a wall.")]
    generator = HFDecoder(model, encoder)
    for episode, new in zip(episodes, decode(generator, episodes, [0, 1], 4, temperature=0.0, top_p=1.0, top_k=0)):
        episode.input_ids += encoder.finish_response(new)[0] + encoder.encode_text("\n<|im_start|>user\nAgain.")
    decode(generator, episodes[1:], [1], 4, temperature=0.0, top_p=1.0, top_k=0)
    with pytest.raises(ValueError, match=r"episodes \[0\] are not in the cache"):
        decode(generator, episodes, [0, 1], 4, temperature=0.0, top_p=1.0, top_k=0)
    episodes[1].input_ids = encoder.encode_text("a different history")
    with pytest.raises(RuntimeError, match="no longer starts with the tokens in the cache"):
        decode(generator, episodes[1:], [1], 4, temperature=0.0, top_p=1.0, top_k=0)


class ScriptedLM(torch.nn.Module):
    """A stand-in causal LM: after its k-th forward pass, row r's most likely next token is script[r][k]."""

    def __init__(self, script, vocab_size):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.script, self.vocab_size, self.calls, self.masks = script, vocab_size, 0, []
        self.config = types.SimpleNamespace(model_type="qwen2")  # stands in for a Qwen2 causal LM

    def forward(self, input_ids, position_ids, attention_mask, use_cache, logits_to_keep, cache=None):
        self.masks.append(attention_mask.clone())
        logits = torch.zeros(input_ids.shape[0], 1, self.vocab_size)
        for row, tokens in enumerate(self.script):
            logits[row, 0, tokens[min(self.calls, len(tokens) - 1)]] = 10.0
        self.calls += 1
        return types.SimpleNamespace(logits=logits, cache=cache if cache is not None else object())


def test_a_row_stops_at_the_end_of_its_answer_or_at_its_stop_token(tiny_text):
    _, _, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    answer = encoder.encode_text("<answer>Up</answer>")
    junk = encoder.encode_text(" more")
    left = encoder.encode_text("Left")
    model = ScriptedLM([answer + junk * 4, left + [encoder.im_end_id] + junk * 8], len(tokenizer))
    episodes = [_episode(encoder, "Where now?"), _episode(encoder, "And here?")]
    prompts = [list(ep.input_ids) for ep in episodes]
    generator = HFDecoder(model, encoder)
    out = decode(generator, episodes, [0, 1], 12, temperature=0.0, top_p=1.0, top_k=0)
    assert out == [answer, left + [encoder.im_end_id]]
    # the last token of each row was never fed, so the next turn starts with it
    assert generator.fed == {0: prompts[0] + answer[:-1], 1: prompts[1] + left}
    # after its stop token, the stopped row's new slots are masked out
    stopped_at = len(left) + 1  # forward passes: the prompt, then one per fed token
    assert all(mask[1, -1] == 0 for mask in model.masks[stopped_at:])
    assert all(mask[0, -1] == 1 for mask in model.masks[1:len(answer)])
    assert model.calls == len(answer)  # no forward pass after the last row stopped


class HostCopies(torch.overrides.TorchFunctionMode):
    """Records every copy to the host, and every sort, of a tensor as wide as the vocabulary."""

    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size, self.copies, self.sorts = vocab_size, [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if tensor is not None and tensor.dim() > 0 and tensor.shape[-1] == self.vocab_size:
            name = getattr(func, "__name__", str(func))
            to_host = name in ("cpu", "numpy", "tolist", "item") or (
                name == "to" and any(str(a).startswith("cpu") for a in [*args[1:], kwargs.get("device")]))
            if to_host:
                self.copies.append((name, tuple(tensor.shape)))
            if name in ("sort", "argsort"):
                self.sorts.append((name, tuple(tensor.shape)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_tokens_are_drawn_where_the_logits_are(tiny_text, top_p):
    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    episodes = [_episode(encoder, "Left is free."), _episode(encoder, "Up is a wall."), _episode(encoder, "Go.")]
    vocab_size = model.get_output_embeddings().weight.shape[0]
    recorder = HostCopies(vocab_size)
    torch.manual_seed(0)
    with recorder:
        out = decode(HFDecoder(model, encoder), episodes, [0, 1, 2], 6, temperature=1.0, top_p=top_p, top_k=0)
    assert all(len(ids) > 0 for ids in out)
    # Only the drawn ids leave the model's device, never a [rows, vocab] tensor (0.23 s a step at 32 rows).
    assert recorder.copies == [], f"[rows, vocab] tensors copied to the host: {recorder.copies}"
    if top_p == 1.0:  # without nucleus truncation nothing needs the vocabulary in order
        assert recorder.sorts == [], f"full-vocabulary sorts with top_p=1, top_k=0: {recorder.sorts}"


def test_a_seed_gives_the_same_draws_and_another_seed_other_draws(tiny_text):
    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)

    def draw(seed):
        episodes = [_episode(encoder, "Left is free."), _episode(encoder, "Up is a wall.")]
        torch.manual_seed(seed)
        return decode(HFDecoder(model, encoder), episodes, [0, 1], 8, temperature=1.0, top_p=1.0, top_k=0)

    first = draw(1)
    assert draw(1) == first
    assert draw(2) != first  # the draws come from torch's seeded generator, nothing else


@pytest.mark.gpu
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_on_a_gpu_the_draws_are_those_of_generate(tiny_vl, top_p):
    import copy

    from vagen.rollout import make_env

    _, model, processor = tiny_vl
    model = copy.deepcopy(model).to("cuda")
    encoder = ChatEncoder(processor)
    env = make_env(load_config("frozenlake_visual", []).env)
    episodes = []
    for seed in (1, 2, 3):
        obs, _ = env.reset(seed=seed)
        episode = Episode("frozenlake", seed, 0, env.system_prompt())
        ids, pixels, grids = encoder.user_segment(obs.text, obs.images, first=True, system=episode.system_prompt)
        episode.input_ids, episode.pixel_values, episode.image_grid_thw = ids, pixels, grids
        episodes.append(episode)
    options = dict(max_new_tokens=12, temperature=1.0, top_p=top_p, top_k=0)
    torch.manual_seed(5)
    expected = generate(model, encoder, episodes, **options)
    recorder = HostCopies(model.get_output_embeddings().weight.shape[0])
    torch.manual_seed(5)
    with recorder:
        drawn = decode(HFDecoder(model, encoder), episodes, [0, 1, 2], **options)
    assert drawn == expected
    assert recorder.copies == [], f"[rows, vocab] tensors copied to the host: {recorder.copies}"
