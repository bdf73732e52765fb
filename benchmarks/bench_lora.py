"""LoRA against full fine-tuning on CPU: trainable parameters, optimizer-state bytes, peak resident memory,
update tokens/s, and whether KL loads a reference copy; prints a Markdown table.

    python benchmarks/bench_lora.py                        # full, LoRA r=8, LoRA r=64; KL off and on
    python benchmarks/bench_lora.py --settings lora8 --kl off
    python benchmarks/bench_lora.py --layers 8             # the same width with 8 layers (~0.26 B)
    python benchmarks/bench_lora.py --steps 3 --kl-steps 1 # KL-on settings: memory and the reference only

The model is `benchmarks/bench_memory.py`'s (`build_checkpoint`): Qwen2.5-VL-shaped with random weights,
Qwen2.5-0.5B's text shape (hidden 896, 24 layers), the real 151,936-entry vocabulary and a small vision
tower, 0.498 B parameters, float32. Each setting is one process of plain `python -m vagen.train`-style
training (`vagen.train.main`, one rank, one thread, `deepspeed/zero0_fp32.json`, `frozenlake_visual`,
GRPO: 2 levels x 2 rollouts, 1 turn of up to 4 new tokens, mini-batch 4, micro-batch 1), run for
`--steps` iterations, each one optimizer step through `vagen.update.ppo_update`. LoRA settings add
`model.lora_rank=r model.lora_alpha=2r` on the default targets (the language model's attention and MLP
projections; the vision tower frozen). KL on is `algo.kl_coef=0.01`. Each setting records:

- trainable: parameters that require a gradient in the actor's engine (what reaches the optimizer);
- optimizer states: the bytes of every tensor in the optimizer's state after its steps (AdamW's
  exp_avg and exp_avg_sq, and its step counters), read from `optimizer.state`;
- peak RSS: the process's VmHWM (/proc/self/status) at the end of the first update (settings with
  different step counts compare there) and of the last, and VmRSS just before `build_models` (torch and
  DeepSpeed loaded) for comparison;
- models loaded: calls of `vagen.models.load_policy` during `build_models`, and the reference's
  parameters that are not the actor's (0 when the reference is the actor with adapters disabled);
- update tokens/s: the tokens of the update's sequences (prompt and response) over the wall time of
  `ppo_update`, and over the process's CPU time in it (which a machine busy with other work inflates
  less), over every step but the first (which allocates the optimizer states); none with one step. The
  machine's 5-minute load average at the end is recorded beside them.

The parent watches each child's resident memory and stops it above `--max-rss-gib` (or when the machine's
available memory falls below `--min-free-gib`); a stopped setting is reported with what its build loaded and
the resident size it was stopped at. No checkpoint is written. MALLOC_MMAP_THRESHOLD_=65536 returns freed
tensors to the operating system, so that peaks are not hidden by memory the allocator keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_memory import ESTIMATORS, GIB, ITERATION, VOCAB, build_checkpoint, status  # noqa: E402

# name: (label, LoRA rank; 0 = full fine-tuning)
SETTINGS = {"full": ("full fine-tuning", 0), "lora8": ("LoRA r=8", 8), "lora64": ("LoRA r=64", 64)}
KL_COEF = 0.01
MIB = 2**20


# -- one setting (a child process) ----------------------------------------------------------------------

def optimizer_state_bytes(engine) -> int:
    """Bytes of every tensor in the state of the engine's optimizer (unwrapping DeepSpeed's wrappers)."""
    import torch

    optimizer = engine.optimizer
    while hasattr(optimizer, "optimizer"):  # DeepSpeed's ZeRO and mixed-precision wrappers hold the torch one
        optimizer = optimizer.optimizer
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def worker(out: Path, steps: int, train_args: list[str]) -> None:
    import torch

    import vagen.models
    import vagen.run
    import vagen.train
    import vagen.update

    record: dict = {"loads": 0, "updates": []}

    real_load_policy = vagen.models.load_policy

    def counting_load_policy(*args, **kwargs):
        record["loads"] += 1
        return real_load_policy(*args, **kwargs)

    vagen.models.load_policy = counting_load_policy  # build_models imports it when it runs

    real_build_models = vagen.train.build_models

    def measured_build_models(cfg, dist, *args, **kwargs):
        record["before"] = status("VmRSS")
        models = real_build_models(cfg, dist, *args, **kwargs)
        record["after_build"] = status("VmRSS")
        module = models.actor.module
        record["params"] = sum(p.numel() for p in module.parameters())
        record["trainable"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
        reference = models.reference
        record["reference"] = None if reference is None else type(reference).__name__
        if reference is not None:
            own = {p.data_ptr() for p in module.parameters()}
            ref_module = getattr(reference, "module", reference)
            record["reference_extra_params"] = sum(p.numel() for p in ref_module.parameters()
                                                   if p.data_ptr() not in own)
        (out / "build.json").write_text(json.dumps(record))  # what the driver reports if it stops this setting
        return models

    vagen.train.build_models = measured_build_models

    real_ppo_update = vagen.update.ppo_update

    def measured_ppo_update(actor, critic, samples, cfg, *args, **kwargs):
        t0, cpu0 = time.perf_counter(), time.process_time()
        metrics = real_ppo_update(actor, critic, samples, cfg, *args, **kwargs)
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
        record["updates"].append({"seconds": seconds, "cpu_seconds": cpu_seconds, "tokens": int(sum(s.length for s in samples)),
                                  "samples": len(samples), "optimizer_steps": actor.global_steps,
                                  "optimizer_state_bytes": optimizer_state_bytes(actor),
                                  "peak": status("VmHWM")})
        if len(record["updates"]) == steps:
            record["peak"] = status("VmHWM")
            record["load_average"] = os.getloadavg()[1]  # the machine's, over the last 5 minutes
            record["metrics"] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            (out / "record.json").write_text(json.dumps(record))
            os._exit(0)  # nothing after the last update is measured
        return metrics

    vagen.update.ppo_update = measured_ppo_update
    vagen.run.RunDir.maybe_save = lambda *a, **k: None
    torch.set_num_threads(1)
    vagen.train.main(train_args)
    raise SystemExit("vagen.train returned before the last measured update")


# -- the driver ----------------------------------------------------------------------------------------

def rss_of(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available() -> int:
    """MemAvailable of the machine in bytes."""
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def run_setting(name: str, kl: bool, model: Path, work: Path, steps: int, max_rss: float, min_free: float) -> dict:
    rank = SETTINGS[name][1]
    tag = f"{name}-kl" if kl else name
    out = work / tag
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    iteration = [a for a in ITERATION if not a.startswith(("train.deepspeed_config=", "train.iterations="))]
    lora = [f"model.lora_rank={rank}", f"model.lora_alpha={2 * rank}"] if rank else ["model.lora_rank=0"]
    train_args = ["--config", "frozenlake_visual", f"model.path={model}", *iteration, *ESTIMATORS["grpo"], *lora,
                  f"train.iterations={steps}", "train.deepspeed_config=deepspeed/zero0_fp32.json",
                  f"algo.kl_coef={KL_COEF if kl else 0.0}", f"train.run_dir={out / 'runs'}", f"train.run_name={tag}"]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out), "--steps", str(steps),
           "--train-args", json.dumps(train_args)]
    record_file = out / "record.json"
    if record_file.exists():  # measured by an earlier call with the same --work folder
        record = dict(json.loads(record_file.read_text()), name=name, kl=kl)
        print(f"{tag}: from {record_file}", file=sys.stderr, flush=True)
        return record
    t0 = time.perf_counter()
    log = open(out / "log.txt", "w")
    child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    highest = 0
    while child.poll() is None:
        highest = max(highest, rss_of(child.pid))
        if highest > max_rss * GIB or available() < min_free * GIB:
            child.kill()
            child.wait()
            log.close()
            if not (out / "build.json").exists():
                raise SystemExit(f"{tag} stopped at {highest / GIB:.1f} GiB resident before its models were built")
            # the models were built (what was loaded is known); the peak is at least where it was stopped
            record = json.loads((out / "build.json").read_text())
            record.update(name=name, kl=kl, stopped=True, peak=highest, wall_s=time.perf_counter() - t0)
            record_file.write_text(json.dumps(record))
            print(f"{tag}: stopped at {highest / GIB:.2f} GiB resident (--max-rss-gib {max_rss}, --min-free-gib "
                  f"{min_free})", file=sys.stderr, flush=True)
            return record
        time.sleep(0.2)
    log.close()
    if child.returncode != 0 or not record_file.exists():
        raise SystemExit(f"{tag} failed (exit {child.returncode}):\n{(out / 'log.txt').read_text()[-4000:]}")
    record = json.loads(record_file.read_text())
    record.update(name=name, kl=kl, wall_s=time.perf_counter() - t0)
    record_file.write_text(json.dumps(record))
    print(f"{tag}: {record['wall_s']:.0f} s, peak {record['peak'] / GIB:.2f} GiB", file=sys.stderr, flush=True)
    return record


def tokens_per_second(record: dict) -> str:
    """Tokens per second of wall time and per CPU-second, and seconds per update, over every update but the
    first (which allocates the optimizer states)."""
    updates = record["updates"][1:]
    if record.get("stopped") or not updates:
        return "– | – | –"
    tokens, seconds = sum(u["tokens"] for u in updates), sum(u["seconds"] for u in updates)
    cpu = sum(u.get("cpu_seconds", float("nan")) for u in updates)
    return f"{tokens / seconds:.1f} | {tokens / cpu:.1f} | {seconds / len(updates):.0f}"


def table(records: list[dict]) -> str:
    full = next((r for r in records if r["name"] == "full" and not r["kl"] and not r.get("stopped")), None)
    lines = ["| setting | KL | trainable parameters | optimizer states (MiB) | vs full | peak RSS after update 1 (GiB) | at the end (GiB) "
             "| RSS before build (GiB) | models loaded | reference (params beyond the actor's) "
             "| update tokens/s | update tokens / CPU-s | s / update | load average |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in records:
        if r.get("stopped"):
            state, versus, peak = "–", "–", f"≥ {r['peak'] / GIB:.2f} (stopped) | –"
        else:
            state = r["updates"][-1]["optimizer_state_bytes"]
            versus = f"{state / full['updates'][-1]['optimizer_state_bytes']:.2%}" if full else "–"
            state, peak = f"{state / MIB:,.1f}", f"{r['updates'][0]['peak'] / GIB:.2f} | {r['peak'] / GIB:.2f}"
        reference = "none" if r["reference"] is None else f"{r['reference']} ({r['reference_extra_params']:,})"
        lines.append(f"| {SETTINGS[r['name']][0]} | {'on' if r['kl'] else 'off'} | {r['trainable']:,} "
                     f"({r['trainable'] / r['params']:.2%}) | {state} | {versus} | {peak} "
                     f"| {r['before'] / GIB:.2f} | {r['loads']} | {reference} | {tokens_per_second(r)} "
                     f"| {r.get('load_average', float('nan')):.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="text decoder layers (24: Qwen2.5-0.5B)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--kl", choices=["off", "on", "both"], default="both",
                        help=f"algo.kl_coef=0 (off), {KL_COEF} (on), or each setting both ways")
    parser.add_argument("--steps", type=int, default=3, help="training iterations (one optimizer step each)")
    parser.add_argument("--kl-steps", type=int, default=None,
                        help="training iterations of the KL-on settings (default --steps; 1 measures memory alone)")
    parser.add_argument("--max-rss-gib", type=float, default=12.0, help="stop a setting whose process passes this")
    parser.add_argument("--min-free-gib", type=float, default=1.5,
                        help="stop a setting when the machine's available memory falls below this")
    parser.add_argument("--cache", default="~/.cache/vagen/bench_memory", help="where the checkpoint is built")
    parser.add_argument("--json", help="also write the records here")
    parser.add_argument("--work", help="folder of the per-setting records (default: a new temporary one); settings "
                                       "already measured there are read back, not run again")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--train-args", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.out), args.steps, json.loads(args.train_args))
        return 0

    model, count = build_checkpoint(args.layers, args.cache, log=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vagen_bench_lora_"))
    print(f"records under {work}", file=sys.stderr)
    kls = {"off": [False], "on": [True], "both": [False, True]}[args.kl]
    kl_steps = args.kl_steps or args.steps
    records = [run_setting(name, kl, model, work, kl_steps if kl else args.steps, args.max_rss_gib, args.min_free_gib)
               for kl in kls for name in args.settings]
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))

    measured = [r for r in records if not r.get("stopped")]
    tokens = measured[0]["updates"][-1]["tokens"]
    print(f"\nQwen2.5-VL shape, {count / 1e9:.3f} B parameters (text hidden 896 x {args.layers} layers, vocabulary "
          f"{VOCAB:,}), float32, ZeRO-0, one process, one thread; GRPO, the actor alone; {args.steps} updates "
          f"(KL on: {kl_steps}) of {measured[0]['updates'][-1]['samples']} sequences ({tokens} tokens in the last)\n")
    print(table(records))
    full = next((r for r in records if r["name"] == "full" and not r.get("stopped")), None)
    lora8 = next((r for r in records if r["name"] == "lora8" and not r.get("stopped")), None)
    if full and lora8:
        ratio = lora8["updates"][-1]["optimizer_state_bytes"] / full["updates"][-1]["optimizer_state_bytes"]
        print(f"\noptimizer states, LoRA r=8 / full fine-tuning: {ratio:.2%} (goal <= 2%: "
              f"{'met' if ratio <= 0.02 else 'not met'})")
    with_kl = [r for r in records if r["kl"] and r["name"] != "full"]
    if with_kl:
        copies = [r["loads"] - 1 + (r["reference_extra_params"] > 0) for r in with_kl]
        print(f"LoRA with KL on: {'no' if not any(copies) else 'a'} reference copy "
              f"(models loaded: {', '.join(str(r['loads']) for r in with_kl)}; reference parameters beyond the actor's: "
              f"{', '.join(str(r['reference_extra_params']) for r in with_kl)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
