"""Model families: each known family is chosen by its checkpoint's model_type and runs every path of the trainer
exactly on its built-in tiny model (Qwen3-VL and Qwen3.5 here; Qwen2.5-VL and the text model are the built-ins
the rest of the suite runs on); an unknown family is refused before any work."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_generate import GenerateDecoder
from PIL import Image
from test_trajectory import append_turn, assert_equal_gradients

import vagen.train
from vagen.config import load_config
from vagen.episode import ChatEncoder, Episode
from vagen.models import (
    FAMILIES,
    family_of,
    forward_shared_prefix,
    generated_positions,
    load_policy,
    lora_targets,
    resolve_model_path,
    select_rows,
    target_names,
)
from vagen.rollout import rollout
from vagen.trajectory import collate, episode_to_sample, model_inputs
from vagen.update import token_logprobs

NEW = ["builtin:tiny-qwen3-vl", "builtin:tiny-qwen3.5"]


@pytest.fixture(scope="session")
def tiny(model_cache):
    """name -> (path, model, processor) of the new families' built-ins, built once per session."""
    loaded = {}

    def get(name):
        if name not in loaded:
            path = resolve_model_path(name, model_cache, seed=0)
            loaded[name] = (path, *load_policy(path))
        return loaded[name]

    return get


def test_an_unknown_model_type_is_refused_before_any_work_with_the_known_ones_listed(tmp_path):
    from vagen.decoding_vllm import architecture_override

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    known = r"known: qwen2, qwen2_5_vl, qwen2_vl, qwen3, qwen3_5, qwen3_vl"
    with pytest.raises(ValueError, match=rf"model_type 'llama' is not a model family vagen knows; {known}"):
        load_policy(tmp_path)  # no weights here: refused on config.json alone
    with pytest.raises(ValueError, match=known):
        architecture_override(tmp_path)


@pytest.mark.parametrize("name", NEW)
def test_each_built_in_is_a_real_model_of_its_family(name, tiny):
    path, model, processor = tiny(name)
    family = family_of(path)
    assert family.builtin == name and family_of(model) is family
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    assert family.architecture(model_type) == type(model).__name__  # the name vLLM is given
    assert [f.name for f in FAMILIES] == ["qwen2_vl", "qwen3_vl", "qwen3_5", "qwen_text"]
    # 16-pixel patches merged 2x2: a 56x56 frame resizes to 64x64 and is 2x2 = 4 tokens
    encoder = ChatEncoder(processor)
    assert encoder.resize(Image.new("RGB", (56, 56))).size == (64, 64)
    _, grids = encoder.images_to_inputs([Image.new("RGB", (64, 64))])
    assert grids[0].tolist() == [1, 4, 4] and encoder.merge == 2


def _frame(seed):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8))


def _episode(encoder, responses, seed):
    """A 3-turn episode with a frame each turn, built the way the rollout builds it."""
    episode = Episode("sokoban", seed=seed, group_id=0, system_prompt="Push the box onto the target.")
    for turn, response in enumerate(responses):
        append_turn(encoder, episode, _frame(seed + turn), response)
    return episode


def _batch(model, processor):
    encoder = ChatEncoder(processor)
    episodes = [_episode(encoder, ["<answer>Left</answer>", "<think>box</think><answer>Up</answer>",
                                   "<answer>Down, Down</answer>"], seed=0),
                _episode(encoder, ["<answer>Right, Up</answer>", "<answer>Up</answer>", "<answer>Left</answer>"],
                         seed=10)]
    samples = [episode_to_sample(ep, encoder, model) for ep in episodes]
    return episodes, collate(samples, encoder.pad_id)


