"""Moving weights and LoRA adapters into a rank's vLLM engine (built in `engine.py`), and the engine's sleep
while the update runs.

Weights follow training through `sync_weights(model)`: the actor's parameters are loaded into the
engine by vLLM's in-place reload, a group of whole layers at a time (under ZeRO-3 each group is
gathered with `GatheredParameters`, never the whole model at once), then the prefix and encoder caches
are reset, so no key, value or image embedding of the old weights is reused. A LoRA policy (a peft
model) is served as adapters, as the trainer computes it (W x + scale B (A x)): an engine built with
`lora_rank` (what `from_config` does for a LoRA run) runs vLLM's LoRA support, is given the base
weights unmerged and, at each sync, the adapters as a new adapter (written to a temporary folder, which
vLLM loads by path), which every request names. Merging W + scale B A into one tensor of W's dtype would
round, in bfloat16, every element whose change is under half a step of W back to W (docs/training.md,
"vLLM rollouts"); an engine built without `lora_rank` is still given the merged weights. On a
GPU, `sleep()` releases the engine's memory while the update runs (vLLM's sleep level 2: the KV cache and
the weights are dropped, not copied to the host, since the sync overwrites the weights anyway), and
`sync_weights` brings it back in the order that keeps the peak low: the weights' memory first, then the
new weights, then the KV cache. Before waking, the free memory is compared with what the engine released,
so an update whose optimizer states left too little room fails with a message instead of an out-of-memory
error inside vLLM. On the CPU sleeping does nothing.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import torch

from vagen import vllm_compat as compat
from vagen.distributed import gathered
from vagen.models import has_adapters, without_wrapper


def unwrap(model):
    """The `transformers` module under a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


