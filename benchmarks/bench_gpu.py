"""The training loop at the size of a real checkpoint: a Qwen2.5-VL-3B- or 7B-shaped policy (and critic) with
random weights, built from a config (nothing downloaded), trained by `vagen.train.main` for a few
iterations; prints seconds per iteration, rollout generated tokens per second, update tokens per
second and peak accelerator memory.

    python benchmarks/bench_gpu.py                              # 3B shape, bf16, ZeRO-2, checkpointing
    python benchmarks/bench_gpu.py --shape tiny --groups 2 --group-size 2 --max-new-tokens 16   # any CPU
    python benchmarks/bench_gpu.py algo.adv_estimator=grpo     # without a critic (half the optimizer states)
    python benchmarks/bench_gpu.py --backend vllm              # rollouts from vLLM (pip install -e ".[vllm]")
    python benchmarks/bench_gpu.py --shape 7b model.lora_rank=8 algo.adv_estimator=grpo   # 7B with LoRA

Defaults: `sokoban_visual`, 16 level groups x 8 rollouts, 3 turns, 256 new tokens per turn, bf16
weights with fp32 master weights (`deepspeed/zero2_bf16.json`), gradient checkpointing, 3 iterations
(the first is reported apart: it includes allocator and kernel warm-up). The tokenizer and image
processor are the built-in tiny model's; the model keeps Qwen2.5-VL's 151,936-entry vocabulary, so
the language-model head, log-probabilities and sampling cost what they cost at 3B. A random policy
rarely writes `</answer>`, so nearly every turn runs to the token limit: the worst case of a rollout.
No checkpoint is written (a 3B actor and critic with their optimizer states would take minutes). On a GPU the
configuration is checked first against the GPU's memory by vagen's estimate (`memory_estimate`), and refused
before the checkpoint is built when it does not fit: the defaults at the 3B shape (an actor and a critic, 112 GiB
of model states) need `algo.adv_estimator=grpo model.lora_rank=64` on one 80 GB GPU, as scripts/gpu_check.sh runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen2.5-VL-3B-Instruct's published shape.
SHAPES = {
    "3b": {
        "text": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                     num_key_value_heads=2, vocab_size=151_936, max_position_embeddings=32_768),
        "mrope_section": [16, 24, 24],
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                       fullatt_block_indexes=[7, 15, 23, 31], window_size=112),
    },
    # Qwen2.5-VL-7B-Instruct's published shape (untied embeddings, a 152,064-entry vocabulary).
    "7b": {
        "text": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152_064, max_position_embeddings=32_768,
                     tie_word_embeddings=False),
        "mrope_section": [16, 24, 24],
        "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       fullatt_block_indexes=[7, 15, 23, 31], window_size=112),
        "tie_word_embeddings": False,
    },
    "tiny": None,  # the built-in tiny VLM as it is
}


def build_checkpoint(shape: str, out: Path, cache: str) -> Path:
    """The built-in tiny VLM's processor with a model of `shape` and random weights, saved at `out`."""
    from vagen.models import resolve_model_path

    if SHAPES[shape] is None:
        return resolve_model_path("builtin:tiny-vl", cache, seed=0)
    model, processor = shape_model(shape, cache)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    del model
    return out


