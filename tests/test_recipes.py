"""GPU recipes (configs/recipes/): composition with an environment config, the checks of
`python -m vagen.config ... --ranks N`, the per-GPU memory estimate, and two iterations of each recipe
on the CPU with its checkpoint swapped for a tiny model of its family (Qwen2.5-VL, Qwen3-VL)."""

import importlib.util
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from vagen.config import CONFIGS_DIR, ChecksFailed, ConfigError, check_config, load_config, load_configs
from vagen.memory import (
    GIB,
    KNOWN_SHAPES,
    estimate,
    known_tensors,
    lora_parameters,
    qwen2_5_vl_tensors,
    qwen3_vl_tensors,
)

REPO = Path(__file__).resolve().parent.parent
# Model recipes name their checkpoint's family at the top; presets (vagen-full) go after one of them.
RECIPES = sorted(p.stem for p in (CONFIGS_DIR / "recipes").glob("*.yaml") if "\nfamily: " in p.read_text())
PRESETS = sorted(p.stem for p in (CONFIGS_DIR / "recipes").glob("*.yaml") if p.stem not in RECIPES)
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
NO_VLLM = "rollout.backend=vllm samples with vLLM, which is not installed in this environment"


def check_recipe(names, overrides, ranks, gpu_gib=None):
    """`check_config` where the environment decides one check: a vLLM config fails on vllm's absence alone
    where vllm is not installed (the refusal naming its install line), and passes where it is. Returns
    (config, the estimate's lines)."""
    try:
        cfg, lines = check_config(names, overrides, ranks, gpu_gib)
    except ChecksFailed as err:
        if VLLM_INSTALLED or len(err.failures) != 1 or not err.failures[0].startswith(NO_VLLM):
            raise
        return load_configs(names, overrides, require_checkpoint=False), err.lines
    assert VLLM_INSTALLED or cfg.rollout.backend != "vllm", "a vLLM config passed where vllm is not installed"
    return cfg, lines


def _stated_gpus(name: str) -> int:
    """The GPU count a recipe's header states in its deepspeed command."""
    header = (CONFIGS_DIR / "recipes" / f"{name}.yaml").read_text()
    return int(re.search(r"deepspeed --num_gpus (\d+) vagen/train.py", header).group(1))


def test_the_recipes_are_the_qwen2_5_vl_and_qwen3_vl_ones():
    assert RECIPES == ["qwen2.5-vl-3b", "qwen2.5-vl-3b-lora", "qwen2.5-vl-7b", "qwen2.5-vl-7b-lora",
                       "qwen3-vl-4b", "qwen3-vl-4b-lora", "qwen3-vl-8b", "qwen3-vl-8b-lora"]
    assert PRESETS == ["vagen-full"]


def test_a_recipe_composes_over_an_environment_config():
    cfg = load_configs(["sokoban_visual", "recipes/qwen2.5-vl-3b"], require_checkpoint=False)
    assert cfg.name == "sokoban_visual+qwen2.5-vl-3b"
    # the environment config's keys the recipe does not hold are kept
    assert cfg.env.params == {"dim_room": [6, 6], "num_boxes": 1, "cell_size": 28}
    assert cfg.algo.token_selection == "entropy" and cfg.algo.adv_estimator == "turn_gae"
    # the laptop's sizes are replaced by the recipe's
    assert (cfg.train.actor_lr, cfg.train.critic_lr, cfg.train.iterations) == (1e-6, 1e-5, 300)
    assert (cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.rollout.env_groups) == (200, 3, 16)
    assert cfg.model.path == "/models/Qwen2.5-VL-3B-Instruct"
    # a comma list is the same as repeated names; overrides come last
    comma = load_configs("sokoban_visual,recipes/qwen2.5-vl-3b", ["train.iterations=7"], require_checkpoint=False)
    assert comma.train.iterations == 7 and comma.name == cfg.name and comma.env == cfg.env
    # the order matters: the environment config after the recipe brings the laptop's learning rate back
    reverse = load_configs(["recipes/qwen2.5-vl-3b", "sokoban_visual"])
    assert reverse.train.actor_lr == 1e-4 and reverse.model.path == "assets:sokoban_visual"


def test_an_absent_checkpoint_is_refused_unless_only_checked():
    with pytest.raises(ConfigError, match="model.path='/models/Qwen2.5-VL-3B-Instruct' is not a checkpoint"):
        load_config(["sokoban_visual", "recipes/qwen2.5-vl-3b"])
    # a misspelt built-in or shipped name is refused even then
    with pytest.raises(ConfigError, match="is not a shipped warm start"):
        load_configs(["sokoban_visual"], ["model.path=assets:sokoban_vision"], require_checkpoint=False)


