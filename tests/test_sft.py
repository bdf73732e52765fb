import json

import pytest
import torch

from vagen.config import load_config
from vagen.episode import ChatEncoder
from vagen.models import load_policy, resolve_model_path
from vagen.warmstart import cli, sft
from vagen.warmstart.demos import distinct_eval_seeds

SMALL = ["sft.demos=48", "sft.val_demos=8", "sft.exclude_eval=16", "sft.batch_size=8", "sft.micro_batch_size=8",
         "sft.lr=3e-3", "sft.warmup_steps=0", "sft.check_every=10", "sft.min_steps=0", "rollout.max_turns=2",
         "sft.cell_questions=0"]

def patch_loop(monkeypatch, name: str, value) -> None:
    """Replace `name` of the supervised loop (`vagen.warmstart.loop`) where the build and its stages look it up."""
    from vagen.warmstart import loop

    monkeypatch.setattr(loop, name, value)
    if hasattr(sft, name):
        monkeypatch.setattr(sft, name, value)



def test_sft_on_demonstrations_teaches_the_format(model_cache, distributed):
    torch.manual_seed(0)
    cfg = load_config("frozenlake_text", SMALL + ["sft.max_steps=80", "sft.patience=100"])
    model, processor = load_policy(resolve_model_path(sft.base_path_of(cfg), model_cache))
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
    model, processor = load_policy(resolve_model_path("builtin:tiny-text", model_cache))
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


def test_a_build_writes_the_checkpoint_what_built_it_and_a_card(tmp_path, model_cache, capsys):
    out = tmp_path / "ws"
    overrides = SMALL + ["sft.max_steps=4", f"model.builtin_cache={model_cache}", "train.run_dir=" + str(tmp_path)]
    assert cli.main(["--config", "frozenlake_text", "--out", str(out), "--eval", "8", *overrides]) == 0
    printed = capsys.readouterr().out
    assert f"train from it: deepspeed vagen/train.py --config frozenlake_text model.path={out}" in printed
    state = json.loads((out / sft.STATE_FILE).read_text())
    assert state["command"].startswith("python -m vagen.sft --config frozenlake_text --out ")
    assert state["settings"]["sft"]["max_steps"] == 4 and state["settings"]["env"]["name"] == "frozenlake"
    assert state["base"].startswith(model_cache) and "tiny-text" in state["base"] and state["sft/step"] == 4
    assert len(state["code_revision"]) >= 40 or state["code_revision"] == "unknown"
    card = json.loads((out / sft.CARD_FILE).read_text())
    assert card["config"] == "frozenlake_text" and card["build"]["command"] == state["command"]
    rows = card["evaluation"]["rows"]
    assert card["evaluation"]["levels"] == 8 and {"sft greedy", "sft sampled", "teacher", "solver", "random"} <= set(rows)
    for row in rows.values():
        low, high = row["interval_95"]
        assert row["n"] == 8 and low <= row["success"] <= high and row["successes"] == round(row["success"] * 8)
    assert rows["solver"]["success"] == 1.0  # FrozenLake levels are solvable within the turn budget
    model, _ = load_policy(out)  # Hugging Face format
    assert model.config.get_text_config().vocab_size > 0


def test_a_build_under_zero3_is_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "ws"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--config", "frozenlake_text", "--out", str(out), "train.deepspeed_config=deepspeed/zero3_fp32.json"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "train.deepspeed_config=deepspeed/zero3_fp32.json partitions the parameters (ZeRO stage 3)" in err
    assert "deepspeed/zero2_bf16.json" in err
    assert not out.exists()


def test_evaluating_an_existing_warm_start_rewrites_only_its_card(tmp_path, tiny_text, capsys):
    import shutil

    path, _, _ = tiny_text
    checkpoint = tmp_path / "copy"
    shutil.copytree(path, checkpoint)
    weights = (checkpoint / "model.safetensors").read_bytes()
    assert cli.main(["--config", "frozenlake_text", "--evaluate", str(checkpoint), "--eval", "4",
                     "rollout.max_turns=1", "rollout.max_new_tokens=8"]) == 0
    card = json.loads((checkpoint / sft.CARD_FILE).read_text())
    assert card["evaluation"]["rows"]["sft greedy"]["n"] == 4 and card["build"]["command"] is None  # not built here
    assert (checkpoint / "model.safetensors").read_bytes() == weights
    assert f"card written to {checkpoint / sft.CARD_FILE}" in capsys.readouterr().out


def test_the_base_is_a_built_in_never_the_checkpoint_training_starts_from():
    assert sft.base_path_of(load_config("sokoban_visual", ["model.path=builtin:tiny-vl"])) == "builtin:tiny-vl"
    assert sft.base_path_of(load_config("sokoban_text")) == "builtin:tiny-text"
    assert sft.base_path_of(load_config("sokoban_text", ["sft.base=/somewhere"])) == "/somewhere"