class WeightSync:
    """The weights and memory half of `VLLMDecoder` (engine.py). It reads what the engine's constructor sets:
    `llm` (the `vllm.LLM`), `settings`, `on_gpu`, `in_process` (one worker, in this process), `lora_rank`
    (adapters served: > 0), `activation_bytes`; and keeps `lora_request`, `adapter_dir`, `adapters_loaded`,
    `reload_name`, `sleeping`, `released_bytes` and `last_sync_bytes` up to date."""

    def sync_weights(self, model) -> float:
        """Load `model`'s parameters (a `transformers` policy, or the DeepSpeed engine around one) into
        the engine through vLLM's in-place reload, `vllm.sync_group_mb` of them at a time; under ZeRO-3
        each group is gathered from the ranks (a collective: every rank calls this together), never the
        whole model at once. A group holds whole layers: vLLM fuses a layer's projections (q, k and v
        into one matrix), and processes a layer once all its tensors have arrived. A LoRA policy given to an
        engine that serves adapters (built with `lora_rank`) sends only what trains: its adapters, and the
        modules peft trains whole (`modules_to_save`); the engine keeps the frozen base weights it loaded
        from the base checkpoint (a LoRA run's base never changes). Returns the seconds it took;
        `last_sync_bytes` holds the bytes of the tensors it sent."""
        start = time.perf_counter()
        module = unwrap(model)
        adapted = lora_layers(module)
        # Served adapters (an engine built with `lora_rank`): the adapters into `adapters`, the base left as the
        # engine holds it. Without `lora_rank`, the whole policy, merged (`engine_weights`).
        adapters = {} if adapted and self.lora_rank > 0 else None
        rank = max((layer.r[a] for layer in adapted.values() for a in layer.lora_A), default=0)
        if adapters is not None and rank > self.lora_rank:
            raise ValueError(f"the policy's LoRA rank {rank} exceeds the rank {self.lora_rank} the vLLM engine was "
                             f"built for; build it with VLLMDecoder(..., lora_rank={rank}) or VLLMDecoder.from_config")
        self._wake(["weights"])  # the weights' memory back first; the KV cache only once the new weights are in
        limit = float(self.settings["sync_group_mb"]) * 2**20
        sent = [0]
        if adapters is None:
            groups = list(weight_groups(without_wrapper(module), limit))
        else:
            groups = list(weight_groups(without_wrapper(module), limit, only=trained_whole))
            _gather_adapters(adapted, adapters)
            sent[0] += sum(tensor.numel() * tensor.element_size() for tensor in adapters.values())
        if groups and self.reload_name is None:
            self.reload_name = compat.reload_names(self.llm, self.lora_rank > 0)
        if groups and self.in_process:
            # One reload over a generator: the engine pulls each group while it is gathered.
            weights = _counted(_gathered_weights(groups, adapted, adapters, self.reload_name), sent)
            compat.reload_weights(self.llm, weights)
        elif groups:
            # Worker processes get each group serialised (vLLM's own messages carry no nested tensors), as a
            # list of (name, tensor) pairs saved by `torch.save`; layers outside a group keep their weights.
            for group in groups:
                with gathered(_group_parameters(group, adapted)):
                    buffer = io.BytesIO()
                    pairs = [(self.reload_name(name), tensor)
                             for name, tensor in _counted(engine_weights(group, adapted, adapters), sent)]
                    torch.save([(name, tensor.cpu()) for name, tensor in pairs], buffer)
                compat.reload_serialized(self.llm, buffer.getvalue())
        self.last_sync_bytes = sent[0]
        if adapters is not None or self.lora_request is not None:  # a policy without adapters drops the last
            self._serve_adapters(adapters, module)
        if groups:
            self.llm.apply_model(compat.repack_tied_heads)
        self._wake(["kv_cache"])
        self.llm.reset_prefix_cache()  # keys and values of the old weights
        self.llm.llm_engine.reset_encoder_cache()  # image embeddings of the old weights
        return time.perf_counter() - start

    def _serve_adapters(self, adapters: dict | None, module) -> None:
        """Make `adapters` (peft-format names -> tensors; None: no adapter) the adapter every request from now
        on runs: written to a new folder with the peft model's LoRA config, loaded by vLLM under a new id (an
        id it has loaded before would be served from its cache), the previous one removed with its folder."""
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        request = folder = None
        if adapters is not None:
            folder = Path(tempfile.mkdtemp(prefix="vagen_lora_"))
            write_adapter(folder, adapters, module)
            self.adapters_loaded += 1
            request = LoRARequest(f"vagen-policy-{self.adapters_loaded}", self.adapters_loaded, str(folder))
            self.llm.llm_engine.add_lora(request)
        if self.lora_request is not None:
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
        self.lora_request, self.adapter_dir = request, folder

    def sleep(self) -> None:
        """Release the engine's GPU memory while the update runs: the KV cache dropped, and the weights dropped
        (sleep level 2: nothing is copied to the host, `sync_weights` loads the updated weights anyway; vLLM
        keeps the model's buffers) or, in an engine that serves LoRA adapters, copied to the host and back
        (level 1: the frozen base is never synced again). Records how much was released, which waking needs
        back."""
        if self.on_gpu and self.settings["sleep_mode"] and not self.sleeping:
            free = free_gpu_bytes()
            self.llm.sleep(level=self.sleep_level)
            self.released_bytes = max(0, free_gpu_bytes() - free)
            self.sleeping = {"weights", "kv_cache"}

    @property
    def sleep_level(self) -> int:
        """vLLM's sleep level (see `sleep`)."""
        return 1 if self.lora_rank > 0 else 2

    @property
    def asleep(self) -> bool:
        return bool(self.sleeping)

    def _wake(self, tags: list[str]) -> None:
        """Take back what `sleep()` dropped among `tags` (nothing when awake); the memory is checked once, for
        all the engine needs back, before any of it is taken."""
        tags = [tag for tag in tags if tag in self.sleeping]
        if not tags:
            return
        if "weights" in tags:
            check_wake_memory(self.released_bytes, free_gpu_bytes(), total_gpu_bytes(),
                              float(self.settings["gpu_memory_utilization"]), self.activation_bytes)
        self.llm.wake_up(tags=tags)
        self.sleeping -= set(tags)


def free_gpu_bytes() -> int:
    """Free memory of this rank's GPU, after the trainer's allocator has returned what it holds unused."""
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def total_gpu_bytes() -> int:
    return int(torch.cuda.mem_get_info()[1])


# The share of the GPU kept free for the engine's activations when vLLM does not report their peak.
ACTIVATION_MARGIN = 0.05


