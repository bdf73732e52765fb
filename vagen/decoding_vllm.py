"""The vLLM decoder: each rank runs its own in-process `vllm.LLM` engine over its share of the rollout
(data-parallel; `vllm.tensor_parallel_size` GPUs per engine), with prefix caching, so a turn re-reads
its history from cache instead of recomputing it.

What the engine is given and what comes back are exactly the tokens training uses:
- a turn's prompt is the episode's own `input_ids` (a `TokensPrompt`, never re-rendered text) with its
  frames (`Episode.images`, resized once by `ChatEncoder.resize`, so vLLM's processor leaves them as
  they are); the prompt vLLM ran is checked to be those ids, position for position;
- generated ids are kept as sampled, and with each the engine's log-probability of it under the
  distribution it was drawn from (`logprobs_mode="processed_logprobs"`: after the suppress mask and the
  temperature, which is what `vagen.update` computes);
- the rules of `vagen.decoding` hold: stop at `<|im_end|>`/`<|endoftext|>` (kept), at `</answer>` (the
  token that completes it kept), or after `max_new_tokens`; `ChatEncoder.suppress_ids` get -inf
  logits (`SuppressTokens`, an exact mask, greedy included); no nucleus, no top-k unless asked; each request seeded from the turn's seed and the episode's row (`request_seed`); greedy when
  `do_sample` is false. The checkpoint's own generation config (repetition penalty and the like) is
  never read.

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

import io
import json
import os
import sys
import time
from pathlib import Path

import torch

from vagen import vllm_compat as compat
from vagen.decoding import STOP_STRING, Generated, Sampling, request_seed
from vagen.distributed import gathered
from vagen.episode import ChatEncoder, Episode
from vagen.models import (
    CENTER_IMAGE_TOKENS,
    FAMILIES,
    IMAGE_POSITION_CODE,
    family_of,
    has_adapters,
    without_wrapper,
)
from vagen.vllm_compat import SUPPRESS_ARG, SUPPRESS_TOKENS

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


# Checkpoints saved by `config.save_pretrained` alone (the built-ins) name no architecture; vLLM needs one,
# which the checkpoint's model family knows.
ARCHITECTURES = {model_type: family.architecture(model_type) for family in FAMILIES for model_type in family.model_types}


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


def unwrap(model):
    """The `transformers` module under a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


