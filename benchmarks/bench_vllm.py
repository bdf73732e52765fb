"""Rollout throughput of the two decoders, `hf` (transformers, one key/value cache across turns) and
`vllm` (an in-process vLLM engine with prefix caching), on the same policy, levels and sampling:
generated tokens per second of `vagen.rollout.rollout`, the engine's start-up and one weight sync.
Information only: nothing is asserted. Runs in the vLLM environment (scripts/vllm_env.sh):

    .venv-vllm/bin/python benchmarks/bench_vllm.py                  # the tiny VLM, on the CPU
    .venv-vllm/bin/python benchmarks/bench_vllm.py --shape 3b       # Qwen2.5-VL-3B's shape (a GPU)

The policy is the built-in tiny VLM (or `benchmarks/bench_gpu.py`'s 3B-shaped build of it) with
random weights and vagen's image hooks taken out of its config (vLLM runs standard Qwen2.5-VL only).
A random policy rarely writes `</answer>`, so nearly every turn runs to the token limit. Each backend
plays `--repeats` rollouts of the same levels; the first includes warm-up and is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def standard_checkpoint(shape: str, out: Path, cache: str) -> Path:
    """A checkpoint of `shape` (bench_gpu's shapes) without vagen's image hooks, at `out`."""
    from benchmarks.bench_gpu import build_checkpoint
    from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE

    built = build_checkpoint(shape, out.with_name(out.name + "_built"), cache)
    shutil.copytree(built, out)
    config = json.loads((out / "config.json").read_text())
    for key in (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("tiny", "3b"), default="tiny")
    parser.add_argument("--groups", type=int, default=8, help="level groups")
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per level group")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="rollouts per backend (the first is warm-up)")
    parser.add_argument("--backends", default="hf,vllm", help="any of hf, vllm, vllm-unseeded (vllm.seeded_requests=false)")
    parser.add_argument("--cache", default="~/.cache/vagen", help="where the built-in tiny model is built")
    args = parser.parse_args(argv)

    import torch

    from vagen.config import load_config
    from vagen.decoding_hf import HFDecoder
    from vagen.episode import ChatEncoder, train_seeds
    from vagen.models import load_policy
    from vagen.rollout import rollout

    on_gpu = torch.cuda.is_available()
    dtype = "bfloat16" if on_gpu else "float32"
    work = Path(tempfile.mkdtemp(prefix="vagen_bench_vllm_"))
    path = standard_checkpoint(args.shape, work / "model", args.cache)
    model, processor = load_policy(path, dtype)
    model.to("cuda" if on_gpu else "cpu").eval()
    encoder = ChatEncoder(processor)
    cfg = load_config("sokoban_visual", [
        f"model.path={path}", f"model.dtype={dtype}", f"rollout.max_turns={args.turns}",
        f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
        "rollout.max_trajectory_length=8192"])
    seeds = train_seeds(0, args.groups)

    rows = []
    for backend in args.backends.split(","):
        t0 = time.perf_counter()
        if backend == "hf":
            decoder = HFDecoder(model, encoder)
            extra = ""
        elif backend in ("vllm", "vllm-unseeded"):
            from vagen.decoding_vllm import VLLMDecoder

            decoder = VLLMDecoder(path, encoder, dtype=dtype, seed=0, seeded_requests=backend == "vllm")
            start_s = time.perf_counter() - t0
            sync_s = decoder.sync_weights(model)
            extra = f"engine start {start_s:.1f} s, weight sync {sync_s:.2f} s"
        else:
            raise SystemExit(f"unknown backend {backend!r}; choices: hf, vllm, vllm-unseeded (no per-request seeds)")
        runs = []
        for repeat in range(args.repeats):
            _, timing = rollout(model, encoder, cfg, seeds, args.group_size, decoder=decoder, sample_seed=repeat)
            runs.append((timing["rollout/generated_tokens"], timing["timing/generate"]))
            print(f"{backend} rollout {repeat}: {runs[-1][0]:.0f} tokens in {runs[-1][1]:.1f} s", flush=True)
        rows.append((backend, runs, extra))
        if hasattr(decoder, "close"):
            decoder.close()
        del decoder

    device = torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    print(f"\n{args.shape} shape, {dtype}, sokoban_visual, {args.groups} x {args.group_size} rollouts, {args.turns} turns, "
          f"{args.max_new_tokens} new tokens, temperature {args.temperature}, {device}")
    print("| backend | first rollout: tokens / s | later rollouts: tokens / s | notes |")
    print("| --- | --- | --- | --- |")
    for backend, runs, extra in rows:
        later = runs[1:] or runs
        rate = sum(n for n, _ in later) / max(sum(s for _, s in later), 1e-9)
        print(f"| {backend} | {runs[0][0] / max(runs[0][1], 1e-9):,.0f} | {rate:,.0f} | {extra} |")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
