"""`rollout.backend=vllm` against real vLLM: the registry's CPU build, in the environment that
scripts/vllm_env.sh builds (never the base one). Marked `vllm`, outside the default selection:

    bash scripts/vllm_env.sh && .venv-vllm/bin/python -m pytest -m vllm tests/test_vllm.py

The models are built here, offline: the built-in tiny Qwen2.5-VL with vagen's image hooks taken out
of its config.json (a standard Qwen2.5-VL, random weights), and the shipped text warm start
`assets:sokoban_text` (a standard Qwen2, a trained policy). One engine per model serves the session.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vagen.config import checkpoints_dir, load_config
from vagen.decoding_hf import HFDecoder
from vagen.decoding_vllm import DEFAULT_SETTINGS, VLLMDecoder
from vagen.episode import ChatEncoder
from vagen.models import CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE, load_policy, resolve_model_path
from vagen.rollout import rollout
from vagen.trajectory import collate, episode_to_sample, model_inputs
from vagen.update import token_logprobs

pytestmark = pytest.mark.vllm

TOLERANCE = 1e-4  # float32 on both sides: measured differences are ~1e-5
# The mean KL to the base that one LoRA update at train.actor_lr=0.003 reaches on sokoban_text (measured 2.6e-3):
# log-probabilities that differ from the base's by far more than TOLERANCE.
KL_AFTER_LORA_UPDATE = 1e-3
# Both sides' logits are bfloat16 numbers (8 significant bits): rounding them alone may move a token's logit and
# the row's log-sum-exp by half a step each at the row's largest logit, on each side, so two bfloat16 computations
# of one policy may differ by 2 steps in a log-probability from that rounding, and by about as much again from
# the roundings of the hidden states before it. A bound in bfloat16's own steps (`bf16_steps`) holds whatever
# bfloat16 kernels the processor has. Measured on an Intel Xeon with AMX-BF16 and AVX512-BF16, over 48 tokens:
# Qwen3.5 0.37 steps before a sync and 1.05 after it, Qwen2.5-VL 0.32 before, and 267 steps from the synced
# engine to the model before the step (tests/test_vllm_families.py); LoRA served as adapters in
# tests/test_vllm_lora.py.
BF16_STEPS = 4



def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise RuntimeError(f"tests marked vllm need vLLM ({err}); build its environment with "
                           f"`bash scripts/vllm_env.sh` and run them with `.venv-vllm/bin/python -m pytest -m vllm`") from err


@pytest.fixture(scope="session")
def standard_vl(model_cache, tmp_path_factory):
    """The built-in tiny Qwen2.5-VL as a standard checkpoint: its config.json without vagen's hooks."""
    source = resolve_model_path("builtin:tiny-vl", model_cache, seed=0)
    return standard_copy(source, tmp_path_factory.mktemp("standard_vl") / "tiny-vl")


def standard_copy(source, out: Path) -> Path:
    """A copy of the built-in tiny VLM at `source` whose config.json turns vagen's image hooks off."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    assert config.get(CENTER_IMAGE_TOKENS), f"the built-in was expected to carry {CENTER_IMAGE_TOKENS}: {config}"
    for key in (CENTER_IMAGE_TOKENS, IMAGE_POSITION_CODE):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


@pytest.fixture(scope="session")
def vl(standard_vl):
    """(model, encoder, decoder) of the standard tiny VLM: the trainer's float32 model and a vLLM engine."""
    require_vllm()
    model, processor = load_policy(standard_vl)
    model.eval()
    encoder = ChatEncoder(processor)
    return model, encoder, VLLMDecoder(standard_vl, encoder, dtype="float32", seed=0)


@pytest.fixture(scope="session")
def text_policy():
    """(model, encoder, decoder) of the shipped text warm start, a trained Qwen2 policy."""
    require_vllm()
    path = checkpoints_dir() / "sokoban_text"
    model, processor = load_policy(path)
    model.eval()
    encoder = ChatEncoder(processor)
    return model, encoder, VLLMDecoder(path, encoder, dtype="float32", seed=0)


def config(*overrides: str):
    return load_config(None, ["rollout.max_turns=3", "rollout.max_new_tokens=24", "rollout.temperature=1.0",
                              "env.name=sokoban", "env.render_mode=vision", *overrides])


