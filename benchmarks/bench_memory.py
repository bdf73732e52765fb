"""Host memory per rank under ZeRO-3: each rank's peak resident memory through model build and one
training update, at 1 rank and at 2 ranks, with the models built partitioned (`vagen.train.partitioned_build`)
and, for comparison, built whole on every rank first (the way before it); prints a Markdown table.

    python benchmarks/bench_memory.py                    # Qwen2.5-0.5B's text shape, 24 layers
    python benchmarks/bench_memory.py --layers 8         # the same width with 8 layers (~0.26 B)
    python benchmarks/bench_memory.py --settings zero3-1 zero3-2 --kl
    python benchmarks/bench_memory.py --estimator grpo   # the actor alone (a 24 GiB host at 24 layers)
    python benchmarks/bench_memory.py --activations      # the estimate's activation term against measured peaks

The model is Qwen2.5-VL-shaped with random weights and the real 151,936-entry vocabulary: text hidden
896, 14 heads / 2 key-value heads, intermediate 4864 (Qwen2.5-0.5B's text shape) and a small vision tower
(depth 2, hidden 256), saved once as float32 safetensors under --cache with the built-in tiny VLM's
tokenizer and image processor. Each setting is one `vagen.train` iteration (`frozenlake_visual`, 2 levels
x 1 rollout, 1 turn of up to 4 new tokens, `deepspeed/zero3_fp32.json`, TRICO's `turn_gae`: actor and
critic; `--estimator grpo`: 2 levels x 2 rollouts and the actor alone; `--kl` adds a reference) launched by the DeepSpeed launcher, one thread per rank. Every rank
records, from /proc/self/status:

- before: VmRSS just before `build_models` (torch, DeepSpeed and the process group loaded);
- build: the peak (VmHWM) from there to the end of `build_models` (models loaded, engines made);
- update: the peak up to the end of the iteration's `ppo_update` (rollout, annotation, one optimizer step
  of each engine, whose Adam states exist from then on);
- params+optim: update minus before, the part the issue's goal is about;
- anon / file: the highest anonymous and file-backed resident sizes a sampling thread saw (every 20 ms),
  since VmHWM also counts pages of the checkpoint file that loading maps.

The run ends after the update (no checkpoint is written).

`--activations` measures instead what `vagen.memory.activation_bytes` estimates: the rise of anonymous resident
memory (RssAnon, sampled every 5 ms; the resident total, VmHWM, also moves with library pages that a loaded
machine evicts) over one forward and backward of `vagen.update.token_logprobs` (the update's path:
the backbone, then the head's float32 chunks) on a batch of random tokens, each parameter's gradient dropped
once accumulated (as ZeRO moves it into its buckets: gradients are model states, not activations), for the built-in tiny VLM and the Qwen2.5-0.5B text shape
above (random weights, built from a config in memory, nothing saved), each at two micro-batch sizes, with and
without gradient checkpointing; float32 on the CPU, one thread, text only (no frames: the tower's term is 0). MALLOC_MMAP_THRESHOLD_=65536 returns freed
tensors to the operating system, so that peaks are not hidden by memory the allocator keeps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VOCAB = 151_936
TEXT = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=32_768)
MROPE_SECTION = [8, 12, 12]  # head_dim 64: the three sections add up to 32
VISION = dict(depth=2, hidden_size=256, intermediate_size=1024, num_heads=4, out_hidden_size=896,
              fullatt_block_indexes=[1], window_size=112)

# name: (ranks, built partitioned)
SETTINGS = {"zero3-1": (1, True), "zero3-2": (2, True), "zero3-2-whole": (2, False)}

ITERATION = ["rollout.max_turns=1", "rollout.max_new_tokens=4", "train.micro_batch_size=1", "train.iterations=1", "eval.every=0",
             "log.progress=false", "log.tensorboard=false", "train.deepspeed_config=deepspeed/zero3_fp32.json"]
# two levels (one per rank at 2 ranks) of one rollout each (turn_gae), or of two (grpo compares within a level)
ESTIMATORS = {"turn_gae": ["rollout.env_groups=2", "rollout.group_size=1", "train.mini_batch_size=2",
                           "algo.adv_estimator=turn_gae"],
              "grpo": ["rollout.env_groups=2", "rollout.group_size=2", "train.mini_batch_size=4",
                       "algo.adv_estimator=grpo"]}

GIB = 2**30


# -- the model ------------------------------------------------------------------------------------

def build_checkpoint(layers: int, cache: str | Path, log: bool = False) -> tuple[Path, int]:
    """The checkpoint of `layers` text layers (built once under `cache`, `~` expanded) and its parameter
    count; with `log`, says on stderr what it is and how long building or loading took."""
    t0 = time.perf_counter()
    cache = Path(os.path.expanduser(cache))
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"qwen2_5_vl-h896-l{layers}-v{VOCAB}-fp32"
    if not (out / "model.safetensors").exists() and not list(out.glob("model-*.safetensors")):
        import torch
        from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

        from vagen.models import load_policy, resolve_model_path

        tiny = resolve_model_path("builtin:tiny-vl", str(cache / "builtin"), seed=0)
        config = AutoConfig.from_pretrained(tiny)
        text = config.get_text_config()
        for key, value in {**TEXT, "num_hidden_layers": layers}.items():
            setattr(text, key, value)
        text.rope_parameters = dict(text.rope_parameters, mrope_section=MROPE_SECTION)
        text.layer_types = ["full_attention"] * layers
        if getattr(text, "head_dim", None) is not None:
            text.head_dim = text.hidden_size // text.num_attention_heads
        for key, value in VISION.items():
            setattr(config.vision_config, key, value)
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.float32)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        load_policy(tiny)[1].save_pretrained(tmp)
        del model
        os.replace(tmp, out)
    from safetensors import safe_open

    count = 0
    for shard in out.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            count += sum(_numel(handle.get_slice(k).get_shape()) for k in handle.keys())
    if log:
        print(f"checkpoint {out}: {count / 1e9:.3f} B parameters ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return out, count


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# -- one rank (run under the DeepSpeed launcher) ------------------------------------------------------

def status(field: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


class Sampler(threading.Thread):
    """The highest RssAnon and RssFile seen since the last `reset`, sampled every `period` seconds."""

    def __init__(self, period: float = 0.02):
        super().__init__(daemon=True)
        self.period, self.anon, self.file = period, 0, 0

    def reset(self) -> None:
        self.anon, self.file = status("RssAnon"), status("RssFile")

    def run(self) -> None:
        while True:
            self.anon, self.file = max(self.anon, status("RssAnon")), max(self.file, status("RssFile"))
            time.sleep(self.period)


def worker(out: Path, whole: bool, train_args: list[str]) -> None:
    import torch

    import vagen.models
    import vagen.run
    import vagen.train
    import vagen.update

    sampler = Sampler()
    record: dict = {"loads": []}

    if whole:  # the old way: every rank builds each model whole, DeepSpeed partitions it in make_engine
        @contextlib.contextmanager
        def whole_build(cfg, dist):
            yield False

        vagen.train.partitioned_build = whole_build

    real_load_policy = vagen.models.load_policy

    def recording_load_policy(*args, **kwargs):
        model, processor = real_load_policy(*args, **kwargs)
        held = sum(p.numel() for p in model.parameters())
        total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        record["loads"].append([held, total])
        return model, processor

    vagen.models.load_policy = recording_load_policy  # build_models imports it when it runs

    real_build_models = vagen.train.build_models

    def measured_build_models(cfg, dist, *args, **kwargs):
        with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from the current size
            f.write("5")
        sampler.reset()
        record.update(rank=dist.rank, world_size=dist.world_size, before=status("VmRSS"),
                      before_anon=status("RssAnon"))
        t0 = time.perf_counter()
        models = real_build_models(cfg, dist, *args, **kwargs)
        record.update(build=status("VmHWM"), build_anon=sampler.anon, build_file=sampler.file,
                      build_s=time.perf_counter() - t0)
        record["t_after_build"] = time.perf_counter()
        return models

    vagen.train.build_models = measured_build_models

    real_ppo_update = vagen.update.ppo_update

    def measured_ppo_update(actor, critic, samples, cfg, *args, **kwargs):
        metrics = real_ppo_update(actor, critic, samples, cfg, *args, **kwargs)
        record.update(update=status("VmHWM"), update_anon=sampler.anon, update_file=sampler.file,
                      iteration_s=time.perf_counter() - record.pop("t_after_build"),
                      actor_steps=actor.global_steps, critic_steps=critic.global_steps if critic is not None else 0,
                      metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                      samples=len(samples), tokens=int(sum(s.length for s in samples)))
        (out / f"rank{record['rank']}.json").write_text(json.dumps(record))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        os._exit(0)  # nothing after the update is measured, and a checkpoint at this size takes minutes

    vagen.update.ppo_update = measured_ppo_update
    vagen.run.RunDir.maybe_save = lambda *a, **k: None
    sampler.start()
    vagen.train.main(train_args)
    raise SystemExit("vagen.train returned without reaching ppo_update")


# -- the activation term against measured peaks -----------------------------------------------------------

# name: (micro-batch sizes, tokens per sequence, trained positions per sequence); kept small enough that the
# 0.5B model's four passes take a few CPU-minutes
ACTIVATION_MODELS = {"tiny": ((1, 4), 512, 195), "0.5b": ((1, 2), 128, 96)}


def activation_model(name: str, cache: str):
    """The built-in tiny VLM (`name="tiny"`) or the Qwen2.5-0.5B text shape over its vision tower, with random
    weights, float32, built from a config (nothing is downloaded or saved)."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from vagen.models import resolve_model_path

    config = AutoConfig.from_pretrained(resolve_model_path("builtin:tiny-vl", os.path.expanduser(cache), seed=0))
    if name == "0.5b":
        text = config.get_text_config()
        for key, value in {**TEXT, "num_hidden_layers": 24}.items():
            setattr(text, key, value)
        text.rope_parameters = dict(text.rope_parameters, mrope_section=MROPE_SECTION)
        text.layer_types = ["full_attention"] * 24
        if getattr(text, "head_dim", None) is not None:
            text.head_dim = text.hidden_size // text.num_attention_heads
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.float32)
    return model, config.get_text_config().to_dict(), config.vision_config.to_dict()