@pytest.mark.parametrize("name", NEW)
def test_the_trainers_logprobs_of_a_three_turn_episode_equal_a_plain_forward(name, tiny):
    """vagen's positions, batching and shared prefix against the model's own forward over each whole sequence,
    where the model derives the positions itself."""
    _, model, processor = tiny(name)
    episodes, batch = _batch(model, processor)
    image_pad = ChatEncoder(processor).image_pad_id
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch, 1.0, False)
        for row, episode in enumerate(episodes):
            ids = torch.tensor([episode.input_ids])
            logits = model(input_ids=ids, pixel_values=torch.cat(episode.pixel_values),
                           image_grid_thw=torch.stack(episode.image_grid_thw),
                           mm_token_type_ids=(ids == image_pad).int()).logits[0]
            plain = logits[:-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            mask = batch["loss_mask"][row, 1 : ids.shape[1]].bool()
            assert mask.sum() == sum(t.response_length for t in episode.turns)
            assert torch.allclose(trainer[row, 1 : ids.shape[1]][mask], plain[mask], atol=1e-5)


def _play(model, processor, reuse, decoder=None):
    cfg = load_config("frozenlake_visual", ["rollout.max_new_tokens=8", "rollout.max_turns=3",
                                            f"rollout.reuse_cache={reuse}", "rollout.temperature=1.0"])
    torch.manual_seed(0)
    episodes, _ = rollout(model, ChatEncoder(processor), cfg, [3], 3, decoder=decoder)
    return episodes


@pytest.mark.parametrize("name", NEW)
def test_the_hf_decoder_gives_the_episodes_of_generate_over_the_whole_history(name, tiny):
    """Qwen3-VL keeps the cache across turns; Qwen3.5's padding is not inert, so its turns start from an empty
    cache (`rollout.reuse_cache` cannot turn it on): both draw what `generate` over each whole history draws."""
    from vagen.decoding_hf import HFDecoder

    _, model, processor = tiny(name)
    assert HFDecoder(model, ChatEncoder(processor)).keep_cache == (name == "builtin:tiny-qwen3-vl")
    whole = _play(model, processor, True, decoder=GenerateDecoder(model, ChatEncoder(processor)))
    assert all(len(ep.turns) == 3 for ep in whole)
    for reuse in (True, False) if name == "builtin:tiny-qwen3-vl" else (True,):
        played = _play(model, processor, reuse)
        assert [ep.input_ids for ep in played] == [ep.input_ids for ep in whole]


@pytest.mark.parametrize("name, inert", [("builtin:tiny-qwen3-vl", True), ("builtin:tiny-qwen3.5", False)])
def test_padding_fed_after_a_cache_is_inert_only_where_the_family_says(name, inert, tiny):
    """A turn's tokens fed after a cached history, left-padded under attention mask 0, against the same tokens
    unpadded: equal for attention caches; for Qwen3.5 the pad moves the linear layers' convolution window
    and recurrent state (the error a cache kept across turns would make)."""
    _, model, processor = tiny(name)
    pad = ChatEncoder(processor).pad_id
    history, turn = torch.arange(100, 140)[None], torch.arange(200, 212)[None]

    def last_logits(padding):
        with torch.no_grad():
            first = model(input_ids=history, position_ids=torch.arange(40).expand(3, 1, -1), use_cache=True)
            ids = torch.cat([torch.full((1, padding), pad), turn], 1)
            mask = torch.cat([torch.ones(1, 40), torch.zeros(1, padding), torch.ones(1, 12)], 1).long()
            positions = torch.cat([torch.zeros(padding, dtype=torch.long), torch.arange(40, 52)]).expand(3, 1, -1)
            return model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=first.cache,
                         logits_to_keep=1).logits[0, -1]

    gap = (last_logits(3) - last_logits(0)).abs().max().item()
    assert family_of(model).inert_padding == inert
    assert (gap < 1e-5) if inert else (gap > 1e-4), gap


