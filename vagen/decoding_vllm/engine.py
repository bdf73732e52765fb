"""Building and closing a rank's vLLM engine: its settings, placement, the process environment it needs and
its shutdown. The weights it is given afterwards are `weights.py`'s, the episodes it plays `play.py`'s.

Placement. Under a trainer's process group of several ranks every rank's engine uses vLLM's
`external_launcher` executor:
the engine's one worker runs in the trainer's process with the trainer's RANK and LOCAL_RANK, so on a GPU
it sits on the rank's own device (vLLM's single-process executor would put every rank's engine on GPU 0,
and make GPU 0 the trainer's current device). Tensor parallelism (`vllm.tensor_parallel_size > 1`) spawns
worker processes on GPUs 0..TP-1, so it is refused under several ranks (`vagen.config.check_vllm_ranks`).

Built-in tiny models whose config turns on vagen's image hooks (`vagen_center_image_tokens`,
`vagen_image_position_code`) are refused: stock vLLM does not run those hooks, so it would sample a
different policy from the one being trained.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from vagen import vllm_compat as compat
from vagen.decoding_vllm.play import AgentLoop
from vagen.decoding_vllm.weights import WeightSync, lora_rank_slot
from vagen.episode import ChatEncoder
from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE, family_of
from vagen.vllm_compat import SUPPRESS_TOKENS

# Engine settings, read from the `vllm` config section where it exists (see `settings_from`).
DEFAULT_SETTINGS = {
    "gpu_memory_utilization": 0.5,
    "max_model_len": 8192,
    "enforce_eager": None,  # None: CUDA graphs on a GPU, eager on the CPU
    "tensor_parallel_size": 1,
    "sleep_mode": True,
    "cpu_kv_cache_gib": 1.0,
    "sync_group_mb": 512,
    "seeded_requests": True,
}



def image_hooks(checkpoint: Path) -> list[str]:
    """The vagen image hooks a checkpoint's config.json turns on (keys of `vagen.models`)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return [key for key in (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE) if config.get(key)]


def refuse_image_hooks(checkpoint: Path) -> None:
    hooks = image_hooks(checkpoint)
    if hooks:
        raise ValueError(
            f"rollout.backend=vllm cannot decode {checkpoint}: its config.json turns on vagen's image hooks "
            f"{hooks}, which stock vLLM does not run, so vLLM would sample a different policy from the one "
            f"being trained. Use a standard Qwen2.5-VL / Qwen2-VL checkpoint (model.path=/path/to/checkpoint), "
            f"or rollout.backend=hf, which runs the hooks.")


def architecture_override(checkpoint: Path) -> dict:
    """vLLM's `hf_overrides` naming the checkpoint's architecture when its config.json names none. A model
    family vagen does not know is refused (`vagen.models.family_of`)."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    family = family_of(config)
    if config.get("architectures"):
        return {}
    return {"architectures": [family.architecture(config["model_type"])]}


def cpu_binding(workers: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` giving each of `workers` CPU workers its own share of this process's
    cores ("0-3|4-7")."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        raise ValueError(f"vllm.tensor_parallel_size={workers} CPU workers need a core each; this process may "
                         f"use {len(cores)}: {cores}")
    share = len(cores) // workers
    parts = [cores[k * share : (k + 1) * share] for k in range(workers)]
    return "|".join(f"{part[0]}-{part[-1]}" if len(part) > 1 else str(part[0]) for part in parts)


def settings_from(cfg) -> dict:
    """Engine settings of the config's `vllm` section, defaults where the section or a field is absent."""
    section = getattr(cfg, "vllm", None)
    return {key: getattr(section, key, default) for key, default in DEFAULT_SETTINGS.items()}


