"""Per-GPU memory of a training run's model states, estimated from parameter counts before anything loads.

    python -m vagen.config sokoban_visual --config recipes/qwen2.5-vl-3b --ranks 8

The parameters are counted from the checkpoint's safetensors headers when `model.path` is a local
directory (exact, for any architecture), or from the published shape of a checkpoint named in
`KNOWN_SHAPES` when the directory is not on this machine. Per rank, under DeepSpeed's ZeRO stage s of
`train.deepspeed_config` with N ranks (AdamW), each trained parameter holds:

    weights      2 B (bf16) or 4 B (fp32); partitioned over the N ranks at stage 3
    gradients    as the weights; partitioned at stage >= 2
    optimizer    two AdamW moments (8 B), plus a 4 B fp32 master copy under bf16 or any ZeRO stage >= 1;
                 partitioned at stage >= 1

A frozen parameter (the base under LoRA adapters, the reference) holds its weights only. The critic
(`gae`, `turn_gae`) is a second model of the same size; the reference (`algo.kl_coef > 0`, full
fine-tuning) a third, weights only.

With the GPU's memory G (`--gpu-gib G`, by default the visible GPU's), the estimate adds what else lives on
the GPU while the engines hold their states, and refuses a total over G:

    vLLM         vllm.gpu_memory_utilization x G (rollout.backend=vllm): vLLM starts after the engines and
                 takes that share whatever else is resident; sleeping it releases the share during the
                 update, but the engines' states are resident while it is awake, so the two add up
    buckets      DeepSpeed's communication buffers of `train.deepspeed_config` (configs/deepspeed/ sets each
                 size), in the model's dtype, each at most the parameters it holds: ZeRO-3 keeps a reduce
                 bucket of `reduce_bucket_size` elements in each trained engine (actor, and critic for
                 gae/turn_gae) from its start, and gathers `stage3_max_live_parameters` +
                 `stage3_prefetch_bucket_size` (at least the largest tensor) in the one engine that runs;
                 ZeRO-1/2 hold their reduce buckets (two under `overlap_comm`, DeepSpeed's double buffer)
                 only during an engine's backward, so one engine's count, and the all-gather bucket
                 `allgather_bucket_size` after its step; ZeRO-0 all-reduces through a fixed buffer of 5e8
                 elements. tests/test_preflight.py reads these buffers off real DeepSpeed engines
    margin       MARGIN_GIB: the CUDA context and the allocator's fragmentation (1-3 GiB), and the
                 activations of one micro-batch under gradient checkpointing with its [tokens, vocabulary]
                 log-probability chunk (2-3 GiB at 7B and 2,400 tokens)

Imports only the standard library: it runs inside `python -m vagen.config`, before torch.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

GIB = 1024 ** 3

# What the GPU check keeps free beyond the states, vLLM's share and the buckets (module docstring).
MARGIN_GIB = 6.0

# DeepSpeed's defaults, for a config that does not set a size (deepspeed/runtime/zero/config.py), and the
# all-reduce buffer of ZeRO-0 (deepspeed/runtime/engine.py, MEMORY_OPT_ALLREDUCE_SIZE), which no setting
# changes.
BUCKET_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                   "stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000}
ZERO0_ALLREDUCE = 500_000_000

# Published shapes (the checkpoints' config.json) of the checkpoints the estimate knows by name, matched
# against the last component of model.path when that directory is not on this machine; `model_type` picks
# the formula below that names their tensors.
KNOWN_SHAPES = {
    "Qwen2.5-VL-3B-Instruct": dict(
        model_type="qwen2_5_vl",
        text=dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, vocab_size=151_936, tie_word_embeddings=True),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=2048, patch_size=14,
                    temporal_patch_size=2, in_channels=3, spatial_merge_size=2)),
    "Qwen2.5-VL-7B-Instruct": dict(
        model_type="qwen2_5_vl",
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152_064, tie_word_embeddings=False),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, out_hidden_size=3584, patch_size=14,
                    temporal_patch_size=2, in_channels=3, spatial_merge_size=2)),
    # Qwen/Qwen3-VL-4B-Instruct config.json: a Qwen3-4B language model (head_dim 128, tied embeddings) and a
    # 24-block tower of width 1024 with DeepStack taps after blocks 5, 11 and 17
    "Qwen3-VL-4B-Instruct": dict(
        model_type="qwen3_vl",
        text=dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=151_936, tie_word_embeddings=True),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2560, patch_size=16,
                    temporal_patch_size=2, in_channels=3, spatial_merge_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[5, 11, 17])),
    # Qwen/Qwen3-VL-8B-Instruct config.json: a Qwen3-8B language model (untied lm_head); its tower is
    # transformers' Qwen3VLVisionConfig defaults (27 blocks of width 1152, taps after 8, 16 and 24)
    "Qwen3-VL-8B-Instruct": dict(
        model_type="qwen3_vl",
        text=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=151_936, tie_word_embeddings=False),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=4096, patch_size=16,
                    temporal_patch_size=2, in_channels=3, spatial_merge_size=2, num_position_embeddings=2304,
                    deepstack_visual_indexes=[8, 16, 24])),
}


def _language_tensors(text: dict, qk_norm: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a Qwen2 (`qk_norm=False`: q/k/v biases) or Qwen3 (`qk_norm=True`: no
    biases, RMS norms of each head's queries and keys) language model inside a VLM, with its head."""
    h, layers = text["hidden_size"], text["num_hidden_layers"]
    head_dim = text.get("head_dim") or h // text["num_attention_heads"]
    q, kv, inter = text["num_attention_heads"] * head_dim, text["num_key_value_heads"] * head_dim, text["intermediate_size"]
    out = [("model.language_model.embed_tokens.weight", (text["vocab_size"], h))]
    for i in range(layers):
        p = f"model.language_model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                (f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h)),
                (f"{p}.mlp.down_proj.weight", (h, inter)),
                (f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,))]
        if qk_norm:
            out += [(f"{p}.self_attn.q_norm.weight", (head_dim,)), (f"{p}.self_attn.k_norm.weight", (head_dim,))]
        else:
            out += [(f"{p}.self_attn.q_proj.bias", (q,)), (f"{p}.self_attn.k_proj.bias", (kv,)),
                    (f"{p}.self_attn.v_proj.bias", (kv,))]
    out.append(("model.language_model.norm.weight", (h,)))
    if not text.get("tie_word_embeddings", True):
        out.append(("lm_head.weight", (text["vocab_size"], h)))
    return out


