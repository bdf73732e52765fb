"""The plan and the report of scripts/gpu_smoke.sh: which runs it makes of a recipe, and what each cost on this
machine, read from what the run left behind, with one line per run to paste into an issue.

    python scripts/gpu_smoke.py plan OUT --env E --recipe R --checkpoint C --ranks N [--iterations K]
                                [--checks "recipe lora stale"] [--keep-checkpoint] [-- key=value ...]
    python scripts/gpu_smoke.py report OUT/CHECK [--check NAME --recipe R --env E --checkpoint C --ranks N --wall S]

`plan` writes, for each check it runs, OUT/<check>/train_args and OUT/<check>/check_args (one argument a line:
vagen/train.py's, and `python -m vagen.config`'s), the checks' names into OUT/checks and says why any is
skipped. Each run trains K >= 3 iterations, so that every iteration after the first samples from an engine that
slept, woke and took the updated weights, and evaluates after the last iteration's sync (eval.every=K). The
checks (`CHECKS`):
- `recipe`: the recipe as it is;
- `lora`: the recipe with LoRA adapters (model.lora_rank=16): vLLM's sleep level 1, the base kept on the host and
  the adapters served anew after each sync; skipped for a LoRA recipe, whose `recipe` run is that already;
- `stale`: rollout.max_staleness=1 (with algo.rollout_correction=tis): episodes carried over a sync and
  finished by the updated engine; skipped where rollout.backend is not vllm (the checks refuse it there).
No checkpoint is written (train.save_last=false) unless `--keep-checkpoint`, which prints the checkpoint's size
(an estimate from the parameter count) and path first.

`report` reads a check's folder: `estimate.txt` (`python -m vagen.config ... --ranks N`), `train.log`, `run/`
(its `metrics.jsonl`) and, on a GPU, `gpu_memory.csv` (`nvidia-smi --query-gpu=index,memory.used,memory.total,name
--format=csv,noheader,nounits` sampled through the run). Printed: the first iteration and the steady ones (the
mean of the others) apart, seconds per phase of the steady iterations (the metrics' `timing/` keys), the sampler's
log-prob gap per iteration (a gap that grows after the first sync means the engine samples other weights than the
trainer's), episodes carried over syncs, the evaluation after the last sync, the start-up before the first
iteration, the vLLM engine's start-up (its `[vllm] engine ... built in S s` line per rank), the peak memory of
each GPU against the estimate, and the summary line. It exits 1 when the run left fewer iterations than asked, or
no evaluation after the last sync.
"""

from __future__ import annotations

import argparse
import json
import math
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


CHECKS = ("recipe", "lora", "stale")
LORA_RANK = 16
# A gap that grows this many times over the first iteration's (before any sync), and past GAP_FLOOR, after a
# sync: the engine samples other weights than the trainer's. At rollout.max_staleness=1 the gap measures
# staleness as well (docs/training.md), so it is only reported there.
GAP_GROWTH, GAP_FLOOR = 10.0, 0.05


def _args(configs: list[str], checkpoint: str, overrides: list[str]) -> tuple[list[str], list[str]]:
    """vagen/train.py's arguments and `python -m vagen.config`'s for `configs` (an environment config, a recipe)."""
    train = [arg for config in configs for arg in ("--config", config)] + [f"model.path={checkpoint}", *overrides]
    check = [configs[0]] + [arg for config in configs[1:] for arg in ("--config", config)]
    return train, check + [f"model.path={checkpoint}", *overrides]


def checkpoint_gb(cfg) -> float | None:
    """About how many GB one checkpoint of `cfg` takes (docs/training.md, "How large a checkpoint is"): per
    trained model 16 bytes a trained parameter (14 under ZeRO-3): its weights, DeepSpeed's fp32 master and AdamW
    moments; the actor, and the critic of a gae/turn_gae run. None when the parameters cannot be counted."""
    from vagen.config import CONFIGS_DIR
    from vagen.memory import is_vision, lora_parameters, model_tensors

    tensors, _ = model_tensors(cfg.model.path)
    if tensors is None:
        return None
    sizes = [(name, math.prod(shape)) for name, shape in tensors]
    trained = sum(size for _, size in sizes)
    if cfg.model.lora_rank > 0:  # the adapters, and the vision tower unless it is frozen
        vision = sum(size for name, size in sizes if is_vision(name))
        trained = lora_parameters(tensors, set(cfg.model.lora_target_modules), cfg.model.lora_rank) + \
            (0 if cfg.model.freeze_vision else vision)
    stage = json.loads((CONFIGS_DIR / cfg.train.deepspeed_config).read_text()).get("zero_optimization", {}).get("stage", 0)
    models = 1 if cfg.algo.adv_estimator == "grpo" else 2
    return models * trained * (14 if stage == 3 else 16) / 1e9