@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_is_sized_for_gpus_and_passes_their_checks(name):
    text = (CONFIGS_DIR / "recipes" / f"{name}.yaml").read_text()
    for line in text.splitlines():  # every value says where it comes from
        if line.strip() and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"{name}: no comment on {line!r}"
    assert "GB (H100)" in text and "algo.filter_mode=std" in text  # what the reward-std filter needs, stated
    assert re.search(r'Sources \("VAGEN"\): mll-lab-nu/VAGEN@[0-9a-f]{40} ', text), f"{name}: no VAGEN commit"
    cfg, lines = check_recipe(["sokoban_visual", f"recipes/{name}"], [], _stated_gpus(name), gpu_gib=80)
    assert cfg.model.dtype == "bfloat16" and "bf16" in cfg.train.deepspeed_config
    assert cfg.rollout.backend == "vllm" and cfg.model.gradient_checkpointing
    assert cfg.train.save_every > 0 and cfg.train.keep_checkpoints is not None
    assert cfg.rollout.max_new_tokens >= 200 and cfg.train.actor_lr <= 1e-5
    assert any(line.startswith("  total") for line in lines)
    stated = re.search(r"Estimated model states[^:]*: ([\d.]+) GiB", text).group(1)
    assert f"total      {stated} GiB" in "\n".join(lines), f"{name}: its header states {stated} GiB"
    (gpu,) = [line for line in lines if line.startswith("  GPU total")]
    assert gpu.endswith("of 80 GiB: fits"), gpu


def test_ranks_check_refuses_what_train_py_refuses():
    with pytest.raises(ConfigError, match="rollout.env_groups=4 must be divisible by the 16 ranks"):
        check_config(["sokoban_visual"], ["model.path=/models/Qwen2.5-VL-3B-Instruct"], 16)
    with pytest.raises(ConfigError, match="algo.filter_keep_ratio=0.25 keeps 4 of rollout.env_groups=16 level "
                                          "groups, fewer than the 8 ranks"):
        check_config(["sokoban_visual", "recipes/qwen2.5-vl-3b"], ["algo.filter_mode=std"], 8)
    with pytest.raises(ConfigError, match="model.dtype=float32 with train.deepspeed_config=deepspeed/zero2_bf16.json"):
        check_config(["sokoban_visual", "recipes/qwen2.5-vl-3b"], ["model.dtype=float32"], 8)