class VLLMDecoder:
    """A rank's vLLM engine over `checkpoint`, decoding turns of `vagen.episode.Episode`s. Implements
    `vagen.decoding.Decoder`; `sync_weights` and `sleep` keep it in step with training."""

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
        if tensor_parallel == 1:
            # The engine core and its one worker run in this process: `sync_weights` hands them the
            # actor's tensors directly instead of serialising them to another process.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            # Workers are processes: `sync_weights` sends them a function of this module to run.
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            if not self.on_gpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                # vLLM binds each CPU worker to a NUMA node of its own unless told which cores to use.
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tensor_parallel)
        compat.pin_model_runner()  # the V1 runner, whose logits processors `SuppressTokens` is one of
        import vllm.envs

        # A first engine in this process froze vLLM's reading of the environment; this one's settings
        # above must be read again.
        vllm.envs.disable_envs_cache()
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
            **placement(tensor_parallel, ranks),
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
        # vLLM's CPU worker expects a process of its own: it sets torch to one thread and replaces
        # `torch.set_num_threads` with a no-op. Here it shares the trainer's process, which gets both back.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        device = torch.cuda.current_device() if self.on_gpu else None
        start = time.perf_counter()
        try:
            self.llm = LLM(**options)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
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

    # -- the Decoder protocol ---------------------------------------------------------------------------

    def start_rollout(self) -> None:
        """Nothing to drop: requests carry whole histories, and the prefix cache serves the next turn."""

    def any_rank(self, flag: bool) -> bool:
        """Each rank's engine decodes alone: no rank waits for another's."""
        return flag

    def sampling_params(self, sampling: Sampling, row: int):
        from vllm import SamplingParams

        options = dict(
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=sorted(self.encoder.stop_ids),
            ignore_eos=True,  # only the stop ids above end a turn, as in the hf backend
            stop=[STOP_STRING],
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's own log-probability
            skip_special_tokens=True,
            extra_args={SUPPRESS_ARG: list(self.encoder.suppress_ids)},  # masked by `SuppressTokens`
        )
        if sampling.do_sample:
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0))
            if self.settings["seeded_requests"]:
                # Each request draws from a generator of its own: what an episode samples does not depend on
                # which requests share its batch. vLLM then draws each seeded row's noise in a loop of its own.
                options["seed"] = request_seed(sampling.seed, row)
        else:
            options.update(temperature=0.0)
        return SamplingParams(**options)

    def prompt(self, episode: Episode) -> dict:
        """The episode's ids and frames as a vLLM `TokensPrompt`. vLLM expands each image's placeholder
        itself (its processor counts the image's tokens), so each image's run of `<|image_pad|>` goes in
        as one; `generate` checks that the expanded prompt is the episode's ids again."""
        if not episode.images:
            return {"prompt_token_ids": list(episode.input_ids)}
        pad = self.encoder.image_pad_id
        ids = [t for k, t in enumerate(episode.input_ids) if t != pad or k == 0 or episode.input_ids[k - 1] != pad]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": list(episode.images)}}

    def generate(self, episodes: list[Episode], rows: list[int], sampling: Sampling) -> list[Generated]:
        assert len(episodes) == len(rows), f"{len(episodes)=} {len(rows)=}"
        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: it dropped its weights and KV cache for the update; "
                               "call sync_weights(model), which wakes it with the updated weights, before generating")
        if not episodes:
            return []
        outputs = self.llm.generate([self.prompt(ep) for ep in episodes],
                                    [self.sampling_params(sampling, row) for row in rows], use_tqdm=False,
                                    lora_request=self.lora_request)
        return [self.completion(row, episode, output) for row, episode, output in zip(rows, episodes, outputs)]

    def completion(self, row: int, episode: Episode, output) -> Generated:
        """The ids and log-probabilities of a finished vLLM request for `episode`, once the prompt vLLM ran is
        checked to be the episode's ids."""
        if list(output.prompt_token_ids) != list(episode.input_ids):
            first = next((k for k, (a, b) in enumerate(zip(output.prompt_token_ids, episode.input_ids)) if a != b),
                         min(len(output.prompt_token_ids), len(episode.input_ids)))
            raise RuntimeError(
                f"vLLM ran a different prompt from episode {row}'s token ids (first difference at position "
                f"{first} of {len(episode.input_ids)}; vLLM's has {len(output.prompt_token_ids)}): its image "
                f"processor expanded the frames to other token counts than the encoder's; check that "
                f"Episode.images were resized by ChatEncoder.resize")
        completion = output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, ids)]
        return Generated(ids, logprobs)

    def play(self, game) -> None:
        """The agent loop (`vagen.rollout.Game`): each episode's next request joins the engine's running batch
        as soon as its observation is ready, and the engine steps (one forward pass over every running
        request) while the environments answer, so no episode waits for a turn boundary. Before each pass
        the engine waits for every environment answer due (worker processes or actors step them in
        parallel), so an episode's next turn joins the pass right after its response, as when its
        environment steps in this process: workers never add forward passes (without the wait, answers
        that came a few passes late spread episodes that moved together over twice the passes, each half
        full; docs/benchmarks.md). A request is seeded by its episode's row and turn exactly as in
        the per-turn schedule (`request_seed` of `turn_seed`), so what an episode samples depends on neither
        its batch nor the order in which requests finish. Request ids name the episode and turn; the prefix
        cache serves each turn's history whatever request brought it. With rollout.max_staleness > 0 the game
        closes once enough groups have ended: the requests running then finish, the episodes it holds wait
        between turns (`Game.waiting`), and the loop returns once nothing runs; the next rollout sends them
        on with the synced weights. `engine_steps` and `engine_sequences` count the forward passes and the
        requests they ran."""
        from vllm.sampling_params import RequestOutputKind

        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep: it dropped its weights and KV cache for the update; "
                               "call sync_weights(model), which wakes it with the updated weights, before generating")
        engine, clock, timing = self.llm.llm_engine, time.perf_counter, game.timing
        running: dict[str, int] = {}  # request id -> episode row
        self.engine_steps = self.engine_sequences = 0
        try:
            while True:
                game.take_answers(block=True, all_of_them=True)  # every answer due joins this pass
                game.ended.count()
                for row in game.ready:
                    episode = game.episodes[row]
                    params = self.sampling_params(*game.request(row))  # seeded by its group's rollout and row
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                    request_id = f"episode-{row}-turn-{len(episode.turns)}"
                    # What `LLM.generate` does to a prompt before `add_request`: the frames through vLLM's
                    # processor.
                    engine.add_request(request_id, compat.preprocess_prompt(self.llm, self.prompt(episode)), params,
                                       lora_request=self.lora_request)
                    running[request_id] = row
                game.ready.clear()
                if not running:
                    if game.finished():
                        return
                    continue
                t0 = clock()
                self.engine_sequences += engine.get_num_unfinished_requests()
                outputs = engine.step()
                self.engine_steps += 1
                timing["timing/generate"] += clock() - t0
                for output in outputs:
                    if output.finished:
                        row = running.pop(output.request_id)
                        game.respond(row, self.completion(row, game.episodes[row], output))
        finally:
            # Requests of an agent loop stopped by an error would otherwise stay in the engine and be stepped
            # with the next rollout's (whose loop knows nothing of them).
            if running:
                engine.abort_request(list(running))

    # -- weights and memory -----------------------------------------------------------------------------

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
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        elif groups:
            # Worker processes get each group serialised (vLLM's own messages carry no nested tensors);
            # layers outside a group keep their weights.
            for group in groups:
                with gathered(_group_parameters(group, adapted)):
                    buffer = io.BytesIO()
                    pairs = [(self.reload_name(name), tensor)
                             for name, tensor in _counted(engine_weights(group, adapted, adapters), sent)]
                    torch.save([(name, tensor.cpu()) for name, tensor in pairs], buffer)
                self.llm.collective_rpc(_reload_serialized, args=(buffer.getvalue(),))
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


