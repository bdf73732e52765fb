"""The on-policy stage of a warm start: the model's own episodes, each later turn answered by the teacher."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vagen.config import ConfigError, load_config
from vagen.episode import ChatEncoder
from vagen.models import load_policy
from vagen.rollout import make_env
from vagen.warmstart import cli, sft
from vagen.warmstart.demos import Demo, demo_episode, demo_response

SOKOBAN_TEXT = "assets/checkpoints/sokoban_text"
# what the model said: a valid move, then a response that does not parse, then another move
MODEL_SAID = ["<think>go up</think><answer>Up</answer>", "<think>boxox", "<answer>Left</answer>"]


def played(cfg, encoder, seed: int):
    """An episode as `rollout` returns it, of a model that said MODEL_SAID on level `seed`."""
    return demo_episode(Demo(seed, "", list(MODEL_SAID), [None] * 3), make_env(cfg.env), encoder)


@pytest.mark.parametrize("name", ["sokoban_text", "sokoban_visual"])
def test_each_later_turn_is_the_teachers_answer_after_the_models_own_history(name):
    cfg = load_config(name)
    model, processor = load_policy(f"assets/checkpoints/{name}")
    encoder = ChatEncoder(processor)
    seed = 3
    episode = played(cfg, encoder, seed)
    assert len(episode.turns) == 3 and not episode.turns[1].info["format_ok"]
    samples = sft.relabelled_samples([episode], cfg, encoder, model)
    assert len(samples) == 2  # turns 2 and 3; the first turn is the demonstrations' own
    env = make_env(cfg.env, {"render_mode": "text"})
    env.reset(seed=seed)
    for t, sample in zip((1, 2), samples):
        env.step(MODEL_SAID[t - 1])
        teacher = demo_response(env, "teacher", np.random.default_rng([seed, 13, t]), kind=cfg.sft.reasoning)
        start = episode.turns[t].span[0]
        ids = sample.input_ids.tolist()
        # the context is the model's episode up to this turn, token for token
        assert ids[:start] == episode.input_ids[:start]
        # the learned tokens are exactly the teacher's response and the closing <|im_end|>, and nothing before
        learned = [i for i, m in zip(ids, sample.loss_mask.tolist()) if m]
        assert learned == ids[start:] and processor.decode(learned[:-1]) == teacher
        assert learned[-1] == encoder.im_end_id
        assert sample.turn_end_mask.sum() == 1 and sample.turn_end_mask[-1] == 1
        assert sample.answer_mask[:start].sum() == 0 and sample.answer_mask.sum() > 0
        if name == "sokoban_visual":  # the frames of turns 1..t+1, the model's own
            assert sample.image_grid_thw.shape[0] == t + 1
            assert torch.equal(sample.pixel_values, torch.cat(episode.pixel_values[: t + 1]))
        else:
            assert sample.pixel_values is None


def test_an_episode_of_one_turn_gives_nothing_to_relabel():
    cfg = load_config("sokoban_text")
    model, processor = load_policy(SOKOBAN_TEXT)
    encoder = ChatEncoder(processor)
    episode = played(cfg, encoder, 3)
    episode.turns = episode.turns[:1]
    assert sft.relabelled_samples([episode], cfg, encoder, model) == []


def test_an_on_policy_build_continues_a_warm_start_with_that_stage_alone(tmp_path, distributed):
    overrides = ["sft.on_policy_levels=16", "sft.on_policy_steps=4", "sft.demos=8", "sft.val_demos=4",
                 "sft.check_every=2", "sft.batch_size=4", "sft.micro_batch_size=4", "sft.exclude_eval=16"]
    cfg = load_config("sokoban_text", overrides)
    said = []
    stats = sft.build_warm_start(cfg, SOKOBAN_TEXT, tmp_path / "ws", "teacher", distributed, log=said.append,
                                 on_policy_only=True)
    played_line = next(line for line in said if line.startswith("on-policy: the model played 20 levels"))
    assert "later turns relabelled by the teacher, mixed into 8 demonstrations" in played_line
    assert sum(line.startswith("on-policy: sft/val_answer_accuracy=") for line in said) == 2  # steps 2 and 4
    assert stats["sft/on_policy_turns"] > 0 and 0.0 <= stats["sft/on_policy_format_ok"] <= 1.0
    state = json.loads((tmp_path / "ws" / sft.STATE_FILE).read_text())
    assert state["stages"] == "on_policy" and state["settings"]["sft"]["on_policy_levels"] == 16
    assert "sft/val_answer_accuracy" in state and "sft/perception_steps" not in state
    # the base's own build is recorded beside it, and its card carries both commands
    base_state = json.loads((Path(SOKOBAN_TEXT) / sft.STATE_FILE).read_text())
    assert state["base_build"]["command"] == base_state["command"] and "settings" not in state["base_build"]
    card = sft.card_head(cfg, tmp_path / "ws", 4)
    assert card["build"]["base_build"] == state["base_build"] and card["build"]["base"] == str(SOKOBAN_TEXT)
    with pytest.raises(ValueError, match="sft.on_policy_levels=0; set sft.on_policy_levels"):
        sft.build_warm_start(load_config("sokoban_text", overrides + ["sft.on_policy_levels=0"]), SOKOBAN_TEXT,
                             tmp_path / "ws2", "teacher", distributed, on_policy_only=True)


def test_the_on_policy_flag_is_refused_without_levels_or_with_cells_only(tmp_path, capsys):
    base = ["--config", "sokoban_text", "--base", SOKOBAN_TEXT, "--out", str(tmp_path / "ws")]
    with pytest.raises(SystemExit):
        cli.main(base + ["--on-policy-only"])
    assert "sft.on_policy_levels=0; add e.g. sft.on_policy_levels=1000" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(base + ["--on-policy-only", "--cells-only", "sft.on_policy_levels=8"])
    assert "choose one" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--config", "sokoban_text", "--on-policy-only", "sft.on_policy_levels=8"])
    assert "name it with --base and the result with --out" in capsys.readouterr().err
    assert not (tmp_path / "ws").exists()
    with pytest.raises(ConfigError, match="sft.on_policy_levels=-1 must be >= 0"):
        load_config("sokoban_text", ["sft.on_policy_levels=-1"])