def test_config_cli_checks_ranks_without_torch():
    code = ("import sys\nfrom vagen.config import main\n"
            "code = main(['sokoban_visual', '--config', 'recipes/qwen2.5-vl-7b', '--ranks', '8'])\n"
            "print('torch' in sys.modules, 'deepspeed' in sys.modules, code)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    # where vllm is not installed the recipe's rollout.backend=vllm is the one failing check (tests/test_preflight.py)
    code = "0" if VLLM_INSTALLED else "2"
    assert result.stdout.splitlines()[-1].split() == ["False", "False", code], result.stderr
    if VLLM_INSTALLED:
        assert "sokoban_visual+qwen2.5-vl-7b: every check train.py runs before loading the model passes for 8" in \
            result.stdout
    else:
        assert result.stderr.splitlines()[1].startswith(f"config error: {NO_VLLM}")
    assert "parameters: 8.292 B, from the published shape of Qwen2.5-VL-7B-Instruct" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "vagen.config", "sokoban_visual", "recipes/qwen2.5-vl-3b",
                          "--ranks", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("config error: unknown config key 'recipes/qwen2.5-vl-3b'") or \
        bad.stderr.startswith("config error: override 'recipes/qwen2.5-vl-3b' has no '='")
    bad = subprocess.run([sys.executable, "-m", "vagen.config", "sokoban_visual,recipes/qwen2.5-vl-3b",
                          "--ranks", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.splitlines()[1] == (
        "config error: rollout.env_groups=16 must be divisible by the 3 ranks (each rank plays and trains an equal "
        "share); use a multiple of 3, or fewer ranks (deepspeed --num_gpus K; without --num_gpus the launcher starts "
        "one rank per GPU of the node)")


def test_known_shapes_count_the_published_parameters():
    # the model cards give 3.75 B, 8.29 B, 4.44 B and 8.77 B
    counts = {name: sum(_numel(s) for _, s in known_tensors(name)) for name in KNOWN_SHAPES}
    assert counts == {"Qwen2.5-VL-3B-Instruct": 3_754_622_976, "Qwen2.5-VL-7B-Instruct": 8_292_166_656,
                      "Qwen3-VL-4B-Instruct": 4_437_815_808, "Qwen3-VL-8B-Instruct": 8_767_123_696}
    # the 8B's tower: 27 blocks of width 1152, four mergers (the final one and three DeepStack taps)
    vision = sum(_numel(s) for name, s in known_tensors("Qwen3-VL-8B-Instruct") if name.startswith("model.visual."))
    assert vision == 576_388_336


def test_shape_formula_names_and_sizes_every_tensor_transformers_builds():
    torch = pytest.importorskip("torch")
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=64, patch_size=14,
                  temporal_patch_size=2, in_channels=3, spatial_merge_size=2)
    config = Qwen2_5_VLConfig(text_config={**text, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                                       "rope_theta": 10000.0}},
                              vision_config={**vision, "num_heads": 2}, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert dict(qwen2_5_vl_tensors(text, vision)) == built


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_vl_shape_formula_names_and_sizes_every_tensor_transformers_builds(tied):
    """head_dim apart from hidden / heads, q/k norms, the tower's biases and position embeddings, and one
    merger per DeepStack tap normalising the merged (4 x hidden) features."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, vocab_size=300, tie_word_embeddings=tied)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, patch_size=16,
                  temporal_patch_size=2, in_channels=3, spatial_merge_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 2])
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4], "mrope_interleaved": True}
    config = Qwen3VLConfig(text_config={**text, "rope_parameters": rope}, vision_config={**vision, "num_heads": 2},
                           tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config)
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    formula = dict(qwen3_vl_tensors(text, vision))
    assert formula == built
    assert ("lm_head.weight" in formula) == (not tied)
    assert formula["model.visual.deepstack_merger_list.1.norm.weight"] == (128,)


def test_lora_share_matches_the_measured_adapter_count():
    # docs/benchmarks.md, "LoRA against full fine-tuning": r=8 on Qwen2.5-0.5B's text shape trained 4,399,104
    # parameters (counted from the optimizer's tensors)
    text = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151_936)
    vision = dict(depth=2, hidden_size=256, intermediate_size=1024, out_hidden_size=896, patch_size=14,
                  temporal_patch_size=2, in_channels=3, spatial_merge_size=2)
    targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert lora_parameters(qwen2_5_vl_tensors(text, vision), targets, 8) == 4_399_104
    assert lora_parameters(qwen2_5_vl_tensors(text, vision), targets, 64) == 35_192_832


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _write_safetensors(path: Path, tensors: dict) -> None:
    header = json.dumps({name: {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, 0]}
                         for name, shape in tensors.items()}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)


@pytest.mark.parametrize("overrides, ranks, expected_bytes", [
    # grpo: the actor alone. ZeRO-2 bf16 over 4 ranks: 2 B weights, 2/4 B gradients, 12/4 B optimizer
    (["algo.adv_estimator=grpo", "train.deepspeed_config=deepspeed/zero2_bf16.json"], 4, (2 + 0.5 + 3) * 1_000_000),
    # ZeRO-3 bf16 over 4 ranks: everything partitioned; a critic doubles it and the reference adds 2/4 B
    (["train.deepspeed_config=deepspeed/zero3_bf16.json", "algo.kl_coef=0.01"], 4, (2 * 4 + 0.5) * 1_000_000),
    # ZeRO-0 float32 on one rank: 4 B weights, 4 B gradients, 8 B moments (no master copy)
    (["algo.adv_estimator=grpo", "model.dtype=float32"], 1, 16 * 1_000_000),
    # ZeRO-3 float32: DeepSpeed keeps a fp32 master partition besides the weights: 20 B over 2 ranks
    (["algo.adv_estimator=grpo", "model.dtype=float32", "train.deepspeed_config=deepspeed/zero3_fp32.json"], 2,
     10 * 1_000_000),
])
def test_memory_estimate_hand_checked(tmp_path, overrides, ranks, expected_bytes):
    # one language-model projection of 1000 x 1000: a million parameters
    _write_safetensors(tmp_path / "model.safetensors", {"model.language_model.layers.0.mlp.up_proj.weight": (1000, 1000)})
    (tmp_path / "config.json").write_text("{}")
    base = ["model.dtype=bfloat16", f"model.path={tmp_path}"]
    cfg = load_config("sokoban_text", base + overrides)
    ds = json.loads((CONFIGS_DIR / cfg.train.deepspeed_config).read_text())
    result = estimate(cfg, ranks, ds)
    assert result.total_gib == pytest.approx(expected_bytes / GIB, rel=1e-12)
    assert f"the safetensors headers in {tmp_path}" in result.lines[1]


def test_memory_estimate_of_lora_counts_adapters_and_the_frozen_base(tmp_path):
    _write_safetensors(tmp_path / "model.safetensors", {"model.language_model.layers.0.mlp.up_proj.weight": (1000, 1000),
                                                        "model.visual.blocks.0.mlp.up_proj.weight": (1000, 1000)})
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config("sokoban_text", [f"model.path={tmp_path}", "model.dtype=bfloat16", "algo.adv_estimator=grpo",
                                       "train.deepspeed_config=deepspeed/zero2_bf16.json", "model.lora_rank=10",
                                       "algo.kl_coef=0.01"])
    ds = json.loads((CONFIGS_DIR / cfg.train.deepspeed_config).read_text())
    result = estimate(cfg, 2, ds)
    # 2 M frozen bf16 weights + 20,000 adapter parameters (10 x (1000 + 1000), the tower's layer gets none):
    # 2 B weights, 2/2 B gradients, 12/2 B optimizer each; the reference is the actor with adapters off
    assert result.total_gib == pytest.approx((2 * 2_020_000 + 20_000 + 6 * 20_000) / GIB, rel=1e-12)
    assert "LoRA r=10: 0.0 M trained (0.99%)" in result.lines[2]
    assert "no copy" in "\n".join(result.lines)


TINY = ["model.path=assets:sokoban_visual", "rollout.backend=hf", "train.iterations=2", "rollout.env_groups=2",
        "rollout.group_size=2", "rollout.max_new_tokens=12", "rollout.max_turns=2", "train.mini_batch_size=4",
        "train.micro_batch_size=2", "train.save_every=1", "train.keep_checkpoints=1", "log.progress=false",
        "eval.episodes=2", "eval.videos=0"]


def _train_recipe(name, out, model_cache, extra=()):
    from vagen.train import main

    overrides = TINY + [f"train.run_dir={out}", f"model.builtin_cache={model_cache}", *extra]
    assert main(["--config", "sokoban_visual", "--config", f"recipes/{name}", *overrides]) == 0
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the recipes evaluate the starting checkpoint first (eval.before_training), as the record of iteration -1
    assert [r["iteration"] for r in records] == [-1, 0, 1] and records[0]["eval/episodes"] == 2
    # the saved config reproduces the run, composition included
    saved = load_config(str(run / "config.yaml"))
    assert saved == load_config(["sokoban_visual", f"recipes/{name}"], overrides)
    assert saved.name == f"sokoban_visual+{name}" and run.name.startswith(f"sokoban_visual+{name}-")
    # saved every iteration, the newest kept
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_2"]
    return saved


FP32 = ["model.dtype=float32", "train.deepspeed_config=deepspeed/zero0_fp32.json"]


def test_a_recipe_trains_two_iterations_with_a_tiny_qwen2_5_vl(tmp_path, model_cache, distributed):
    """The recipe's keys (KL, clip-higher, gradient checkpointing, its batch shape and checkpointing), the model
    swapped for the shipped tiny Qwen2.5-VL warm start, sampled by hf, in float32 with ZeRO-0 (bf16 DeepSpeed
    on a CPU takes minutes: the slow tests run every recipe, and with its own DeepSpeed config)."""
    saved = _train_recipe("qwen2.5-vl-3b", tmp_path, model_cache, FP32)
    assert saved.algo.clip_high == 0.28 and saved.algo.kl_coef == 0.001 and saved.model.gradient_checkpointing


def _tiny_of_family(name: str) -> list[str]:
    """The built-in of the recipe's model family where it is not the Qwen2.5-VL warm start of TINY: the
    Qwen3-VL recipes train the built-in Qwen3-VL (random weights, its 16-pixel patches and DeepStack)."""
    return ["model.path=builtin:tiny-qwen3-vl"] if name.startswith("qwen3-vl") else []


# Two iterations of a Qwen3-VL recipe on the built-in take ~1.4x the Qwen2.5-VL one above (54 s against 40 s,
# measured side by side on a loaded 2-core machine): slow; the default run checks those recipes' configs.
@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_two_iterations_with_a_tiny_model_of_its_family(name, tmp_path, model_cache,
                                                                           distributed):
    saved = _train_recipe(name, tmp_path, model_cache, [*FP32, *_tiny_of_family(name)])
    assert saved.model.lora_rank == (16 if "lora" in name else 0)
    assert saved.model.path == ("builtin:tiny-qwen3-vl" if name.startswith("qwen3-vl") else "assets:sokoban_visual")


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_each_recipe_trains_in_bf16_with_its_own_deepspeed_config(name, tmp_path, model_cache, distributed):
    saved = _train_recipe(name, tmp_path, model_cache, _tiny_of_family(name))
    assert saved.model.dtype == "bfloat16" and saved.train.deepspeed_config.endswith("_bf16.json")