def check_wake_memory(needed: int, free: int, total: int, utilization: float, activations: int | None = None) -> None:
    """Refuse to wake an engine into less memory than it released plus what its forward passes take:
    `needed` bytes (the weights and KV cache its sleep released) and `activations`, the activation peak
    vLLM measured at start-up (`vllm_compat.activation_bytes`: the profiled forward pass, with CUDA graphs'
    memory where vLLM counts it there), or `ACTIVATION_MARGIN` of the GPU where vLLM reports none. vLLM sizes
    its KV cache at start-up, before the optimizer's states exist (AdamW allocates them at its first step),
    and would fail inside its allocator with a bare out-of-memory error; the activations' cached blocks are
    returned while the engine sleeps, and its first forward pass after waking takes them again."""
    extra = int(ACTIVATION_MARGIN * total) if activations is None else int(activations)
    if free >= needed + extra:
        return
    gib = 2**30
    short = (needed + extra - free) / total
    lower = max(0.05, int((utilization - short - 0.02) * 100) / 100)  # rounded down, with 2% to spare
    counted = (f"{extra / gib:.2f} GiB for its activations as vLLM measured them" if activations is not None else
               f"{extra / gib:.2f} GiB ({ACTIVATION_MARGIN:.0%} of the GPU) for its activations, which vLLM did not report")
    raise RuntimeError(
        f"the vLLM engine cannot wake up after the update: it needs {needed / gib:.2f} GiB back (the weights and KV "
        f"cache it released; vllm.gpu_memory_utilization={utilization:g} of this GPU's {total / gib:.1f} GiB) and "
        f"{counted}, but only {free / gib:.2f} GiB are free now that the update holds its optimizer states and "
        f"gradients. Lower "
        f"vllm.gpu_memory_utilization to {lower:.2f} or less, or make the update smaller: ZeRO-3 "
        f"(train.deepspeed_config=deepspeed/zero3_bf16.json) over more GPUs, LoRA (model.lora_rank=64), or "
        f"model.gradient_checkpointing=true")


def trained_whole(name: str) -> bool:
    """Whether the parameter `name` of a peft model belongs to a module it trains whole (`modules_to_save`)."""
    return "modules_to_save" in name.split(".")


def weight_groups(module, limit_bytes: float, only=None):
    """`module`'s (name, parameter) pairs in groups of about `limit_bytes` (full sizes), each made of
    whole blocks: the tensors of one numbered layer (`...layers.3.`, `...blocks.1.`) never straddle two.
    `only`: a predicate on names; the parameters it refuses are left out."""
    group, size, block = [], 0, None
    for name, param in module.named_parameters():
        if only is not None and not only(name):
            continue
        parts = name.split(".")
        here = next((".".join(parts[: k + 1]) for k, part in enumerate(parts) if part.isdigit()), name)
        if group and here != block and size >= limit_bytes:
            yield group
            group, size = [], 0
        group.append((name, param))
        size += _full_numel(param) * param.element_size()
        block = here
    if group:
        yield group


def lora_layers(module) -> dict:
    """The LoRA layers of a peft model (`vagen.models.add_adapters`) by their name in its base model
    (`without_wrapper`); {} for any other model."""
    if not has_adapters(module):
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: layer for name, layer in without_wrapper(module).named_modules() if isinstance(layer, LoraLayer)}


def engine_weights(group, adapted: dict, adapters: dict | None = None):
    """(name, tensor) pairs as the engine loads them, from a group of `weight_groups` whose parameters are
    whole on this rank. A model without adapters gives its parameters as they are. A peft model gives the
    policy its adapters compute, under the base model's names: an adapted layer's weight merged, W + scale
    B A for each active adapter (peft's own `get_delta_weight`), into a new tensor (the trained model is
    not modified); `.base_layer` left out of names; the adapters themselves left out; of a module peft
    trains whole (`modules_to_save`, the vision tower with `model.freeze_vision=false`), the trained copy
    under the original's name, and the original (which the reference runs) left out. Given `adapters` (a
    dict), the adapted layers' weights are left unmerged and their adapters' tensors are put in it instead,
    under peft's names (`adapter_tensors`), for the engine to serve as an adapter."""
    for name, param in group:
        parts = name.split(".")
        if any(part.startswith("lora_") for part in parts) or "original_module" in parts:
            continue
        tensor = param.data.detach()
        if parts[-2:-1] == ["base_layer"] and ".".join(parts[:-2]) in adapted:
            layer = adapted[".".join(parts[:-2])]
            if parts[-1] == "weight" and adapters is not None:
                adapters.update(adapter_tensors(".".join(parts[:-2]), layer))
            elif parts[-1] == "weight" and not layer.merged:
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        tensor = tensor + layer.get_delta_weight(adapter)
        if "modules_to_save" in parts:  # `modules_to_save.<adapter>.` -> `.`
            at = parts.index("modules_to_save")
            parts = parts[:at] + parts[at + 2 :]
        yield ".".join(part for part in parts if part != "base_layer"), tensor