@pytest.mark.parametrize("name", NEW)
def test_the_shared_prefix_forward_equals_the_plain_one_with_and_without_gradients(name, tiny):
    """Qwen3.5's linear layers update their cache in place, so under gradients its batch runs whole (one call)."""
    _, model, processor = tiny(name)
    _, batch = _batch(model, processor)
    inputs = model_inputs(batch)
    positions = generated_positions(batch["loss_mask"])
    generated = batch["loss_mask"][:, positions + 1].bool()
    plain = model(**inputs, use_cache=False).logits[:, positions]
    for grad in (False, True):
        calls = []
        hook = model.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        try:
            with torch.set_grad_enabled(grad):
                shared = forward_shared_prefix(model, inputs, logits_to_keep=positions)
        finally:
            hook.remove()
        assert len(calls) == (1 if grad and name == "builtin:tiny-qwen3.5" else 2), (grad, calls)
        assert torch.allclose(shared[generated], plain[generated], atol=1e-5)
    assert_equal_gradients(model, shared[generated], plain[generated])


def test_rows_of_a_hybrid_cache_are_selected_and_repeated_in_every_layer_type(tiny):
    _, model, _ = tiny("builtin:tiny-qwen3.5")
    with torch.no_grad():
        cache = model(input_ids=torch.arange(100, 130).view(3, 10), use_cache=True).cache
    linear, full = cache.layers[0], cache.layers[1]
    before = linear.recurrent_states[0].clone(), full.keys.clone()
    select_rows(cache, torch.tensor([2, 0, 0]))
    assert torch.equal(linear.recurrent_states[0], before[0][[2, 0, 0]])
    assert torch.equal(full.keys, before[1][[2, 0, 0]])


def test_qwen3_5s_default_lora_targets_cover_its_linear_attention_layers(tiny):
    _, model, _ = tiny("builtin:tiny-qwen3.5")
    cfg = load_config("sokoban_visual", ["model.lora_rank=8"]).model
    targets = {n.split("language_model.")[1] for n in lora_targets(model, target_names(cfg, model))}
    assert {f"layers.0.linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                                                    "out_proj")} <= targets
    assert {f"layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} <= targets
    assert len(targets) == 5 + 4 + 2 * 3  # the MLP's three projections in both layers
    chosen = load_config("sokoban_visual", ["model.lora_rank=8", "model.lora_target_modules=[q_proj]"]).model
    assert target_names(chosen, model) == ["q_proj"]  # a list the user sets is kept as set


@pytest.mark.parametrize("name", NEW)
def test_two_iterations_train_with_the_critic_and_lora(name, tmp_path, distributed, model_cache):
    overrides = [f"model.path={name}", f"model.builtin_cache={model_cache}", "model.lora_rank=8",
                 "model.freeze_vision=false", "train.iterations=2", "rollout.env_groups=1", "rollout.group_size=2",
                 "rollout.max_new_tokens=6", "rollout.max_turns=2", "train.mini_batch_size=2",
                 "train.micro_batch_size=2", "log.progress=false", "log.tensorboard=false", "algo.kl_coef=0.1",
                 f"train.run_dir={tmp_path}", "train.run_name=run", "train.save_every=0"]
    assert vagen.train.main(["--config", "sokoban_visual", *overrides]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    assert all(np.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 and np.isfinite(r["critic/vf_loss"])
               for r in records), records


@pytest.mark.slow
def test_two_iterations_train_under_zero3_on_two_ranks(tmp_path, model_cache):
    from test_zero3 import _launch

    _launch(2, tmp_path, model_cache, Path(__file__).parent / "families_zero3_worker.py", timeout=900)
    for name in NEW:
        records = [json.loads(line) for line in (tmp_path / name.split(":")[1] / "metrics.jsonl").read_text().splitlines()]
        assert [r["iteration"] for r in records] == [0, 1], name
        assert all(np.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in records), (name, records)


def test_no_function_of_the_model_family_seam_is_over_80_lines():
    import ast

    package = Path(__file__).resolve().parent.parent / "vagen" / "models"
    long = [(f.name, n.name, n.end_lineno - n.lineno + 1) for f in sorted(package.glob("*.py"))
            for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 80]
    assert long == [], long