def activation_worker(name: str, cache: str) -> list[dict]:
    """One row per (micro-batch, checkpointing) of model `name`: the measured rise of the peak resident memory
    over one forward and backward, and the estimate's activation term. Run with MALLOC_MMAP_THRESHOLD_ set
    (the driver does), so that freed tensors leave the resident size."""
    import gc

    import torch

    from vagen.memory import activation_bytes
    from vagen.update import token_logprobs

    torch.set_num_threads(1)
    sizes, tokens, generated = ACTIVATION_MODELS[name]
    model, text, vision = activation_model(name, cache)
    model.train()
    for p in model.parameters():  # each gradient dropped once it is accumulated, as ZeRO moves it to its buckets
        p.register_post_accumulate_grad_hook(lambda param: setattr(param, "grad", None))
    generator = torch.Generator().manual_seed(0)

    def batch(rows: int, length: int) -> dict:
        ids = torch.randint(10, text["vocab_size"], (rows, length), generator=generator)
        loss_mask = torch.zeros(rows, length, dtype=torch.long)
        loss_mask[:, -generated:] = 1
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}

    def step(inputs: dict) -> None:
        logprobs, entropies = token_logprobs(model, inputs, 1.0, with_entropy=True)
        ((logprobs + 0.001 * entropies) * inputs["loss_mask"]).sum().backward()

    step(batch(1, generated + 8))  # first-call allocations (thread pools, kernels' buffers) out of the way
    sampler = Sampler(period=0.005)
    sampler.start()
    rows = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_disable()
        for size in sizes:
            inputs = batch(size, tokens)
            gc.collect()
            before, before_anon = status("VmRSS"), status("RssAnon")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            sampler.reset()
            t0 = time.perf_counter()
            step(inputs)
            seconds = time.perf_counter() - t0
            # anonymous memory: the resident total also moves with the library pages a loaded machine evicts
            measured, hwm = max(sampler.anon, status("RssAnon")) - before_anon, status("VmHWM") - before
            estimate = activation_bytes(text, vision, sequences=size, tokens=tokens, generated=generated, patches=0,
                                        width=4, checkpointing=checkpointing)
            row = {"model": name, "parameters": sum(p.numel() for p in model.parameters()),
                         "micro_batch": size, "tokens": tokens, "generated": generated,
                         "checkpointing": checkpointing, "measured": measured, "hwm": hwm, "estimate": estimate.total,
                         "layers": estimate.layers, "backward": estimate.backward, "head": estimate.head,
                         "seconds": seconds}
            print(json.dumps(row), flush=True)  # a row at a time: a run stopped later keeps the ones before
            rows.append(row)
            del inputs
    return rows


