"""The vLLM decoder's settings and its memory protocol, without vLLM: what each rank's engine is built with,
the rules that refuse a config before any work, and the order and guard of sleeping and waking on a GPU
(the engine faked, the free-memory reading faked). The engine itself is tested in tests/test_vllm.py."""

from __future__ import annotations

import os

import pytest

import vagen.decoding_vllm as dv
import vagen.decoding_vllm.engine
import vagen.decoding_vllm.weights
from vagen.config import ConfigError, check_vllm_ranks, load_config

GIB = 2**30


def test_each_rank_engine_uses_the_external_launcher_with_the_rank_of_the_environment(monkeypatch):
    for key, value in {"RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    assert dv.placement(1, ranks=8) == {"distributed_executor_backend": "external_launcher"}
    assert dv.placement(1, ranks=1) == {}  # one rank: vLLM's own executor, whose device 0 is the rank's
    assert dv.placement(2, ranks=1) == {}  # tensor-parallel workers of its own
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(RuntimeError, match=r"\['LOCAL_RANK'\] are not set"):
        dv.placement(1, ranks=8)


def test_cuda_graphs_by_default_on_a_gpu_and_eager_on_the_cpu():
    assert dv.eager(None, on_gpu=True) is False
    assert dv.eager(None, on_gpu=False) is True
    assert dv.eager(True, on_gpu=True) is True and dv.eager(False, on_gpu=False) is False
    assert load_config("sokoban_text").vllm.enforce_eager is None


def test_tensor_parallel_engines_are_refused_under_several_ranks():
    cfg = load_config("sokoban_text", ["rollout.backend=vllm", "vllm.tensor_parallel_size=2"])
    check_vllm_ranks(cfg, 1)  # one rank: its engine may span GPUs
    with pytest.raises(ConfigError, match=r"vllm.tensor_parallel_size=2 with 8 ranks.*GPUs 0..1.*tensor_parallel_size=1"):
        check_vllm_ranks(cfg, 8)
    check_vllm_ranks(load_config("sokoban_text", ["vllm.tensor_parallel_size=2"]), 8)  # hf rollouts: no engine


def test_a_trajectory_longer_than_the_engine_accepts_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"rollout.max_trajectory_length=9000 exceeds vllm.max_model_len=8192"):
        load_config("sokoban_text", ["rollout.backend=vllm", "rollout.max_trajectory_length=9000"])
    load_config("sokoban_text", ["rollout.backend=vllm", "rollout.max_trajectory_length=8192"])
    load_config("sokoban_text", ["rollout.max_trajectory_length=9000"])  # hf rollouts have no such limit


class FakeEngine:
    """The calls `VLLMDecoder` makes on its `vllm.LLM`, recorded; sleeping frees `footprint` bytes of the
    fake GPU and waking takes them back."""

    def __init__(self, gpu: dict, footprint: int):
        self.calls, self.gpu, self.footprint = [], gpu, footprint
        self.llm_engine = self

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.gpu["free"] += self.footprint

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))
        self.gpu["free"] -= self.footprint // 2

    def collective_rpc(self, method, kwargs=None, args=()):
        list(kwargs["weights_iterator"])  # the engine pulls every group
        self.calls.append(("reload_weights",))

    def apply_model(self, fn):
        pass

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def reset_encoder_cache(self):
        pass


def gpu_decoder(monkeypatch, free: int, footprint: int):
    import torch

    gpu = {"free": free}
    # where `WeightSync` looks them up (the package's names are copies)
    monkeypatch.setattr(vagen.decoding_vllm.weights, "free_gpu_bytes", lambda: gpu["free"])
    monkeypatch.setattr(vagen.decoding_vllm.weights, "total_gpu_bytes", lambda: 80 * GIB)
    decoder = object.__new__(dv.VLLMDecoder)
    decoder.settings = {**dv.DEFAULT_SETTINGS}
    decoder.on_gpu, decoder.sleeping, decoder.in_process, decoder.released_bytes = True, set(), True, 0
    decoder.lora_rank, decoder.lora_request, decoder.adapter_dir, decoder.adapters_loaded = 0, None, None, 0
    decoder.reload_name, decoder.activation_bytes = None, None
    decoder.llm = FakeEngine(gpu, footprint)
    return decoder, gpu, torch.nn.Linear(2, 2)


