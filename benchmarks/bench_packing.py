"""Update throughput by micro-batch planning: count-based micro-batches of 1 and 4 trajectories, micro-batches
cut by a token budget (`train.micro_batch_tokens`), and packed micro-batches (`train.pack_sequences`), on
multi-turn trajectories of the shapes real checkpoints write.

    python benchmarks/bench_packing.py                      # tiny model and the 0.5B-shaped one (2 layers)
    python benchmarks/bench_packing.py --layers 24          # the 0.5B shape whole (slow on a CPU)
    python benchmarks/bench_packing.py --models 0.5b --shapes navigation --trajectories 4

Trajectories: 8 per batch (`--trajectories`), real frames of the environment (one per turn) and random response tokens of
between half and all of a turn's budget: navigation 1 to 5 turns of up to 256 tokens, Sokoban 1 to 3 turns of
up to 200 (the real-model budgets of `configs/navigation_visual.yaml` and `sokoban_visual.yaml`). Each
setting runs in a fresh process, one thread: the forward and backward of the policy-gradient loss over every
micro-batch of the batch (as `vagen.update.train_minibatch` runs the actor), once for the memory peak and once
timed. Columns: trained tokens per second (real tokens, padding excluded), the growth of the process's peak
resident memory over the first pass (model and trajectories already in memory), the passes, and the padding fraction (the share of the tokens run that were
padding). The 0.5B-shaped model is `benchmarks/bench_memory.py`'s (hidden 896, the real 151,936-entry
vocabulary), with `--layers` of its 24 layers.
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
    "tokens 4096": ["train.micro_batch_tokens=4096"],
    "packed 4096": ["train.micro_batch_tokens=4096", "train.pack_sequences=true"],
}


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
    import torch
    from bench_annotate import peak, reset_peak

    from vagen.batch_plan import micro_batch_tokens, micro_batches
    from vagen.config import load_config
    from vagen.models import load_policy
    from vagen.trajectory import collate
    from vagen.update import token_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, processor = load_policy(Path(model_path))
    model.train()
    samples, pad_id, _ = trajectories(model, processor, config, max_turns, budget, count)
    train = load_config(config, overrides).train
    plan = micro_batches(list(range(len(samples))), samples, train)

    def one_pass():
        for indices in plan:
            batch = collate([samples[i] for i in indices], pad_id, ("advantages",))
            logprobs, _ = token_logprobs(model, batch, 1.0, with_entropy=False, packed=train.pack_sequences)
            (-(logprobs * batch["advantages"]).sum() / batch["loss_mask"].sum()).backward()
        model.zero_grad(set_to_none=True)

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,0.5b", help="comma list of tiny and 0.5b")
    parser.add_argument("--shapes", default="navigation,sokoban", help="comma list of navigation and sokoban")
    parser.add_argument("--layers", type=int, default=2, help="text layers of the 0.5B-shaped model (24: whole)")
    parser.add_argument("--cache", default="~/.cache/vagen-bench", help="where the 0.5B-shaped checkpoint is built")
    parser.add_argument("--trajectories", type=int, default=8, help="trajectories per batch")
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model_path, config, turns, budget, count = args.worker
        print(json.dumps(worker(model_path, config, int(turns), int(budget), int(count), args.overrides)))
        return 0
    models = {}
    for name in args.models.split(","):
        if name == "tiny":
            from vagen.models import resolve_model_path

            models["tiny"] = str(resolve_model_path("builtin:tiny-vl", str(Path(args.cache).expanduser()), seed=0))
        elif name == "0.5b":
            from bench_memory import build_checkpoint

            path, count = build_checkpoint(args.layers, args.cache)
            models[f"0.5B shape, {args.layers} layers ({count / 1e6:.0f} M)"] = str(path)
        else:
            parser.error(f"--models: {name!r} is not tiny or 0.5b")
    rows = ["| model | trajectories | setting | tokens/s | peak MiB | passes | padding |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, path in models.items():
        for shape in args.shapes.split(","):
            config, turns, budget = SHAPES[shape]
            for setting, overrides in SETTINGS.items():
                out = subprocess.run([sys.executable, __file__, "--worker", path, config, str(turns), str(budget),
                                      str(args.trajectories), "--", *overrides], capture_output=True, text=True, check=False)
                if out.returncode:
                    raise SystemExit(f"{label} {shape} {setting} failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(f"| {label} | {shape} {turns} x {budget} ({r['tokens']} tokens) | {setting} | "
                            f"{r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} | {r['passes']} | {r['padding']:.2f} |")
                print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