def test_model_warm_start_is_refused_with_the_way_to_build_one():
    from vagen.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.warm_start in command-line override was removed; .*python -m vagen.sft "
                                          r"--config CONFIG --out DIR.*model.path=DIR"):
        load_config("frozenlake_text", ["model.warm_start=teacher"])


def test_the_demonstration_code_hash_follows_the_env_module(monkeypatch):
    import inspect

    frozenlake, sokoban = sft.demonstration_code("frozenlake"), sft.demonstration_code("sokoban")
    real = inspect.getsource
    edited = lambda obj: real(obj) + ("# edited" if obj.__name__ == "envs_visual.frozenlake" else "")  # noqa: E731
    monkeypatch.setattr(inspect, "getsource", edited)  # e.g. a changed teacher_action
    assert sft.demonstration_code("frozenlake") != frozenlake
    assert sft.demonstration_code("sokoban") == sokoban


def test_responses_longer_than_generation_allows_are_refused(tiny_text):
    _, model, processor = tiny_text
    cfg = load_config("frozenlake_text", ["rollout.max_new_tokens=8"])
    train, _ = sft.demo_sets(load_config("frozenlake_text", SMALL), "teacher")
    with pytest.raises(ValueError, match="raise rollout.max_new_tokens"):
        sft.demo_samples(train[:2], cfg, ChatEncoder(processor), model)


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
    patch_loop(monkeypatch, "nll_loss", lambda engine, batch, device: torch.tensor(0.5))
    patch_loop(monkeypatch, "answer_accuracy",
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
    patch_loop(monkeypatch, "answer_accuracy", lambda *a, **k: {"sft/val_answer_accuracy": 0.55})
    said = []
    stats = sft.frame_dependence(None, [_sample(0, [[1, 4, 4]])], 0.56, 0, "cpu", 8, log=said.append)
    assert stats == {"sft/val_answer_accuracy": 0.56, "sft/val_answer_accuracy_other_frames": 0.55}
    assert len(said) == 1 and "does not read the frame" in said[0] and "model.builtin_seed" in said[0]
    said.clear()
    sft.frame_dependence(None, [_sample(0, [[1, 4, 4]])], 0.80, 0, "cpu", 8, log=said.append)
    assert said == []


def test_path_reasoning_is_checked_on_every_generated_token(monkeypatch):
    from vagen.models import generated_positions
    from vagen.trajectory import Sample

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

    patch_loop(monkeypatch, "masked_logits", right_but_the_reasoning)
    model = torch.nn.Linear(1, 1)
    assert sft.answer_accuracy(model, [sample], 0, "cpu")["sft/val_answer_accuracy"] == 1.0
    assert sft.answer_accuracy(model, [sample], 0, "cpu", whole_response=True)["sft/val_response_accuracy"] == 0.0
    # the frame check then compares whole responses with own and other frames
    own, other = _sample(0, [[1, 4, 4]]), _sample(1, [[1, 4, 4]])

    def by_frames(model, samples, pad_id, device, micro_batch_size, whole_response):
        assert whole_response
        return {"sft/val_response_accuracy": 0.9 if float(samples[0].pixel_values[0, 0]) == 0.0 else 0.5}

    patch_loop(monkeypatch, "answer_accuracy", by_frames)
    said = []
    stats = sft.frame_dependence(None, [own, other], 1.0, 0, "cpu", 8, log=said.append, whole_response=True)
    assert stats == {"sft/val_response_accuracy": 0.9, "sft/val_response_accuracy_other_frames": 0.5} and not said


def test_a_named_stage_shows_its_steps_out_of_the_total(monkeypatch, capsys):
    import types

    cfg = load_config("frozenlake_text", SMALL + ["sft.max_steps=30", "sft.min_steps=0", "sft.patience=1"])
    patch_loop(monkeypatch, "nll_loss", lambda engine, batch, device: torch.tensor(0.5))
    patch_loop(monkeypatch, "answer_accuracy", lambda *a, **k: {"sft/val_answer_accuracy": 0.5, "sft/val_nll": 0.1})
    monkeypatch.setattr("vagen.trajectory.collate", lambda group, pad_id: group)
    engine = types.SimpleNamespace(module=torch.nn.Linear(1, 1), backward=lambda loss: None, step=lambda: None)
    samples = [types.SimpleNamespace(length=n) for n in range(10, 30)]
    stats = sft.train_sft(engine, samples, [], cfg, 0, "cpu", desc="sft: demonstrations")
    shown = capsys.readouterr()
    assert stats["sft/step"] == 20  # stopped early: the bar ends where training did, out of the most it could run
    assert "sft: demonstrations" in shown.err and "20/30" in shown.err and "accuracy=0.500" in shown.err
    assert "sft/val_answer_accuracy=0.5" in shown.out  # the check lines still print
