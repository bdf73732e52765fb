"""The GPU checks of scripts/gpu_check.sh, for a machine with one CUDA GPU (80 GB: H100 or H200) and no network:

    bash scripts/gpu_check.sh [WHEELS] [--dry-run] [--gpu-gib G] [--with-runner] [--with-hf] [--with-staleness]
    python scripts/gpu_check.py --dry-run          # on any machine: each step's command and memory verdict

What it needs installed (`pip install -c constraints/gpu.txt -e ".[vllm,lora]" pytest hypothesis`, or the wheels
of scripts/gpu_wheels.sh): torch with CUDA, transformers, deepspeed, vllm, peft, pytest and hypothesis, vagen
itself; nvidia-smi; a C compiler and the Python headers (Triton builds its launcher with them at vLLM's first
compile). Whatever of these is missing is refused by name before anything runs.

The steps, in this order, each with a time limit; the default steps finish within DEADLINE_S from an installed
environment (7.5 minutes of steps, the rest imports and the report); a step that would overrun is
stopped at its limit and reported as such:

1. bandwidth   the GPU's device-to-device copy bandwidth, and vLLM's sampling step for 128 requests;
2. bench vllm  benchmarks/bench_gpu.py at Qwen2.5-VL-3B's shape (random weights) with vLLM rollouts, GRPO and LoRA
               r=64 (the configuration of recipes/qwen2.5-vl-3b-lora: one 80 GB GPU holds it beside vLLM's share;
               full fine-tuning with a critic would need 156 GiB), 2 iterations, so that the second samples after a
               sleep, a wake and a weight sync; its rollout throughput is printed against the bandwidth bound;
3. packing     benchmarks/bench_packing.py at the 3B shape on the GPU (bf16, gradient checkpointing): the update's
               tokens a second, peak memory and padding over 16 Sokoban trajectories with micro-batches of 1 and 4
               trajectories, token budgets of 2,400 (the recipes') and 4,096, and packed micro-batches of 4,096;
4. pytest      `pytest -m gpu` (tests/test_gpu.py: tiny models, the shipped DeepSpeed configs, CUDA against CPU
               log-probs, seeded sampling, vLLM on CUDA: sleep, waking weights first, the synced policy);
5. engine      scripts/gpu_engine_check.py linear and egl (F.linear after a ZeRO-3 build with an engine decoding
               after it; each rank's EGL device);
and beyond the 8 minutes: with --with-runner scripts/gpu_engine_check.py runner (the model runner vLLM chose and
its start-up time against vLLM's serving defaults: two engine start-ups), with --with-hf the benchmark with hf
rollouts, with --with-staleness benchmarks/bench_staleness.py's k = 0 against k = 1.

Every step that trains prints vagen's memory estimate for this GPU beside its command (`vagen.memory`, the check
`python -m vagen.config --ranks 1 --gpu-gib G` runs), and a step the estimate refuses is not started. The
rows as JSON and each step's log go to $OUT (or ./gpu_check). Imports only the standard library at the top.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# The default steps' time limits add up to at most this, the whole script's bound from an installed environment.
DEADLINE_S = 450

# Python modules every step together imports, with the install that brings each.
MODULES = {"torch": "the GPU install line", "transformers": "the GPU install line", "deepspeed": "the GPU install line",
           "vllm": ".[vllm]", "peft": ".[lora]", "pytest": "pip install pytest",
           "hypothesis": "pip install hypothesis", "vagen": "pip install -e ."}
INSTALL = 'pip install -c constraints/gpu.txt -e ".[vllm,lora]" pytest hypothesis'

# The benchmark's configuration: Qwen2.5-VL-3B's shape, 4 level groups x 8 rollouts of 2 turns x 128 new tokens
# (two optimizer steps of 16), GRPO with LoRA r=64 on one rank, 2,048 tokens a trajectory (a turn is ~600 tokens of history
# and frame), vLLM's share 0.3 of the GPU: the estimate is ~36 GiB on 80 (the full actor alone would be 78.7 GiB,
# too close to an H100's 79.6 GiB to run reliably, and with a critic 156 GiB).
BENCH = ["--shape", "3b", "--groups", "4", "--group-size", "8", "--turns", "2", "--max-new-tokens", "128",
         "--iterations", "2"]
BENCH_OVERRIDES = ["algo.adv_estimator=grpo", "model.lora_rank=64", "rollout.max_trajectory_length=2048",
                   "vllm.gpu_memory_utilization=0.3", "vllm.max_model_len=2048"]

# The packing comparison: the update's forward and backward at the 3B shape over 16 Sokoban trajectories (~10,000
# tokens), micro-batches by count, by the recipes' token budget and a larger one, and packed; no optimizer states.
PACKING = ["--device", "cuda", "--models", "3b", "--shapes", "sokoban", "--trajectories", "16",
           "--settings", "count 1,count 4,tokens 2400,tokens 4096,packed 4096"]

# Nominal HBM bandwidth of the GPUs the checks are sized for, by a word of torch.cuda.get_device_name().
NOMINAL_TB_S = {"H200": 4.8, "H100 80GB HBM3": 3.35, "H100 PCIe": 2.0, "H100 NVL": 3.9, "A100-SXM4-80GB": 2.04}


@dataclass
class Step:
    name: str
    argv: list[str]
    budget_s: int
    bench: list[str] | None = None  # bench_gpu.py's arguments, for the memory estimate
    default: bool = True
    env: dict = field(default_factory=dict)


def steps(logs: Path, with_hf: bool = False, with_staleness: bool = False, with_runner: bool = False) -> list[Step]:
    """The checks in the order they run (module docstring); the optional ones after the default ones."""
    py = sys.executable
    bench = [py, "benchmarks/bench_gpu.py", *BENCH, "--cache", str(logs / "cache")]
    out = [Step("bandwidth", [py, "scripts/gpu_check.py", "--bandwidth", str(logs / "bandwidth.json")], 20),
           Step("bench vllm", [*bench, "--backend", "vllm", "--json", str(logs / "bench_vllm.json"), *BENCH_OVERRIDES],
                200, [*BENCH, "--backend", "vllm", *BENCH_OVERRIDES]),
           Step("packing", [py, "benchmarks/bench_packing.py", *PACKING, "--cache", str(logs / "cache"), "--json",
                            str(logs / "packing.json")], 60),
           Step("pytest -m gpu", [py, "-m", "pytest", "-m", "gpu", "-q", "-x", "-p", "no:cacheprovider",
                                  "tests/test_gpu.py"], 90),
           Step("engine linear", [py, "scripts/gpu_engine_check.py", "linear"], 60),
           Step("engine egl", [py, "scripts/gpu_engine_check.py", "egl"], 20)]
    if with_runner:
        out.append(Step("engine runner", [py, "scripts/gpu_engine_check.py", "runner"], 150, default=False))
    if with_hf:
        out.append(Step("bench hf", [*bench, "--backend", "hf", "--json", str(logs / "bench_hf.json"), *BENCH_OVERRIDES],
                        240, [*BENCH, "--backend", "hf", *BENCH_OVERRIDES], default=False))
    if with_staleness:
        out.append(Step("staleness", [py, "benchmarks/bench_staleness.py", "--envs", "sokoban_visual", "--ks", "0", "1",
                                      "--seeds", "0", "--iterations", "5", "--timeout", "200", "--json",
                                      str(logs / "staleness.json")], 420, default=False))
    return out


def missing(find_spec=importlib.util.find_spec, which=shutil.which) -> list[str]:
    """What the checks need and this machine lacks, each named with how to get it."""
    problems = [f"the Python module {name} ({how})" for name, how in MODULES.items() if find_spec(name) is None]
    if which("nvidia-smi") is None:
        problems.append("nvidia-smi (the NVIDIA driver's tools)")
    if which("gcc") is None and which("cc") is None:
        problems.append("a C compiler, gcc (Triton builds its launcher with it at vLLM's first compile)")
    include = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not include.is_file():
        problems.append(f"the Python headers, {include} (python{sys.version_info.major}.{sys.version_info.minor}-dev: "
                        f"Triton compiles against them)")
    return problems


def verdict(step: Step, gpu_gib: float) -> tuple[bool, str]:
    """Whether vagen's memory estimate passes the step's training configuration on one GPU of `gpu_gib`, and
    the estimate's last line (or why there is nothing to estimate)."""
    if step.name == "packing":
        return True, ("the 3B shape's bf16 weights and gradients (14 GiB) and one micro-batch's checkpointed "
                      "activations; no optimizer states")
    if step.bench is None:
        return True, ("tiny models (the built-in, well under a million parameters): nothing to estimate"
                      if step.name.startswith(("pytest", "engine", "staleness")) else "trains nothing")
    import bench_gpu

    result = bench_gpu.memory_estimate(bench_gpu.build_parser().parse_args(step.bench), gpu_gib)
    if result.gpu_total_gib is None:
        return True, result.lines[0].strip()
    line = next(line for line in result.lines if line.startswith("  GPU total")).strip()
    return result.problem is None, line if result.problem is None else f"{line}: {result.problem}"