def record_requests(decoder: VLLMDecoder, monkeypatch) -> list[dict]:
    """What the engine itself reports for every request from now on, whether a turn's batch or the agent loop
    sent it: the prompt ids it ran, the ids it generated and its log-probability of each."""
    requests = []
    engine_generate, engine_step = decoder.llm.generate, decoder.llm.llm_engine.step

    def record(output):
        completion = output.outputs[0]
        requests.append({"prompt": list(output.prompt_token_ids), "ids": list(completion.token_ids),
                         "logprobs": [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]})

    def recording(*args, **kwargs):  # a batch of one turn (`generate`)
        outputs = engine_generate(*args, **kwargs)
        for output in outputs:
            record(output)
        return outputs

    def stepping(*args, **kwargs):  # the agent loop (`play`): requests that finish at this engine step
        outputs = engine_step(*args, **kwargs)
        for output in outputs:
            if output.finished:
                record(output)
        return outputs

    monkeypatch.setattr(decoder.llm, "generate", recording)
    monkeypatch.setattr(decoder.llm.llm_engine, "step", stepping)
    return requests


@torch.no_grad()
def trainer_logprobs(model, encoder: ChatEncoder, episode, temperature: float):
    """The episode's token ids as training builds them, and the update's log-probability of each [L]."""
    sample = episode_to_sample(episode, encoder, model)
    batch = collate([sample], encoder.pad_id)
    logprobs, _ = token_logprobs(model, batch, temperature, with_entropy=False, suppress_ids=encoder.suppress_ids)
    return sample.input_ids.tolist(), logprobs[0]


@torch.no_grad()
def bf16_steps(model, encoder: ChatEncoder, episodes) -> torch.Tensor:
    """For each sampled token of `episodes` (in `sampled_gaps`' order), the spacing of bfloat16 numbers at the
    largest |logit| of the row the token was drawn from, under `model`: 2^(floor(log2 max|z|) - 7)."""
    steps = []
    for episode in episodes:
        batch = collate([episode_to_sample(episode, encoder, model)], encoder.pad_id)
        largest = model(**model_inputs(batch)).logits[0].float().abs().amax(-1)  # [L]: row t predicts token t + 1
        for turn in episode.turns:
            start = turn.span[0]
            steps.append(largest[start - 1 : start - 1 + len(turn.sampled_logprobs)])
    return torch.exp2(torch.floor(torch.log2(torch.cat(steps))) - 7)


def sampled_gaps(model, encoder, episodes, temperature: float) -> list[float]:
    """|engine - trainer| log-probability of every sampled token of the episodes."""
    gaps = []
    for episode in episodes:
        _, logprobs = trainer_logprobs(model, encoder, episode, temperature)
        for turn in episode.turns:
            start = turn.span[0]
            engine = torch.tensor(turn.sampled_logprobs)
            gaps += (engine - logprobs[start : start + len(engine)]).abs().tolist()
    return gaps


