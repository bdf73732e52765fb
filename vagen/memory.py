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

With the GPU's memory G (`--gpu-gib G`, by default the visible GPU's; on a GPU `vagen/train.py` reads the
rank's own), the estimate adds what else lives on the GPU in each phase of an iteration, and refuses the
larger phase when it is over G:

    rollout      states + vLLM's share (rollout.backend=vllm) or the hf rollout's keys and values (the rank's
                 episodes x rollout.max_trajectory_length) + buckets + margin
    update       states + activations + step + buckets + margin, + vLLM's share when vllm.sleep_mode=false
                 (a sleeping engine releases its weights and KV cache during the update)

    step         the float32 gradient partition ZeRO-1/2 builds for each optimizer step and frees after it,
                 4 B a trained parameter over the N ranks (ZeRO-3: one sub_group_size at a time; `step_gib`):
                 14 GiB at 3.75 B parameters on one rank

    vLLM         vllm.gpu_memory_utilization x G (rollout.backend=vllm): vLLM starts after the engines and
                 takes that share whatever else is resident. The share must hold the engine's weights, one
                 vllm.max_model_len sequence of keys and values, and its profiled forward pass
                 (`vllm_floor`), or vLLM refuses to start ("No available memory for the cache blocks")
    buckets      DeepSpeed's communication buffers of `train.deepspeed_config` (configs/deepspeed/ sets each
                 size), in the model's dtype, each at most the parameters it holds: ZeRO-3 keeps a reduce
                 bucket of `reduce_bucket_size` elements in each trained engine (actor, and critic for
                 gae/turn_gae) from its start, and gathers `stage3_max_live_parameters` +
                 `stage3_prefetch_bucket_size` (at least the largest tensor) in the one engine that runs;
                 ZeRO-1/2 hold their reduce buckets (two under `overlap_comm`, DeepSpeed's double buffer)
                 only during an engine's backward, so one engine's count, and the all-gather bucket
                 `allgather_bucket_size` after its step; ZeRO-0 all-reduces through a fixed buffer of 5e8
                 elements. tests/test_preflight.py reads these buffers off real DeepSpeed engines
    activations  one micro-batch's forward and backward through the actor (`activation_bytes`): what each
                 decoder layer saves for backward per token, from the model's shape (hidden size,
                 intermediate size, heads, key-value heads), for train.micro_batch_size sequences of
                 rollout.max_trajectory_length tokens (the longest a sequence can be) over every layer, or,
                 with model.gradient_checkpointing, each layer's input and one layer recomputed; the
                 gradients in flight during a layer's backward (two [tokens, intermediate], two [tokens, h]); the head's float32 [rows, vocabulary] chunks
                 (`vagen.update.head_logprobs`) and three [vocabulary, h] gradients of its weight (the sum
                 of the chunks', the one arriving, and their sum); the vision tower's blocks over the frames of a sequence
                 (max_turns frames, each of its image tokens x spatial_merge_size^2 patches) when it trains.
                 The critic runs after the actor's backward and has no vocabulary head, so the actor's is
                 the peak
    margin       MARGIN_GIB: the CUDA context, NCCL's buffers and the allocator's fragmentation

`benchmarks/bench_memory.py --activations` sets the activation term beside peaks measured on the CPU.

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

# What the GPU check keeps free beyond the states, vLLM's share, the buckets and the activations (module
# docstring): a CUDA context with torch's kernels (~0.5-1 GiB), NCCL's buffers, the allocator's fragmentation.
MARGIN_GIB = 3.0

# vagen.update's chunking of the head's log-probabilities (HEAD_CHUNK_*; tests/test_memory.py keeps the two
# equal): rows of float32 [rows, vocabulary] tensors computed at once, four of them alive in a chunk's backward.
HEAD_CHUNK_FRACTION = 32
HEAD_CHUNK_BYTES = 256 * 2**20
HEAD_CHUNK_TENSORS = 4

# vLLM beside its weights and keys and values: CUDA graphs, cuBLAS and sampler workspaces (the profiled
# forward pass is counted from the model's shape, `vllm_floor`); and vagen.decoding_vllm.engine.STEP_TOKENS,
# the most tokens one engine step reads on a GPU (tests/test_memory.py keeps the two equal).
VLLM_RUNTIME_GIB = 1.0
VLLM_STEP_TOKENS = 8192

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


def model_shape(path: str) -> tuple[dict, dict] | None:
    """The (text, vision) config dicts of model.path: a known checkpoint's published shape, or the config.json
    of a directory on this machine (its text_config and vision_config, or its top level for a text model);
    None for a built-in (built at first use) or a directory without a readable config.json."""
    if path.startswith("builtin:"):
        return None
    if path.startswith("assets:"):
        from envs_visual.assets import ASSETS_DIR

        directory = ASSETS_DIR / "checkpoints" / path.split(":", 1)[1]
    else:
        directory = Path(path).expanduser()
    file = directory / "config.json"
    if file.is_file():
        try:
            config = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        text, vision = config.get("text_config") or config, config.get("vision_config") or {}
        needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        return (text, vision) if all(isinstance(text.get(key), int) for key in needed) else None
    known = {key.lower(): key for key in KNOWN_SHAPES}
    match = known.get(directory.name.lower())
    return (KNOWN_SHAPES[match]["text"], KNOWN_SHAPES[match]["vision"]) if match else None


def layer_bytes(text: dict, width: int, attention: str = "sdpa", tokens: int = 0) -> int:
    """Bytes one decoder layer of a Qwen2/Qwen3-style language model (`text`: its config) saves for backward per
    token, activations of `width` bytes (2 in bf16, 4 in float32), as transformers' layer computes them:

        2 RMS norms   (4 + 2 w) h   the float32 upcast of the input, the normalised input and the weighted output
        attention     (3 q + 2 kv) w  queries, keys, values, the output and o_proj's contiguous copy of it
        MLP (SwiGLU)  4 i w         gate, SiLU(gate), up, and their product that down_proj reads

    where h is the hidden size, q = heads x head_dim, kv = key-value heads x head_dim and i the intermediate
    size. `attention="eager"` also keeps each token's row of attention weights over `tokens` positions
    (heads x tokens, float32 softmax and its cast); sdpa's kernels keep one log-sum-exp a head."""
    h, inter = text["hidden_size"], text["intermediate_size"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or h // heads
    q, kv = heads * head_dim, text.get("num_key_value_heads", heads) * head_dim
    out = 2 * (4 + 2 * width) * h + (3 * q + 2 * kv) * width + 4 * inter * width + 4 * heads
    if attention == "eager":
        out += heads * tokens * (4 + width)
    return out


def vision_block_bytes(vision: dict, width: int) -> int:
    """Bytes one vision-tower block saves for backward per patch, as `layer_bytes` counts a decoder layer: two
    norms, fused q/k/v (3 x hidden), the attention output and its projection's input, and the MLP (Qwen2.5-VL's
    SwiGLU: 4 x intermediate; Qwen3-VL's GELU fc1/fc2, `linear_fc1` in its tensors: 2 x intermediate)."""
    vh, vi = vision["hidden_size"], vision["intermediate_size"]
    mlp = (2 if "deepstack_visual_indexes" in vision else 4) * vi
    return 2 * (4 + 2 * width) * vh + 5 * vh * width + mlp * width


def head_chunk_rows(rows: int, vocab: int) -> int:
    """Rows of logits vagen.update.head_logprobs computes at once for `rows` positions of a `vocab`-entry head."""
    budget = HEAD_CHUNK_BYTES // (HEAD_CHUNK_TENSORS * 4 * vocab)
    return max(1, min(-(-rows // HEAD_CHUNK_FRACTION), budget))


@dataclass
class Activations:
    """One micro-batch's activation memory in the update (module docstring, "activations"), in bytes."""
    layers: int  # what the decoder layers keep for backward (every layer's, or checkpoints + one layer)
    backward: int  # gradients in flight during a layer's backward
    head: int  # the final norm, the gathered positions and the head's float32 chunks
    vision: int  # the vision tower's blocks over the sequence's frames (0 when it does not train)
    sequences: int
    tokens: int  # per sequence
    generated: int  # trained positions per sequence
    patches: int  # vision patches per sequence
    checkpointing: bool

    @property
    def total(self) -> int:
        return self.layers + self.backward + self.head + self.vision

    def describe(self) -> str:
        return (f"train.micro_batch_size={self.sequences} x {self.tokens:,} tokens "
                f"(rollout.max_trajectory_length), {self.patches:,} vision patches a sequence, "
                f"{'with' if self.checkpointing else 'without'} gradient checkpointing: layers "
                f"{self.layers / GIB:.2f}, backward {self.backward / GIB:.2f}, head {self.head / GIB:.2f}, "
                f"vision {self.vision / GIB:.2f} GiB")


def activation_bytes(text: dict, vision: dict, *, sequences: int, tokens: int, generated: int, patches: int,
                     width: int, checkpointing: bool, vision_trained: bool = True,
                     attention: str = "sdpa") -> Activations:
    """The activation memory of one forward and backward of the actor over `sequences` sequences of `tokens`
    tokens, `generated` of them trained (the head's rows), and `patches` vision patches each, in activations of
    `width` bytes. Without checkpointing every layer keeps `layer_bytes` a token; with it (transformers'
    non-reentrant checkpoint of each decoder layer and vision block) each keeps its input (h x width) and one
    layer is recomputed at a time. During a layer's backward, which frees what the layer saved as it goes, two
    [tokens, intermediate] and two [tokens, h] gradients are in flight besides."""
    count = sequences * tokens
    layers, h = text["num_hidden_layers"], text["hidden_size"]
    per_layer = layer_bytes(text, width, attention, tokens) * count
    kept = layers * h * width * count + per_layer if checkpointing else layers * per_layer
    # a layer's backward frees what it saved as it goes: beside it, two [tokens, intermediate] and two [tokens, h]
    # gradients at once
    flight = 2 * (text["intermediate_size"] + h) * width * count
    rows = sequences * min(generated, tokens)
    chunk = HEAD_CHUNK_TENSORS * 4 * text["vocab_size"] * head_chunk_rows(rows, text["vocab_size"])
    # the final norm, the [rows, h] hidden states the head reads, the float32 log-probabilities and losses, and
    # three [vocabulary, h] gradients of the head weight: autograd sums the head's chunks (and a tied
    # embedding's) into one buffer before the weight's gradient is stored, beside the one arriving and their sum
    # (bench_memory.py --activations: 0.5 B's measured peaks sit one such tensor above a count of two)
    head = (4 + 2 * width) * h * count + rows * h * width + chunk + 8 * 4 * count + 3 * text["vocab_size"] * h * width
    tower = 0
    if vision and vision_trained and patches:
        all_patches = sequences * patches
        block = vision_block_bytes(vision, width) * all_patches
        depth, vh = vision["depth"], vision["hidden_size"]
        tower = depth * vh * width * all_patches + block if checkpointing else depth * block
    return Activations(kept, flight, head, tower, sequences, tokens, generated, patches, checkpointing)


def frame_patches(cfg, vision: dict) -> int:
    """Vision patches of one frame of cfg.env (0 in text mode): the frame's pixels (the environment's image
    size, or its grid x cell size, from cfg.env.params over the environment's defaults), resized to whole image
    tokens of patch_size x spatial_merge_size pixels within model.min_pixels / max_pixels, x merge^2."""
    if cfg.env.render_mode != "vision" or not vision:
        return 0
    import inspect

    import envs_visual

    params = {}
    for klass in reversed(envs_visual.env_class(cfg.env.name).__mro__):
        if "__init__" in vars(klass):
            params.update({p.name: p.default for p in inspect.signature(klass.__init__).parameters.values()
                           if p.default is not p.empty})
    params.update(cfg.env.params)
    if "image_width" in params and "image_height" in params:
        width, height = int(params["image_width"]), int(params["image_height"])
    elif "cell_size" in params and ("dim_room" in params or "size" in params):
        rows, columns = params["dim_room"] if "dim_room" in params else (params["size"], params["size"])
        width, height = int(columns) * int(params["cell_size"]), int(rows) * int(params["cell_size"])
    else:
        return 0
    merge = vision.get("spatial_merge_size", 2)
    factor = vision.get("patch_size", 14) * merge
    tokens = max(1, round(width / factor)) * max(1, round(height / factor))
    if cfg.model.min_pixels and tokens * factor ** 2 < cfg.model.min_pixels:
        tokens = -(-cfg.model.min_pixels // factor ** 2)
    if cfg.model.max_pixels and tokens * factor ** 2 > cfg.model.max_pixels:
        tokens = max(1, cfg.model.max_pixels // factor ** 2)
    return tokens * merge ** 2


def update_activations(cfg, text: dict, vision: dict, width: int) -> Activations:
    """`activation_bytes` of cfg's update: train.micro_batch_size sequences of rollout.max_trajectory_length
    tokens (with train.micro_batch_tokens, as many as that budget holds, rounded up); trained positions max_turns x (max_new_tokens + 1) (one turn's with rollout.context=window); the
    frames of a sequence (max_turns, or window_turns + 1 with rollout.context=window). With rollout.tasks, the
    largest task's."""
    from vagen.config_checks import task_configs

    subs = [sub for _, sub in task_configs(cfg)] or [cfg]
    best = None
    for sub in subs:
        ro = sub.rollout
        window = ro.context == "window"
        turns = min(ro.max_turns, ro.window_turns + 1) if window else ro.max_turns
        generated = (ro.max_new_tokens + 1) * (1 if window else ro.max_turns)
        trained_tower = cfg.model.lora_rank == 0 or not cfg.model.freeze_vision
        sequences = cfg.train.micro_batch_size
        if cfg.train.micro_batch_tokens > 0:  # as many whole trajectories as the budget holds tokens, one at least
            sequences = max(1, -(-cfg.train.micro_batch_tokens // ro.max_trajectory_length))
        result = activation_bytes(text, vision, sequences=sequences, tokens=ro.max_trajectory_length,
                                  generated=generated, patches=turns * frame_patches(sub, vision), width=width,
                                  checkpointing=cfg.model.gradient_checkpointing, vision_trained=trained_tower,
                                  attention=cfg.model.attn_implementation)
        best = result if best is None or result.total > best.total else best
    return best


def _changed(cfg, section: str, **values):
    """A shallow copy of `cfg` with `values` set in `section`, not validated again (the config's own checks
    passed; a copy made with dataclasses.replace would look for the checkpoint)."""
    import copy

    out, part = copy.copy(cfg), copy.copy(getattr(cfg, section))
    for key, value in values.items():
        setattr(part, key, value)
    setattr(out, section, part)
    return out


def kv_bytes_per_token(text: dict, width: int = 2) -> int:
    """Bytes of keys and values one token holds in every layer of the language model."""
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return text["num_hidden_layers"] * 2 * text.get("num_key_value_heads", text["num_attention_heads"]) * head_dim * width


def vllm_floor(cfg, text: dict, parameters: int, ranks: int) -> tuple[float, str]:
    """GiB a vLLM engine needs of its share to start (vLLM refuses below it: "No available memory for the cache
    blocks"), and how it adds up: its weights in model.dtype (split over vllm.tensor_parallel_size), one
    vllm.max_model_len sequence of keys and values, the forward pass vLLM profiles (one step of at most
    VLLM_STEP_TOKENS tokens: the layer's widest intermediates, and float32 logits of every episode a rank
    plays), and VLLM_RUNTIME_GIB."""
    width = 2 if cfg.model.dtype == "bfloat16" else 4
    tp = max(1, cfg.vllm.tensor_parallel_size)
    weights = width * parameters / tp
    kv = kv_bytes_per_token(text, width) * cfg.vllm.max_model_len / tp
    episodes = max(1, cfg.rollout.env_groups * cfg.rollout.group_size // ranks)
    step = min(VLLM_STEP_TOKENS, max(episodes, episodes * cfg.rollout.max_trajectory_length))
    profile = (step * (2 * text["intermediate_size"] + 4 * text["hidden_size"]) * width / tp
               + 2 * 4 * episodes * text["vocab_size"])
    total = (weights + kv + profile) / GIB + VLLM_RUNTIME_GIB
    return total, (f"{weights / GIB:.1f} GiB of weights, {kv / GIB:.2f} GiB of keys and values for one "
                   f"vllm.max_model_len={cfg.vllm.max_model_len:,} sequence, {profile / GIB:.2f} GiB for the "
                   f"profiled forward pass and {VLLM_RUNTIME_GIB:.0f} GiB of CUDA graphs and workspaces")


@dataclass
class Estimate:
    lines: list[str]
    total_gib: float | None  # model states; None when the parameters could not be counted
    gpu_total_gib: float | None = None  # with vLLM's share, the buckets and the margin, when the GPU is known
    problem: str | None = None  # why it does not fit the GPU, and what to change
    activations: Activations | None = None  # one micro-batch's update; None when the shape is unknown
    rollout_gib: float | None = None  # the two phases whose larger is gpu_total_gib (module docstring)
    update_gib: float | None = None


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


def step_gib(deepspeed: dict, trained: int, ranks: int) -> float:
    """GiB of the float32 gradient partition a ZeRO optimizer builds at each step of one engine and frees after
    it (`deepspeed/runtime/zero/stage_1_and_2.py` `step`: the flat gradient partition cast to the master
    weights' dtype; stage 3 does so one sub-group of at most `sub_group_size` elements at a time): 4 B for each
    trained parameter of this rank's partition. ZeRO-0 steps the gradients it holds."""
    zero = deepspeed.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage == 0:
        return 0.0
    count = trained / ranks
    if stage == 3:
        count = min(count, float(zero.get("sub_group_size", 1e9)))
    return 4 * count / GIB


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
    shape = model_shape(cfg.model.path)
    acts = update_activations(cfg, shape[0], shape[1], width) if shape else None
    activations = acts.total / GIB if acts else 0.0
    if acts:
        lines.append(f"  activations {activations:5.1f} GiB of one micro-batch's update ({acts.describe()})")
    else:
        lines.append(f"  activations not counted: no config.json gives the shape of model.path={cfg.model.path}")
    vllm_on = cfg.rollout.backend == "vllm"
    if gpu_gib is None:
        vllm = (f"vLLM's share of the GPU (vllm.gpu_memory_utilization={cfg.vllm.gpu_memory_utilization} of it)"
                if vllm_on else "the hf rollout's key/value cache")
        lines.append(f"  DeepSpeed's communication buckets: {buckets:.1f} GiB ({how})")
        lines.append(f"  not counted without a GPU size (--gpu-gib G): {vllm}, and a margin of {MARGIN_GIB:.0f} GiB "
                     f"for the CUDA context, NCCL and the allocator")
        return Estimate(lines, result, activations=acts)
    size = f"{gpu_gib:.0f}" if gpu_gib == round(gpu_gib) else f"{gpu_gib:.1f}"  # 80, or 79.6 read from a GPU
    vllm = cfg.vllm.gpu_memory_utilization * gpu_gib if vllm_on else 0.0
    awake = vllm if vllm_on and not cfg.vllm.sleep_mode else 0.0
    episodes = max(1, cfg.rollout.env_groups * cfg.rollout.group_size // ranks)
    # the hf rollout keeps every episode of the rank's batch in one key/value cache, up to its longest trajectory
    cache = (episodes * cfg.rollout.max_trajectory_length * kv_bytes_per_token(shape[0], width) / GIB
             if not vllm_on and shape else 0.0)
    rollout_phase = result + vllm + cache + buckets + MARGIN_GIB
    step = step_gib(deepspeed, trained, ranks)
    update_phase = result + activations + step + awake + buckets + MARGIN_GIB
    gpu_total = max(rollout_phase, update_phase)
    lines.append(f"  buckets    {buckets:6.1f} GiB of DeepSpeed's communication buffers ({how})")
    if vllm_on:
        lines.append(f"  vLLM       {vllm:6.1f} GiB (vllm.gpu_memory_utilization={cfg.vllm.gpu_memory_utilization} "
                     f"of {size} GiB), " + ("asleep during the update (vllm.sleep_mode)" if cfg.vllm.sleep_mode
                                            else "awake during the update (vllm.sleep_mode=false)"))
    else:
        lines.append(f"  hf cache   {cache:6.1f} GiB: the hf rollout's keys and values, {episodes} episode(s) of this "
                     f"rank x {cfg.rollout.max_trajectory_length:,} tokens" if shape else
                     "  hf cache   the hf rollout's key/value cache: not counted (the model's shape is unknown)")
    lines.append(f"  margin     {MARGIN_GIB:6.1f} GiB (CUDA context, NCCL, allocator)")
    if step:
        lines.append(f"  step       {step:6.1f} GiB: the float32 gradient partition DeepSpeed builds for each optimizer "
                     f"step")
    lines.append(f"  rollout    {rollout_phase:6.1f} GiB: states + " + ("vLLM + " if vllm_on else "hf cache + ")
                 + "buckets + margin")
    lines.append(f"  update     {update_phase:6.1f} GiB: states + activations + " + ("step + " if step else "")
                 + "buckets + margin"
                 + (" + vLLM awake" if awake else ""))
    lines.append(f"  GPU total  {gpu_total:.1f} GiB of {size} GiB: {'fits' if gpu_total <= gpu_gib else 'does not fit'}")
    problems = []
    floor = None
    if vllm_on and shape:
        floor, floor_how = vllm_floor(cfg, shape[0], total, ranks)
        if vllm < floor:
            needed = -(-floor * 100 // gpu_gib) / 100  # rounded up to a percent
            problems.append(
                f"vllm.gpu_memory_utilization={cfg.vllm.gpu_memory_utilization} gives vLLM {vllm:.1f} GiB of the "
                f"{size} GiB GPU, less than the {floor:.1f} GiB it needs to start ({floor_how}); vLLM would refuse "
                f"at start-up (\"No available memory for the cache blocks\"). Raise it to at least {needed:.2f}, "
                f"or lower vllm.max_model_len")
    if gpu_total > gpu_gib:
        over = gpu_total - gpu_gib
        fixes = []
        if update_phase > gpu_gib:
            if acts and not acts.checkpointing:
                fewer = update_activations(_changed(cfg, "model", gradient_checkpointing=True), *shape, width)
                fixes.append(f"model.gradient_checkpointing=true (activations {activations:.1f} -> "
                             f"{fewer.total / GIB:.1f} GiB)")
            if acts and cfg.train.micro_batch_size > 1:
                fewer = update_activations(_changed(cfg, "train", micro_batch_size=1), *shape, width)
                fixes.append(f"train.micro_batch_size=1 (activations {activations:.1f} -> {fewer.total / GIB:.1f} GiB)")
            if awake:
                fixes.append(f"vllm.sleep_mode=true, which releases vLLM's {vllm:.1f} GiB during the update")
        fixes.append("more ranks (--ranks N, deepspeed --num_gpus N: the partitioned states shrink with them)")
        if stage < 3:
            fixes.append("ZeRO-3 (train.deepspeed_config=deepspeed/zero3_bf16.json), which partitions the weights too")
        if vllm_on and rollout_phase > gpu_gib:
            room = gpu_gib - result - buckets - MARGIN_GIB
            if floor is not None and room >= floor:
                fixes.append(f"a smaller vLLM share: vllm.gpu_memory_utilization={int(room / gpu_gib * 100) / 100:.2f} "
                             f"fits and still holds what vLLM needs to start ({floor:.1f} GiB)")
            else:
                fixes.append("rollout.backend=hf: beside the states there is no room for what vLLM needs to start"
                             + (f" ({floor:.1f} GiB)" if floor is not None else ""))
        if cache and rollout_phase > gpu_gib:
            fixes.append(f"fewer episodes a rank (rollout.env_groups x rollout.group_size / ranks = {episodes}) or a "
                         f"shorter rollout.max_trajectory_length, which the hf rollout's {cache:.1f} GiB cache holds")
        if m.lora_rank == 0:
            fixes.append("LoRA (model.lora_rank > 0; the -lora recipes), which trains a fraction of the parameters")
        phase = ("the update" if update_phase >= rollout_phase else "the rollout")
        parts_text = (f"{result:.1f} GiB of model states, {activations:.1f} GiB of activations"
                      + (f", {step:.1f} GiB of the optimizer step's float32 gradients" if step else "")
                      + (f", {awake:.1f} GiB of vLLM kept awake" if awake else "")
                      if phase == "the update" else f"{result:.1f} GiB of model states, "
                      + (f"{vllm:.1f} GiB of vLLM" if vllm_on else f"{cache:.1f} GiB of the hf rollout's cache"))
        problems.append(f"the estimate of {gpu_total:.1f} GiB per GPU in {phase} ({parts_text}, {buckets:.1f} GiB of "
                        f"DeepSpeed buckets, a {MARGIN_GIB:.0f} GiB margin) does not fit a GPU of {size} GiB with "
                        f"{ranks} rank(s), by {over:.1f} GiB; use " + "; or ".join(fixes))
    return Estimate(lines, result, gpu_total, "; and ".join(problems) if problems else None, acts, rollout_phase,
                    update_phase)


def check_memory(cfg, ranks: int, gpu_gib: float) -> list[str]:
    """`estimate` for `ranks` ranks on GPUs of `gpu_gib` GiB with train.deepspeed_config's settings; raises
    vagen.config.ChecksFailed with the estimate's refusal (what does not fit, and what to change) when the
    larger phase of an iteration is over the GPU or vLLM's share cannot start. Returns the estimate's lines."""
    from vagen.config_checks import CONFIGS_DIR, ChecksFailed

    path = CONFIGS_DIR / cfg.train.deepspeed_config
    if not path.is_file():
        return []  # check_training and the DeepSpeed engines name the missing file
    result = estimate(cfg, ranks, json.loads(path.read_text()), gpu_gib)
    if result.problem:
        raise ChecksFailed([result.problem], result.lines)
    return result.lines
