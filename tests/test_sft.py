import json

import pytest
import torch

from vagen import sft
from vagen.config import load_config
from vagen.demos import distinct_eval_seeds
from vagen.models import load_policy, resolve_model_path
from vagen.rollout import ChatEncoder

SMALL = ["sft.demos=48", "sft.val_demos=8", "sft.exclude_eval=16", "sft.batch_size=8", "sft.micro_batch_size=8",
         "sft.lr=3e-3", "sft.warmup_steps=0", "sft.check_every=10", "sft.min_steps=0", "rollout.max_turns=2",
         "sft.cell_questions=0"]


def test_sft_on_demonstrations_teaches_the_format(model_cache, distributed):
    torch.manual_seed(0)
    cfg = load_config("frozenlake_text", SMALL + ["sft.max_steps=80", "sft.patience=100"])
    model, processor = load_policy(resolve_model_path(cfg.model.path, model_cache))
    encoder = ChatEncoder(processor)
    seeds = distinct_eval_seeds(cfg.env, 16)
    before = sft.held_out_metrics(model, encoder, cfg, seeds, do_sample=False)
    assert before["format_ok"] < 0.1
    train, val = sft.demo_sets(cfg, "teacher")
    engine = sft.sft_engine(model, cfg, distributed)
    stats = sft.train_sft(engine, sft.demo_samples(train, cfg, encoder, model),
                          sft.demo_samples(val, cfg, encoder, model), cfg, encoder.pad_id, distributed.device,
                          log=lambda _: None)
    assert stats["sft/step"] == 80 and stats["sft/train_nll"] < 1.0
    after = sft.held_out_metrics(engine.module, encoder, cfg, seeds, do_sample=False)
    assert after["format_ok"] > 0.9, (before, after)
    assert after["n"] == 16


def test_sampled_held_out_evaluation_is_seeded_and_leaves_the_callers_random_state(model_cache, played_tokens):
    cfg = load_config("frozenlake_text", ["rollout.max_turns=2", "rollout.max_new_tokens=16"])
    model, processor = load_policy(resolve_model_path(cfg.model.path, model_cache))
    encoder = ChatEncoder(processor)
    seeds = distinct_eval_seeds(cfg.env, 8)
    torch.manual_seed(123)
    sft.held_out_metrics(model, encoder, cfg, seeds, do_sample=True)
    after_call = torch.rand(3)
    torch.manual_seed(456)  # another state before the call: the same episodes
    sft.held_out_metrics(model, encoder, cfg, seeds, do_sample=True)
    sft.held_out_metrics(model, encoder, cfg, seeds, do_sample=True, sample_seed=1)
    assert played_tokens[0] == played_tokens[1] != played_tokens[2]
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after_call)  # the caller's stream goes on as if nothing had drawn


def test_warm_start_none_is_the_base_checkpoint(tmp_path, distributed):
    cfg = load_config("frozenlake_text", ["model.warm_start=none"])
    assert sft.warm_start_checkpoint(cfg, tmp_path, distributed) == tmp_path


@pytest.mark.parametrize("config", ["frozenlake_text", "frozenlake_visual"])
def test_warm_start_is_built_once_and_cached(config, tmp_path, model_cache, distributed):
    overrides = SMALL + ["sft.max_steps=2", "model.warm_start=teacher", f"model.builtin_cache={tmp_path}"]
    cfg = load_config(config, overrides)
    base = resolve_model_path(cfg.model.path, model_cache)
    path = sft.warm_start_checkpoint(cfg, base, distributed)
    assert path != base and (path / "config.json").exists()
    state = json.loads((path / sft.STATE_FILE).read_text())
    assert state["policy"] == "teacher" and state["sft/step"] == 2
    # from frames, the build also measures how much its answers depend on the frame
    assert ("sft/val_answer_accuracy_other_frames" in state) == (config == "frozenlake_visual")
    stamp = (path / sft.STATE_FILE).stat().st_mtime_ns
    assert sft.warm_start_checkpoint(cfg, base, distributed) == path
    assert (path / sft.STATE_FILE).stat().st_mtime_ns == stamp  # loaded, not rebuilt
    model, _ = load_policy(path)
    assert model.config.get_text_config().vocab_size == load_policy(base)[0].config.get_text_config().vocab_size


