"""The warm starts the repository ships in assets/checkpoints/<name>: Hugging Face folders that load
with the Auto classes, play in the format from the first iteration, and score what their card says."""

import json

import pytest
import torch

from vagen.config import available_configs, checkpoints_dir, load_config, shipped_checkpoints
from vagen.episode import ChatEncoder
from vagen.models import load_policy, resolve_model_path
from vagen.warmstart.demos import distinct_eval_seeds
from vagen.warmstart.sft import CARD_FILE, held_out_metrics

SHIPPED = shipped_checkpoints()
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", CARD_FILE)


def _card(name: str) -> dict:
    return json.loads((checkpoints_dir() / name / CARD_FILE).read_text())


def test_the_configs_start_from_shipped_warm_starts():
    named = {load_config(c).model.path.removeprefix("assets:") for c in available_configs()
             if load_config(c).model.path.startswith("assets:")}
    assert {"sokoban_visual", "frozenlake_visual", "sokoban_text", "frozenlake_text"} & named, named
    assert named <= set(SHIPPED), f"configs name {sorted(named)}, assets/checkpoints holds {SHIPPED}"
    size = sum(f.stat().st_size for f in checkpoints_dir().rglob("*") if f.is_file())
    assert size < 30 * 2**20, f"shipped checkpoints take {size / 2**20:.1f} MB"


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_warm_start_is_complete_and_says_how_it_was_built(name):
    folder = checkpoints_dir() / name
    for file in FILES:
        assert (folder / file).exists(), f"{folder} lacks {file}"
    card = _card(name)
    assert card["build"]["command"].startswith("python -m vagen.sft --config ")
    assert card["build"]["code_revision"] and card["build"]["settings"]["sft"]
    rows = card["evaluation"]["rows"]
    assert card["evaluation"]["levels"] == 256 and {"sft greedy", "teacher", "solver", "random"} <= set(rows)
    for row in rows.values():
        low, high = row["interval_95"]
        assert row["n"] == 256 and low <= row["success"] <= high


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_warm_start_loads_with_the_auto_classes_and_answers_in_the_format(name):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    folder = resolve_model_path(f"assets:{name}")
    cfg = load_config(_card(name)["config"])
    vision = "vision_config" in AutoConfig.from_pretrained(folder).to_dict()
    plain = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(folder)
    model, processor = load_policy(folder)
    assert (cfg.env.render_mode == "vision") == vision
    for (key, value), (other_key, other) in zip(plain.state_dict().items(), model.state_dict().items()):
        assert key == other_key and torch.equal(value, other), key
    row = held_out_metrics(model, ChatEncoder(processor), cfg, distinct_eval_seeds(cfg.env, 16), do_sample=False)
    assert row["n"] == 16 and row["format_ok"] >= 0.9, row


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_warm_start_scores_what_its_card_says(name):
    card = _card(name)
    cfg = load_config(card["config"])
    model, processor = load_policy(resolve_model_path(f"assets:{name}"))
    seeds = distinct_eval_seeds(cfg.env, card["evaluation"]["levels"])
    row = held_out_metrics(model, ChatEncoder(processor), cfg, seeds, do_sample=False)
    low, high = card["evaluation"]["rows"]["sft greedy"]["interval_95"]
    assert low <= row["success"] <= high, (row, card["evaluation"]["rows"]["sft greedy"])