def qwen2_5_vl_tensors(text: dict, vision: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a Qwen2.5-VL model of this shape, named as transformers saves them."""
    out = _language_tensors(text, qk_norm=False)
    vh, vi, merged = vision["hidden_size"], vision["intermediate_size"], vision["hidden_size"] * vision["spatial_merge_size"] ** 2
    out.append(("model.visual.patch_embed.proj.weight",
                (vh, vision["in_channels"], vision["temporal_patch_size"], vision["patch_size"], vision["patch_size"])))
    for i in range(vision["depth"]):
        p = f"model.visual.blocks.{i}"
        out += [(f"{p}.norm1.weight", (vh,)), (f"{p}.norm2.weight", (vh,)),
                (f"{p}.attn.qkv.weight", (3 * vh, vh)), (f"{p}.attn.qkv.bias", (3 * vh,)),
                (f"{p}.attn.proj.weight", (vh, vh)), (f"{p}.attn.proj.bias", (vh,)),
                (f"{p}.mlp.gate_proj.weight", (vi, vh)), (f"{p}.mlp.gate_proj.bias", (vi,)),
                (f"{p}.mlp.up_proj.weight", (vi, vh)), (f"{p}.mlp.up_proj.bias", (vi,)),
                (f"{p}.mlp.down_proj.weight", (vh, vi)), (f"{p}.mlp.down_proj.bias", (vh,))]
    out += [("model.visual.merger.ln_q.weight", (vh,)),
            ("model.visual.merger.mlp.0.weight", (merged, merged)), ("model.visual.merger.mlp.0.bias", (merged,)),
            ("model.visual.merger.mlp.2.weight", (vision["out_hidden_size"], merged)),
            ("model.visual.merger.mlp.2.bias", (vision["out_hidden_size"],))]
    return out


def qwen3_vl_tensors(text: dict, vision: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of a Qwen3-VL model of this shape, named as transformers saves them.

    Against Qwen2.5-VL: the language model is Qwen3's (no q/k/v biases; RMS norms of each head's queries and
    keys; head_dim set apart from hidden / heads); the tower has LayerNorms with biases, a biased patch
    embedding, learnt position embeddings, a two-layer GELU MLP, and one merger per DeepStack tap beside the
    final one, each normalising the 2x2-merged features (width 4 x hidden) rather than the patch features."""
    out = _language_tensors(text, qk_norm=True)
    vh, vi, merged = vision["hidden_size"], vision["intermediate_size"], vision["hidden_size"] * vision["spatial_merge_size"] ** 2
    vout = vision["out_hidden_size"]
    out += [("model.visual.patch_embed.proj.weight",
             (vh, vision["in_channels"], vision["temporal_patch_size"], vision["patch_size"], vision["patch_size"])),
            ("model.visual.patch_embed.proj.bias", (vh,)),
            ("model.visual.pos_embed.weight", (vision["num_position_embeddings"], vh))]
    for i in range(vision["depth"]):
        p = f"model.visual.blocks.{i}"
        out += [(f"{p}.norm1.weight", (vh,)), (f"{p}.norm1.bias", (vh,)),
                (f"{p}.norm2.weight", (vh,)), (f"{p}.norm2.bias", (vh,)),
                (f"{p}.attn.qkv.weight", (3 * vh, vh)), (f"{p}.attn.qkv.bias", (3 * vh,)),
                (f"{p}.attn.proj.weight", (vh, vh)), (f"{p}.attn.proj.bias", (vh,)),
                (f"{p}.mlp.linear_fc1.weight", (vi, vh)), (f"{p}.mlp.linear_fc1.bias", (vi,)),
                (f"{p}.mlp.linear_fc2.weight", (vh, vi)), (f"{p}.mlp.linear_fc2.bias", (vh,))]

    def merger(prefix: str, norm_width: int) -> list:
        return [(f"{prefix}.norm.weight", (norm_width,)), (f"{prefix}.norm.bias", (norm_width,)),
                (f"{prefix}.linear_fc1.weight", (merged, merged)), (f"{prefix}.linear_fc1.bias", (merged,)),
                (f"{prefix}.linear_fc2.weight", (vout, merged)), (f"{prefix}.linear_fc2.bias", (vout,))]

    out += merger("model.visual.merger", vh)
    for j in range(len(vision["deepstack_visual_indexes"])):
        out += merger(f"model.visual.deepstack_merger_list.{j}", merged)
    return out


SHAPE_FORMULAS = {"qwen2_5_vl": qwen2_5_vl_tensors, "qwen3_vl": qwen3_vl_tensors}


def known_tensors(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the checkpoint `name` of KNOWN_SHAPES."""
    shape = KNOWN_SHAPES[name]
    return SHAPE_FORMULAS[shape["model_type"]](shape["text"], shape["vision"])


def safetensors_tensors(directory: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor in a checkpoint directory's *.safetensors files, read from their headers
    (8 bytes of header length, then a JSON header) without loading a weight."""
    out = []
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        out += [(name, tuple(entry["shape"])) for name, entry in header.items() if name != "__metadata__"]
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def is_vision(name: str) -> bool:
    return "visual" in name.split(".")


def lora_parameters(tensors, targets, rank: int) -> int:
    """Parameters of LoRA adapters of `rank` on the language model's 2-D weights whose module name (last
    component) is in `targets`: r x (in + out) each (A is r x in, B is out x r); the vision tower gets none."""
    total = 0
    for name, shape in tensors:
        parts = name.split(".")
        if len(shape) == 2 and parts[-1] == "weight" and len(parts) > 1 and parts[-2] in targets and not is_vision(name):
            total += rank * (shape[0] + shape[1])
    return total


@dataclass
class Estimate:
    lines: list[str]
    total_gib: float | None  # model states; None when the parameters could not be counted
    gpu_total_gib: float | None = None  # with vLLM's share, the buckets and the margin, when the GPU is known
    problem: str | None = None  # why it does not fit the GPU, and what to change


def visible_gpu_gib() -> float | None:
    """The memory of the smallest GPU this process would use (CUDA_VISIBLE_DEVICES), in GiB, asked of
    nvidia-smi (no torch); None without an NVIDIA GPU or driver."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [[field.strip() for field in line.split(",")] for line in done.stdout.splitlines() if line.count(",") == 2]
    if done.returncode or not rows:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        wanted = [entry.strip() for entry in visible.split(",") if entry.strip()]
        rows = [row for row in rows if row[0] in wanted or any(row[1].startswith(w) for w in wanted if len(w) > 3)]
    sizes = [float(row[2]) / 1024 for row in rows if row[2].replace(".", "", 1).isdigit()]
    return min(sizes) if sizes else None


def communication_gib(deepspeed: dict, width: int, trained: list[int], held: int, largest: int) -> tuple[float, str]:
    """GiB of DeepSpeed's communication buffers on each GPU (module docstring, "buckets"), and how they add
    up: `trained` holds the trained parameter count of each engine that steps an optimizer, `held` the
    parameters of one model, `largest` the element count of its largest tensor, `width` the bytes of the
    model's dtype."""
    zero = deepspeed.get("zero_optimization", {})
    stage = zero.get("stage", 0)

    def size(key: str) -> int:
        return int(float(zero.get(key, BUCKET_DEFAULTS[key])))

    buffers = 0
    if stage == 0:
        gathered, what = min(ZERO0_ALLREDUCE, max(trained, default=0)), "ZeRO-0's all-reduce buffer"
    elif stage == 3:
        live = size("stage3_max_live_parameters") + size("stage3_prefetch_bucket_size")
        gathered, what = min(max(live, largest), held), "live parameters gathered"
        buffers = 1 if zero.get("contiguous_gradients", True) else 0
    else:
        gathered, what = min(size("allgather_bucket_size"), max(trained, default=0)), "all-gather bucket"
        buffers = (2 if zero.get("overlap_comm", False) else 1) if zero.get("contiguous_gradients", True) else 0
    reduce_size = size("reduce_bucket_size") if stage > 0 else 0
    # ZeRO-3 allocates each engine's bucket when the engine starts; ZeRO-1/2 in each backward, freed after it
    holding = trained if stage == 3 else trained[:1]
    reduce = sum(buffers * min(reduce_size, count) for count in holding)
    detail = (f"{len(holding)} engine(s) x {buffers} reduce bucket(s) of up to {reduce_size:.0e} elements"
              if buffers and trained else "no reduce bucket")
    return width * (reduce + gathered) / GIB, f"{detail}, {what}: {gathered:.2e} elements"


def model_tensors(path: str) -> tuple[list | None, str]:
    """The parameter tensors of model.path, and where their count came from."""
    if path.startswith("builtin:"):
        return None, f"model.path={path} is a built-in model of well under a million parameters: nothing to estimate"
    if path.startswith("assets:"):
        from envs_visual.assets import ASSETS_DIR  # where vagen.config.checkpoints_dir finds the warm starts

        directory = ASSETS_DIR / "checkpoints" / path.split(":", 1)[1]
    else:
        directory = Path(path).expanduser()
    if directory.is_dir() and list(directory.glob("*.safetensors")):
        return safetensors_tensors(directory), f"the safetensors headers in {directory}"
    name = directory.name
    known = {key.lower(): key for key in KNOWN_SHAPES}
    match = known.get(name.lower())
    if match is None:
        return None, (f"model.path={path} is not on this machine and {name!r} is not a checkpoint of known shape "
                      f"({', '.join(KNOWN_SHAPES)}): parameters not counted")
    return known_tensors(match), (f"the published shape of {match} (model.path={path} is not on this machine: "
                                  f"the checks ran without it)")


def estimate(cfg, ranks: int, deepspeed: dict, gpu_gib: float | None = None) -> Estimate:
    """Per-rank GiB of the actor's, critic's and reference's weights, gradients and AdamW states for `ranks`
    ranks under the DeepSpeed settings `deepspeed` (the JSON of train.deepspeed_config); with `gpu_gib`, the
    total with vLLM's share, DeepSpeed's buckets and MARGIN_GIB against a GPU of that many GiB."""
    tensors, source = model_tensors(cfg.model.path)
    if tensors is None:
        lines = [f"memory estimate: {source}"]
        if gpu_gib is not None:
            lines.append(f"  GPU of {gpu_gib:.1f} GiB: not checked, the parameters are not counted")
        return Estimate(lines, None)
    stage = deepspeed.get("zero_optimization", {}).get("stage", 0)
    bf16 = bool(deepspeed.get("bf16", {}).get("enabled", False))
    width = 2 if bf16 else 4
    total = sum(_numel(shape) for _, shape in tensors)
    vision = sum(_numel(shape) for name, shape in tensors if is_vision(name))
    m = cfg.model
    if m.lora_rank > 0:
        trained = lora_parameters(tensors, set(m.lora_target_modules), m.lora_rank) + (0 if m.freeze_vision else vision)
        frozen = total - (0 if m.freeze_vision else vision)
    else:
        trained, frozen = total, 0
    held = trained + frozen  # every parameter the model holds

    def share(count: float, partitioned: bool) -> float:
        return count / ranks if partitioned else count

    optimizer_bytes = 8 + (4 if bf16 or stage >= 1 else 0)

    def model_gib(trained_count: int, frozen_count: int) -> tuple[float, float, float]:
        weights = width * share(trained_count + frozen_count, stage == 3)
        gradients = width * share(trained_count, stage >= 2)
        optimizer = optimizer_bytes * share(trained_count, stage >= 1)
        return weights / GIB, gradients / GIB, optimizer / GIB

    dtype = "bfloat16 (fp32 master weights)" if bf16 else "float32"
    what = (f"LoRA r={m.lora_rank}: {trained / 1e6:,.1f} M trained ({100 * trained / held:.2f}%), the base frozen"
            if m.lora_rank > 0 else "full fine-tuning: every parameter trained")
    lines = [f"per-GPU memory estimate: {ranks} rank(s), ZeRO-{stage} ({cfg.train.deepspeed_config}), {dtype}",
             f"  parameters: {total / 1e9:.3f} B, from {source}",
             f"  {what}"]
    parts = {"actor": model_gib(trained, frozen)}
    if cfg.algo.adv_estimator in ("gae", "turn_gae"):
        parts["critic"] = model_gib(trained, frozen)  # a model of the policy's shape (+ a value head of hidden + 1)
    result = 0.0
    for label, (weights, gradients, optimizer) in parts.items():
        subtotal = weights + gradients + optimizer
        result += subtotal
        lines.append(f"  {label:<10} weights {weights:6.1f} GiB, gradients {gradients:6.1f} GiB, optimizer "
                     f"{optimizer:6.1f} GiB = {subtotal:6.1f} GiB")
    if cfg.algo.kl_coef > 0 and m.lora_rank == 0:
        reference = width * share(total, stage == 3) / GIB
        result += reference
        lines.append(f"  reference  weights {reference:6.1f} GiB (algo.kl_coef={cfg.algo.kl_coef})")
    elif cfg.algo.kl_coef > 0:
        lines.append("  reference  the actor with its adapters off: no copy")
    lines.append(f"  total      {result:.1f} GiB per GPU of model states")
    engines = [trained] * len(parts)  # the actor's and the critic's optimizers
    buckets, how = communication_gib(deepspeed, width, engines, held, max(_numel(shape) for _, shape in tensors))
    if gpu_gib is None:
        vllm = (f"vLLM's share of the GPU (vllm.gpu_memory_utilization={cfg.vllm.gpu_memory_utilization} of it)"
                if cfg.rollout.backend == "vllm" else "the hf rollout's key/value cache")
        lines.append(f"  DeepSpeed's communication buckets: {buckets:.1f} GiB ({how})")
        lines.append(f"  not counted without a GPU size (--gpu-gib G): {vllm}, and a margin of {MARGIN_GIB:.0f} GiB "
                     f"for the CUDA context, the allocator and one micro-batch's activations")
        return Estimate(lines, result)
    size = f"{gpu_gib:.0f}" if gpu_gib == round(gpu_gib) else f"{gpu_gib:.1f}"  # 80, or 79.6 read from a GPU
    vllm = cfg.vllm.gpu_memory_utilization * gpu_gib if cfg.rollout.backend == "vllm" else 0.0
    gpu_total = result + vllm + buckets + MARGIN_GIB
    lines.append(f"  buckets    {buckets:6.1f} GiB of DeepSpeed's communication buffers ({how})")
    if cfg.rollout.backend == "vllm":
        lines.append(f"  vLLM       {vllm:6.1f} GiB (vllm.gpu_memory_utilization={cfg.vllm.gpu_memory_utilization} "
                     f"of {size} GiB)")
    else:
        lines.append("  rollout    the hf rollout's key/value cache: not counted")
    lines.append(f"  margin     {MARGIN_GIB:6.1f} GiB (CUDA context, allocator, one micro-batch's activations)")
    lines.append(f"  GPU total  {gpu_total:.1f} GiB of {size} GiB: {'fits' if gpu_total <= gpu_gib else 'does not fit'}")
    problem = None
    if gpu_total > gpu_gib:
        over = gpu_total - gpu_gib
        fixes = ["more ranks (--ranks N, deepspeed --num_gpus N: the partitioned states shrink with them)"]
        if stage < 3:
            fixes.append("ZeRO-3 (train.deepspeed_config=deepspeed/zero3_bf16.json), which partitions the weights too")
        if cfg.rollout.backend == "vllm":
            room = gpu_gib - result - buckets - MARGIN_GIB
            engine_weights = (2 if cfg.model.dtype == "bfloat16" else 4) * total / GIB
            if room > engine_weights:
                fixes.append(f"a smaller vLLM share: vllm.gpu_memory_utilization={room / gpu_gib:.2f} fits, leaving "
                             f"{room - engine_weights:.1f} GiB beside vLLM's {engine_weights:.1f} GiB of weights for "
                             f"this rank's key/value cache")
            else:
                fixes.append(f"rollout.backend=hf: beside the states there is no room for vLLM's {engine_weights:.1f} "
                             f"GiB of weights")
        if m.lora_rank == 0:
            fixes.append("LoRA (model.lora_rank > 0; the -lora recipes), which trains a fraction of the parameters")
        problem = (f"the estimate of {gpu_total:.1f} GiB per GPU ({result:.1f} GiB of model states, {vllm:.1f} GiB of "
                   f"vLLM, {buckets:.1f} GiB of DeepSpeed buckets, a {MARGIN_GIB:.0f} GiB margin) does not fit a GPU "
                   f"of {size} GiB with {ranks} rank(s), by {over:.1f} GiB; use " + "; or ".join(fixes))
    return Estimate(lines, result, gpu_total, problem)
