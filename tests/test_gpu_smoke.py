"""scripts/gpu_smoke.sh: its report read from a run's files (scripts/gpu_smoke.py), a refusal before anything
runs, and (slow) the whole script on the CPU with a tiny model."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_smoke)

ESTIMATE = """sokoban_visual+qwen2.5-vl-3b: every check train.py runs before loading the model passes for 2 rank(s)
  total      33.2 GiB per GPU of model states
  GPU total  40.3 GiB of 80 GiB: fits
"""


def _smoke_folder(out: Path, memory: bool = True) -> Path:
    (out / "run").mkdir(parents=True)
    (out / "estimate.txt").write_text(ESTIMATE)
    (out / "train.log").write_text("[vllm] engine of vLLM 0.11.0 built in 41.5 s on cuda:0\n"
                                   "[vllm] engine of vLLM 0.11.0 built in 43.25 s on cuda:1\n")
    record = {"iteration": 0, "time": 130.0, "timing/generate": 20.0, "timing/env": 1.5, "timing/update": 30.25,
              "timing/annotate": 8.0, "timing/iteration": 60.0, "rollout/success": 0.5}
    (out / "run" / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    if memory:  # MiB, as nvidia-smi writes them
        (out / "gpu_memory.csv").write_text("0, 1024, 81920, NVIDIA H100 80GB HBM3\n1, 2048, 81920, NVIDIA H100 80GB HBM3\n"
                                            "0, 36864, 81920, NVIDIA H100 80GB HBM3\n1, 35840, 81920, NVIDIA H100 80GB HBM3\n"
                                            "0, 20480, 81920, NVIDIA H100 80GB HBM3\n")
    return out


def test_report_reads_phases_engine_start_and_peaks_against_the_estimate(tmp_path):
    lines = gpu_smoke.report(_smoke_folder(tmp_path), "qwen2.5-vl-3b", "sokoban_visual", "/models/q", 2, 150.25)
    assert lines == [
        "one iteration of qwen2.5-vl-3b on sokoban_visual, /models/q, 2 rank(s)",
        "  annotate          8.0 s",
        "  env               1.5 s",
        "  generate         20.0 s",
        "  update           30.2 s",
        "  iteration        60.0 s",
        "  start-up         70.0 s (from the run directory's creation to the first iteration: models, engines, "
        "evaluation before training)",
        "  whole command   150.2 s (start-up, the iteration and the checkpoint written after it)",
        "vLLM engine start-up: 43.2 s (slowest of 2 rank(s))",
        "GPU 0 (NVIDIA H100 80GB HBM3): peak 36.0 of 80.0 GiB (estimate 40.3 GiB, 89% of it)",
        "GPU 1 (NVIDIA H100 80GB HBM3): peak 35.0 of 80.0 GiB (estimate 40.3 GiB, 87% of it)",
        "gpu_smoke qwen2.5-vl-3b on sokoban_visual, 2 x NVIDIA H100 80GB HBM3, 2 rank(s): 60.0 s/iteration "
        "(annotate 8.0, env 1.5, generate 20.0, update 30.2); peak 36.0 GiB/GPU, estimate 40.3 GiB; "
        "vLLM start-up 43.2 s; start-up 70.0 s",
    ]


def test_report_without_a_gpu_or_an_engine_says_what_it_did_not_measure(tmp_path):
    out = _smoke_folder(tmp_path, memory=False)
    (out / "train.log").write_text("")
    (out / "estimate.txt").write_text("memory estimate: model.path=builtin:tiny-vl is a built-in model: nothing\n")
    lines = gpu_smoke.report(out, "r", "e", "builtin:tiny-vl", 1, None)
    assert "vLLM engine start-up: none logged (rollout.backend=hf, or no engine)" in lines
    assert "GPU memory: not measured (no nvidia-smi); estimate none" in lines
    assert lines[-1] == ("gpu_smoke r on e, no GPU, 1 rank(s): 60.0 s/iteration (annotate 8.0, env 1.5, generate 20.0, "
                         "update 30.2); estimate none; start-up 70.0 s")
    # the estimate's model-state total when no --gpu-gib was given
    assert gpu_smoke.estimate_gib("  total      33.2 GiB per GPU of model states\n") == 33.2


def _smoke(tmp_path, *args, **env):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1",
                                            **env})


def test_a_recipe_the_checks_refuse_runs_nothing(tmp_path):
    done = _smoke(tmp_path, "qwen2.5-vl-3b", "/models/nowhere", "rollout.backend=hf", "train.keep_checkpoints=0",
                  RANKS="2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "train.keep_checkpoints=0 must be >= 1" in done.stdout
    assert "the checks refused this recipe on 2 rank(s): nothing was run" in done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["estimate.txt"]


@pytest.mark.slow
def test_one_iteration_of_a_recipe_on_the_cpu_with_a_tiny_model(tmp_path, model_cache):
    done = _smoke(tmp_path, "qwen2.5-vl-3b", "builtin:tiny-vl", "rollout.backend=hf", "rollout.env_groups=2",
                  "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_new_tokens=8", "train.mini_batch_size=4",
                  "train.micro_batch_size=2", "model.gradient_checkpointing=false", f"model.builtin_cache={model_cache}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    record = json.loads((out / "run" / "metrics.jsonl").read_text())
    summary = (out / "summary.txt").read_text()
    assert summary.startswith(f"gpu_smoke qwen2.5-vl-3b on sokoban_visual, no GPU, 1 rank(s): "
                              f"{record['timing/iteration']:.1f} s/iteration (annotate "), summary
    assert summary == done.stdout.splitlines()[-2] + "\n"  # printed, then the folder's name
    assert not (out / "run" / "checkpoints").exists()  # the smoke's checkpoint is removed