def bandwidth(path: Path) -> None:
    """The device-to-device copy bandwidth (bytes read + written a second) and vLLM's sampling step for 128
    requests at Qwen's vocabulary, without and with a seed per request, as one JSON row in `path`."""
    import torch

    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    row = {"bytes_per_s": 2 * 20 * x.numel() / (start.elapsed_time(end) / 1e3), "device": torch.cuda.get_device_name(),
           "total_gib": torch.cuda.mem_get_info()[1] / 2**30}
    del x, y
    try:  # vLLM's own sampler (vllm.seeded_requests: each seeded row draws its noise in a loop of its own)
        from vllm.v1.sample.ops.topk_topp_sampler import random_sample
    except ImportError as err:
        row["sampler"] = f"not measured: {err}"
    else:
        probs = torch.randn(128, 151_936, device="cuda").softmax(-1)
        generators = {i: torch.Generator(device="cuda").manual_seed(i) for i in range(128)}
        for name, gens in (("sample_ms_unseeded", {}), ("sample_ms_seeded", generators)):
            for _ in range(3):
                random_sample(probs, gens)
            torch.cuda.synchronize()
            start.record()
            for _ in range(50):
                random_sample(probs, gens)
            end.record()
            torch.cuda.synchronize()
            row[name] = start.elapsed_time(end) / 50
    path.write_text(json.dumps(row) + "\n")


