"""The vLLM decoder: each rank runs its own in-process `vllm.LLM` engine over its share of the rollout
(data-parallel; `vllm.tensor_parallel_size` GPUs per engine), with prefix caching, so a turn re-reads
its history from cache instead of recomputing it. `VLLMDecoder` implements `vagen.decoding.Decoder`.

The package's files, one concern each:
- `engine.py`: building and closing the engine (settings, placement, the process environment, shutdown)
  and `VLLMDecoder` itself;
- `weights.py`: moving the actor's weights and LoRA adapters into the engine (`sync_weights`), and its
  sleep while the update runs (`WeightSync`);
- `play.py`: playing episodes, per turn (`generate`) or in the agent loop over `add_request`/`step`
  (`play`), which carries unfinished episodes over an update under rollout.max_staleness (`AgentLoop`).

Every reach into vLLM's private API (underscore names, `vllm.v1` internals, `vllm.envs`, worker methods)
is in `vagen.vllm_compat`, with the releases it was checked against.
"""

from vagen.decoding_vllm.engine import (
    DEFAULT_SETTINGS,
    STEP_TOKENS,
    VLLMDecoder,
    architecture_override,
    cpu_binding,
    eager,
    engine_sizes,
    image_hooks,
    placement,
    refuse_image_hooks,
    settings_from,
)
from vagen.decoding_vllm.play import AgentLoop
from vagen.decoding_vllm.weights import (
    ACTIVATION_MARGIN,
    VLLM_LORA_RANKS,
    WeightSync,
    adapter_tensors,
    check_wake_memory,
    engine_weights,
    free_gpu_bytes,
    lora_layers,
    lora_rank_slot,
    total_gpu_bytes,
    trained_whole,
    unwrap,
    weight_groups,
    write_adapter,
)

__all__ = [
    "ACTIVATION_MARGIN", "AgentLoop", "DEFAULT_SETTINGS", "STEP_TOKENS", "VLLMDecoder",
    "VLLM_LORA_RANKS", "WeightSync", "adapter_tensors", "architecture_override", "check_wake_memory",
    "cpu_binding", "eager", "engine_sizes", "engine_weights", "free_gpu_bytes", "image_hooks", "lora_layers",
    "lora_rank_slot", "placement", "refuse_image_hooks", "settings_from", "total_gpu_bytes", "trained_whole",
    "unwrap", "weight_groups", "write_adapter",
]