def test_logprobs_and_token_ids_of_three_turns_with_images(vl, monkeypatch):
    model, encoder, decoder = vl
    cfg = config()
    requests = record_requests(decoder, monkeypatch)
    episodes, _ = rollout(model, encoder, cfg, seeds=[3, 4], group_size=2, decoder=decoder, sample_seed=11)
    assert len(requests) == 12, f"{len(requests)} requests for 4 episodes of 3 turns"
    gaps = []
    for episode in episodes:
        assert len(episode.turns) == 3 and len(episode.images) == 3, (len(episode.turns), len(episode.images))
        ids, logprobs = trainer_logprobs(model, encoder, episode, cfg.rollout.temperature)
        for turn in episode.turns:
            start, end = turn.span
            # Members of a group share their first prompt: the request is the one that returned these ids.
            same_prompt = [r for r in requests if r["prompt"] == ids[:start]]
            assert same_prompt, f"no request ran the trainer's prefix of {start} ids (turn at {turn.span})"
            request = next((r for r in same_prompt if ids[start : start + len(r["ids"])] == r["ids"]
                            or ids[start : start + len(r["ids"]) - 1] == r["ids"][:-1]), None)
            assert request is not None, "no request for this prompt returned the ids the trainer holds for the turn"
            requests.remove(request)
            returned = request["ids"]
            stopped = returned[-1] in encoder.stop_ids
            kept = len(returned) - stopped
            assert ids[start : start + kept] == returned[:kept], "generated ids differ from the trainer's"
            assert end == start + kept + 1 and ids[end - 1] == encoder.im_end_id, (turn.span, kept)
            assert turn.end_sampled == (returned[-1] == encoder.im_end_id)
            engine = request["logprobs"][: kept + turn.end_sampled]
            assert turn.sampled_logprobs == pytest.approx(engine, abs=0), "the episode keeps the engine's log-probs"
            trainer = logprobs[start : start + len(engine)]
            gaps += (torch.tensor(engine) - trainer).abs().tolist()
    assert len(gaps) >= 12
    assert max(gaps) < TOLERANCE, f"max |vLLM - trainer| log-prob {max(gaps):.2e} over {len(gaps)} sampled tokens"
    print(f"log-prob max |vLLM - trainer| {max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e} over {len(gaps)} tokens")


def test_weight_sync_follows_an_optimizer_step(vl):
    model, encoder, decoder = vl
    cfg = config("rollout.max_turns=2")
    played = dict(seeds=[5], group_size=2, decoder=decoder, sample_seed=3)
    before, _ = rollout(model, encoder, cfg, **played)  # caches now hold these prompts under the old weights
    assert max(sampled_gaps(model, encoder, before, 1.0)) < TOLERANCE

    updated = copy.deepcopy(model)
    updated.train()
    optimizer = torch.optim.AdamW(updated.parameters(), lr=1e-2)
    samples = [episode_to_sample(ep, encoder, updated) for ep in before]
    batch = collate(samples, encoder.pad_id)
    logprobs, _ = token_logprobs(updated, batch, 1.0, with_entropy=False, suppress_ids=encoder.suppress_ids)
    (-(logprobs * batch["loss_mask"]).sum()).backward()
    optimizer.step()
    updated.eval()
    vision = dict(model.named_parameters())["model.visual.blocks.0.attn.qkv.weight"]
    assert not torch.equal(vision, dict(updated.named_parameters())["model.visual.blocks.0.attn.qkv.weight"])

    try:
        seconds = decoder.sync_weights(updated)
        assert seconds > 0
        after, _ = rollout(updated, encoder, cfg, **played)
        to_updated = sampled_gaps(updated, encoder, after, 1.0)
        to_old = sampled_gaps(model, encoder, after, 1.0)
        assert max(to_updated) < TOLERANCE, f"after sync: max |vLLM - updated model| {max(to_updated):.2e}"
        assert max(to_old) > 100 * TOLERANCE, f"the step changed the old model's log-probs by only {max(to_old):.2e}"
    finally:
        decoder.sync_weights(model)
    again, _ = rollout(model, encoder, cfg, **played)
    assert [ep.input_ids for ep in again] == [ep.input_ids for ep in before], "syncing the old weights back"


def test_same_seed_same_rollout(vl):
    """Seeded requests replay, whatever the prefix cache holds, and a turn's prompts may take more than one
    engine step to read (more tokens than `max_num_batched_tokens`, as in the benchmark's rollouts)."""
    model, encoder, decoder = vl
    cfg = config("rollout.max_turns=2")
    levels, group_size = list(range(7, 19)), 3

    def play(sample_seed):
        episodes, _ = rollout(model, encoder, cfg, seeds=levels, group_size=group_size, decoder=decoder,
                              sample_seed=sample_seed)
        return [ep.input_ids for ep in episodes], [[t.sampled_logprobs for t in ep.turns] for ep in episodes], episodes

    first_ids, first_logprobs, episodes = play(21)
    step_budget = decoder.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    first_turn_prompts = sum(ep.turns[0].span[0] for ep in episodes)
    assert first_turn_prompts > step_budget, f"{first_turn_prompts=} should exceed one step's {step_budget} tokens"
    again_ids, again_logprobs, _ = play(21)  # every prompt now comes from the prefix cache
    assert again_ids == first_ids and again_logprobs == first_logprobs
    for group in range(len(levels)):
        members = first_ids[group * group_size : (group + 1) * group_size]
        assert len({tuple(ids) for ids in members}) == group_size, "members of a group draw their own responses"
    other_ids, _, _ = play(22)
    assert other_ids != first_ids