def shape_model(shape: str, cache: str):
    """A bf16 Qwen2.5-VL of `shape` (not "tiny") with random weights, built on the GPU where there is one, and
    the built-in tiny VLM's processor."""
    import torch
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE, load_policy, resolve_model_path

    tiny = resolve_model_path("builtin:tiny-vl", cache, seed=0)
    spec = SHAPES[shape]
    config = AutoConfig.from_pretrained(tiny)
    text = config.get_text_config()
    for key, value in spec["text"].items():
        setattr(text, key, value)
    text.rope_parameters = dict(text.rope_parameters, mrope_section=spec["mrope_section"])
    text.layer_types = ["full_attention"] * text.num_hidden_layers
    if getattr(text, "head_dim", None) is not None:
        text.head_dim = text.hidden_size // text.num_attention_heads
    for key, value in spec["vision"].items():
        setattr(config.vision_config, key, value)
    if "tie_word_embeddings" in spec:
        config.tie_word_embeddings = spec["tie_word_embeddings"]
    # a standard checkpoint of this shape: without the built-in's image hooks, which stock vLLM does not run (the
    # config check refuses them under rollout.backend=vllm)
    for key in (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE):
        if hasattr(config, key):
            delattr(config, key)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    _, processor = load_policy(tiny)
    return model, processor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--config", default="sokoban_visual")
    parser.add_argument("--groups", type=int, default=16, help="level groups per iteration")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per level group")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--backend", choices=["hf", "vllm"], default="hf",
                        help="rollout.backend: transformers generate, or vLLM (its engine sleeps during the update)")
    parser.add_argument("--cache", default="~/.cache/vagen", help="where the built-in tiny model is built")
    parser.add_argument("--json", default=None, help="also write the iterations after the first as one JSON row")
    parser.add_argument("overrides", nargs="*", help="further section.key=value overrides")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    import vagen.run
    from vagen.train import main as train

    on_gpu = torch.cuda.is_available()
    if on_gpu:  # refused before a checkpoint is built, as training refuses before a model loads
        gpu_gib = torch.cuda.mem_get_info()[1] / 2**30
        result = memory_estimate(args, gpu_gib)
        print("\n".join(result.lines))
        if result.problem:
            print(f"bench_gpu.py: {result.problem}", file=sys.stderr)
            return 2
    work = Path(tempfile.mkdtemp(prefix="vagen_bench_gpu_"))
    t0 = time.perf_counter()
    path = build_checkpoint(args.shape, work / "model", args.cache)
    build_s = time.perf_counter() - t0
    overrides = train_overrides(args, str(path), on_gpu, work)
    vagen.run.RunDir.maybe_save = lambda *a, **k: None  # see the module docstring: no checkpoint
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    code = train(["--config", args.config, *overrides])
    if code:
        return code
    records = [json.loads(line) for line in (work / "runs" / "bench" / "metrics.jsonl").read_text().splitlines()]
    peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else float("nan")

    def row(name, recs):
        def total(key):
            return sum(r.get(key) or 0.0 for r in recs)

        it = total("timing/iteration") / len(recs)
        generate = total("rollout/generated_tokens") / max(total("timing/generate"), 1e-9)
        update = total("update/tokens") / max(total("timing/update"), 1e-9)
        sync = total("timing/weight_sync") / len(recs)
        return f"| {name} | {len(recs)} | {it:.1f} | {generate:,.0f} | {update:,.0f} | {sync:.2f} |"

    device = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"\n{args.shape} shape, {args.backend} rollouts, {args.config}, {args.groups} x {args.group_size} rollouts, {args.turns} turns, "
          f"{args.max_new_tokens} new tokens, {device}; checkpoint built in {build_s:.0f} s; "
          f"peak accelerator memory {peak:.1f} GiB")
    print("| iterations | n | s / iteration | generated tokens / s | update tokens / s | weight sync s |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(row("first", records[:1]))
    if len(records) > 1:
        print(row("after the first", records[1:]))
    if args.json:
        later = records[1:] or records
        Path(args.json).write_text(json.dumps(summary(later, args, peak, device)) + "\n")
    return 0


# The published checkpoint whose shape each --shape is: the memory estimate counts its parameters by this name
# (vagen.memory.KNOWN_SHAPES) before the random checkpoint exists.
SHAPE_NAMES = {"3b": "Qwen2.5-VL-3B-Instruct", "7b": "Qwen2.5-VL-7B-Instruct"}


def train_overrides(args, path: str, on_gpu: bool, work: Path | None = None) -> list[str]:
    """The overrides the benchmark trains `args.config` with (the command line's own `args.overrides` last)."""
    mini = args.groups * args.group_size // 2
    overrides = [
        f"model.path={path}", f"model.dtype={'bfloat16' if on_gpu else 'float32'}",
        "model.gradient_checkpointing=true",
        f"train.deepspeed_config=deepspeed/{'zero2_bf16' if on_gpu else 'zero0_fp32'}.json",
        f"rollout.env_groups={args.groups}", f"rollout.group_size={args.group_size}",
        f"rollout.max_turns={args.turns}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.max_trajectory_length=8192", f"train.iterations={args.iterations}",
        f"train.mini_batch_size={mini}", "train.micro_batch_size=4", "eval.every=0",
        "train.run_name=bench", "log.tensorboard=false", "log.progress=false",
        f"model.builtin_cache={args.cache}", f"rollout.backend={args.backend}",
    ]
    if work is not None:
        overrides.append(f"train.run_dir={work / 'runs'}")
    return overrides + list(args.overrides)


def memory_estimate(args, gpu_gib: float):
    """vagen.memory's per-GPU estimate of the benchmark's configuration on one rank with a GPU of `gpu_gib`
    GiB (the shape counted from its published checkpoint's name; the built-in tiny model is not estimated)."""
    import json as json_module

    from vagen.config import CONFIGS_DIR, load_configs
    from vagen.memory import estimate

    name = SHAPE_NAMES.get(args.shape, "builtin:tiny-vl")
    path = name if name.startswith("builtin:") else f"/models/{name}"
    cfg = load_configs([args.config], train_overrides(args, path, True), require_checkpoint=False)
    deepspeed = json_module.loads((CONFIGS_DIR / cfg.train.deepspeed_config).read_text())
    return estimate(cfg, 1, deepspeed, gpu_gib)


def summary(records: list[dict], args, peak_gib: float, device: str) -> dict:
    """The iterations' means as one row (`scripts/gpu_check.sh` prints the rows of both backends together),
    with what a decode step must read at this shape: the language model's weights once, and every
    running sequence's keys and values (`decode_bytes`)."""
    def total(key):
        return sum(r.get(key) or 0.0 for r in records)

    n = len(records)
    turns = total("rollout/turns") / max(n, 1)
    tokens = total("rollout/generated_tokens")
    return {"backend": args.backend, "shape": args.shape, "device": device, "iterations": n,
            "iteration_s": total("timing/iteration") / n, "generate_s": total("timing/generate") / n,
            "generated_tokens_per_s": tokens / max(total("timing/generate"), 1e-9),
            "update_tokens_per_s": total("update/tokens") / max(total("timing/update"), 1e-9),
            "weight_sync_s": total("timing/weight_sync") / n, "peak_gib": peak_gib,
            "sequences": args.groups * args.group_size, "turns": args.turns, "max_new_tokens": args.max_new_tokens,
            "mean_response_tokens": tokens / max(turns * args.groups * args.group_size * n, 1)}


def decode_bytes(shape: str, sequences: int, context: float) -> float:
    """Bytes one decode step of `sequences` running sequences must read in bf16 at `shape`: the language
    model's weights (the embedding table only through its rows, but a head of vocabulary x hidden), and
    each sequence's keys and values over `context` tokens. The bandwidth bound of decoding is then
    sequences x bandwidth / decode_bytes tokens per second."""
    text = SHAPES[shape]["text"]
    hidden, layers, inter = text["hidden_size"], text["num_hidden_layers"], text["intermediate_size"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    head_dim = hidden // heads
    per_layer = hidden * (hidden + 2 * kv_heads * head_dim) + hidden * hidden + 3 * hidden * inter
    weights = layers * per_layer + text["vocab_size"] * hidden
    kv_per_token = layers * 2 * kv_heads * head_dim
    return 2.0 * (weights + sequences * context * kv_per_token)


if __name__ == "__main__":
    raise SystemExit(main())