def test_sleep_drops_the_weights_and_a_sync_wakes_weights_then_kv_cache(monkeypatch):
    decoder, gpu, model = gpu_decoder(monkeypatch, free=10 * GIB, footprint=40 * GIB)
    decoder.sleep()
    assert decoder.released_bytes == 40 * GIB and decoder.asleep
    gpu["free"] -= 5 * GIB  # the update's optimizer states
    decoder.sync_weights(model)
    assert decoder.llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("reload_weights",),
                                 ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert not decoder.asleep


def test_waking_into_less_memory_than_the_engine_released_fails_with_what_to_change(monkeypatch):
    decoder, gpu, model = gpu_decoder(monkeypatch, free=10 * GIB, footprint=40 * GIB)
    decoder.sleep()
    gpu["free"] -= 20 * GIB  # AdamW's states, allocated at the first step, took what the engine left
    # 40 GiB back and 4 (5% of 80) for the activations vLLM did not report: short by 14 of 80 GiB,
    # 0.5 - 0.175 - 0.02 = 0.305, rounded down
    with pytest.raises(RuntimeError, match=r"needs 40.00 GiB back .* and 4.00 GiB \(5% of the GPU\) for its "
                                           r"activations.* only 30.00 GiB are free .* Lower "
                                           r"vllm.gpu_memory_utilization to 0.30 or less"):
        decoder.sync_weights(model)
    assert decoder.llm.calls == [("sleep", 2)]  # nothing of the engine was taken back


def test_on_the_cpu_sleeping_does_nothing(monkeypatch):
    decoder, _, model = gpu_decoder(monkeypatch, free=0, footprint=GIB)
    decoder.on_gpu = False
    decoder.sleep()
    decoder.sync_weights(model)
    assert decoder.llm.calls == [("reload_weights",), ("reset_prefix_cache",)]


def test_a_sync_that_fails_after_waking_the_weights_takes_back_only_the_rest_next_time(monkeypatch):
    decoder, gpu, model = gpu_decoder(monkeypatch, free=10 * GIB, footprint=40 * GIB)
    decoder.sleep()
    reload = decoder.llm.collective_rpc

    def failing_once(*args, **kwargs):
        decoder.llm.collective_rpc = reload
        raise RuntimeError("a group failed to load")

    decoder.llm.collective_rpc = failing_once
    with pytest.raises(RuntimeError, match="a group failed to load"):
        decoder.sync_weights(model)
    assert decoder.asleep and decoder.sleeping == {"kv_cache"}
    decoder.sync_weights(model)
    assert decoder.llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("reload_weights",),
                                 ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert not decoder.asleep


def test_the_v1_model_runner_is_pinned_and_an_environment_asking_for_v2_is_refused(monkeypatch):
    from vagen import vllm_compat

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    vllm_compat.pin_model_runner()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    for value in ("1", "true"):
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
        with pytest.raises(ValueError, match=f"VLLM_USE_V2_MODEL_RUNNER={value} is set.*Unset VLLM_USE_V2_MODEL_RUNNER"):
            vllm_compat.pin_model_runner()
    assert vllm_compat.runner_version("vllm.v1.worker.gpu.model_runner.GPUModelRunner") == "V2"
    assert vllm_compat.runner_version("vllm.v1.worker.gpu_model_runner.GPUModelRunner") == "V1"
    assert vllm_compat.runner_version("vllm.v1.worker.cpu_model_runner.CPUModelRunner") == "V1"