def test_greedy_equals_the_hf_backend_and_stops_at_the_answer(text_policy):
    model, encoder, decoder = text_policy
    cfg = load_config(None, ["rollout.max_turns=3", "rollout.max_new_tokens=64", "env.name=sokoban",
                             "env.render_mode=text"])
    played = dict(seeds=[1_000_000_000 + k for k in range(16)], group_size=1, do_sample=False)  # 16 evaluation levels
    hf, _ = rollout(model, encoder, cfg, decoder=HFDecoder(model, encoder), **played)
    vllm, _ = rollout(model, encoder, cfg, decoder=decoder, **played)
    assert [ep.input_ids for ep in vllm] == [ep.input_ids for ep in hf]
    assert [ep.success for ep in vllm] == [ep.success for ep in hf]
    answered = 0
    for episode in vllm:
        for turn in episode.turns:
            if turn.response.endswith("</answer>"):  # the stop string: its completing token kept, <|im_end|> appended
                text = encoder.tokenizer.decode(episode.input_ids[turn.span[0] : turn.span[1] - 1])
                assert text.endswith("</answer>") and not turn.end_sampled, (text, turn.end_sampled)
                answered += 1
    assert answered, [t.response for ep in vllm for t in ep.turns]


def test_from_config_builds_the_run_engine_with_the_actor_weights(text_policy):
    from vagen.distributed import init_distributed

    model, encoder, _ = text_policy
    init_distributed()  # a trainer's process group, which the engine's shutdown must leave
    cfg = load_config(None, ["model.path=assets:sokoban_text", "rollout.max_turns=2", "rollout.max_new_tokens=64",
                             "env.name=sokoban", "env.render_mode=text"])
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for param in updated.parameters():
            param.add_(0.01 * torch.randn_like(param))
    decoder = VLLMDecoder.from_config(cfg, updated, encoder)
    try:
        expected = {key: getattr(getattr(cfg, "vllm", None), key, default) for key, default in DEFAULT_SETTINGS.items()}
        assert decoder.settings == expected
        # sized for the rank's 4 x 4 episodes, not vLLM's serving defaults (256 sequences on the CPU)
        scheduler = decoder.llm.llm_engine.vllm_config.scheduler_config
        assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (16, cfg.vllm.max_model_len)
        played = dict(seeds=[3, 4], group_size=2, sample_seed=8)
        episodes, _ = rollout(updated, encoder, cfg, decoder=decoder, **played)
        assert max(sampled_gaps(updated.eval(), encoder, episodes, cfg.rollout.temperature)) < TOLERANCE
    finally:
        decoder.close()
    assert torch.distributed.is_initialized(), "closing the engine destroyed the trainer's process group"
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    assert total.item() == torch.distributed.get_world_size()


