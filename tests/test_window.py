"""Per-turn samples with a history window (`rollout.context=window`): each turn's prompt is the system
prompt, the last `rollout.window_turns` turns and the new observation; that prompt is what the policy
generated from and what it is trained on (tokens, M-RoPE positions, frames and log-probabilities), every
advantage estimator computes over a trajectory's turn samples what it computes over its single sequence,
and training runs with it."""

import json
import math

import pytest
import torch
from scripted import ScriptedDecoder

from envs_visual.base import format_response
from vagen.config import ConfigError, load_config


def _scripted(encoder, config, overrides, script, seed=3):
    from vagen.rollout import rollout

    cfg = load_config(config, [f"rollout.max_turns={len(script[0])}", f"rollout.group_size={len(script)}",
                               "rollout.env_groups=1", f"train.mini_batch_size={len(script)}",
                               *overrides])
    decoder = ScriptedDecoder(encoder, script)
    episodes, _ = rollout(None, encoder, cfg, [seed], group_size=len(script), decoder=decoder)
    return cfg, episodes, decoder


def test_each_prompt_holds_the_system_prompt_the_last_turns_and_the_new_observation(tiny_text):
    from vagen.episode import ChatEncoder

    encoder = ChatEncoder(tiny_text[2])
    fmt = load_config("sokoban_text").env.prompt_format
    answers = [format_response(fmt, move) for move in ("Left", "Up", "Right", "Down")]
    _, (window,), decoder = _scripted(encoder, "sokoban_text", ["rollout.context=window", "rollout.window_turns=1"],
                                      {0: answers})
    _, (full,), _ = _scripted(encoder, "sokoban_text", [], {0: answers})
    obs = [turn.observation for turn in full.turns]
    system = full.system_prompt
    responses = [encoder.encode_text(a) + [encoder.im_end_id] for a in answers]

    def user(text, first):
        prefix = f"<|im_start|>system\n{system}<|im_end|>\n" if first else "\n"
        return encoder.encode_text(f"{prefix}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")

    expected = [user(obs[0], True)] + [user(obs[k - 1], True) + responses[k - 1] + user(obs[k], False)
                                       for k in range(1, 4)]
    assert decoder.prompts[0] == expected
    assert [turn.observation for turn in window.turns] == obs  # the same play: the window changes no state
    for k, turn in enumerate(window.turns):
        assert turn.context.input_ids == expected[k] + responses[k]
        assert turn.span == (len(expected[k]), len(expected[k]) + len(responses[k]))
    # full mode: one growing sequence, the window's last prompt is its suffix after the system prompt
    assert full.input_ids[-len(responses[3]):] == responses[3]


def test_window_zero_keeps_the_new_observation_alone(tiny_text):
    from vagen.episode import ChatEncoder

    encoder = ChatEncoder(tiny_text[2])
    fmt = load_config("sokoban_text").env.prompt_format
    answers = [format_response(fmt, move) for move in ("Left", "Up", "Right")]
    _, (episode,), decoder = _scripted(encoder, "sokoban_text", ["rollout.context=window", "rollout.window_turns=0"],
                                       {0: answers})
    for prompt, turn in zip(decoder.prompts[0], episode.turns):
        text = encoder.tokenizer.decode(prompt)
        assert text.count("<|im_start|>user") == 1 and text.count("<|im_start|>system") == 1
        assert text.count("<|im_start|>assistant") == 1 and turn.observation in text


