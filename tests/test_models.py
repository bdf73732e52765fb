import json

import pytest
import torch

from vagen.models import (
    BUILTINS,
    ValueModel,
    image_position_code,
    is_vision_checkpoint,
    load_policy,
    matmul_patch_embedding,
    resolve_model_path,
)


def test_tiny_vl_is_a_real_qwen2_5_vl_that_loads_through_auto_classes(tiny_vl):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path, model, processor = tiny_vl
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n_params < 5e6, n_params
    reloaded = AutoModelForImageTextToText.from_pretrained(path)
    assert type(AutoProcessor.from_pretrained(path)).__name__ == "Qwen2_5_VLProcessor"
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    text = model.config.text_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    tok = processor.tokenizer
    for special in ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|endoftext|>"):
        assert len(tok.tokenize(special)) == 1, special
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")


def test_builtins_are_cached_and_deterministic(model_cache, tmp_path):
    first = resolve_model_path("builtin:tiny-text", model_cache, seed=0)
    assert resolve_model_path("builtin:tiny-text", model_cache, seed=0) == first  # cached, not rebuilt
    other = resolve_model_path("builtin:tiny-text", str(tmp_path), seed=0)
    a, _ = load_policy(first)
    b, _ = load_policy(other)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert json.loads((first / "vagen_builtin.json").read_text())["name"] == "builtin:tiny-text"
    assert not is_vision_checkpoint(first)


def test_model_path_errors_say_how_to_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a checkpoint: no config.json in .*missing; download the "
                                                r"checkpoint beforehand .* and pass its directory"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"'builtin:huge' is not a built-in model.* choices: " + ", ".join(BUILTINS)):
        resolve_model_path("builtin:huge")


def test_assets_names_a_shipped_warm_start(tiny_text, tmp_path, monkeypatch):
    import shutil

    import vagen.config

    path, _, _ = tiny_text
    shutil.copytree(path, tmp_path / "checkpoints" / "mini_text")
    (tmp_path / "checkpoints" / "unfinished").mkdir()  # no config.json: not a checkpoint
    import vagen.config_checks

    for module in (vagen.config, vagen.config_checks):  # where the loader and the checks look it up
        monkeypatch.setattr(module, "checkpoints_dir", lambda: tmp_path / "checkpoints")
    assert vagen.config.shipped_checkpoints() == ["mini_text"]
    assert resolve_model_path("assets:mini_text") == tmp_path / "checkpoints" / "mini_text"
    model, _ = load_policy(resolve_model_path("assets:mini_text"))
    assert torch.equal(model.lm_head.weight, tiny_text[1].lm_head.weight)
    vagen.config.load_config("sokoban_text", ["model.path=assets:mini_text"])  # the config knows it too
    for wrong in ("assets:mini_txt", "assets:unfinished"):
        with pytest.raises(ValueError, match=rf"model.path='{wrong}' is not a shipped warm start .*"
                                             r"choices: builtin:tiny-vl, builtin:tiny-qwen3-vl, builtin:tiny-qwen3.5, builtin:tiny-text, "
                                             r"assets:mini_text"):
            resolve_model_path(wrong)
    with pytest.raises(vagen.config.ConfigError, match=r"did you mean 'assets:mini_text'"):
        vagen.config.load_config("sokoban_text", ["model.path=assets:mini_txt"])