def test_an_engine_builds_where_triton_works_and_runs_the_v1_model_runner(text_policy, monkeypatch, capsys):
    """vLLM 0.32 chooses Model Runner V2 wherever Triton works (a CUDA machine reports HAS_TRITON = True), and
    V2 refuses the V1 logits processor that masks `suppress_ids` inside `LLM(...)`. The engine pins V1, says
    which runner it started, and decodes as the engine built where Triton is absent."""
    import vllm.config.vllm

    from vagen.decoding import Sampling
    from vagen.episode import Episode

    model, encoder, decoder = text_policy
    monkeypatch.setattr(vllm.config.vllm, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    capsys.readouterr()
    triton = VLLMDecoder(checkpoints_dir() / "sokoban_text", encoder, dtype="float32", seed=0)
    try:
        assert triton.model_runner == decoder.model_runner and triton.model_runner.startswith("vllm.v1.worker."), \
            triton.model_runner
        assert ".worker.gpu." not in triton.model_runner, f"Model Runner V2 ran: {triton.model_runner}"
        log = capsys.readouterr().err
        assert f"model runner V1 ({triton.model_runner})" in log, log[-2000:]
        prompt = encoder.tokenizer("<|im_start|>user\nPush the box.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        episode = Episode(env_name="sokoban", seed=0, group_id=0, system_prompt="", input_ids=prompt)
        greedy = Sampling(do_sample=False, temperature=1.0, max_new_tokens=16)
        assert triton.generate([episode], [0], greedy)[0].ids == decoder.generate([episode], [0], greedy)[0].ids
    finally:
        triton.close()


def test_models_with_image_hooks_are_refused_before_any_work(model_cache):
    script = f"""
import sys
from vagen.config import load_config
from vagen.decoding_vllm import DEFAULT_SETTINGS, VLLMDecoder
from vagen.episode import ChatEncoder
from vagen.models import load_policy, resolve_model_path
path = resolve_model_path("builtin:tiny-vl", {model_cache!r}, seed=0)
encoder = ChatEncoder(load_policy(path)[1])
for make in (lambda: VLLMDecoder(path, encoder),
             lambda: VLLMDecoder.from_config(load_config(None, ["model.builtin_cache={model_cache}"]))):
    try:
        make()
    except ValueError as err:
        print("refused:", err)
    else:
        print("accepted")
print("vllm imported:", "vllm" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    refusals = [line for line in lines if line.startswith("refused:")]
    assert len(refusals) == 2, out.stdout
    for line in refusals:
        assert CENTER_IMAGE_TOKENS in line and "rollout.backend=hf" in line and "standard Qwen2.5-VL" in line, line
    assert lines[-1] == "vllm imported: False", "the refusal came after vLLM was started"


def test_weight_sync_from_zero3_gathers_a_group_at_a_time(vl, monkeypatch):
    import deepspeed

    from vagen.distributed import init_distributed

    model, encoder, decoder = vl
    init_distributed()  # a group of one (vLLM's, when its engine made it first): DeepSpeed engines need one
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for param in updated.parameters():
            param.add_(0.02 * torch.randn_like(param))
    expected = copy.deepcopy(updated).eval()  # the weights whole, for the trainer's log-probs below
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=updated, model_parameters=list(updated.parameters()), config=ds_config)
    params = list(engine.module.parameters())
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in params), "ZeRO-3 should partition every parameter"

    gathered = []
    real = deepspeed.zero.GatheredParameters

    def counting(params, *args, **kwargs):
        gathered.append(len(params))
        return real(params, *args, **kwargs)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", counting)
    decoder.settings["sync_group_mb"] = 0.5  # the tiny model is 3.4 MB: several groups
    cfg = config("rollout.max_turns=2")
    try:
        decoder.sync_weights(engine)
        episodes, _ = rollout(expected, encoder, cfg, seeds=[9], group_size=2, decoder=decoder, sample_seed=5)
        gaps = sampled_gaps(expected, encoder, episodes, 1.0)
        assert max(gaps) < TOLERANCE, f"after a ZeRO-3 sync: max |vLLM - updated model| {max(gaps):.2e}"
    finally:
        decoder.settings["sync_group_mb"] = DEFAULT_SETTINGS["sync_group_mb"]
        decoder.sync_weights(model)
    assert sum(gathered) == len(params) and len(gathered) > 1 and max(gathered) < len(params), gathered


def _lora_trained(model, encoder: ChatEncoder, model_path, *overrides: str):
    """A copy of `model` with LoRA adapters (r = 8) after three AdamW steps on the adapters alone that raise
    the log-probabilities of responses the copy sampled, and the names of its trained parameters."""
    from vagen.models import add_adapters

    lora = load_config(None, [f"model.path={model_path}", "model.lora_rank=8", *overrides])
    adapted = add_adapters(copy.deepcopy(model), lora.model)
    cfg = config("rollout.max_turns=2", "env.render_mode=vision" if encoder.is_vision else "env.render_mode=text")
    played, _ = rollout(adapted, encoder, cfg, seeds=[1, 2], group_size=2, sample_seed=4)
    batch = collate([episode_to_sample(ep, encoder, adapted) for ep in played], encoder.pad_id)
    trained = [name for name, param in adapted.named_parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW([adapted.get_parameter(name) for name in trained], lr=1e-2)
    adapted.train()
    for _ in range(3):
        logprobs, _ = token_logprobs(adapted, batch, 1.0, with_entropy=False, suppress_ids=encoder.suppress_ids)
        optimizer.zero_grad()
        (-(logprobs * batch["loss_mask"]).sum()).backward()
        optimizer.step()
    adapted.eval()
    lora_b = [adapted.get_parameter(name) for name in trained if ".lora_B." in name]
    assert lora_b and all(p.abs().max() > 0 for p in lora_b), "the update left an adapter at zero"
    return adapted, trained


def test_a_lora_policy_is_synced_merged_and_greedy_equals_the_hf_backend(text_policy):
    """After a LoRA update the engine samples the adapted policy: greedy play is the hf backend's on the peft
    model, token for token, and sampled tokens' log-probabilities are the adapted policy's, not the base's.
    The sync merges into the engine's weights only: the trained model is left as it was."""
    from vagen.models import without_wrapper

    model, encoder, decoder = text_policy
    adapted, _ = _lora_trained(model, encoder, "assets:sokoban_text")
    before = {name: param.detach().clone() for name, param in adapted.named_parameters()}
    cfg = load_config(None, ["rollout.max_turns=3", "rollout.max_new_tokens=64", "env.name=sokoban",
                             "env.render_mode=text"])
    try:
        decoder.sync_weights(adapted)
        after = dict(adapted.named_parameters())
        assert all(torch.equal(after[name], value) for name, value in before.items())
        assert not any(getattr(layer, "merged", False) for layer in without_wrapper(adapted).modules())
        greedy = dict(seeds=[1_000_000_000 + k for k in range(16)], group_size=1, do_sample=False)
        hf, _ = rollout(adapted, encoder, cfg, decoder=HFDecoder(adapted, encoder), **greedy)
        vllm, _ = rollout(adapted, encoder, cfg, decoder=decoder, **greedy)
        assert [ep.input_ids for ep in vllm] == [ep.input_ids for ep in hf]
        assert [ep.success for ep in vllm] == [ep.success for ep in hf]
        sampled, _ = rollout(adapted, encoder, cfg, seeds=[5, 6], group_size=2, decoder=decoder, sample_seed=9)
        to_adapted = sampled_gaps(adapted, encoder, sampled, cfg.rollout.temperature)
        to_base = sampled_gaps(model, encoder, sampled, cfg.rollout.temperature)
        assert max(to_adapted) < TOLERANCE, f"max |vLLM - adapted policy| {max(to_adapted):.2e}"
        assert max(to_base) > 100 * TOLERANCE, f"the update changed the base's log-probs by only {max(to_base):.2e}"
    finally:
        decoder.sync_weights(model)


def test_a_lora_policy_under_zero3_is_synced_merged_with_its_trained_tower(standard_vl, vl):
    """ZeRO-3 partitions the peft model's base weights, adapters and trained vision tower
    (`model.freeze_vision=false`, peft's `modules_to_save`): the sync gathers each group's adapters with it
    and loads the merged weights and the trained tower under the base model's names."""
    import deepspeed

    from vagen.distributed import init_distributed

    model, encoder, decoder = vl
    init_distributed()
    adapted, trained = _lora_trained(model, encoder, standard_vl, "model.freeze_vision=false")
    assert any(".modules_to_save." in name for name in trained)
    expected = copy.deepcopy(adapted).eval()  # the weights whole, for the trainer's log-probs below
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=adapted, model_parameters=[adapted.get_parameter(n) for n in trained],
                                      config=ds_config)
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in engine.module.parameters())
    decoder.settings["sync_group_mb"] = 0.5  # several groups
    cfg = config("rollout.max_turns=2")
    try:
        decoder.sync_weights(engine)
        episodes, _ = rollout(expected, encoder, cfg, seeds=[9], group_size=2, decoder=decoder, sample_seed=5)
        to_adapted = sampled_gaps(expected, encoder, episodes, 1.0)
        to_base = sampled_gaps(model, encoder, episodes, 1.0)
        assert max(to_adapted) < TOLERANCE, f"after a ZeRO-3 sync: max |vLLM - adapted policy| {max(to_adapted):.2e}"
        assert max(to_base) > 100 * TOLERANCE, f"the update changed the base's log-probs by only {max(to_base):.2e}"
    finally:
        decoder.settings["sync_group_mb"] = DEFAULT_SETTINGS["sync_group_mb"]
        decoder.sync_weights(model)