def throughput_table(logs: Path) -> list[str]:
    """The benchmark's rows: generated tokens a second against the bound of reading the weights and every running
    sequence's keys and values once per decode step (`bench_gpu.decode_bytes`) at the measured copy bandwidth
    and, where the GPU is known, at its nominal HBM bandwidth."""
    from bench_gpu import decode_bytes

    measured = json.loads((logs / "bandwidth.json").read_text()) if (logs / "bandwidth.json").exists() else {}
    copy = measured.get("bytes_per_s")
    nominal = next((tb * 1e12 for word, tb in NOMINAL_TB_S.items() if word in measured.get("device", "")), None)
    lines = []
    if copy:
        lines.append(f"device-to-device copy: {copy / 1e12:.2f} TB/s (bytes read + written)"
                     + (f"; nominal HBM {nominal / 1e12:.2f} TB/s" if nominal else ""))
    if "sample_ms_seeded" in measured:
        lines.append(f"vLLM's sampling step for 128 requests at a 151,936 vocabulary: {measured['sample_ms_unseeded']:.2f} "
                     f"ms unseeded, {measured['sample_ms_seeded']:.2f} ms with a seed per request")
    lines += ["| backend | s / iteration | generate s | generated tok/s | bound tok/s (copy) | share | "
              "bound tok/s (nominal) | share | update tok/s | sync s | peak GiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for backend in ("vllm", "hf"):
        path = logs / f"bench_{backend}.json"
        if not path.exists():
            lines.append(f"| {backend} | not run or failed (see {logs / f'bench_{backend}.log'}) |")
            continue
        r = json.loads(path.read_text())
        # mean context while decoding: a turn's prompt (~600 tokens of history and frame) plus half the response;
        # the smaller context makes the bound the generous one
        per_step = decode_bytes(r["shape"], r["sequences"], 600 + r["mean_response_tokens"] / 2)
        bounds = [r["sequences"] * bw / per_step if bw else None for bw in (copy, nominal)]
        cells = [f"{b:,.0f} | {r['generated_tokens_per_s'] / b:.0%}" if b else "- | -" for b in bounds]
        lines.append(f"| {backend} | {r['iteration_s']:.1f} | {r['generate_s']:.1f} | {r['generated_tokens_per_s']:,.0f} | "
                     f"{cells[0]} | {cells[1]} | {r['update_tokens_per_s']:,.0f} | {r['weight_sync_s']:.2f} | "
                     f"{r['peak_gib']:.1f} |")
    return lines


def packing_table(logs: Path) -> list[str]:
    """The packing step's rows (bench_packing.py --json: one JSON row per setting, written as each is measured),
    with each setting's update tokens a second over micro-batches of one trajectory's."""
    path = logs / "packing.json"
    if not path.exists():
        return [f"packing: not run or failed (see {logs / 'packing.log'})"]
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    base = next((r["tokens_per_s"] for r in rows if r["setting"] == "count 1"), None)
    lines = ["| update micro-batches (3B shape, 16 Sokoban trajectories) | tokens/s | over count 1 | peak GiB | passes "
             "| padding |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['setting']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['peak_mib'] / 1024:.1f} | "
                     f"{r['passes']} | {r['padding']:.2f} |")
    return lines


def run_step(step: Step, log: Path, limit: int) -> str:
    """Run `step` with its output in `log`, in a process group of its own that is killed whole (an engine's
    workers included) at `limit` seconds; "ok" or what went wrong."""
    import signal

    with open(log, "w") as handle:
        process = subprocess.Popen(step.argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                   env={**os.environ, **step.env}, start_new_session=True)
        try:
            code = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return f"stopped at its limit of {limit} s ({log})"
    return "ok" if code == 0 else f"failed (exit {code}; {log})"


def gpu_memory_gib() -> float:
    import torch

    return torch.cuda.mem_get_info()[1] / 2**30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="print what is missing here, each step's command, time limit and memory verdict; run nothing")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="the GPU's memory for the verdicts (default: the GPU's own; 80 with --dry-run)")
    parser.add_argument("--with-runner", action="store_true",
                        help="also scripts/gpu_engine_check.py runner (two engine start-ups, ~2 minutes more)")
    parser.add_argument("--with-hf", action="store_true", help="also the benchmark with hf rollouts (~4 minutes more)")
    parser.add_argument("--with-staleness", action="store_true",
                        help="also bench_staleness.py k = 0 against 1 (~7 minutes more)")
    parser.add_argument("--bandwidth", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bandwidth:
        bandwidth(Path(args.bandwidth))
        return 0
    logs = Path(os.environ.get("OUT") or ROOT / "gpu_check")
    plan = steps(logs, args.with_hf, args.with_staleness, args.with_runner)
    lacking = missing()
    if args.dry_run:
        gpu_gib = args.gpu_gib or 80.0
        print(f"gpu_check dry run: {len(plan)} steps, memory verdicts at {gpu_gib:g} GiB; the default steps' limits add "
              f"up to {sum(s.budget_s for s in plan if s.default)} s of {DEADLINE_S} s")
        print("missing here (a real run refuses these): " + ("; ".join(lacking) if lacking else "nothing"))
        fits = True
        for step in plan:
            ok, text = verdict(step, gpu_gib)
            fits &= ok
            print(f"step {step.name}: limit {step.budget_s} s{'' if step.default else ' (optional)'}; memory: {text}")
            print("  " + shlex.join(step.argv))
        return 0 if fits else 1
    if lacking:
        print("gpu_check: this machine lacks what the checks need:\n  " + "\n  ".join(lacking)
              + f"\ninstall the GPU set ({INSTALL}, docs/installation.md) or pass a wheel folder of "
                f"scripts/gpu_wheels.sh: bash scripts/gpu_check.sh WHEELS", file=sys.stderr)
        return 1
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda}); "
              f"it needs one GPU and torch built with CUDA", file=sys.stderr)
        return 1
    logs.mkdir(parents=True, exist_ok=True)
    gpu_gib = args.gpu_gib or gpu_memory_gib()
    import importlib.metadata as md

    names = ["torch", "transformers", "deepspeed", "vllm", "peft"]
    versions = ", ".join(f"{n} {md.version(n)}" for n in names)
    print(f"gpu_check on {torch.cuda.get_device_name()} ({gpu_gib:.1f} GiB), CUDA {torch.version.cuda}: {versions}")
    (logs / "versions.txt").write_text(versions + "\n")
    started = time.monotonic()
    deadline = DEADLINE_S + sum(s.budget_s for s in plan if not s.default)
    results = []
    for step in plan:
        ok, text = verdict(step, gpu_gib)
        left = deadline - (time.monotonic() - started)
        stamp = f"[gpu_check {time.monotonic() - started:4.0f} s]"
        print(f"{stamp} {step.name}: memory {text}", flush=True)
        if not ok:
            results.append((step, "refused by the memory estimate", 0.0))
            continue
        if left < 10:
            results.append((step, "not started: the 8 minutes were spent", 0.0))
            continue
        limit = int(min(step.budget_s, left))
        log = logs / f"{step.name.replace(' ', '_').replace('-', '')}.log"
        t0 = time.monotonic()
        status = run_step(step, log, limit)
        seconds = time.monotonic() - t0
        results.append((step, status, seconds))
        print(f"{stamp} {step.name}: {status} in {seconds:.1f} s (limit {limit} s)", flush=True)
        if status != "ok":
            print("  the end of its log:\n    " + "\n    ".join(log.read_text().splitlines()[-15:]))
    print(f"\ngpu_check: {time.monotonic() - started:.0f} s in all")
    print("| step | result | s | limit s |\n| --- | --- | --- | --- |")
    for step, status, seconds in results:
        print(f"| {step.name} | {status} | {seconds:.1f} | {step.budget_s} |")
    print()
    print("\n".join(throughput_table(logs)))
    print()
    print("\n".join(packing_table(logs)))
    if (logs / "staleness.json").exists():
        subprocess.run([sys.executable, "benchmarks/bench_staleness.py", "--table", str(logs / "staleness.json")],
                       cwd=ROOT)
    return 0 if all(status == "ok" for _, status, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