def test_cache_key_follows_what_the_warm_start_depends_on(tmp_path):
    cfg = load_config("frozenlake_visual", ["model.warm_start=teacher"])
    key = sft.cache_key(cfg, tmp_path, "teacher")
    assert sft.cache_key(load_config("frozenlake_visual"), tmp_path, "teacher") == key
    for change in ["env.params.size=5", "env.prompt_format=no_think", "env.render_mode=text sft.cell_questions=0",
                   "sft.lr=1e-4", "env.max_actions_per_turn=2", "rollout.max_turns=4"]:
        assert sft.cache_key(load_config("frozenlake_visual", change.split()), tmp_path, "teacher") != key, change
    assert sft.cache_key(cfg, tmp_path, "solver") != key
    assert sft.cache_key(cfg, tmp_path / "other", "teacher") != key


def test_cache_key_follows_the_demonstration_code(tmp_path, monkeypatch):
    import inspect

    cfg = load_config("frozenlake_visual")
    key, sokoban = sft.cache_key(cfg, tmp_path, "teacher"), sft.demonstration_code("sokoban")
    real = inspect.getsource
    edited = lambda obj: real(obj) + ("# edited" if obj.__name__ == "envs_visual.frozenlake" else "")  # noqa: E731
    monkeypatch.setattr(inspect, "getsource", edited)  # e.g. a changed teacher_action
    assert sft.cache_key(cfg, tmp_path, "teacher") != key
    assert sft.demonstration_code("sokoban") == sokoban


def test_responses_longer_than_generation_allows_are_refused(tiny_text):
    _, model, processor = tiny_text
    cfg = load_config("frozenlake_text", ["rollout.max_new_tokens=8"])
    train, _ = sft.demo_sets(load_config("frozenlake_text", SMALL), "teacher")
    with pytest.raises(ValueError, match="raise rollout.max_new_tokens"):
        sft.demo_samples(train[:2], cfg, ChatEncoder(processor), model)


def test_unknown_warm_start_names_the_choices():
    from vagen.config import ConfigError

    with pytest.raises(ConfigError, match="none, teacher, solver"):
        load_config("frozenlake_text", ["model.warm_start=teachr"])


def test_length_grouped_batches_draw_uniformly_and_pad_less():
    lengths = [10, 50, 20, 40, 30, 60, 15, 45] * 8
    draws = torch.randint(len(lengths), (4 * 6,), generator=torch.Generator().manual_seed(3)).tolist()
    batches = sft.length_grouped_batches(lengths, 6, 4, torch.Generator().manual_seed(3))
    assert sorted(i for batch in batches for i in batch) == sorted(draws)  # the same uniform draws, regrouped
    assert all(len(batch) == 6 for batch in batches)
    spans = sorted((min(lengths[i] for i in batch), max(lengths[i] for i in batch)) for batch in batches)
    assert all(high <= next_low for (_, high), (next_low, _) in zip(spans, spans[1:]))  # no overlap
    plain = sft.length_grouped_batches(lengths, 6, 1, torch.Generator().manual_seed(3))
    assert [sorted(batch) for batch in plain] == [sorted(draws[:6])]


def test_sft_batch_sizes_must_be_positive():
    from vagen.config import ConfigError

    with pytest.raises(ConfigError, match="sft.length_window=0 must be >= 1"):
        load_config("frozenlake_visual", ["sft.length_window=0"])


@pytest.mark.parametrize("accuracy, min_steps, patience, stop", [(1.0, 40, 1, 40), (1.0, 0, 1, 10), (0.5, 0, 2, 30),
                                                                  (0.5, 40, 1, 40)])
def test_early_stopping_waits_for_min_steps(monkeypatch, accuracy, min_steps, patience, stop):
    # checks every 10 steps; a perfect or flat held-out accuracy ends training only from sft.min_steps on
    import types

    cfg = load_config("frozenlake_text", SMALL + ["sft.max_steps=100", f"sft.min_steps={min_steps}",
                                                  f"sft.patience={patience}"])
    monkeypatch.setattr(sft, "nll_loss", lambda engine, batch, device: torch.tensor(0.5))
    monkeypatch.setattr(sft, "answer_accuracy",
                        lambda *a, **k: {"sft/val_answer_accuracy": accuracy, "sft/val_nll": 0.1})
    monkeypatch.setattr("vagen.trajectory.collate", lambda group, pad_id: group)
    engine = types.SimpleNamespace(module=torch.nn.Linear(1, 1), backward=lambda loss: None, step=lambda: None)
    samples = [types.SimpleNamespace(length=n) for n in range(10, 30)]
    stats = sft.train_sft(engine, samples, [], cfg, 0, "cpu", log=lambda _: None)
    assert stats["sft/step"] == stop