def activation_table(rows: list[dict]) -> str:
    lines = ["| model | micro-batch x tokens | checkpointing | estimate MiB (layers + backward + head) | "
             "measured MiB | measured / estimate | s |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    mib = 2**20
    for r in rows:
        lines.append(f"| {r['model']} ({r['parameters'] / 1e9:.3f} B) | {r['micro_batch']} x {r['tokens']} | "
                     f"{'yes' if r['checkpointing'] else 'no'} | {r['estimate'] / mib:,.1f} ({r['layers'] / mib:,.1f} "
                     f"+ {r['backward'] / mib:,.1f} + {r['head'] / mib:,.1f}) | {r['measured'] / mib:,.1f} | "
                     f"{r['measured'] / r['estimate']:.2f} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def run_activations(cache: str, models: list[str]) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    rows = []
    for name in models:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--activation-worker", name,
                               "--cache", cache], env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"the {name} activation run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows


# -- the driver ----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_setting(name: str, ranks: int, partitioned: bool, model: Path, work: Path, kl: bool,
                estimator: str = "turn_gae") -> list[dict]:
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    train_args = ["--config", "frozenlake_visual", f"model.path={model}", *ITERATION, *ESTIMATORS[estimator],
                  f"algo.kl_coef={0.01 if kl else 0.0}", f"train.run_dir={out / 'runs'}", f"train.run_name={name}"]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
           str(free_port()), str(Path(__file__).resolve()), "--worker", "--out", str(out),
           *(["--whole"] if not partitioned else []), "--train-args", json.dumps(train_args)]
    t0 = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    files = sorted(out.glob("rank*.json"))
    if result.returncode != 0 or len(files) != ranks:
        raise SystemExit(f"{name} failed (exit {result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    records = [json.loads(f.read_text()) for f in files]
    print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return records


def table(results: dict[str, list[dict]], kl: bool) -> str:
    lines = ["| setting | rank | before | after build (peak) | after update (peak) | params+optim (update - before) "
             "| peak anon / file | built partitioned |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, records in results.items():
        ranks, partitioned = SETTINGS[name]
        label = f"ZeRO-3, {ranks} rank{'s' if ranks > 1 else ''}, " + ("partitioned build" if partitioned
                                                                       else "built whole first")
        if kl:
            label += ", + reference"
        for r in sorted(records, key=lambda r: r["rank"]):
            # a parameter built under deepspeed.zero.Init is an empty placeholder beside its partition
            held = {True: "yes", False: "no (whole)"}.get(all(h < t for h, t in r["loads"]), "mixed")
            if len({h < t for h, t in r["loads"]}) > 1:
                held = "mixed"
            lines.append(f"| {label} | {r['rank']} | {r['before'] / GIB:.2f} | {r['build'] / GIB:.2f} | "
                         f"{r['update'] / GIB:.2f} | {(r['update'] - r['before']) / GIB:.2f} | "
                         f"{r['update_anon'] / GIB:.2f} / {r['update_file'] / GIB:.2f} | {held} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="text decoder layers (24: Qwen2.5-0.5B)")
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--kl", action="store_true", help="also run 2 partitioned ranks with algo.kl_coef=0.01")
    parser.add_argument("--estimator", choices=sorted(ESTIMATORS), default="turn_gae",
                        help="turn_gae: actor and critic; grpo: the actor alone (at 24 layers, fits a 24 GiB host)")
    parser.add_argument("--cache", default="~/.cache/vagen/bench_memory", help="where the checkpoint is built")
    parser.add_argument("--activations", nargs="*", choices=sorted(ACTIVATION_MODELS), default=None,
                        help="measure the activation term instead (default: both models)")
    parser.add_argument("--json", default=None, help="with --activations: also write the rows as JSON")
    parser.add_argument("--activation-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--whole", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--train-args", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.out), args.whole, json.loads(args.train_args))
        return 0
    if args.activation_worker:
        activation_worker(args.activation_worker, args.cache)
        return 0
    if args.activations is not None:
        rows = run_activations(args.cache, args.activations or sorted(ACTIVATION_MODELS, reverse=True))
        print("\nOne forward and backward of vagen.update.token_logprobs, float32, one CPU thread; peak anonymous "
              "resident memory above where it stood before (each gradient dropped once accumulated)\n")
        print(activation_table(rows))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        return 0

    model, count = build_checkpoint(args.layers, args.cache, log=True)
    work = Path(tempfile.mkdtemp(prefix="vagen_bench_memory_"))
    results = {name: run_setting(name, *SETTINGS[name], model, work, kl=False, estimator=args.estimator)
               for name in args.settings}
    kl_results = ({"zero3-2": run_setting("zero3-2-kl", 2, True, model, work, kl=True, estimator=args.estimator)}
                  if args.kl else {})

    print(f"\nQwen2.5-VL shape, {count / 1e9:.3f} B parameters (text hidden 896 x {args.layers} layers, vocabulary "
          f"{VOCAB:,}), float32, ZeRO-3; {'actor + critic' if args.estimator == 'turn_gae' else 'actor alone'}; "
          "GiB per rank\n")
    print(table(results, kl=False))
    if kl_results:
        print(table(kl_results, kl=True).split("\n", 2)[2])
    one, two = results.get("zero3-1", []), results.get("zero3-2", [])
    if one and two:
        base = one[0]["update"] - one[0]["before"]
        ratios = [(r["update"] - r["before"]) / base for r in two]
        print(f"\nparams+optim at 2 ranks / at 1 rank: {', '.join(f'rank {i} {x:.2f}' for i, x in enumerate(ratios))} "
              f"(goal <= 0.60: {'met' if max(ratios) <= 0.6 else 'not met'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