def plan(out: Path, env: str, recipe: str, checkpoint: str, ranks: int, iterations: int, checks: list[str],
         keep_checkpoint: bool, overrides: list[str], eval_episodes: int | None = None) -> list[str]:
    """Write each check's arguments under `out` (see the module docstring); returns what to say."""
    from vagen.config import load_configs

    unknown = [name for name in checks if name not in CHECKS]
    if unknown or not checks:
        raise SystemExit(f"gpu_smoke: CHECKS={' '.join(checks)!r}: {'unknown ' + ', '.join(unknown) if unknown else 'none'}; "
                         f"choose among {', '.join(CHECKS)}")
    if iterations < 3:
        raise SystemExit(f"gpu_smoke: ITERATIONS={iterations}: at least 3, so that iterations after the first sample "
                         f"from an engine that slept, woke and took new weights, timed apart from the first")
    configs = [env, f"recipes/{recipe}"]
    base = load_configs(configs, [f"model.path={checkpoint}", *overrides], require_checkpoint=False)
    episodes = eval_episodes or 2 * ranks
    said, chosen = [], []
    for name in checks:
        extra = []
        if name == "lora":
            if base.model.lora_rank > 0:
                said.append(f"[gpu_smoke] check lora: skipped: recipes/{recipe} trains LoRA adapters itself "
                            f"(model.lora_rank={base.model.lora_rank}), so its `recipe` run goes through sleep level 1")
                continue
            extra = [f"model.lora_rank={LORA_RANK}"]
        if name == "stale":
            if base.rollout.backend != "vllm":
                said.append(f"[gpu_smoke] check stale: skipped: rollout.max_staleness carries episodes in a vLLM engine, "
                            f"and this run has rollout.backend={base.rollout.backend}")
                continue
            extra = ["rollout.max_staleness=1", "algo.rollout_correction=tis"]
        folder = out / name
        run = [f"train.iterations={iterations}", "train.resume=null", f"eval.every={iterations}",
               "eval.before_training=false", f"eval.episodes={episodes}", "eval.videos=0", "log.progress=false",
               f"train.run_dir={folder}", "train.run_name=run", f"train.save_last={'true' if keep_checkpoint else 'false'}",
               *extra]
        train, check = _args(configs, checkpoint, [*run, *overrides])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train_args").write_text("\n".join(train) + "\n")
        (folder / "check_args").write_text("\n".join(check) + "\n")
        if keep_checkpoint:
            cfg = load_configs(configs, [f"model.path={checkpoint}", *run, *overrides], require_checkpoint=False)
            size = checkpoint_gb(cfg)
            said.append(f"[gpu_smoke] check {name}: keeps its checkpoint: {folder / 'run' / 'checkpoints' / f'step_{iterations}'}, "
                        + (f"about {size:.1f} GB" if size is not None else "size unknown (parameters not counted)"))
        said.append(f"[gpu_smoke] check {name}: {iterations} iterations{', ' + ' '.join(extra) if extra else ''}, "
                    f"{episodes} evaluation episodes after the last sync"
                    + ("" if keep_checkpoint else ", no checkpoint (train.save_last=false)"))
        chosen.append(name)
    (out / "checks").write_text("".join(f"{name}\n" for name in chosen))
    return said