def test_five_turns_with_frames_train_on_exactly_what_was_generated(tiny_vl, monkeypatch):
    """The proof that the window is what the policy saw: for a 5-turn episode with images, the token ids,
    positions and frames fed to the model while generating, and the log-probabilities of the drawn tokens,
    equal those of the turn samples that training builds and scores."""
    import vagen.decoding_hf as decoding_hf
    from vagen.episode import ChatEncoder
    from vagen.rollout import rollout
    from vagen.trajectory import collate, episode_samples
    from vagen.update import token_logprobs

    _, model, processor = tiny_vl
    encoder = ChatEncoder(processor)
    cfg = load_config("sokoban_visual", ["rollout.context=window", "rollout.window_turns=2", "rollout.max_turns=5",
                                         "rollout.max_new_tokens=6", "rollout.temperature=1.0"])
    fed, drawn = [], []
    real_forward, real_draw = decoding_hf.HFDecoder._forward, decoding_hf.draw

    def forward(self, input_ids, positions, new_mask, images, grids):
        fed.append((input_ids.clone(), positions.clone(), [p.clone() for p in images]))
        return real_forward(self, input_ids, positions, new_mask, images, grids)

    def draw(logits, suppress, sampling):
        token = real_draw(logits, suppress, sampling)
        scaled = logits.index_fill(-1, suppress, float("-inf")) / sampling.temperature
        drawn.append((int(token[0]), float(torch.log_softmax(scaled, -1)[0, token[0]])))
        return token

    monkeypatch.setattr(decoding_hf.HFDecoder, "_forward", forward)
    monkeypatch.setattr(decoding_hf, "draw", draw)
    torch.manual_seed(0)
    (episode,), _ = rollout(model, encoder, cfg, [5], group_size=1)
    assert len(episode.turns) == 5
    samples = episode_samples(episode, encoder, model, index=0)
    assert [s.turn_index for s in samples] == list(range(5)) and {s.episode_index for s in samples} == {0}

    turn_calls, call = [], 0  # the forward passes of each turn: the whole window, then one per drawn token
    for turn in episode.turns:
        steps = turn.response_length - 1 - (not turn.end_sampled)  # tokens fed after the window
        turn_calls.append(fed[call : call + 1 + steps])
        call += 1 + steps
    assert call == len(fed)
    draws = iter(drawn)
    for k, (turn, sample, calls) in enumerate(zip(episode.turns, samples, turn_calls)):
        start, end = turn.span
        # tokens and positions: the window as fed, then each drawn token
        ids = torch.cat([c[0][0] for c in calls])
        positions = torch.cat([c[1][:, 0] for c in calls], dim=-1)
        assert torch.equal(ids, sample.input_ids[: ids.shape[0]])
        assert ids.shape[0] == start + turn.response_length - 1 - (not turn.end_sampled)  # the last draw is not fed
        assert torch.equal(positions, sample.position_ids[:, : ids.shape[0]])
        # frames: every frame of the window, in order, and no other
        assert torch.equal(torch.cat(calls[0][2]), sample.pixel_values)
        assert sample.image_grid_thw.shape[0] == min(k, 2) + 1
        text = encoder.tokenizer.decode(sample.input_ids)
        assert text.count("<|im_start|>user") == min(k, 2) + 1 and text.count("<|im_start|>system") == 1
        # log-probabilities of the drawn tokens, at generation and at training
        sampled = (sample.sampled_mask > 0).nonzero(as_tuple=True)[0]
        at_generation = [next(draws) for _ in range(turn.response_length - (not turn.end_sampled))]
        assert [token for token, _ in at_generation] == sample.input_ids[sampled].tolist()
        batch = collate([sample], encoder.pad_id)
        with torch.no_grad():
            logprobs, _ = token_logprobs(model, batch, cfg.rollout.temperature, with_entropy=False,
                                         suppress_ids=encoder.suppress_ids)
        torch.testing.assert_close(logprobs[0, sampled], torch.tensor([lp for _, lp in at_generation]),
                                   rtol=0, atol=2e-5)


def _annotated(episodes, encoder, seed=0):
    """Samples of `episodes` with made-up old log-probs, entropies and values that depend only on the
    generated token's turn and place in its response, so that both modes see the same numbers."""
    from vagen.trajectory import episode_samples

    samples = []
    for index, episode in enumerate(episodes):
        for sample in episode_samples(episode, encoder, index=index):
            turn_of = torch.cumsum(sample.turn_end_mask, 0) - sample.turn_end_mask
            first = 0 if sample.turn_index is None else sample.turn_index
            place = torch.zeros(sample.length)  # the token's index in its turn's response
            for k in range(int(sample.turn_end_mask.sum())):
                tokens = (sample.loss_mask > 0) & (turn_of == k)
                place[tokens] = torch.arange(int(tokens.sum()), dtype=torch.float)
            key = (turn_of + first) * 100 + place + seed
            for name, scale in (("old_logprobs", -0.01), ("entropies", 0.37), ("old_values", 0.013)):
                sample.extra[name] = torch.sin(key * scale) * (sample.loss_mask > 0)
            samples.append(sample)
    return samples


def _per_turn(samples, name):
    """Each turn's generated-token values of `name`, in episode and turn order."""
    out = []
    for sample in samples:
        turn_of = torch.cumsum(sample.turn_end_mask, 0) - sample.turn_end_mask
        for k in range(int(sample.turn_end_mask.sum())):
            out.append(sample.extra[name][(sample.loss_mask > 0) & (turn_of == k)])
    return out