def test_engine_sizes_follow_the_ranks_episodes_not_vllms_serving_defaults():
    # 16 groups x 8 rollouts over 8 ranks: 16 episodes a rank of at most 4,096 tokens
    assert dv.engine_sizes(16, 4096, 8192, on_gpu=True) == {
        "max_num_seqs": 16, "max_num_batched_tokens": 8192, "cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    # few short episodes: every trajectory in one step, and no graph larger than the batch rounded up to 8
    assert dv.engine_sizes(3, 1000, 8192, on_gpu=True) == {
        "max_num_seqs": 3, "max_num_batched_tokens": 3000, "cudagraph_capture_sizes": [1, 2, 3]}
    assert dv.engine_sizes(20, 100, 8192, on_gpu=True)["cudagraph_capture_sizes"] == [1, 2, 4, 8, 16, 24]
    assert dv.engine_sizes(64, 32, 8192, on_gpu=True)["max_num_batched_tokens"] == 2048
    # on the CPU prompts are prefilled whole: a step holds max_model_len
    assert dv.engine_sizes(16, 4096, 8192, on_gpu=False)["max_num_batched_tokens"] == 8192
    with pytest.raises(ValueError, match="0 episodes of 4096 tokens"):
        dv.engine_sizes(0, 4096, 8192, on_gpu=True)


def test_a_runs_engine_is_built_for_the_ranks_share_of_episodes(monkeypatch):
    built = {}

    class Recording(dv.VLLMDecoder):
        def __init__(self, checkpoint, encoder, **kwargs):
            built.update(kwargs)
            raise StopIteration

    monkeypatch.setattr(vagen.decoding_vllm.engine, "refuse_image_hooks", lambda path: None)
    monkeypatch.setattr("vagen.distributed.world_size", lambda: 4)
    cfg = load_config("sokoban_text", ["rollout.backend=vllm", "rollout.env_groups=16", "rollout.group_size=8",
                                       "rollout.max_trajectory_length=2048"])
    with pytest.raises(StopIteration):
        Recording.from_config(cfg, encoder=object())
    assert built["episodes"] == 32 and built["trajectory_length"] == 2048
    # with rollout.max_staleness = 1, up to two shares of groups are in flight
    cfg = load_config("sokoban_text", ["rollout.backend=vllm", "rollout.env_groups=16", "rollout.group_size=8",
                                       "rollout.max_staleness=1", "algo.rollout_correction=tis"])
    with pytest.raises(StopIteration):
        Recording.from_config(cfg, encoder=object())
    assert built["episodes"] == 64


def test_an_engine_that_serves_lora_adapters_keeps_its_base_weights_through_sleep(monkeypatch):
    decoder, gpu, model = gpu_decoder(monkeypatch, free=10 * GIB, footprint=40 * GIB)
    decoder.lora_rank = 8  # the frozen base is never synced again: copied to the host and back (level 1)
    decoder.sleep()
    assert decoder.llm.calls == [("sleep", 1)] and decoder.released_bytes == 40 * GIB
    decoder.lora_rank = 0  # a full fine-tuning engine drops its weights (level 2): the sync overwrites them
    decoder.sync_weights(model)
    decoder.sleep()
    assert decoder.llm.calls[-1] == ("sleep", 2)


def test_waking_leaves_room_for_the_activation_peak_vllm_measured():
    # the weights and KV cache fit, the activation peak vLLM profiled at start-up does not
    dv.check_wake_memory(40 * GIB, 43 * GIB, 80 * GIB, 0.5, activations=3 * GIB)
    with pytest.raises(RuntimeError, match=r"needs 40.00 GiB back .* and 3.50 GiB for its activations as vLLM "
                                           r"measured them, but only 43.00 GiB are free"):
        dv.check_wake_memory(40 * GIB, 43 * GIB, 80 * GIB, 0.5, activations=int(3.5 * GIB))
    # unreported (None): a margin of 5% of the GPU
    with pytest.raises(RuntimeError, match=r"4.00 GiB \(5% of the GPU\)"):
        dv.check_wake_memory(40 * GIB, 43 * GIB, 80 * GIB, 0.5)
    dv.check_wake_memory(40 * GIB, 44 * GIB, 80 * GIB, 0.5)