def report(out: Path, recipe: str, env: str, checkpoint: str, ranks: int, wall: float | None,
           check: str = "recipe", iterations: int | None = None) -> tuple[list[str], list[str]]:
    """The report's lines, the summary last, and what failed (empty: the check passed)."""
    failed = []
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("iteration", -1) >= 0]
    if not records:
        raise SystemExit(f"gpu_smoke: {out / 'run' / 'metrics.jsonl'} holds no iteration; see {out / 'train.log'}")
    if iterations is not None and len(records) < iterations:
        failed.append(f"{len(records)} of {iterations} iterations in metrics.jsonl")
    first, steady = records[0], records[1:]

    def timing(record) -> dict[str, float]:
        return {k[len("timing/"):]: v for k, v in record.items() if k.startswith("timing/") and v is not None}

    phases: dict[str, float] = {}
    for record in steady or [first]:
        for name, seconds in timing(record).items():
            phases[name] = phases.get(name, 0.0) + seconds / len(steady or [first])
    lines = [f"{check}: {len(records)} iteration(s) of {recipe} on {env}, {checkpoint}, {ranks} rank(s)"]
    first_s = timing(first).get("iteration")
    steady_s = phases.get("iteration") if steady else None
    lines.append(f"  first iteration   {first_s:8.1f} s" if first_s is not None else
                 "  first iteration: no timing/iteration in metrics.jsonl")
    if steady_s is not None:
        lines.append(f"  steady iteration  {steady_s:8.1f} s (mean of iterations 2-{len(records)}); per phase:")
    lines += [f"    {name:<14} {seconds:8.1f} s" for name, seconds in sorted(phases.items()) if name != "iteration"]
    gaps = [r.get("rollout/inference_logprob_gap") for r in records]
    if any(g is not None for g in gaps):
        lines.append("  sampler log-prob gap by iteration: " + ", ".join("-" if g is None else f"{g:.2g}" for g in gaps))
        if check != "stale" and gaps[0] is not None:
            grown = [i + 1 for i, g in enumerate(gaps[1:], 1)
                     if g is not None and g > max(GAP_GROWTH * gaps[0], GAP_FLOOR)]
            if grown:
                failed.append(f"the sampler's log-prob gap grew after a sync (iteration(s) {grown}: "
                              f"{', '.join(f'{gaps[i - 1]:.2g}' for i in grown)} against {gaps[0]:.2g} before any): "
                              f"the engine samples other weights than the trainer's")
    carried = [r.get("rollout/carried_episodes") for r in records]
    if check == "stale":
        total = sum(c or 0 for c in carried[:-1])
        lines.append(f"  episodes carried over a sync: {', '.join('-' if c is None else f'{c:.0f}' for c in carried)}")
        if not total:
            lines.append("  (none carried before the last sync: the carry-over path did not run; more turns or "
                         "groups make it likely)")
    evaluation = {k: v for k, v in records[-1].items() if k.startswith("eval/")}
    if evaluation:
        lines.append(f"  evaluation after the last sync: {evaluation.get('eval/episodes', 0):.0f} episodes, success "
                     f"{evaluation.get('eval/success', float('nan')):.2f}, format_ok {evaluation.get('eval/format_ok', float('nan')):.2f}")
    else:
        failed.append("no evaluation after the last sync in metrics.jsonl")
    startup = first["time"] - first_s if first_s is not None else None
    if startup is not None:
        lines.append(f"  start-up     {startup:8.1f} s (from the run directory's creation to the first iteration: "
                     f"models, engines)")
    if wall is not None:
        lines.append(f"  whole command {wall:7.1f} s (start-up, the iterations, the evaluation and any checkpoint)")
    log = (out / "train.log").read_text() if (out / "train.log").exists() else ""
    starts = engine_starts(log)
    engine = (f"{max(starts):.1f} s (slowest of {len(starts)} rank(s))" if starts
              else "none logged (rollout.backend=hf, or no engine)")
    lines.append(f"  vLLM engine start-up: {engine}")
    estimate = estimate_gib((out / "estimate.txt").read_text()) if (out / "estimate.txt").exists() else None
    said = f"{estimate:.1f} GiB" if estimate is not None else "none"
    memory = out / "gpu_memory.csv"
    peaks = gpu_peaks(memory.read_text()) if memory.exists() else {}
    if peaks:
        for index, (used, total, name) in sorted(peaks.items()):
            share = f", {used / estimate:.0%} of it" if estimate else ""
            lines.append(f"  GPU {index} ({name}): peak {used:.1f} of {total:.1f} GiB (estimate {said}{share})")
        peak = max(used for used, _, _ in peaks.values())
        device = f"{len(peaks)} x {next(iter(peaks.values()))[2]}"
    else:
        lines.append(f"  GPU memory: not measured (no nvidia-smi); estimate {said}")
        peak, device = None, "no GPU"
    per_phase = ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(phases.items()) if name != "iteration")
    head = f"gpu_smoke {recipe} [{check}] on {env}, {device}, {ranks} rank(s): "
    if steady_s is not None:
        summary = head + f"{steady_s:.1f} s/iteration steady ({per_phase}), first {first_s:.1f} s"
    elif first_s is not None:
        summary = head + f"{first_s:.1f} s first iteration ({per_phase})"
    else:
        summary = head + "no iteration timing"
    summary += (f"; peak {peak:.1f} GiB/GPU, estimate {said}" if peak is not None else f"; estimate {said}")
    summary += f"; vLLM start-up {max(starts):.1f} s" if starts else ""
    summary += f"; start-up {startup:.1f} s" if startup is not None else ""
    summary += f"; FAILED: {'; '.join(failed)}" if failed else ""
    lines.append(summary)
    return lines, failed


def main(argv=None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in ("plan", "report") else "report"
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--recipe", default="?")
    parser.add_argument("--env", default="?")
    parser.add_argument("--checkpoint", default="?")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=None, help="iterations each run trains (plan: 3)")
    parser.add_argument("--check", default="recipe", help="report: the check's name")
    parser.add_argument("--checks", default=" ".join(CHECKS), help="plan: the checks to run")
    parser.add_argument("--eval-episodes", type=int, default=None, help="plan: episodes of the evaluation (2 a rank)")
    parser.add_argument("--keep-checkpoint", action="store_true", help="plan: write the last iteration's checkpoint")
    parser.add_argument("--wall", type=float, default=None, help="report: seconds the training command took")
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []  # plan: key=value overrides of the recipe
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if command == "plan":
        from vagen.config import ConfigError

        try:
            said = plan(args.out, args.env, args.recipe, args.checkpoint, args.ranks, args.iterations or 3,
                        args.checks.split(), args.keep_checkpoint, overrides, args.eval_episodes)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 1
        for line in said:
            print(line)
        return 0
    lines, failed = report(args.out, args.recipe, args.env, args.checkpoint, args.ranks, args.wall, args.check,
                           args.iterations)
    for line in lines:
        print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
