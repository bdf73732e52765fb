"""Update throughput by micro-batch planning: count-based micro-batches of 1 and 4 trajectories, micro-batches
cut by a token budget (`train.micro_batch_tokens`), and packed micro-batches (`train.pack_sequences`), on
multi-turn trajectories of the shapes real checkpoints write.

    python benchmarks/bench_packing.py                      # tiny model and the 0.5B-shaped one (2 layers)
    python benchmarks/bench_packing.py --layers 24          # the 0.5B shape whole (slow on a CPU)
    python benchmarks/bench_packing.py --models 0.5b --shapes navigation --trajectories 4
    python benchmarks/bench_packing.py --device cuda --models 3b --shapes sokoban --trajectories 16 \
        --settings "count 1,count 4,tokens 2400,tokens 4096,packed 4096"    # a GPU (scripts/gpu_check.sh)

Trajectories: 8 per batch (`--trajectories`), real frames of the environment (one per turn) and random response tokens of
between half and all of a turn's budget: navigation 1 to 5 turns of up to 256 tokens, Sokoban 1 to 3 turns of
up to 200 (the real-model budgets of `configs/navigation_visual.yaml` and `sokoban_visual.yaml`). On a CPU each
setting runs in a fresh process, one thread, float32: the forward and backward of the policy-gradient loss over
every micro-batch of the batch (as `vagen.update.train_minibatch` runs the actor), once for the memory peak and
once timed. Columns: trained tokens per second (real tokens, padding excluded), the growth of the process's peak
resident memory over the first pass (model and trajectories already in memory), the passes, and the padding
fraction (the share of the tokens run that were padding). The 0.5B-shaped model is `benchmarks/bench_memory.py`'s
(hidden 896, the real 151,936-entry vocabulary), with `--layers` of its 24 layers. With `--device cuda` every
setting runs in one process on the GPU, as the GPU recipes train: bf16 weights, gradient checkpointing, sdpa
attention; peak is the growth of the GPU's allocated peak over the first pass. `--models 3b` is
`benchmarks/bench_gpu.py`'s Qwen2.5-VL-3B shape with random weights, built in the GPU's memory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MIB = 2**20
SHAPES = {"navigation": ("navigation_visual", 5, 256), "sokoban": ("sokoban_visual", 3, 200)}
SETTINGS = {
    "count 1": ["train.micro_batch_size=1"],
    "count 4": ["train.micro_batch_size=4"],
    "tokens 2400": ["train.micro_batch_tokens=2400"],  # the GPU recipes' budget: one Sokoban trajectory's limit
    "tokens 4096": ["train.micro_batch_tokens=4096"],
    "packed 4096": ["train.micro_batch_tokens=4096", "train.pack_sequences=true"],
}
DEFAULT_SETTINGS = "count 1,count 4,tokens 4096,packed 4096"


def trajectories(model, processor, config: str, max_turns: int, budget: int, count: int, seed: int = 0):
    """`count` samples of 1..max_turns turns (cycling), each turn a real frame of the environment and a
    random response of budget/2..budget tokens."""
    import random

    import torch

    import envs_visual
    from vagen.config import load_config
    from vagen.episode import ChatEncoder, Episode, Turn
    from vagen.trajectory import episode_to_sample

    cfg = load_config(config)
    env = envs_visual.make(cfg.env.name, **cfg.env.params)
    encoder = ChatEncoder(processor)
    rng = random.Random(seed)
    vocab = len(encoder.tokenizer) - 300  # clear of the special tokens at the end
    samples = []
    for i in range(count):
        obs, _ = env.reset(seed=i)
        episode = Episode(config, seed=i, group_id=i, system_prompt=env.system_prompt())
        for turn in range(1 + i % max_turns):
            ids, pixel_values, grids = encoder.user_segment(obs.text, obs.images, first=turn == 0,
                                                            system=episode.system_prompt)
            episode.input_ids += ids
            episode.pixel_values += pixel_values
            episode.image_grid_thw += grids
            response = [rng.randrange(300, vocab) for _ in range(rng.randint(budget // 2, budget))]
            response.append(encoder.tokenizer.convert_tokens_to_ids("<|im_end|>"))
            start = len(episode.input_ids)
            episode.input_ids += response
            episode.turns.append(Turn(obs.text, obs.images, "", 0.0, {}, (start, len(episode.input_ids)),
                                      len(response)))
            obs, *_ = env.step("<answer>Left</answer>")
        sample = episode_to_sample(episode, encoder, model)
        sample.extra["advantages"] = sample.loss_mask * (1.0 if i % 2 else -1.0)
        samples.append(sample)
    return samples, encoder.pad_id, torch


def worker(model_path: str, config: str, max_turns: int, budget: int, count: int, overrides: list[str]) -> dict:
    """One setting on the CPU, in this process (a fresh one per setting: the resident peak is the process's)."""
    import torch

    from vagen.config import load_config
    from vagen.models import load_policy

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, processor = load_policy(Path(model_path))
    model.train()
    samples, pad_id, _ = trajectories(model, processor, config, max_turns, budget, count)
    return measure(model, samples, pad_id, load_config(config, overrides).train, torch.device("cpu"))


def measure(model, samples, pad_id: int, train, device) -> dict:
    """The forward and backward of the policy-gradient loss over every micro-batch of `samples` cut under the
    `train` section, on `device`: a first pass for the memory peak, a second timed."""
    import torch
    from bench_annotate import peak, reset_peak

    from vagen.batch_plan import micro_batch_tokens, micro_batches
    from vagen.trajectory import collate
    from vagen.update import token_logprobs

    plan = micro_batches(list(range(len(samples))), samples, train)
    cuda = device.type == "cuda"

    def one_pass():
        for indices in plan:
            batch = {k: v.to(device) for k, v in collate([samples[i] for i in indices], pad_id, ("advantages",)).items()}
            logprobs, _ = token_logprobs(model, batch, 1.0, with_entropy=False, packed=train.pack_sequences)
            (-(logprobs * batch["advantages"]).sum() / batch["loss_mask"].sum()).backward()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        one_pass()
        grown = torch.cuda.max_memory_allocated() - before
    else:
        reset_peak()
        before = peak()
        one_pass()  # the first pass sets the peak: the allocator keeps what it freed, so a second would not show
        grown = peak() - before
    start = time.perf_counter()
    one_pass()
    seconds = time.perf_counter() - start
    real = sum(s.length for s in samples)
    run = sum(micro_batch_tokens([samples[i].length for i in m], train.pack_sequences) for m in plan)
    return {"tokens_per_s": real / seconds, "peak_mib": grown / MIB, "passes": len(plan),
            "padding": 1 - real / run, "tokens": real, "seconds": seconds}


def in_one_process(models: dict, shapes: list[str], settings: list[str], count: int, out, device) -> None:
    """Every model, shape and setting in this process on `device` (the GPU's way: bf16, gradient checkpointing),
    each row given to `out(label, shape, setting, result)`. `models`: label -> a callable that builds (model,
    processor)."""
    import torch

    from vagen.config import load_config

    for label, build in models.items():
        model, processor = build()
        model.to(device).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for shape in shapes:
            config, turns, budget = SHAPES[shape]
            samples, pad_id, _ = trajectories(model, processor, config, turns, budget, count)
            for setting in settings:
                out(label, shape, setting, measure(model, samples, pad_id, load_config(config, SETTINGS[setting]).train,
                                                   device))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,0.5b", help="comma list of tiny, 0.5b and (with --device cuda) 3b")
    parser.add_argument("--shapes", default="navigation,sokoban", help="comma list of navigation and sokoban")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS, help=f"comma list of {', '.join(SETTINGS)}")
    parser.add_argument("--layers", type=int, default=2, help="text layers of the 0.5B-shaped model (24: whole)")
    parser.add_argument("--cache", default="~/.cache/vagen-bench", help="where the 0.5B-shaped checkpoint is built")
    parser.add_argument("--trajectories", type=int, default=8, help="trajectories per batch")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: every setting in one process on the GPU, bf16 with gradient checkpointing")
    parser.add_argument("--json", default=None, help="also write each row, as it is measured, to this JSON-lines file")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model_path, config, turns, budget, count = args.worker
        print(json.dumps(worker(model_path, config, int(turns), int(budget), int(count), args.overrides)))
        return 0
    settings = args.settings.split(",")
    shapes = args.shapes.split(",")
    for name in settings:
        if name not in SETTINGS:
            parser.error(f"--settings: {name!r} is not one of {', '.join(SETTINGS)}")
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"--shapes: {name!r} is not one of {', '.join(SHAPES)}")
    cache = str(Path(args.cache).expanduser())
    models = {}
    for name in args.models.split(","):
        if name == "tiny":
            from vagen.models import resolve_model_path

            models["tiny"] = str(resolve_model_path("builtin:tiny-vl", cache, seed=0))
        elif name == "0.5b":
            from bench_memory import build_checkpoint

            path, count = build_checkpoint(args.layers, cache)
            models[f"0.5B shape, {args.layers} layers ({count / 1e6:.0f} M)"] = str(path)
        elif name == "3b" and args.device == "cuda":
            models["3B shape (random weights)"] = "3b"
        else:
            parser.error(f"--models: {name!r} is not tiny or 0.5b (or 3b with --device cuda)")
    rows = ["| model | trajectories | setting | tokens/s | peak MiB | passes | padding |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    sink = open(args.json, "w") if args.json else None  # noqa: SIM115 (rows are written as they come)

    def out(label, shape, setting, r):
        config, turns, budget = SHAPES[shape]
        rows.append(f"| {label} | {shape} {turns} x {budget} ({r['tokens']} tokens) | {setting} | "
                    f"{r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} | {r['passes']} | {r['padding']:.2f} |")
        print(rows[-1], flush=True)
        if sink:
            sink.write(json.dumps({"model": label, "shape": shape, "setting": setting, **r}) + "\n")
            sink.flush()

    if args.device == "cuda":
        import torch

        builders = {label: _gpu_builder(path, cache) for label, path in models.items()}
        in_one_process(builders, shapes, settings, args.trajectories, out, torch.device("cuda"))
    else:
        for label, path in models.items():
            for shape in shapes:
                config, turns, budget = SHAPES[shape]
                for setting in settings:
                    done = subprocess.run([sys.executable, __file__, "--worker", path, config, str(turns), str(budget),
                                           str(args.trajectories), "--", *SETTINGS[setting]], capture_output=True,
                                          text=True, check=False)
                    if done.returncode:
                        raise SystemExit(f"{label} {shape} {setting} failed:\n{done.stderr[-3000:]}")
                    out(label, shape, setting, json.loads(done.stdout.strip().splitlines()[-1]))
    print("\n".join(rows))
    return 0


def _gpu_builder(path: str, cache: str):
    """A callable that builds the model of `path` (a checkpoint, or "3b": bench_gpu.py's shape) in bf16 on the GPU."""
    def build():
        import torch

        if path == "3b":
            from bench_gpu import shape_model

            return shape_model("3b", cache)
        from vagen.models import load_policy

        model, processor = load_policy(Path(path))
        return model.to(torch.bfloat16), processor

    return build


if __name__ == "__main__":
    raise SystemExit(main())