class VLLMDecoder(WeightSync, AgentLoop):
    """A rank's vLLM engine over `checkpoint`, decoding turns of `vagen.episode.Episode`s. Implements
    `vagen.decoding.Decoder` (`AgentLoop`, play.py); `sync_weights` and `sleep` keep it in step with training
    (`WeightSync`, weights.py). This file builds the engine and closes it."""

    def __init__(self, checkpoint: str | Path, encoder: ChatEncoder, *, dtype: str = "float32", seed: int = 0,
                 lora_rank: int = 0, episodes: int | None = None, trajectory_length: int | None = None, **settings):
        unknown = sorted(set(settings) - set(DEFAULT_SETTINGS))
        if unknown:
            raise ValueError(f"unknown vLLM settings {unknown}; known: {sorted(DEFAULT_SETTINGS)}")
        self.settings = {**DEFAULT_SETTINGS, **settings}
        self.checkpoint = Path(checkpoint)
        refuse_image_hooks(self.checkpoint)
        self.encoder = encoder
        self.on_gpu = torch.cuda.is_available()
        tensor_parallel = int(self.settings["tensor_parallel_size"])
        trainer_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        ranks = torch.distributed.get_world_size() if trainer_group else 1
        if tensor_parallel > 1 and ranks > 1:
            raise ValueError(f"vllm.tensor_parallel_size={tensor_parallel} with {ranks} ranks: each rank's engine "
                             f"would start its workers on GPUs 0..{tensor_parallel - 1}, the GPUs of other ranks; use "
                             f"vllm.tensor_parallel_size=1 (one engine per rank on its own GPU), or one rank")
        # One worker runs in this process with the engine core (`sync_weights` hands it the actor's tensors
        # directly); several are processes, on the CPU each with its own share of this process's cores.
        compat.prepare_process(tensor_parallel, cpu_binding=None if self.on_gpu else cpu_binding)
        from vllm import LLM

        compat.check_release()

        options = dict(
            model=str(self.checkpoint),
            tokenizer=str(self.checkpoint),
            runner="generate",
            hf_overrides=architecture_override(self.checkpoint),
            dtype=dtype,
            seed=seed,
            tensor_parallel_size=tensor_parallel,
            enable_prefix_caching=True,
            enforce_eager=eager(self.settings["enforce_eager"], self.on_gpu),
            max_model_len=int(self.settings["max_model_len"]),
            gpu_memory_utilization=float(self.settings["gpu_memory_utilization"]),
            generation_config="vllm",  # the checkpoint's sampling defaults would change the distribution
            logprobs_mode="processed_logprobs",  # of the distribution sampled from: masked, after temperature
            logits_processors=[SUPPRESS_TOKENS],
            **placement(tensor_parallel, ranks, torch.cuda.current_device() if self.on_gpu else None),
        )
        if self.on_gpu:
            options["enable_sleep_mode"] = bool(self.settings["sleep_mode"])
        else:
            options["kv_cache_memory_bytes"] = int(float(self.settings["cpu_kv_cache_gib"]) * 2**30)
            # A prompt prefilled in chunks draws a token after each chunk and throws it away, then rewinds
            # the request's random generator, which the CPU's generator cannot do ("CPU Generator does
            # not use offset"): seeded requests would fail once a turn's prompts exceed one step's
            # token budget. Whole prompts per step instead.
            options["enable_chunked_prefill"] = False
            options["max_num_batched_tokens"] = int(self.settings["max_model_len"])
        if episodes is not None:  # sized for the rank's episodes, not for serving (`engine_sizes`)
            self.sizes = engine_sizes(episodes, trajectory_length or int(self.settings["max_model_len"]),
                                      int(self.settings["max_model_len"]), self.on_gpu)
            options.update(max_num_seqs=self.sizes["max_num_seqs"],
                           max_num_batched_tokens=self.sizes["max_num_batched_tokens"])
            if self.on_gpu:
                options["compilation_config"] = {"cudagraph_capture_sizes": self.sizes["cudagraph_capture_sizes"]}
        # What the family's kernels need over these (Qwen3.5's linear layers: chunked prefill under prefix caching)
        options.update(family_of(self.checkpoint).vllm_options(self.on_gpu, dtype))
        self.lora_rank, self.lora_request, self.adapter_dir, self.adapters_loaded = int(lora_rank), None, None, 0
        if self.lora_rank > 0:
            options.update(enable_lora=True, max_lora_rank=lora_rank_slot(self.lora_rank), max_loras=1)
        if encoder.is_vision:
            size = encoder.processor.image_processor.size
            # The encoder's pixel bounds (model.min_pixels/max_pixels included): frames resized under
            # them are left as they are by vLLM's processor, so image token counts agree.
            options["mm_processor_kwargs"] = {"size": {"shortest_edge": size["shortest_edge"],
                                                       "longest_edge": size["longest_edge"]}}
            options["limit_mm_per_prompt"] = {"video": 0}
        device = torch.cuda.current_device() if self.on_gpu else None
        start = time.perf_counter()
        with compat.torch_threads_kept():  # vLLM's CPU worker shares the trainer's process
            self.llm = LLM(**options)
        if self.on_gpu and torch.cuda.current_device() != device:
            raise RuntimeError(f"building the vLLM engine moved this process from GPU {device} to GPU "
                               f"{torch.cuda.current_device()}: the engine was placed on another rank's GPU")
        self.shutdown_finalizer = compat.guard_shutdown(self.llm, trainer_group)
        self.model_runner = compat.model_runner_name(self.llm)
        self.start_seconds = time.perf_counter() - start
        print(f"[vllm] engine of vLLM {compat.release()} built in {self.start_seconds:.1f} s on "
              f"{f'GPU {device}' if self.on_gpu else 'the CPU'}: model runner {compat.runner_version(self.model_runner)} "
              f"({self.model_runner})", file=sys.stderr, flush=True)
        self.sleeping: set[str] = set()  # what the engine dropped in `sleep()` and has not taken back yet
        self.reload_name = None  # the names vLLM's reload takes (`vllm_compat.reload_names`), found at the first sync
        # vLLM's activation peak, which waking must leave room for (`check_wake_memory`)
        self.activation_bytes = compat.activation_bytes(self.llm) if self.on_gpu else None
        self.released_bytes = 0  # GPU memory the engine gave up in its last `sleep()`
        self.in_process = tensor_parallel == 1

    @classmethod
    def from_config(cls, cfg, model=None, encoder: ChatEncoder | None = None) -> VLLMDecoder:
        """The engine of a run: the base checkpoint of `cfg.model` (refused when it has image hooks),
        `cfg.model.dtype`, seeded by `cfg.train.seed`, settings of `cfg.vllm`; then `model`'s weights
        when given (a resumed or warm-started actor differs from the base checkpoint)."""
        from vagen.config import check_vllm_ranks
        from vagen.distributed import world_size
        from vagen.models import base_checkpoint, load_policy

        check_vllm_ranks(cfg, world_size())
        checkpoint = base_checkpoint(cfg.model)
        refuse_image_hooks(checkpoint)
        if encoder is None:
            encoder = ChatEncoder(load_policy(checkpoint, cfg.model.dtype, cfg.model.min_pixels, cfg.model.max_pixels)[1])
        # the rank's share, as train.py plays it, and with rollout.max_staleness = k up to k + 1 shares in flight
        episodes = cfg.rollout.env_groups // world_size() * cfg.rollout.group_size * (1 + cfg.rollout.max_staleness)
        decoder = cls(checkpoint, encoder, dtype=cfg.model.dtype, seed=cfg.train.seed, lora_rank=cfg.model.lora_rank,
                      episodes=episodes, trajectory_length=cfg.rollout.max_trajectory_length, **settings_from(cfg))
        if model is not None:
            decoder.sync_weights(model)
        return decoder

    def close(self) -> None:
        """Shut the engine down (its worker processes too, with tensor parallelism); the trainer's process
        group stays."""
        if self.llm is not None:
            compat.shutdown(self.llm, self.shutdown_finalizer)
            self.llm = None
        if self.adapter_dir is not None:
            import shutil

            shutil.rmtree(self.adapter_dir, ignore_errors=True)
            self.adapter_dir = None