def _sample(level: int, grids: list[list[int]]):
    from vagen.trajectory import Sample

    zeros = torch.zeros(3)
    return Sample(torch.tensor([level, 1, 2]), torch.arange(3), zeros, zeros, zeros, zeros, zeros,
                  pixel_values=torch.full((len(grids), 2), float(level)), image_grid_thw=torch.tensor(grids),
                  group_id=level, score=0.0, seed=level)


def test_other_frames_come_from_another_level_with_the_same_image_grids():
    a, b, c = (_sample(k, [[1, 4, 4], [1, 4, 4]]) for k in (0, 1, 2))
    lone = _sample(3, [[1, 4, 4]])  # no other sample has one frame: it keeps its own
    out = sft.with_other_frames([a, lone, b, c])
    assert [float(s.pixel_values[0, 0]) for s in out] == [1.0, 3.0, 2.0, 0.0]
    assert [int(s.input_ids[0]) for s in out] == [0, 3, 1, 2]  # text and answers stay
    assert float(a.pixel_values[0, 0]) == 0.0  # the originals are untouched


def test_a_warm_start_that_does_not_read_the_frame_is_reported(monkeypatch):
    monkeypatch.setattr(sft, "answer_accuracy", lambda *a, **k: {"sft/val_answer_accuracy": 0.55})
    said = []
    stats = sft.frame_dependence(None, [_sample(0, [[1, 4, 4]])], 0.56, 0, "cpu", 8, log=said.append)
    assert stats == {"sft/val_answer_accuracy": 0.56, "sft/val_answer_accuracy_other_frames": 0.55}
    assert len(said) == 1 and "does not read the frame" in said[0] and "model.builtin_seed" in said[0]
    said.clear()
    sft.frame_dependence(None, [_sample(0, [[1, 4, 4]])], 0.80, 0, "cpu", 8, log=said.append)
    assert said == []


def test_path_reasoning_is_checked_on_every_generated_token(monkeypatch):
    from vagen.trajectory import Sample, generated_positions

    zeros = torch.zeros(5)
    sample = Sample(torch.tensor([5, 6, 7, 8, 9]), torch.arange(5), loss_mask=torch.tensor([0, 1, 1, 1, 1.0]),
                    turn_end_mask=torch.tensor([0, 0, 0, 0, 1.0]), answer_mask=torch.tensor([0, 0, 0, 1, 1.0]),
                    think_mask=zeros, token_rewards=zeros, pixel_values=None, image_grid_thw=None, group_id=0,
                    score=0.0, seed=0)

    def right_but_the_reasoning(model, batch, device):  # argmax is the target except at the first think token
        wanted = generated_positions(batch["loss_mask"])
        targets = batch["input_ids"][:, wanted + 1]
        logits = torch.nn.functional.one_hot(targets, 10).float()
        logits[:, 0] = torch.nn.functional.one_hot(torch.tensor(0), 10).float()
        return logits, targets, batch["loss_mask"][:, wanted + 1]

    monkeypatch.setattr(sft, "masked_logits", right_but_the_reasoning)
    model = torch.nn.Linear(1, 1)
    assert sft.answer_accuracy(model, [sample], 0, "cpu")["sft/val_answer_accuracy"] == 1.0
    assert sft.answer_accuracy(model, [sample], 0, "cpu", whole_response=True)["sft/val_response_accuracy"] == 0.0
    # the frame check then compares whole responses with own and other frames
    own, other = _sample(0, [[1, 4, 4]]), _sample(1, [[1, 4, 4]])

    def by_frames(model, samples, pad_id, device, micro_batch_size, whole_response):
        assert whole_response
        return {"sft/val_response_accuracy": 0.9 if float(samples[0].pixel_values[0, 0]) == 0.0 else 0.5}

    monkeypatch.setattr(sft, "answer_accuracy", by_frames)
    said = []
    stats = sft.frame_dependence(None, [own, other], 1.0, 0, "cpu", 8, log=said.append, whole_response=True)
    assert stats == {"sft/val_response_accuracy": 0.9, "sft/val_response_accuracy_other_frames": 0.5} and not said
