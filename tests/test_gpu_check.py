"""scripts/gpu_check.sh and scripts/gpu_check.py on the CPU: the dry run (each step's command, time limit and
memory verdict at 80 GiB), the refusal of what the machine lacks, by name, before anything runs, a step stopped
at its limit, and the throughput report against the bandwidth bound."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
spec.loader.exec_module(gpu_check)
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_gpu  # noqa: E402


def test_the_dry_run_prints_every_step_passing_the_estimate_at_80_gib():
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                                            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpu_check dry run: 6 steps, memory verdicts at 80 GiB; the default steps' limits add "
                               "up to 450 s of 450 s")
    assert lines[1].startswith("missing here (a real run refuses these): ")
    verdicts = [line for line in lines if line.startswith("step ")]
    assert [v.split(":")[0] for v in verdicts] == ["step bandwidth", "step bench vllm", "step packing",
                                                   "step pytest -m gpu", "step engine linear", "step engine egl"]
    (packing,) = [v for v in verdicts if v.startswith("step packing")]
    command = lines[lines.index(packing) + 1].split()
    assert command[1] == "benchmarks/bench_packing.py" and command[2:8] == ["--device", "cuda", "--models", "3b",
                                                                            "--shapes", "sokoban"]
    (bench,) = [v for v in verdicts if v.startswith("step bench vllm")]
    assert "GPU total" in bench and bench.endswith("of 80 GiB: fits")
    # each step's command follows its verdict; the benchmark's carries the overrides the verdict counted
    command = lines[lines.index(bench) + 1].split()
    assert command[1:3] == ["benchmarks/bench_gpu.py", "--shape"] and command[-5:] == gpu_check.BENCH_OVERRIDES


@pytest.mark.parametrize("gpu_gib", [79.6, 80, 141])  # an H100's 81,559 MiB, the nominal 80, an H200
def test_every_step_fits_one_gpu_and_the_default_steps_fit_8_minutes(gpu_gib, tmp_path):
    plan = gpu_check.steps(tmp_path, with_hf=True, with_staleness=True, with_runner=True)
    for step in plan:
        ok, text = gpu_check.verdict(step, gpu_gib)
        assert ok, (step.name, text)
    assert sum(step.budget_s for step in plan if step.default) <= gpu_check.DEADLINE_S < 8 * 60
    assert {step.name for step in plan if not step.default} == {"bench hf", "staleness", "engine runner"}


def test_the_benchmarks_old_configuration_is_refused_by_the_estimate():
    """bench_gpu.py's defaults at the 3B shape (sokoban_visual's turn_gae: an actor and a critic, ZeRO-2 on one
    rank) are what gpu_check.sh used to run: refused, at 80 GiB and at an H200's 141."""
    for gpu_gib in (80, 141):
        old = gpu_check.Step("old", [], 1, ["--shape", "3b", "--groups", "8", "--group-size", "8", "--turns", "2",
                                            "--max-new-tokens", "128", "--iterations", "3", "--backend", "vllm"])
        ok, text = gpu_check.verdict(old, gpu_gib)
        assert not ok and f"does not fit a GPU of {gpu_gib} GiB with 1 rank(s)" in text
    # the model states of actor and critic: 2 x 16 B a parameter, unpartitioned on one rank
    args = bench_gpu.build_parser().parse_args(["--shape", "3b", "--backend", "hf"])
    assert bench_gpu.memory_estimate(args, 80).total_gib == pytest.approx(2 * 16 * 3_754_622_976 / 2**30)