def placement(tensor_parallel: int, ranks: int, device: int | None = None) -> dict:
    """vLLM's executor for an engine built inside a trainer rank: `external_launcher` under a process group of
    several ranks, which gives the engine's worker the rank's RANK and LOCAL_RANK; the default otherwise (one
    rank, whose device is the engine's device 0, or tensor-parallel workers of its own). vLLM's worker takes
    LOCAL_RANK as its CUDA index, so on a GPU (`device`: the rank's current CUDA index) it must name that
    device; `vagen.distributed.init_distributed` sets it so (device 0 where one GPU is bound per task)."""
    if tensor_parallel > 1 or ranks == 1:
        return {}
    missing = [key for key in ("RANK", "LOCAL_RANK") if key not in os.environ]
    if missing:
        raise RuntimeError(f"a vLLM engine inside a trainer rank reads its rank from the environment, but {missing} "
                           f"are not set; start the job with the DeepSpeed launcher (deepspeed vagen/train.py) or "
                           f"with vagen.distributed.init_distributed, which set them")
    if device is not None and os.environ["LOCAL_RANK"] != str(device):
        raise RuntimeError(f"this rank runs on GPU {device} but LOCAL_RANK={os.environ['LOCAL_RANK']}, which vLLM's "
                           f"external_launcher worker would take as its device (another rank's GPU, or one this "
                           f"process cannot see); start the rank with vagen.distributed.init_distributed, which sets "
                           f"LOCAL_RANK to the rank's device")
    return {"distributed_executor_backend": "external_launcher"}


