"""What a GPU user relies on beyond the CPU suite: the DeepSpeed configs shipped in configs/deepspeed
train on CUDA (fused Adam, bf16, ZeRO-2/3), CUDA and CPU compute the same log-probabilities, and
sampling on CUDA is reproducible by seed. Skipped without CUDA (see conftest.py)."""

import copy
import json
import math

import pytest
import torch
from test_train import FAST

from vagen.config import load_config
from vagen.episode import ChatEncoder
from vagen.rollout import rollout
from vagen.train import main
from vagen.trajectory import episode_to_sample
from vagen.update import annotate

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("ds_config, dtype", [("deepspeed/zero0_fp32.json", "float32"),
                                              ("deepspeed/zero2_bf16.json", "bfloat16"),
                                              ("deepspeed/zero3_bf16.json", "bfloat16")])
def test_each_shipped_deepspeed_config_trains_on_a_gpu(ds_config, dtype, tmp_path, model_cache, distributed):
    assert distributed.device.type == "cuda"
    torch.cuda.reset_peak_memory_stats()
    overrides = FAST + [f"train.run_dir={tmp_path}", f"model.builtin_cache={model_cache}",
                        f"train.deepspeed_config={ds_config}", f"model.dtype={dtype}"]
    assert main(["--config", "frozenlake_visual", *overrides]) == 0
    assert torch.cuda.max_memory_allocated() > 0  # the engines really ran on the GPU
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "rollout/reward_mean"):
        assert math.isfinite(records[-1][key]), (key, records[-1][key])
    assert records[-1]["actor/grad_norm"] > 0
    ckpt = run / "checkpoints" / "step_2" / "actor"
    assert (ckpt / "model.safetensors").exists()  # ZeRO-3 shards are gathered into one saved model


def _frozenlake_samples(model, processor, n_seeds=3):
    encoder = ChatEncoder(processor)
    cfg = load_config("frozenlake_visual", ["rollout.max_new_tokens=24", "rollout.max_turns=2",
                                            "train.micro_batch_size=2"])
    torch.manual_seed(0)
    episodes, _ = rollout(model, encoder, cfg, list(range(n_seeds)), group_size=2)
    return cfg, encoder, [episode_to_sample(ep, encoder, model) for ep in episodes]


def test_cuda_and_cpu_agree_on_log_probs_of_a_visual_trajectory(tiny_vl):
    _, model, processor = tiny_vl
    cfg, encoder, samples = _frozenlake_samples(model, processor)
    on_cpu = copy.deepcopy(samples)
    annotate(on_cpu, model, None, None, cfg, encoder.pad_id, torch.device("cpu"))
    gpu_model = copy.deepcopy(model).cuda()
    on_gpu = copy.deepcopy(samples)
    annotate(on_gpu, gpu_model, None, None, cfg, encoder.pad_id, torch.device("cuda"))
    for a, b in zip(on_cpu, on_gpu):
        # float32 on both; cuDNN may run the patch-embedding convolution in TF32, hence 2e-3 and not 1e-5
        torch.testing.assert_close(b.extra["old_logprobs"], a.extra["old_logprobs"], atol=2e-3, rtol=0)
        torch.testing.assert_close(b.extra["entropies"], a.extra["entropies"], atol=2e-3, rtol=0)
    bf16 = copy.deepcopy(samples)
    annotate(bf16, gpu_model.to(torch.bfloat16), None, None, cfg, encoder.pad_id, torch.device("cuda"))
    gaps = torch.cat([(b.extra["old_logprobs"].float() - a.extra["old_logprobs"]).abs()
                      for a, b in zip(on_cpu, bf16)])
    assert gaps.mean() < 0.05, f"bfloat16 log-probs drift {gaps.mean():.3f} nats on average from float32"


def test_sampling_on_cuda_is_reproducible_by_seed(tiny_vl):
    _, model, processor = tiny_vl
    gpu_model = copy.deepcopy(model).cuda()
    _, _, first = _frozenlake_samples(gpu_model, processor)
    _, _, again = _frozenlake_samples(gpu_model, processor)
    assert [s.input_ids.tolist() for s in first] == [s.input_ids.tolist() for s in again]
    assert len({tuple(s.input_ids.tolist()) for s in first}) > 1  # sampled, not one greedy answer repeated


def test_vllm_on_cuda_sleeps_wakes_weights_first_and_samples_the_trainer_policy(tiny_vl, tmp_path):
    """vLLM on this rank's GPU (pip install -e ".[vllm]"): CUDA graphs by default, the engine on the trainer's
    own device, sleep level 2 releasing memory, and a sync after sleeping (weights woken, loaded, then the KV
    cache) giving the engine the updated weights: its sampled tokens' log-probs are the trainer's."""
    import shutil

    from test_vllm import sampled_gaps, standard_copy

    from vagen.decoding_vllm import VLLMDecoder
    from vagen.models import load_policy

    checkpoint = standard_copy(tiny_vl[0], tmp_path / "standard")
    model, processor = load_policy(checkpoint)  # the trainer's side stays on the CPU, in float32
    model.eval()
    encoder = ChatEncoder(processor)
    decoder = VLLMDecoder(checkpoint, encoder, dtype="float32", seed=0, gpu_memory_utilization=0.3)
    try:
        assert decoder.llm.llm_engine.vllm_config.model_config.enforce_eager is False
        assert torch.cuda.current_device() == 0
        cfg = load_config("frozenlake_visual", ["rollout.max_new_tokens=24", "rollout.max_turns=2",
                                                "rollout.temperature=1.0"])
        played = dict(seeds=[3], group_size=2, decoder=decoder, sample_seed=1)
        episodes, _ = rollout(model, encoder, cfg, **played)
        assert max(sampled_gaps(model, encoder, episodes, 1.0)) < 2e-3  # TF32 and CUDA kernels: 2e-3, as above
        decoder.sleep()
        assert decoder.asleep and decoder.released_bytes > 0
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.02 * torch.randn_like(param))
        decoder.sync_weights(model)
        assert not decoder.asleep
        episodes, _ = rollout(model, encoder, cfg, **played)
        gaps = sampled_gaps(model, encoder, episodes, 1.0)
        assert max(gaps) < 2e-3, f"after sleep and sync: max |vLLM - trainer| {max(gaps):.2e}"
    finally:
        decoder.close()
        shutil.rmtree(checkpoint, ignore_errors=True)