def _group_parameters(group, adapted: dict) -> list:
    """The parameters `engine_weights` reads for `group`: its own and the adapters of its adapted layers."""
    params = {id(param): param for _, param in group}
    for name, _ in group:
        layer = adapted.get(name.removesuffix(".base_layer.weight")) if name.endswith(".base_layer.weight") else None
        if layer is not None:
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    for param in (*layer.lora_A[adapter].parameters(), *layer.lora_B[adapter].parameters()):
                        params[id(param)] = param
    return list(params.values())


def _gather_adapters(adapted: dict, adapters: dict) -> None:
    """The active adapter of every LoRA layer of `adapted` (`lora_layers`) into `adapters` (`adapter_tensors`),
    each layer's adapter gathered (ZeRO-3) while it is copied."""
    for name, layer in adapted.items():
        params = [param for adapter in layer.active_adapters if adapter in layer.lora_A
                  for param in (*layer.lora_A[adapter].parameters(), *layer.lora_B[adapter].parameters())]
        with gathered(params):
            adapters.update(adapter_tensors(name, layer))


def _counted(pairs, sent: list):
    """`pairs` ((name, tensor)) as they are, their bytes added to `sent[0]`."""
    for name, tensor in pairs:
        sent[0] += tensor.numel() * tensor.element_size()
        yield name, tensor


def _gathered_weights(groups, adapted: dict, adapters: dict | None = None, rename=None):
    """`engine_weights` of every group, each group's parameters gathered (ZeRO-3) while they are read; names
    through `rename` (`vllm_compat.reload_names`) where given."""
    for group in groups:
        with gathered(_group_parameters(group, adapted)):
            for name, tensor in engine_weights(group, adapted, adapters):
                yield (rename(name) if rename is not None else name), tensor


# The ranks vLLM can serve adapters of (`LoRAConfig.max_lora_rank`; the same in 0.26.0 and 0.32.0).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of `rank`."""
    fits = [slot for slot in VLLM_LORA_RANKS if slot >= rank]
    if not fits:
        raise ValueError(f"model.lora_rank={rank}: vLLM serves adapters of rank {VLLM_LORA_RANKS[-1]} at most; "
                         f"use a smaller model.lora_rank, or rollout.backend=hf")
    return fits[0]


def adapter_tensors(name: str, layer) -> dict:
    """The active adapter of the LoRA layer at `name` (in the base model) under the names peft saves it
    with (`base_model.model.<name>.lora_A.weight`, `...lora_B.weight`), copied to the CPU: they must
    outlive the gathering of ZeRO-3."""
    active = [adapter for adapter in layer.active_adapters if adapter in layer.lora_A]
    if len(active) != 1:
        raise ValueError(f"LoRA layer {name} has active adapters {active}; vLLM serves one adapter per request, so "
                         f"activate exactly one (peft's set_adapter)")
    adapter = active[0]
    return {f"base_model.model.{name}.lora_A.weight": layer.lora_A[adapter].weight.detach().cpu().clone(),
            f"base_model.model.{name}.lora_B.weight": layer.lora_B[adapter].weight.detach().cpu().clone()}


def write_adapter(folder: Path, adapters: dict, module) -> None:
    """`adapters` (`adapter_tensors`) and the LoRA config of the peft model `module` as peft saves an
    adapter (adapter_model.safetensors, adapter_config.json) in `folder`, which vLLM loads. The config names
    no `modules_to_save`: a module trained whole reaches the engine as weights (`engine_weights`)."""
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(module.peft_config[module.active_adapter])
    config.modules_to_save = None
    config.save_pretrained(str(folder))
    save_file({name: tensor.contiguous() for name, tensor in adapters.items()}, str(folder / "adapter_model.safetensors"))


def _full_numel(param) -> int:
    """Elements of a parameter, whole: a ZeRO-3 partitioned one reports its full shape in `ds_numel`."""
    return int(getattr(param, "ds_numel", param.numel()))