# Tokens one engine step reads at most on a GPU: vLLM's own default for GPUs under 70 GB, half of what it takes
# above (16,384), which it profiles activations for out of the KV cache's budget.
STEP_TOKENS = 8192


def engine_sizes(episodes: int, trajectory_length: int, max_model_len: int, on_gpu: bool) -> dict:
    """The engine's batch sizes for a rank that plays `episodes` at once (`rollout.env_groups / ranks x
    rollout.group_size`), each at most `trajectory_length` tokens, instead of vLLM's serving defaults (on a
    GPU of 70 GB or more: 1,024 sequences, 16,384 tokens a step, CUDA graphs up to batch 512, and 1,024 rows of
    logits profiled out of the KV cache's budget):
    - `max_num_seqs`: the episodes; the agent loop never runs more requests than that;
    - `max_num_batched_tokens`: on a GPU, every episode's trajectory in one step where that is under
      `STEP_TOKENS` (longer prompts are prefilled in chunks), never under `max_num_seqs`; on the CPU
      `max_model_len`, since prompts are prefilled whole there (see `VLLMDecoder`);
    - `cudagraph_capture_sizes`: decode batches of 1, 2, 4, then multiples of 8 up to the first that holds
      every episode (vLLM's own pattern, cut at `max_num_seqs`)."""
    if episodes < 1 or trajectory_length < 1:
        raise ValueError(f"an engine for {episodes} episodes of {trajectory_length} tokens; both must be at least 1 "
                         f"(rollout.env_groups / ranks x rollout.group_size, rollout.max_trajectory_length)")
    step = max(episodes, min(episodes * trajectory_length, STEP_TOKENS)) if on_gpu else max_model_len
    largest = -(-episodes // 8) * 8 if episodes > 4 else episodes
    sizes = sorted({size for size in (1, 2, 4) if size < largest} | set(range(8, largest + 1, 8)) | {largest})
    return {"max_num_seqs": episodes, "max_num_batched_tokens": step, "cudagraph_capture_sizes": sizes}


def eager(setting: bool | None, on_gpu: bool) -> bool:
    """`vllm.enforce_eager`: null means CUDA graphs on a GPU (decode steps replayed, not launched kernel by
    kernel) and eager on the CPU, where vLLM's CPU backend compiles instead."""
    return (not on_gpu) if setting is None else bool(setting)