@pytest.mark.parametrize("estimator", ["turn_gae", "gae", "grpo", "gigpo"])
def test_every_estimator_gives_each_turn_sample_what_the_whole_trajectory_gets(tiny_text, estimator):
    from vagen.episode import ChatEncoder
    from vagen.update import compute_advantages

    encoder = ChatEncoder(tiny_text[2])
    fmt = load_config("sokoban_text").env.prompt_format
    script = {0: [format_response(fmt, "Left"), format_response(fmt, "Up"), "no answer"],
              1: [format_response(fmt, "Right"), "nothing", format_response(fmt, "Down")],
              2: [format_response(fmt, "Left"), format_response(fmt, "Down"), format_response(fmt, "Up")]}
    overrides = [f"algo.adv_estimator={estimator}", "algo.token_selection=entropy", "algo.top_ratio=0.3"]
    cfg, full, _ = _scripted(encoder, "sokoban_text", overrides, script)
    _, window, _ = _scripted(encoder, "sokoban_text", overrides + ["rollout.context=window",
                                                                   "rollout.window_turns=1"], script)
    full_samples, window_samples = _annotated(full, encoder), _annotated(window, encoder)
    assert len(full_samples) == 3 and len(window_samples) == 9
    window_samples = window_samples[::-1]  # order does not matter: turns are gathered by episode and index
    full_metrics = compute_advantages(full_samples, cfg)
    window_metrics = compute_advantages(window_samples, cfg)
    assert full_metrics == pytest.approx(window_metrics, abs=1e-6)
    window_samples = window_samples[::-1]
    for name in ("advantages", "returns", "adv_mask"):
        for a, b in zip(_per_turn(full_samples, name), _per_turn(window_samples, name), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for sample in window_samples:  # nothing outside the turn's own response
        assert (sample.extra["advantages"][sample.loss_mask == 0] == 0).all()
        assert (sample.extra["adv_mask"][sample.loss_mask == 0] == 0).all()


def test_a_mini_batch_takes_every_turn_sample_of_its_trajectories(tiny_text):
    from vagen.batch_plan import plan_epoch
    from vagen.episode import ChatEncoder

    encoder = ChatEncoder(tiny_text[2])
    fmt = load_config("sokoban_text").env.prompt_format
    script = {k: [format_response(fmt, "Left"), format_response(fmt, "Up"), format_response(fmt, "Right")]
              for k in range(4)}
    cfg, episodes, _ = _scripted(encoder, "sokoban_text", ["rollout.context=window", "train.mini_batch_size=2",
                                                           "train.micro_batch_size=4"], script)
    samples = _annotated(episodes, encoder)
    for sample in samples:
        sample.extra["adv_mask"] = sample.sampled_mask
    minis = plan_epoch(samples, cfg, 1, torch.Generator().manual_seed(0), shuffle=True)
    assert len(minis) == 2  # 4 trajectories, 2 per optimizer step, whatever their 12 turn samples
    trajectories = []
    for mini in minis:
        indices = [i for micro in mini.micro for i in micro]
        assert [len(micro) for micro in mini.micro] == [4, 2]
        trajectories.append({samples[i].episode_index for i in indices})
        assert len(trajectories[-1]) == 2
        for episode in trajectories[-1]:
            assert sorted(samples[i].turn_index for i in indices if samples[i].episode_index == episode) == [0, 1, 2]
    # the two mini-batches split the 4 trajectories between them, each sample trained once per epoch
    assert trajectories[0].isdisjoint(trajectories[1])
    assert trajectories[0] | trajectories[1] == {s.episode_index for s in samples} and len(samples) == 12
    assert sorted(i for mini in minis for micro in mini.micro for i in micro) == list(range(12))


@pytest.mark.parametrize("overrides, match", [
    (["rollout.context=windowed"], r"rollout.context='windowed' is not a valid choice; did you mean 'window'\? "
                                   r"choices: full, window"),
    (["rollout.context=window", "rollout.window_turns=-1"], r"rollout.window_turns=-1 must be >= 0"),
])
def test_config_errors_say_how_to_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("sokoban_visual", overrides)


FAST = ["train.iterations=1", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
        "rollout.max_turns=3", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false"]


@pytest.mark.parametrize("overrides", [["rollout.context=window", "algo.filter_mode=std", "algo.filter_keep_ratio=0.5"],
                                       ["rollout.context=window", "algo.adv_estimator=gigpo"]],
                         ids=["window+filter", "window+gigpo"])
def test_sokoban_visual_trains_one_iteration(tmp_path, model_cache, distributed, overrides):
    from vagen.train import main

    run_overrides = FAST + [f"train.run_dir={tmp_path}", f"model.builtin_cache={model_cache}", "rollout.window_turns=1",
                            *overrides]
    assert main(["--config", "sokoban_visual", *run_overrides]) == 0
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for key in ("actor/pg_loss", "actor/grad_norm", "update/tokens"):
        assert math.isfinite(record[key]), key
    assert record["rollout/turns"] >= 1
    if "algo.filter_mode=std" in overrides:  # one of the two level groups is kept, with all its turn samples
        assert record["rollout/filter_kept_groups"] == 1, record