@pytest.mark.slow  # two worker processes take ~1-2 min to start on 2 cores: `-m "vllm and not slow"` leaves it out
def test_tensor_parallel_engine_samples_and_syncs_the_trainer_policy(standard_vl, vl):
    """vllm.tensor_parallel_size=2: the engine's workers are processes of their own (on the CPU, each
    bound to its own cores), and weights reach them serialised, a group of layers at a time."""
    model, encoder, _ = vl
    decoder = VLLMDecoder(standard_vl, encoder, dtype="float32", seed=0, tensor_parallel_size=2, sync_group_mb=0.5)
    try:
        cfg = config("rollout.max_turns=2")
        played = dict(seeds=[6], group_size=2, decoder=decoder, sample_seed=4)
        episodes, _ = rollout(model, encoder, cfg, **played)
        assert max(sampled_gaps(model, encoder, episodes, 1.0)) < TOLERANCE
        updated = copy.deepcopy(model)
        with torch.no_grad():
            for param in updated.parameters():
                param.add_(0.02 * torch.randn_like(param))
        decoder.sync_weights(updated)
        episodes, _ = rollout(updated, encoder, cfg, **played)
        gaps = sampled_gaps(updated, encoder, episodes, 1.0)
        assert max(gaps) < TOLERANCE, f"after sync over 2 workers: max |vLLM - updated model| {max(gaps):.2e}"
    finally:
        decoder.close()


