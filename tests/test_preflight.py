"""What a config needs from the machine and from its checkpoint, refused before anything loads
(`vagen.preflight`, `vagen.config.machine_problems`), and the GPU check of `python -m vagen.config --ranks N
--gpu-gib G` (`vagen.memory`): a package the config's backend or extras import and the environment lacks, an
unknown model family, vagen's image hooks under rollout.backend=vllm, and a run that does not fit the GPU."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vagen.config import (
    CONFIGS_DIR,
    ChecksFailed,
    ConfigError,
    check_config,
    load_config,
    load_configs,
    machine_problems,
)
from vagen.memory import GIB, MARGIN_GIB, communication_gib, estimate
from vagen.preflight import FAMILY_MODEL_TYPES, IMAGE_HOOK_KEYS, KNOWN_MODEL_TYPES, checkpoint_config

REPO = Path(__file__).resolve().parent.parent
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
NO_VLLM = "rollout.backend=vllm samples with vLLM, which is not installed in this environment"
GPU_INSTALL = 'pip install -c constraints/gpu.txt -e ".[vllm,lora]"'


def _fake_vllm(tmp_path: Path) -> dict:
    """An environment for a subprocess in which `importlib.util.find_spec("vllm")` finds a package: the
    checks look packages up and import nothing, so an empty one stands for an installed vLLM."""
    (tmp_path / "site" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text("raise ImportError('the checks must not import vllm')\n")
    return {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _config_cli(*args, env=None):
    code = ("import sys\nfrom vagen.config import main\ncode = main(sys.argv[1:])\n"
            "print('imported:', 'torch' in sys.modules, 'vllm' in sys.modules, file=sys.stderr)\nsys.exit(code)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)


# -- packages -------------------------------------------------------------------------------------------

def test_a_vllm_recipe_without_vllm_is_a_failing_check_beside_the_estimate():
    """Where vllm is not installed the recipe check refuses and names the install line; the estimate is
    still printed, torch is not imported."""
    if VLLM_INSTALLED:
        pytest.fail("this test runs where vllm is not installed (the base environment); the vLLM environment "
                    "runs test_the_7b_recipe_is_refused_on_4_gpus_of_80_gib_and_passes_on_8 instead")
    done = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-3b", "--ranks", "8")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "1 of the checks train.py runs before loading the model fails for 8 rank(s):"
    assert lines[1].startswith(f"config error: {NO_VLLM}") and GPU_INSTALL in lines[1]
    assert "bash scripts/vllm_env.sh" in lines[1] and "or set rollout.backend=hf" in lines[1]
    assert lines[-1] == "imported: False False"
    assert "  total      33.2 GiB per GPU of model states" in done.stdout.splitlines()


def test_with_vllm_found_the_recipe_passes_and_nothing_is_imported(tmp_path):
    done = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-3b", "--ranks", "8", env=_fake_vllm(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "every check train.py runs before loading the model passes for 8 rank(s)" in done.stdout
    assert done.stderr.splitlines()[-1] == "imported: False False"


def test_every_missing_package_is_named_at_once(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in ("vllm", "peft", "wandb") else real(name, *a, **k))
    cfg = load_config("sokoban_text", ["rollout.backend=vllm", "model.lora_rank=8", "log.trackers=[tensorboard,wandb]"])
    problems = machine_problems(cfg)
    assert len(problems) == 3
    assert problems[0].startswith(NO_VLLM) and GPU_INSTALL in problems[0]
    assert problems[1] == ("model.lora_rank=8 builds its adapters with the peft library, which is not installed; "
                           "pip install -e \".[lora]\" (or model.lora_rank=0)")
    assert 'pip install -e ".[wandb]"' in problems[2]
    # the hf backend needs no vLLM
    assert machine_problems(load_config("sokoban_text", ["rollout.backend=hf"])) == []


# -- the checkpoint's config.json -------------------------------------------------------------------------

def test_the_known_model_types_are_those_of_vagen_models():
    pytest.importorskip("torch")
    from vagen.config import BUILTIN_MODELS
    from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE, builtin_family, known_model_types
    from vagen.models.families import FAMILIES

    assert list(KNOWN_MODEL_TYPES) == known_model_types()
    assert FAMILY_MODEL_TYPES == {family.name: tuple(sorted(family.model_types)) for family in FAMILIES}
    assert IMAGE_HOOK_KEYS == (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE)
    for name in BUILTIN_MODELS:  # each built-in's predicted config.json names a model type of its family
        assert checkpoint_config(name)[0]["model_type"] in builtin_family(name).model_types, name


@pytest.mark.parametrize("position_code", [False, True])
def test_the_built_in_vlm_config_is_what_it_is_built_with(model_cache, position_code):
    from vagen.models import base_checkpoint

    cfg = load_config("sokoban_visual", ["model.path=builtin:tiny-vl", f"model.builtin_cache={model_cache}",
                                         f"model.builtin_position_code={str(position_code).lower()}"])
    built = json.loads((base_checkpoint(cfg.model) / "config.json").read_text())
    predicted, _ = checkpoint_config("builtin:tiny-vl", position_code)
    assert predicted["model_type"] == built["model_type"] == "qwen2_5_vl"
    assert {k: bool(built.get(k)) for k in IMAGE_HOOK_KEYS} == {k: bool(predicted.get(k)) for k in IMAGE_HOOK_KEYS}
    assert bool(predicted.get(IMAGE_HOOK_KEYS[1])) == position_code


def _train(args, tmp_path, env=None):
    done = subprocess.run([sys.executable, "vagen/train.py", "--config", "sokoban_visual", *args,
                           f"train.run_dir={tmp_path / 'runs'}", "log.progress=false"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "runs").exists(), "the run directory was made before the check"
    return done.stderr


def test_an_unknown_model_type_is_refused_before_a_run_directory_without_a_traceback(tmp_path):
    checkpoint = tmp_path / "llava"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llava",
                                                        "architectures": ["LlavaForConditionalGeneration"]}))
    stderr = _train([f"model.path={checkpoint}", "rollout.backend=hf"], tmp_path)
    assert stderr.strip() == (f"config error: model.path={checkpoint}: {checkpoint / 'config.json'} has model_type "
                              f"'llava', not a model family vagen knows; known: qwen2, qwen2_5_vl, qwen2_vl, qwen3, "
                              f"qwen3_5, qwen3_vl. Use a checkpoint of one of them, or add the family: one file in "
                              f"vagen/models/ (see vagen/models/family.py) and a line in FAMILIES")


def test_evaluation_refuses_an_unknown_model_type_before_loading_without_a_traceback(tmp_path):
    checkpoint = tmp_path / "llava"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llava"}))
    done = subprocess.run([sys.executable, "-m", "vagen.eval", "--checkpoint", str(checkpoint), "--config",
                           "sokoban_visual", "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.startswith(f"config error: --checkpoint={checkpoint}: {checkpoint / 'config.json'} has "
                                  f"model_type 'llava', not a model family vagen knows")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path, hooks", [
    ("assets:sokoban_visual", ["vagen_center_image_tokens", "vagen_image_position_code"]),
    ("builtin:tiny-vl", ["vagen_center_image_tokens", "vagen_image_position_code"]),  # sokoban_visual asks for the code
])
def test_vllm_with_vagens_image_hooks_is_refused_before_a_run_directory(tmp_path, path, hooks):
    """With vLLM found (an empty package: nothing may import it), the only refusal is the hooks'."""
    stderr = _train([f"model.path={path}", "rollout.backend=vllm"], tmp_path, env=_fake_vllm(tmp_path))
    (line,) = stderr.strip().splitlines()
    assert line.startswith(f"config error: rollout.backend=vllm cannot decode model.path={path}: ")
    assert f"turns on vagen's image hooks {hooks}, which stock vLLM does not run" in line
    assert "Use rollout.backend=hf" in line


