"""The activation term and the phases of the per-GPU memory estimate (`vagen.memory`), the refusals it gives
through `python -m vagen.config --ranks N --gpu-gib G` and at the start of training on a GPU. Expected values are
derived from the inputs (the model's shape, the micro-batch, the lengths), never copied from an earlier run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vagen.config import CONFIGS_DIR, ChecksFailed, check_config, load_configs
from vagen.memory import (
    GIB,
    KNOWN_SHAPES,
    MARGIN_GIB,
    VLLM_RUNTIME_GIB,
    activation_bytes,
    estimate,
    frame_patches,
    kv_bytes_per_token,
    layer_bytes,
    step_gib,
    vllm_floor,
)
from vagen.preflight import missing_packages

REPO = Path(__file__).resolve().parent.parent
SHAPE_3B = KNOWN_SHAPES["Qwen2.5-VL-3B-Instruct"]
TEXT, VISION = SHAPE_3B["text"], SHAPE_3B["vision"]


def _checked(names, overrides, ranks, gpu_gib):
    """check_config's failures and estimate lines, the absence of vLLM from this environment left out (the
    estimate is what these tests are about)."""
    cfg = load_configs(names, overrides, require_checkpoint=False)
    try:
        _, lines = check_config(names, overrides, ranks, gpu_gib)
        return [], lines
    except ChecksFailed as err:
        return [f for f in err.failures if f not in missing_packages(cfg)], err.lines


def test_a_decoder_layer_saves_what_its_tensors_hold_hand_checked():
    text = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=100)
    # bf16: two norms (4 + 2 x 2) x 8 = 128, attention (3 x 8 + 2 x 4) x 2 = 64, SwiGLU 4 x 16 x 2 = 128, and a
    # float32 log-sum-exp for each of the 2 heads = 8
    assert layer_bytes(text, 2) == 128 + 64 + 128 + 8
    # float32 activations: (4 + 8) x 8 x 2 + 32 x 4 + 64 x 4 + 8
    assert layer_bytes(text, 4) == 192 + 128 + 256 + 8
    # eager attention keeps each token's float32 softmax row and its cast, over the positions, per head
    assert layer_bytes(text, 2, "eager", tokens=10) == layer_bytes(text, 2) + 2 * 10 * (4 + 2)


def _acts(**overrides):
    args = dict(sequences=1, tokens=2400, generated=603, patches=432, width=2, checkpointing=False)
    return activation_bytes(TEXT, VISION, **{**args, **overrides})


def test_doubling_the_micro_batch_doubles_what_the_layers_and_the_tower_keep():
    one, two = _acts(sequences=1), _acts(sequences=2)
    assert two.layers == 2 * one.layers and two.backward == 2 * one.backward and two.vision == 2 * one.vision
    # the head's weight gradients do not grow with the batch; what each sequence adds does
    assert two.total - one.total > one.layers + one.vision
    # so do longer sequences, for the language model
    longer = _acts(tokens=4800)
    assert longer.layers == 2 * one.layers and longer.vision == one.vision


def test_checkpointing_keeps_each_layers_input_and_one_layer():
    full, ckpt = _acts(checkpointing=False), _acts(checkpointing=True)
    layers, h, tokens = TEXT["num_hidden_layers"], TEXT["hidden_size"], 2400
    per_layer = layer_bytes(TEXT, 2) * tokens
    assert full.backward == ckpt.backward == 2 * (TEXT["intermediate_size"] + h) * 2 * tokens
    assert full.layers == layers * per_layer
    assert ckpt.layers == layers * h * 2 * tokens + per_layer
    # the saving is the layer factor, less the checkpoints: 36 layers of 134 kB a token against 4 kB inputs
    assert full.layers / ckpt.layers == pytest.approx(layers * layer_bytes(TEXT, 2) / (layers * h * 2 + layer_bytes(TEXT, 2)))
    assert full.layers / ckpt.layers > 10
    # the frozen tower (LoRA with model.freeze_vision) keeps nothing for backward
    assert _acts(checkpointing=True, vision_trained=False).vision == 0 < ckpt.vision


def test_the_heads_float32_chunks_follow_vagen_update():
    from vagen import memory, update

    for name in ("HEAD_CHUNK_FRACTION", "HEAD_CHUNK_BYTES", "HEAD_CHUNK_TENSORS"):
        assert getattr(memory, name) == getattr(update, name), name
    for rows, vocab in [(603, 151_936), (20_000, 151_936), (5, 1296)]:
        assert memory.head_chunk_rows(rows, vocab) == update.head_chunk_rows(rows, vocab)
    acts = _acts(sequences=4, checkpointing=True)
    rows = 4 * 603
    chunk = 4 * 4 * TEXT["vocab_size"] * update.head_chunk_rows(rows, TEXT["vocab_size"])
    h, count = TEXT["hidden_size"], 4 * 2400
    assert acts.head == (4 + 4) * h * count + rows * h * 2 + chunk + 32 * count + 3 * TEXT["vocab_size"] * h * 2


def test_the_zero_step_partition_is_bounded_by_the_sub_group_under_zero_3():
    assert step_gib({"zero_optimization": {"stage": 0}}, 10**9, 1) == 0
    assert step_gib({"zero_optimization": {"stage": 1}}, 10**9, 4) == 4 * 10**9 / 4 / GIB
    assert step_gib({"zero_optimization": {"stage": 3, "sub_group_size": 10**8}}, 10**9, 2) == 4 * 10**8 / GIB
    assert step_gib({"zero_optimization": {"stage": 3}}, 10**9, 2) == 4 * 10**9 / 2 / GIB


def test_vllm_step_tokens_follow_the_engine():
    from vagen.decoding_vllm.engine import STEP_TOKENS
    from vagen.memory import VLLM_STEP_TOKENS

    assert VLLM_STEP_TOKENS == STEP_TOKENS


@pytest.mark.parametrize("env, family_overrides, token_pixels, merge", [
    ("sokoban_visual", [], 28, 2),  # 6 x 6 cells of 28 pixels: 36 image tokens of 2 x 2 patches
    ("frozenlake_visual", [], 28, 2),  # 4 x 4 cells of 28
    ("navigation_visual", [], 28, 2),  # 112 x 112 pixels
])
def test_frame_patches_are_the_frames_image_tokens_times_the_merge(env, family_overrides, token_pixels, merge):
    cfg = load_configs([env], family_overrides)
    import envs_visual

    made = envs_visual.make(cfg.env.name, render_mode=cfg.env.render_mode, **cfg.env.params)
    try:
        (frame,) = made.reset(seed=0)[0].images
    finally:
        if hasattr(made, "close"):
            made.close()
    width, height = frame.size
    assert frame_patches(cfg, VISION) == (width // token_pixels) * (height // token_pixels) * merge ** 2
    # the processor enlarges a frame to model.min_pixels
    bigger = load_configs([env], [f"model.min_pixels={4 * width * height}"])
    assert frame_patches(bigger, VISION) == 4 * frame_patches(cfg, VISION)
    assert frame_patches(load_configs(["sokoban_text"]), VISION) == 0


def _recipe(overrides=(), recipe="qwen2.5-vl-3b", ranks=8, gpu_gib=80):
    cfg = load_configs(["sokoban_visual", f"recipes/{recipe}"], list(overrides), require_checkpoint=False)
    ds = json.loads((CONFIGS_DIR / cfg.train.deepspeed_config).read_text())
    return cfg, estimate(cfg, ranks, ds, gpu_gib)


def test_the_update_phase_adds_activations_and_an_awake_vllm():
    cfg, asleep = _recipe()
    _, awake = _recipe(["vllm.sleep_mode=false"])
    share = cfg.vllm.gpu_memory_utilization * 80
    assert awake.update_gib == pytest.approx(asleep.update_gib + share, rel=1e-12)
    assert awake.rollout_gib == asleep.rollout_gib
    # the phases' parts: the states and the margin in both, vLLM in the rollout, activations and the optimizer
    # step's float32 gradient partition (ZeRO-2: 4 B a parameter over the 8 ranks) in the update
    step = 4 * 3_754_622_976 / 8 / GIB
    assert step_gib({"zero_optimization": {"stage": 2}}, 3_754_622_976, 8) == step
    assert asleep.rollout_gib - asleep.update_gib == pytest.approx(share - asleep.activations.total / GIB - step,
                                                                   rel=1e-9)
    assert asleep.gpu_total_gib == max(asleep.rollout_gib, asleep.update_gib)
    assert asleep.rollout_gib > asleep.total_gib + share + MARGIN_GIB
    _, four = _recipe(["train.micro_batch_size=4", "train.micro_batch_tokens=0"])  # the recipe cuts by tokens
    assert four.activations.layers == 4 * asleep.activations.layers


def test_the_hf_rollout_holds_its_episodes_keys_and_values():
    hf = ["rollout.backend=hf"]
    _, short = _recipe(hf + ["rollout.max_trajectory_length=2400"])
    _, long = _recipe(hf + ["rollout.max_trajectory_length=4800"])
    _, vllm = _recipe()
    episodes = 16 * 8 // 8  # the recipe's level groups x group size over 8 ranks
    per_token = 36 * 2 * 2 * 128 * 2  # layers x keys and values x key-value heads x head_dim x bf16
    assert kv_bytes_per_token(TEXT) == per_token
    assert long.rollout_gib - short.rollout_gib == pytest.approx(episodes * 2400 * per_token / GIB, rel=1e-9)
    assert short.rollout_gib - (vllm.rollout_gib - 0.3 * 80) == pytest.approx(episodes * 2400 * per_token / GIB,
                                                                               rel=1e-9)


def test_the_issue_case_three_changes_that_each_fit_refused_together():
    """The recipe passes at 8 x 80 GiB; without gradient checkpointing, at micro-batch 4 and with vLLM awake
    through the update it is refused, naming each of the three."""
    names = ["sokoban_visual", "recipes/qwen2.5-vl-3b"]
    failures, lines = _checked(names, [], 8, 80)
    assert failures == [] and lines[-1].endswith("of 80 GiB: fits")
    bad = ["vllm.sleep_mode=false", "model.gradient_checkpointing=false", "train.micro_batch_size=4",
           "train.micro_batch_tokens=0"]  # by count, as before the recipe took a token budget
    (failure,), lines = _checked(names, bad, 8, 80)
    assert "does not fit a GPU of 80 GiB with 8 rank(s)" in failure and "in the update" in failure
    for fix in ("model.gradient_checkpointing=true", "train.micro_batch_size=1", "vllm.sleep_mode=true"):
        assert fix in failure, fix
    # un-checkpointed activations at 4 x 2,400 tokens: every one of the 36 layers keeps layer_bytes a token
    _, result = _recipe(bad)
    assert result.activations.layers == 36 * 4 * 2400 * layer_bytes(TEXT, 2)
    assert result.activations.total / GIB > 40 and lines[-1].endswith("does not fit")


def test_a_vllm_share_that_cannot_hold_its_weights_is_refused():
    names = ["sokoban_visual", "recipes/qwen2.5-vl-7b"]
    (failure,), _ = _checked(names, ["vllm.gpu_memory_utilization=0.2"], 8, 80)
    cfg = load_configs(names, require_checkpoint=False)
    text = KNOWN_SHAPES["Qwen2.5-VL-7B-Instruct"]["text"]
    weights = 2 * 8_292_166_656 / GIB  # the published parameter count in bf16
    floor, _ = vllm_floor(cfg, text, 8_292_166_656, 8)
    kv = kv_bytes_per_token(text) * cfg.vllm.max_model_len / GIB  # one 8,192-token sequence: 28 layers x 2 x 4 x 128
    assert kv == 28 * 2 * 4 * 128 * 2 * 8192 / GIB
    # the weights and one sequence would fit 16 GiB; with the profiled pass and vLLM's graphs they do not
    assert weights + kv < 0.2 * 80 < floor and floor > weights + kv + VLLM_RUNTIME_GIB
    assert failure.startswith(f"vllm.gpu_memory_utilization=0.2 gives vLLM 16.0 GiB of the 80 GiB GPU, less than "
                              f"the {floor:.1f} GiB it needs to start")
    assert f"at least {-(-floor * 100 // 80) / 100:.2f}" in failure
    # the recipe's own share holds it
    assert _checked(names, [], 8, 80)[0] == []


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (CONFIGS_DIR / "recipes").glob("*.yaml")
                                          if "\nfamily: " in p.read_text()))
def test_each_recipe_leaves_room_for_its_update_and_its_engine(recipe):
    cfg, result = _recipe(recipe=recipe, ranks=int(__import__("re").search(
        r"--num_gpus (\d+)", (CONFIGS_DIR / "recipes" / f"{recipe}.yaml").read_text()).group(1)))
    assert result.problem is None, result.problem
    assert cfg.model.gradient_checkpointing and result.activations.checkpointing
    assert result.update_gib < result.rollout_gib <= 80


# -- at the start of training on a GPU -------------------------------------------------------------------


def test_training_on_a_gpu_refuses_before_any_model_loads(monkeypatch, capsys, tmp_path):
    """init_distributed gives a CUDA device (faked), whose memory is read from torch.cuda.mem_get_info (faked):
    a 2 GiB GPU is refused with the estimator's message before the run directory or a model is made, a 40 GiB
    one goes on to them."""
    import torch

    import vagen.distributed
    import vagen.run
    from vagen.distributed import Dist
    from vagen.train import main

    monkeypatch.setattr(vagen.distributed, "init_distributed",
                        lambda **kwargs: Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cuda", 0)))
    total = {"gib": 2}
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return (total["gib"] * GIB // 2, total["gib"] * GIB)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)

    class Reached(Exception):
        pass

    def create(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(vagen.run.RunDir, "create", create)
    args = ["--config", "sokoban_visual", f"train.run_dir={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "config error: the estimate of" in err and "does not fit a GPU of 2 GiB with 1 rank(s)" in err
    assert asked == [torch.device("cuda", 0)]
    total["gib"] = 40
    with pytest.raises(Reached):
        main(args)


# The built-in tiny VLM's four passes take about a minute on a loaded 2-core machine, most of it starting Python
# and building the model: slow.
@pytest.mark.slow
def test_the_activation_term_bounds_what_one_update_pass_takes_on_the_cpu(tmp_path):
    """benchmarks/bench_memory.py --activations tiny: one forward and backward of vagen.update.token_logprobs at
    micro-batches 1 and 4 of 512 tokens, with and without checkpointing. The estimate bounds the anonymous
    resident memory each pass adds (docs/benchmarks.md, "The memory estimate's activation term": 0.6 to 0.9 of it
    on this machine, from run to run; too loose a band to assert as a floor)."""
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_memory.py"), "--activations", "tiny",
                           "--json", str(out), "--cache", str(tmp_path / "cache")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["micro_batch"], r["checkpointing"]) for r in rows] == [(1, False), (4, False), (1, True), (4, True)]
    for row in rows:
        assert 0 < row["measured"] <= row["estimate"], row
    # and the measurement moves with the inputs as the estimate does: 4 sequences keep more than 1, and
    # checkpointing keeps less
    one, four, one_ckpt, four_ckpt = (r["measured"] for r in rows)
    assert four > 2 * one and four_ckpt < four and one_ckpt < one