def placement(tensor_parallel: int, ranks: int) -> dict:
    """vLLM's executor for an engine built inside a trainer rank: `external_launcher` under a process group of
    several ranks, which gives the engine's worker the rank's RANK and LOCAL_RANK (its GPU); the default
    otherwise (one rank, whose device is the engine's device 0, or tensor-parallel workers of its own)."""
    if tensor_parallel > 1 or ranks == 1:
        return {}
    missing = [key for key in ("RANK", "LOCAL_RANK") if key not in os.environ]
    if missing:
        raise RuntimeError(f"a vLLM engine inside a trainer rank reads its rank from the environment, but {missing} "
                           f"are not set; start the job with the DeepSpeed launcher (deepspeed vagen/train.py) or "
                           f"with vagen.distributed.init_distributed, which set them")
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


# The ranks vLLM 0.32 can serve adapters of (`LoRAConfig.max_lora_rank`).
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


def _reload_serialized(worker, payload: bytes) -> None:
    """Run in each vLLM worker process: reload the (name, tensor) pairs serialised in `payload`."""
    weights = torch.load(io.BytesIO(payload), weights_only=True)
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)


def _full_numel(param) -> int:
    """Elements of a parameter, whole: a ZeRO-3 partitioned one reports its full shape in `ds_numel`."""
    return int(getattr(param, "ds_numel", param.numel()))