# -- training with rollout.backend=vllm, in processes of its own (as a user runs it) ----------------------

FAST_TRAINING = ["rollout.backend=vllm", "train.iterations=2", "rollout.env_groups=2", "rollout.group_size=2",
                 "rollout.max_new_tokens=24", "rollout.max_turns=2", "train.mini_batch_size=4",
                 "train.micro_batch_size=2", "eval.every=0", "log.progress=false"]


def _train(tmp_path, ranks: int, *overrides: str) -> list[dict]:
    """`vagen/train.py` on `ranks` CPU ranks (the DeepSpeed launcher for more than one); returns the
    metrics of its iterations. A clean exit is part of the check: the engines' shutdown at exit must not
    trip over the process group the trainer has left."""
    import socket

    from child_env import child_env

    script = str(Path(__file__).resolve().parents[1] / "vagen" / "train.py")
    args = ["--config", *overrides, f"train.run_dir={tmp_path}"]
    if ranks == 1:
        cmd = [sys.executable, script, *args]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
               str(port), script, *args]
    out = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "Traceback" not in out.stderr, out.stderr[-5000:]
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    return [json.loads(line) for line in (runs[-1] / "metrics.jsonl").read_text().splitlines()]


def _check_vllm_training(records: list[dict]) -> None:
    assert [r["iteration"] for r in records] == [0, 1]
    for record in records:
        assert record["rollout/generated_tokens"] > 0 and record["timing/weight_sync"] > 0, record
        # float32 on both sides: vLLM sampled what the trainer's actor computes
        assert record["rollout/inference_logprob_gap_max"] < TOLERANCE, record["rollout/inference_logprob_gap_max"]


def test_training_with_vllm_on_one_rank(standard_vl, tmp_path):
    records = _train(tmp_path, 1, "sokoban_visual", f"model.path={standard_vl}", *FAST_TRAINING)
    _check_vllm_training(records)
    _check_frame_check(records)


def _check_frame_check(records: list[dict]) -> None:
    """The frame check on the trainer's model scored every turn vLLM played (2 groups of 2), in every iteration."""
    for record in records:
        assert math.isfinite(record["rollout/frame_gap"]) and 0 <= record["rollout/frame_gap_positive"] <= 1
        assert record["rollout/frame_gap_turns"] == pytest.approx(4 * record["rollout/turns"]), record