def test_what_the_machine_lacks_is_refused_by_name_before_anything_runs(monkeypatch, tmp_path, capsys):
    include = tmp_path / "include"
    include.mkdir()
    (include / "Python.h").write_text("")
    monkeypatch.setattr(gpu_check.sysconfig, "get_paths", lambda: {"include": str(include)})
    present = lambda name: object()  # noqa: E731
    assert gpu_check.missing(find_spec=present, which=lambda tool: f"/usr/bin/{tool}") == []
    lacking = gpu_check.missing(find_spec=lambda name: None if name in ("pytest", "vllm") else object(),
                                which=lambda tool: None if tool == "nvidia-smi" else f"/usr/bin/{tool}")
    assert lacking == ["the Python module vllm (.[vllm])", "the Python module pytest (pip install pytest)",
                       "nvidia-smi (the NVIDIA driver's tools)"]
    (include / "Python.h").unlink()
    (headers,) = gpu_check.missing(find_spec=present, which=lambda tool: f"/usr/bin/{tool}")
    assert headers.startswith(f"the Python headers, {include / 'Python.h'}")
    no_compiler = gpu_check.missing(find_spec=present, which=lambda tool: None if tool in ("gcc", "cc") else tool)
    assert any(line.startswith("a C compiler, gcc") for line in no_compiler)
    # a real run stops at the first of them, names each and starts no step
    monkeypatch.setattr(gpu_check, "missing", lambda: lacking)
    monkeypatch.setattr(gpu_check, "run_step", lambda *a: pytest.fail("a step ran"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert gpu_check.main([]) == 1
    err = capsys.readouterr().err
    assert all(line in err for line in lacking) and gpu_check.INSTALL in err
    assert not (tmp_path / "out").exists()


def test_a_step_over_its_limit_is_stopped_with_its_children(tmp_path):
    started = tmp_path / "child.pid"
    step = gpu_check.Step("sleeper", ["bash", "-c", f"sleep 60 & echo $! > {started}; wait"], 1)
    status = gpu_check.run_step(step, tmp_path / "sleeper.log", 1)
    assert status.startswith("stopped at its limit of 1 s")
    child = int(started.read_text())

    def alive() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 10  # SIGKILL is delivered at once; the kernel may take a moment on a loaded machine
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(), f"the step's child {child} outlived its limit"
    assert gpu_check.run_step(gpu_check.Step("ok", ["true"], 5), tmp_path / "ok.log", 5) == "ok"
    failed = gpu_check.run_step(gpu_check.Step("no", ["bash", "-c", "exit 3"], 5), tmp_path / "no.log", 5)
    assert failed.startswith("failed (exit 3")


def test_the_throughput_table_sets_tokens_per_second_against_the_bandwidth_bound(tmp_path):
    row = {"backend": "vllm", "shape": "3b", "iteration_s": 30.0, "generate_s": 5.0, "generated_tokens_per_s": 4000.0,
           "update_tokens_per_s": 9000.0, "weight_sync_s": 1.5, "peak_gib": 40.0, "sequences": 32,
           "mean_response_tokens": 128.0}
    (tmp_path / "bench_vllm.json").write_text(json.dumps(row))
    (tmp_path / "bandwidth.json").write_text(json.dumps({"bytes_per_s": 2.5e12, "device": "NVIDIA H100 80GB HBM3"}))
    lines = gpu_check.throughput_table(tmp_path)
    assert lines[0] == "device-to-device copy: 2.50 TB/s (bytes read + written); nominal HBM 3.35 TB/s"
    per_step = bench_gpu.decode_bytes("3b", 32, 600 + 64)
    copy, nominal = 32 * 2.5e12 / per_step, 32 * 3.35e12 / per_step
    (vllm,) = [line for line in lines if line.startswith("| vllm")]
    assert f"| {copy:,.0f} | {4000 / copy:.0%} | {nominal:,.0f} | {4000 / nominal:.0%} |" in vllm
    (hf,) = [line for line in lines if line.startswith("| hf")]
    assert "not run or failed" in hf


def test_the_packing_table_sets_each_setting_against_micro_batches_of_one_trajectory(tmp_path):
    assert gpu_check.packing_table(tmp_path) == [f"packing: not run or failed (see {tmp_path / 'packing.log'})"]
    rows = [{"setting": "count 1", "tokens_per_s": 4000.0, "peak_mib": 2048.0, "passes": 16, "padding": 0.0},
            {"setting": "tokens 2400", "tokens_per_s": 5000.0, "peak_mib": 3072.0, "passes": 9, "padding": 0.21}]
    (tmp_path / "packing.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = gpu_check.packing_table(tmp_path)
    assert lines[2:] == ["| count 1 | 4,000 | 1.00x | 2.0 | 16 | 0.00 |", "| tokens 2400 | 5,000 | 1.25x | 3.0 | 9 | 0.21 |"]


def test_the_packing_steps_settings_are_bench_packings(tmp_path):
    """A misspelt setting would stop the step on the GPU after its imports: the names are checked here."""
    import bench_packing

    (step,) = [s for s in gpu_check.steps(tmp_path) if s.name == "packing"]
    settings = step.argv[step.argv.index("--settings") + 1].split(",")
    assert settings and all(name in bench_packing.SETTINGS for name in settings)
    assert step.argv[step.argv.index("--shapes") + 1] in bench_packing.SHAPES