def test_the_hooks_matter_to_vllm_only_and_a_checkpoint_without_them_passes(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: real("json") if name == "vllm" else real(name, *a, **k))
    assert machine_problems(load_config("sokoban_visual", ["rollout.backend=hf"])) == []
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vagen_center_image_tokens": False}))
    assert machine_problems(load_config("sokoban_visual", ["rollout.backend=vllm", f"model.path={tmp_path}"])) == []
    (tmp_path / "config.json").write_text("{not json")
    (problem,) = machine_problems(load_config("sokoban_visual", ["rollout.backend=vllm", f"model.path={tmp_path}"]))
    assert "config.json cannot be read as JSON" in problem and "copy it again" in problem
    # a checkpoint not on this machine (a recipe checked elsewhere) is not read
    cfg = load_configs(["sokoban_visual", "recipes/qwen2.5-vl-7b"], require_checkpoint=False)
    assert machine_problems(cfg) == []


def _installed_vllm(monkeypatch, tmp_path: Path, version: str) -> None:
    """The package metadata of an installed vLLM `version`, found before any other (nothing is imported)."""
    info = tmp_path / "site" / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


@pytest.mark.parametrize("version, refused", [("0.26.0", True), ("0.31.1", True), ("0.32.0", False),
                                              ("0.32.0+cpu", False), ("0.33.0rc1", False)])