def test_training_with_vllm_and_per_turn_samples(standard_vl, tmp_path):
    """With rollout.context=window vLLM generates from each turn's window (frames included), and the trainer's
    log-probabilities of the window samples are the engine's."""
    records = _train(tmp_path, 1, "sokoban_visual", f"model.path={standard_vl}", *FAST_TRAINING,
                     "rollout.max_turns=3", "rollout.context=window", "rollout.window_turns=1")
    _check_vllm_training(records)
    assert all(record["rollout/turns"] > 2 for record in records)  # the window slid
    _check_frame_check(records)  # per-turn samples: each turn's window with another group's frames


@pytest.mark.parametrize("zero", ["zero0", pytest.param("zero3", marks=pytest.mark.slow)])
def test_training_with_vllm_on_two_gloo_ranks(zero, tmp_path):
    records = _train(tmp_path, 2, "sokoban_text", f"train.deepspeed_config=deepspeed/{zero}_fp32.json", *FAST_TRAINING)
    _check_vllm_training(records)


def test_each_gloo_rank_runs_its_own_engine_with_its_rank_and_samples_its_own_prompts(text_policy, tmp_path):
    """Two ranks under the DeepSpeed launcher, each with an engine of its own: vLLM's worker is built with the
    rank's RANK and LOCAL_RANK (on a GPU, LOCAL_RANK is its device; vLLM's single-process executor gave every
    rank 0, i.e. GPU 0), and each engine answers its own prompt as one engine alone does."""
    import socket

    from child_env import child_env

    _, encoder, decoder = text_policy
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = str(Path(__file__).resolve().parent / "vllm_rank_worker.py")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port), worker,
           "--out", str(tmp_path), "--cache", str(tmp_path / "cache")]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    from vagen.decoding import Sampling
    from vagen.episode import Episode

    sampling = Sampling(do_sample=False, temperature=1.0, max_new_tokens=16)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["engine"] == [{"rank": rank, "local_rank": rank, "device": "cpu"}], report
        episode = Episode(env_name="sokoban", seed=rank, group_id=rank, system_prompt="", input_ids=report["prompt"])
        alone = decoder.generate([episode], [0], sampling)[0]
        assert report["ids"] == alone.ids, (rank, report["ids"], alone.ids)
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first["prompt"] != second["prompt"] and first["ids"] != second["ids"]


def test_training_with_vllm_and_lora_samples_the_adapted_policy(tmp_path):
    """The engine is built from the base checkpoint and given the LoRA actor's merged weights after every
    update: the tokens it samples have the trained adapted policy's log-probabilities, which the update
    has moved away from the base's (the KL to the reference, the base under the adapters)."""
    records = _train(tmp_path, 1, "sokoban_text", *FAST_TRAINING, "model.lora_rank=8", "algo.kl_coef=0.1",
                     "train.actor_lr=0.003")
    _check_vllm_training(records)
    assert records[0]["actor/kl_to_ref"] == 0 and records[1]["actor/kl_to_ref"] > KL_AFTER_LORA_UPDATE, records


def _evaluate(out, backend: str) -> dict:
    from child_env import child_env

    cmd = [sys.executable, "-m", "vagen.eval", "--config", "sokoban_text", "--checkpoint", "assets:sokoban_text",
           "--episodes", "16", "--videos", "0", "--out", str(out), f"rollout.backend={backend}"]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "Traceback" not in done.stderr, done.stderr[-5000:]
    return json.loads((out / "results.json").read_text())


def test_evaluation_with_vllm_gives_the_greedy_results_of_hf(tmp_path):
    """`python -m vagen.eval` on 16 held-out levels, greedy: each episode's success, return, actions and
    response lengths (tokens) are those of the hf backend, and so are the responses the browser shows."""
    hf = _evaluate(tmp_path / "hf" / "eval", "hf")  # the page's title names its folder: the same name for both
    vllm = _evaluate(tmp_path / "vllm" / "eval", "vllm")
    assert len(vllm["episodes"]) == 16
    assert vllm["episodes"] == hf["episodes"]
    assert vllm["model"] == hf["model"]
    assert (tmp_path / "vllm" / "eval" / "index.html").read_text() == (tmp_path / "hf" / "eval" / "index.html").read_text()