def test_value_model_starts_at_zero_and_round_trips(tiny_text, tmp_path):
    _, model, processor = tiny_text
    critic = ValueModel(model)
    ids = torch.tensor([processor.encode("<answer>Left</answer>")])
    values = critic(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert values.shape == ids.shape
    assert torch.all(values == 0)  # zero-initialised head: no value bias before training
    with torch.no_grad():
        critic.value_head.bias.fill_(0.5)
    critic.save(tmp_path / "critic")
    again = ValueModel(load_policy(resolve_model_path("builtin:tiny-text", str(tmp_path / "m"), seed=1))[0])
    again.load(tmp_path / "critic")
    assert torch.allclose(again(input_ids=ids)[:, 1:], torch.full((1, ids.shape[1] - 1), 0.5))


def test_tiny_vl_centres_each_images_tokens_independently_of_the_batch(tiny_vl, tmp_path):
    import envs_visual

    path, model, processor = tiny_vl
    assert json.loads((path / "config.json").read_text())["vagen_center_image_tokens"] is True
    frames = []
    for seed in (0, 1):
        env = envs_visual.make("frozenlake")
        env.reset(seed=seed)
        frames.append(env.render_image())
    alone = [processor.image_processor(images=[f], return_tensors="pt") for f in frames]
    both = processor.image_processor(images=frames, return_tensors="pt")
    with torch.no_grad():
        feats_alone = [torch.cat(model.model.get_image_features(a["pixel_values"], a["image_grid_thw"]).pooler_output)
                       for a in alone]
        feats_both = torch.cat(model.model.get_image_features(both["pixel_values"], both["image_grid_thw"]).pooler_output)
    assert [f.shape[0] for f in feats_alone] == [16, 16]  # one token per 28-px cell
    for feats in feats_alone:
        assert torch.allclose(feats.mean(0), torch.zeros(feats.shape[1]), atol=1e-6)
    assert torch.allclose(torch.cat(feats_alone), feats_both, atol=1e-5)
    assert "vagen_image_position_code" not in json.loads((path / "config.json").read_text())  # off by default
    # the flag travels with saved checkpoints; a checkpoint without it is not centred
    model.save_pretrained(tmp_path / "ckpt")
    processor.save_pretrained(tmp_path / "ckpt")
    assert load_policy(tmp_path / "ckpt")[0].model.visual._forward_hooks
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["vagen_center_image_tokens"] = False
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    assert not load_policy(tmp_path / "ckpt")[0].model.visual._forward_hooks


def test_the_position_code_is_added_to_each_images_centred_tokens(tiny_vl, tmp_path):
    import envs_visual
    from vagen.config import load_config
    from vagen.models import base_checkpoint

    cfg = load_config("sokoban_visual", ["model.path=builtin:tiny-vl", "model.builtin_position_code=true",
                                         f"model.builtin_cache={tmp_path}"])
    path = base_checkpoint(cfg.model)
    assert json.loads((path / "config.json").read_text())["vagen_image_position_code"] is True
    model, processor = load_policy(path)
    plain = tiny_vl[1]  # the same seed without the code: the same weights
    env = envs_visual.make("sokoban", dim_room=[6, 6], num_boxes=1, cell_size=28)
    env.reset(seed=3)
    inputs = processor.image_processor(images=[env.render_image()], return_tensors="pt")
    with torch.no_grad():
        coded = torch.cat(model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        centred = torch.cat(plain.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
    assert coded.shape == (36, 128)  # one token per 28-px cell of the 6x6 room
    expected = centred + centred.pow(2).mean().sqrt() * image_position_code(6, 6, 128)
    assert torch.allclose(coded, expected, atol=1e-6)


def test_image_position_code_is_sines_of_row_and_column():
    code = image_position_code(2, 3, 10, frequencies=2)
    assert code.shape == (6, 10)
    half = 2 ** -0.5
    # the cell in row 1, column 2 (raster index 5): sin and cos of 1 * (pi/2, pi/4), then of 2 * (pi/2, pi/4)
    expected = torch.tensor([1.0, half, 0.0, half, 0.0, 1.0, -1.0, 0.0, 0.0, 0.0])
    assert torch.allclose(code[5], expected, atol=1e-6)
    assert torch.allclose(code[0], torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]))
    assert len({tuple(row.tolist()) for row in image_position_code(6, 6, 32)}) == 36  # every cell differs
    with pytest.raises(ValueError, match="needs 32 features, but image tokens have 16"):
        image_position_code(2, 2, 16)


def test_patch_embedding_is_the_convolution_as_one_matrix_product(tiny_vl):
    import copy
    import types

    _, model, _ = tiny_vl
    assert "model.visual.patch_embed.proj.weight" in model.state_dict()  # checkpoints are unchanged
    embed = copy.deepcopy(model.model.visual.patch_embed)  # a copy (an engine's, a critic's) keeps the product
    assert type(embed).__name__ == "MatmulQwen2_5_VisionPatchEmbed"
    conv = embed.proj
    torch.manual_seed(0)
    pixels = torch.randn(40, conv.weight[0].numel())
    weight = conv.weight.detach().clone().requires_grad_(True)
    expected = torch.nn.functional.conv3d(pixels.view(-1, *conv.weight.shape[1:]), weight, stride=conv.stride)
    expected = expected.view(40, -1)
    got = embed(pixels)
    assert got.shape == (40, conv.out_channels)
    assert torch.allclose(got, expected, atol=1e-5)
    upstream = torch.randn(got.shape)
    (got * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert torch.allclose(conv.weight.grad, weight.grad, atol=1e-4)
    assert matmul_patch_embedding(types.SimpleNamespace(model=types.SimpleNamespace(visual=types.SimpleNamespace(
        patch_embed=embed))))  # installing twice is harmless


def test_matmul_patch_embedding_leaves_other_modules_alone(tiny_text):
    import types

    _, text_model, _ = tiny_text
    assert not matmul_patch_embedding(text_model)  # no vision tower
    embed = torch.nn.Module()
    embed.proj = torch.nn.Conv3d(3, 8, kernel_size=3, stride=1, padding=1)  # overlapping windows: a real convolution
    model = types.SimpleNamespace(model=types.SimpleNamespace(visual=types.SimpleNamespace(patch_embed=embed)))
    assert not matmul_patch_embedding(model)
    assert type(embed) is torch.nn.Module


def test_builtin_layers_builds_a_deeper_model_under_its_own_cache_key(tmp_path):
    from vagen.config import ConfigError, load_config
    from vagen.models import base_checkpoint

    builtin = ["model.path=builtin:tiny-vl", f"model.builtin_cache={tmp_path}"]
    two = base_checkpoint(load_config("frozenlake_visual", builtin).model)
    four = base_checkpoint(load_config("frozenlake_visual", [*builtin, "model.builtin_layers=4"]).model)
    assert two != four
    assert json.loads((two / "config.json").read_text())["text_config"]["num_hidden_layers"] == 2
    assert json.loads((four / "config.json").read_text())["text_config"]["num_hidden_layers"] == 4
    with pytest.raises(ConfigError, match="model.builtin_layers=0 must be >= 1"):
        load_config("frozenlake_visual", ["model.builtin_layers=0"])