def test_qwen3_5_under_vllm_needs_the_release_that_runs_it(tmp_path, monkeypatch, version, refused):
    """vLLM 0.26's CPU kernel of Qwen3.5's linear-attention layers fails; the config says so, naming 0.32.0."""
    from vagen.preflight import checkpoint_problems, vllm_release

    _installed_vllm(monkeypatch, tmp_path, version)
    assert vllm_release() == version.split("+")[0]
    cfg = load_config("sokoban_visual", ["rollout.backend=vllm", "model.path=builtin:tiny-qwen3.5", "model.dtype=bfloat16"])
    problems = checkpoint_problems(cfg)
    if refused:
        assert problems == [f"rollout.backend=vllm with Qwen3.5 (model.path=builtin:tiny-qwen3.5) needs vLLM 0.32 or "
                            f"later, but vLLM {version} is installed (0.26.0's CPU kernel of Qwen3.5's linear-attention "
                            f"layers fails: chunk_gated_delta_rule_cpu, \"Input tensor dtype mismatch\"; no release "
                            f"before 0.32 has run Qwen3.5 in vagen's tests). Install the pinned set, vLLM 0.32.0 (pip install -c "
                            f"constraints/gpu.txt -e \".[vllm,lora]\"; on a CPU bash scripts/vllm_env.sh --vllm 0.32.0), "
                            f"or set rollout.backend=hf"]
    else:
        assert problems == []
    # the hf backend, and another family under the same vLLM, are not its concern
    assert checkpoint_problems(load_config("sokoban_visual", ["model.path=builtin:tiny-qwen3.5"])) == []
    assert checkpoint_problems(load_config("sokoban_text", ["rollout.backend=vllm"])) == []


