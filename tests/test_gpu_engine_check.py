"""scripts/gpu_engine_check.py without a GPU: one vLLM engine per process (vLLM's sleep-mode allocator serves
one instance per process), its arguments; the engines themselves need CUDA and run on a GPU machine."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_engine_check", ROOT / "scripts" / "gpu_engine_check.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

V1 = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
V2 = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


def _children(monkeypatch, tmp_path, answers):
    """Child processes faked: each call recorded, and answered with the next of `answers` (runner, exit status)."""
    calls = []
    monkeypatch.setattr(check, "standard_tiny_vl", lambda work: tmp_path / "tiny-vl")

    def run(cmd, **kwargs):
        calls.append(cmd)
        runner, code = answers[len(calls) - 1]
        out = json.dumps({"start_s": 1.0, "runner": runner}) + "\n" if code == 0 else ""
        return subprocess.CompletedProcess(cmd, code, stdout=out, stderr="" if code == 0 else "CuMem allocator ...")

    monkeypatch.setattr(check.subprocess, "run", run)
    return calls


def test_the_runner_check_builds_each_engine_in_a_process_of_its_own(monkeypatch, tmp_path):
    calls = _children(monkeypatch, tmp_path, [(V1, 0), (V1, 0)])
    row = check.check_runner(tmp_path)
    script = str(ROOT / "scripts" / "gpu_engine_check.py")
    assert calls == [[sys.executable, script, "engine", "rank_sizes", str(tmp_path / "tiny-vl")],
                     [sys.executable, script, "engine", "serving_defaults", str(tmp_path / "tiny-vl")]]
    assert row == {"rank_sizes": {"start_s": 1.0, "runner": V1}, "serving_defaults": {"start_s": 1.0, "runner": V1},
                   "ok": True}
    _children(monkeypatch, tmp_path, [(V1, 0), (V2, 0)])
    assert check.check_runner(tmp_path)["ok"] is False  # Model Runner V2 chosen: the pin did not hold
    _children(monkeypatch, tmp_path, [(V1, 0), (None, 134)])
    row = check.check_runner(tmp_path)
    assert row["ok"] is False and row["serving_defaults"]["error"].startswith(
        f"`engine serving_defaults {tmp_path / 'tiny-vl'}` exited with 134: CuMem allocator")


def test_all_runs_each_check_in_a_process_of_its_own_and_fails_if_one_fails(monkeypatch, tmp_path, capsys):
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd[2:])
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps({"check": cmd[2], "ok": cmd[2] != "egl"}), stderr="")

    monkeypatch.setattr(check.subprocess, "run", run)
    assert check.main(["all"]) == 1
    assert calls == [["runner"], ["linear"], ["egl"]]
    assert [json.loads(line)["ok"] for line in capsys.readouterr().out.splitlines()] == [True, True, False]


def test_an_unknown_check_prints_the_usage(capsys):
    assert check.main(["runners"]) == 2 and check.main(["engine", "huge", "/m"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == \
        "usage: python scripts/gpu_engine_check.py {runner,linear,egl,all}"
