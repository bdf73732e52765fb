"""The report of scripts/gpu_smoke.sh: what one iteration of a recipe cost on this machine, read from what the
run left behind, and one line to paste into an issue.

    python scripts/gpu_smoke.py OUT [--recipe R --env E --checkpoint C --ranks N --wall S]

OUT is the folder gpu_smoke.sh filled: `estimate.txt` (`python -m vagen.config ... --ranks N`), `train.log`
(the training command's output), `run/` (the run directory: its `metrics.jsonl`) and, on a GPU,
`gpu_memory.csv` (`nvidia-smi --query-gpu=index,memory.used,memory.total,name --format=csv,noheader,nounits`
sampled through the run). Printed: seconds per phase of the iteration (the metrics' `timing/` keys), the
start-up before the first iteration, the vLLM engine's start-up (its `[vllm] engine ... built in S s` line
per rank), the peak memory of each GPU against the estimate, and the summary line.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def estimate_gib(text: str) -> float | None:
    """The per-GPU estimate of `python -m vagen.config --ranks N` output: the GPU total with `--gpu-gib`, else
    the model states' total; None when it estimated nothing (a built-in model)."""
    for pattern in (r"GPU total\s+([\d.]+) GiB", r"total\s+([\d.]+) GiB per GPU"):
        found = re.search(pattern, text)
        if found:
            return float(found.group(1))
    return None


def engine_starts(log: str) -> list[float]:
    """Seconds each rank's vLLM engine took to start, in the order they were logged."""
    return [float(s) for s in re.findall(r"\[vllm\] engine of vLLM \S+ built in ([\d.]+) s", log)]


def gpu_peaks(csv: str) -> dict[int, tuple[float, float, str]]:
    """GPU index -> (peak memory used, memory total) in GiB and its name, from nvidia-smi's samples."""
    peaks: dict[int, tuple[float, float, str]] = {}
    for line in csv.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0].isdigit():
            continue
        index, used, total = int(fields[0]), float(fields[1]) / 1024, float(fields[2]) / 1024
        name = ",".join(fields[3:])
        if index not in peaks or used > peaks[index][0]:
            peaks[index] = (used, total, name)
    return peaks


def report(out: Path, recipe: str, env: str, checkpoint: str, ranks: int, wall: float | None) -> list[str]:
    """The report's lines, the summary last."""
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"gpu_smoke: {out / 'run' / 'metrics.jsonl'} holds no iteration; see {out / 'train.log'}")
    record = records[-1]
    timing = {k[len("timing/"):]: v for k, v in record.items() if k.startswith("timing/") and v is not None}
    lines = [f"one iteration of {recipe} on {env}, {checkpoint}, {ranks} rank(s)"]
    lines += [f"  {name:<12} {seconds:8.1f} s" for name, seconds in sorted(timing.items()) if name != "iteration"]
    per_iteration = timing.get("iteration")
    lines.append(f"  {'iteration':<12} {per_iteration:8.1f} s" if per_iteration is not None else
                 "  iteration: no timing/iteration in metrics.jsonl")
    startup = record["time"] - per_iteration if per_iteration is not None else None
    if startup is not None:
        lines.append(f"  start-up     {startup:8.1f} s (from the run directory's creation to the first iteration: "
                     f"models, engines, evaluation before training)")
    if wall is not None:
        lines.append(f"  whole command {wall:7.1f} s (start-up, the iteration and the checkpoint written after it)")
    log = (out / "train.log").read_text() if (out / "train.log").exists() else ""
    starts = engine_starts(log)
    engine = (f"{max(starts):.1f} s (slowest of {len(starts)} rank(s))" if starts
              else "none logged (rollout.backend=hf, or no engine)")
    lines.append(f"vLLM engine start-up: {engine}")
    estimate = estimate_gib((out / "estimate.txt").read_text()) if (out / "estimate.txt").exists() else None
    said = f"{estimate:.1f} GiB" if estimate is not None else "none"
    memory = out / "gpu_memory.csv"
    peaks = gpu_peaks(memory.read_text()) if memory.exists() else {}
    if peaks:
        for index, (used, total, name) in sorted(peaks.items()):
            share = f", {used / estimate:.0%} of it" if estimate else ""
            lines.append(f"GPU {index} ({name}): peak {used:.1f} of {total:.1f} GiB (estimate {said}{share})")
        peak = max(used for used, _, _ in peaks.values())
        device = f"{len(peaks)} x {next(iter(peaks.values()))[2]}"
    else:
        lines.append(f"GPU memory: not measured (no nvidia-smi); estimate {said}")
        peak, device = None, "no GPU"
    phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(timing.items()) if name != "iteration")
    summary = (f"gpu_smoke {recipe} on {env}, {device}, {ranks} rank(s): "
               f"{per_iteration:.1f} s/iteration ({phases})" if per_iteration is not None else
               f"gpu_smoke {recipe} on {env}, {device}, {ranks} rank(s): no iteration timing")
    summary += (f"; peak {peak:.1f} GiB/GPU, estimate {said}" if peak is not None else f"; estimate {said}")
    summary += f"; vLLM start-up {max(starts):.1f} s" if starts else ""
    summary += f"; start-up {startup:.1f} s" if startup is not None else ""
    lines.append(summary)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--recipe", default="?")
    parser.add_argument("--env", default="?")
    parser.add_argument("--checkpoint", default="?")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--wall", type=float, default=None, help="seconds the training command took")
    args = parser.parse_args(argv)
    for line in report(args.out, args.recipe, args.env, args.checkpoint, args.ranks, args.wall):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