def test_a_recipe_over_a_checkpoint_of_another_family_is_refused(tmp_path):
    """A Qwen2.5-VL recipe over a Qwen3-VL checkpoint would give its processor 28-pixel cells and no
    min_pixels: refused when the config loads, naming the recipes of the checkpoint's family."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    with pytest.raises(ConfigError) as refused:
        load_configs(["sokoban_visual", "recipes/qwen2.5-vl-3b"], [f"model.path={tmp_path}"])
    assert str(refused.value) == (
        f"recipe {CONFIGS_DIR / 'recipes' / 'qwen2.5-vl-3b.yaml'} is for model family qwen2_vl (model_type qwen2_5_vl "
        f"or qwen2_vl), but model.path={tmp_path}: {tmp_path / 'config.json'} has model_type 'qwen3_vl', of family "
        f"qwen3_vl; the recipe's image geometry and budgets are its family's. Use a recipe of family qwen3_vl "
        f"(recipes/qwen3-vl-4b, recipes/qwen3-vl-4b-lora, recipes/qwen3-vl-8b, recipes/qwen3-vl-8b-lora), or a "
        f"checkpoint of family qwen2_vl")
    done = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-3b", f"model.path={tmp_path}", "--ranks", "8")
    assert done.returncode == 2 and "of family qwen3_vl" in done.stderr, done.stderr
    # the checkpoint of the recipe's family passes, as does a Qwen3-VL recipe over the Qwen3-VL checkpoint
    load_configs(["sokoban_visual", "recipes/qwen3-vl-4b"], [f"model.path={tmp_path}"], require_checkpoint=False)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    load_configs(["sokoban_visual", "recipes/qwen2.5-vl-3b"], [f"model.path={tmp_path}"], require_checkpoint=False)


# -- the GPU check ----------------------------------------------------------------------------------------

def _one_matrix(tmp_path: Path, overrides: list[str]):
    """A config of a checkpoint holding one 1000 x 1000 language-model projection (a million parameters)."""
    header = json.dumps({"model.language_model.layers.0.mlp.up_proj.weight":
                         {"dtype": "BF16", "shape": [1000, 1000], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    cfg = load_config("sokoban_text", [f"model.path={tmp_path}", "model.dtype=bfloat16", *overrides])
    return cfg, json.loads((CONFIGS_DIR / cfg.train.deepspeed_config).read_text())


def test_gpu_total_adds_vllm_buckets_and_the_margin_hand_checked(tmp_path):
    cfg, ds = _one_matrix(tmp_path, ["train.deepspeed_config=deepspeed/zero2_bf16.json", "rollout.backend=vllm",
                                     "vllm.gpu_memory_utilization=0.25"])
    result = estimate(cfg, 2, ds, gpu_gib=40)
    # states: actor and critic, each 2 B weights + 2/2 B gradients + 12/2 B optimizer over 2 ranks
    states = 2 * (2 + 1 + 6) * 1_000_000
    # buckets: ZeRO-2 with overlap_comm: two reduce buffers, each the 1e6 parameters (less than the configured
    # 2e8), held during one engine's backward at a time, and one all-gather bucket of them, in bf16
    buckets = (2 * 1_000_000 + 1_000_000) * 2
    assert result.total_gib == pytest.approx(states / GIB, rel=1e-12)
    assert result.gpu_total_gib == pytest.approx((states + buckets) / GIB + 0.25 * 40 + MARGIN_GIB, rel=1e-12)
    assert result.problem is None and result.lines[-1].endswith("GiB of 40 GiB: fits")
    small = estimate(cfg, 2, ds, gpu_gib=20)  # 5 GiB of vLLM + the margin + states: fits 20
    assert small.problem is None
    tiny = estimate(cfg, 2, ds, gpu_gib=4)  # 1 GiB of vLLM + the 3 GiB margin + states > 4
    assert MARGIN_GIB == 3.0 and tiny.lines[-1].endswith("GiB of 4 GiB: does not fit")
    assert "does not fit a GPU of 4 GiB with 2 rank(s)" in tiny.problem and "more ranks" in tiny.problem
    # without the GPU's size, nothing is refused and vLLM's share is named as not counted
    none = estimate(cfg, 2, ds)
    assert none.gpu_total_gib is None and none.problem is None
    assert any("not counted without a GPU size (--gpu-gib G)" in line for line in none.lines)


def test_the_shipped_deepspeed_configs_set_every_bucket_they_use():
    zero3 = {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
             "stage3_max_reuse_distance"}
    for path in sorted((CONFIGS_DIR / "deepspeed").glob("*.json")):
        zero = json.loads(path.read_text())["zero_optimization"]
        wanted = {0: set(), 2: {"reduce_bucket_size", "allgather_bucket_size"}, 3: zero3}[zero["stage"]]
        assert wanted <= set(zero), f"{path.name} leaves {sorted(wanted - set(zero))} at DeepSpeed's defaults"


def test_deepspeed_holds_the_buckets_the_estimate_counts(distributed):
    """Read off real engines (one gloo rank, a 20,200-parameter model, buckets of 3,000 elements): ZeRO-2
    holds two reduce buckets with overlap_comm (one without) during backward and none after it, so the
    actor's and the critic's never coexist; ZeRO-3 holds one from the engine's start, so both engines' do."""
    import deepspeed
    import torch

    def engine(stage, overlap):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100))
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
                  "zero_optimization": {"stage": stage, "overlap_comm": overlap, "contiguous_gradients": True,
                                        "reduce_bucket_size": 3000, "allgather_bucket_size": 3000},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
        return deepspeed.initialize(model=model, config=config)[0]

    def held(optimizer):
        return sorted(b.numel() for bucket in optimizer.ipg_buckets.values()
                      for b in (bucket.buffer if isinstance(bucket.buffer, list) else [bucket.buffer]))

    for overlap, during in [(True, [3000, 3000]), (False, [3000])]:
        zero2 = engine(2, overlap)
        seen, reduce = [], zero2.optimizer.reduce_ipg_grads

        def spy(*args, reduce=reduce, optimizer=zero2.optimizer, seen=seen, **kwargs):
            seen.append(held(optimizer))
            return reduce(*args, **kwargs)

        zero2.optimizer.reduce_ipg_grads = spy
        zero2.backward(zero2(torch.randn(2, 100)).sum())
        assert seen and all(s == during for s in seen), seen
        assert held(zero2.optimizer) == []  # freed after the backward
        ds = {"zero_optimization": {"stage": 2, "overlap_comm": overlap, "reduce_bucket_size": 3000,
                                    "allgather_bucket_size": 3000}}
        assert communication_gib(ds, 4, [20_200, 20_200], 20_200, 10_000)[0] * GIB == 4 * (sum(during) + 3000)
    zero3 = engine(3, True)
    assert held(zero3.optimizer) == [3000]  # from the start, before any backward
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 3000, "stage3_max_live_parameters": 0,
                                "stage3_prefetch_bucket_size": 0}}
    assert communication_gib(ds, 4, [20_200, 20_200], 20_200, 10_000)[0] * GIB == 4 * (2 * 3000 + 10_000)


def test_zero3_buckets_count_a_reduce_bucket_per_trained_engine_and_the_live_parameters_once():
    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 100, "stage3_max_live_parameters": 1000,
                                "stage3_prefetch_bucket_size": 50}}
    gib, _ = communication_gib(ds, 2, trained=[10_000, 10_000], held=10_000, largest=500)
    assert gib * GIB == pytest.approx(2 * (2 * 100 + 1050))
    # a tensor larger than the live limit is gathered whole; a model smaller than it, at most itself
    assert communication_gib(ds, 2, [10_000], 10_000, 4000)[0] * GIB == pytest.approx(2 * (100 + 4000))
    assert communication_gib(ds, 2, [600], 600, 10)[0] * GIB == pytest.approx(2 * (100 + 600))
    # DeepSpeed's defaults where a config sets nothing: 5e8 reduce, 1e9 + 5e7 live
    big = 10**10
    assert communication_gib({"zero_optimization": {"stage": 3}}, 2, [big], big, 1)[0] * GIB == \
        pytest.approx(2 * (5e8 + 1.05e9))


def test_the_7b_recipe_is_refused_on_4_gpus_of_80_gib_and_passes_on_8(tmp_path):
    env = _fake_vllm(tmp_path)
    four = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-7b", "--ranks", "4", "--gpu-gib", "80", env=env)
    assert four.returncode == 2 and "Traceback" not in four.stderr, four.stderr
    (refusal,) = [line for line in four.stderr.splitlines() if line.startswith("config error:")]
    assert "does not fit a GPU of 80 GiB with 4 rank(s)" in refusal and "more ranks" in refusal
    assert "GPU total" in four.stdout and "does not fit" in four.stdout
    eight = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-7b", "--ranks", "8", "--gpu-gib", "80", env=env)
    assert eight.returncode == 0, eight.stderr
    assert "of 80 GiB: fits" in eight.stdout


@pytest.mark.vllm
def test_in_the_vllm_environment_the_7b_recipe_needs_8_gpus_of_80_gib():
    """The same with the real vLLM installed (.venv-vllm)."""
    assert VLLM_INSTALLED, "run in the environment scripts/vllm_env.sh builds"
    four = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-7b", "--ranks", "4", "--gpu-gib", "80")
    assert four.returncode == 2 and NO_VLLM not in four.stderr and "does not fit a GPU of 80 GiB" in four.stderr
    eight = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-7b", "--ranks", "8", "--gpu-gib", "80")
    assert eight.returncode == 0, eight.stderr
    assert eight.stderr.splitlines()[-1] == "imported: False False"


def test_check_config_raises_every_failure_with_the_estimate():
    with pytest.raises(ChecksFailed) as info:
        check_config(["sokoban_visual", "recipes/qwen2.5-vl-7b"], ["rollout.temperature=0"], 3, gpu_gib=80)
    failures = info.value.failures
    assert failures[0].startswith("rollout.temperature=0 makes training rollouts greedy")
    assert failures[1].startswith("rollout.env_groups=16 must be divisible by the 3 ranks")
    assert any("does not fit a GPU of 80 GiB with 3 rank(s)" in f for f in failures)
    assert (NO_VLLM in "\n".join(failures)) == (not VLLM_INSTALLED)
    assert any(line.startswith("  total") for line in info.value.lines)


def test_the_readme_recipe_table_is_the_tools():
    """README.md's recipe table, model states and the total with vLLM at 80 GiB, is what
    scripts/recipe_table.py prints from the recipes as they are (python scripts/recipe_table.py --write)."""
    done = subprocess.run([sys.executable, "scripts/recipe_table.py", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_gpu_size_defaults_to_the_visible_gpus(tmp_path):
    """Without --gpu-gib the check asks nvidia-smi (a stand-in on PATH here: GPUs of 81,559 and 40,960 MiB)
    for the smallest GPU CUDA_VISIBLE_DEVICES leaves visible."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho '0, GPU-1111aaaa, 81559'\necho '1, GPU-2222bbbb, 40960'\n")
    smi.chmod(0o755)
    env = _fake_vllm(tmp_path) | {"PATH": f"{smi.parent}{os.pathsep}{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0"}
    done = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-7b", "--ranks", "8", env=env)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("  GPU total")]
    assert line.endswith(" GiB of 79.6 GiB: fits"), line  # 81,559 MiB
    assert f"  vLLM       {0.4 * 81559 / 1024:6.1f} GiB" in done.stdout  # vllm.gpu_memory_utilization=0.4 of it
    done = _config_cli("sokoban_visual", "--config", "recipes/qwen2.5-vl-7b", "--ranks", "8",
                       env=env | {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert done.returncode == 2 and "does not fit a GPU of 40 GiB with 8 rank(s)" in done.stderr
