"""LoRA adapters (peft): only adapters and the value head train, the reference is the base model, adapters
save in peft format and merge into a whole checkpoint, resuming restores them exactly, and LoRA settings
that cannot work fail before any work."""

import json
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

import vagen.train
from vagen.config import ConfigError, check_training, load_config
from vagen.models import DTYPES, AdaptersOff, add_adapters, has_adapters, load_policy, lora_targets
from vagen.trajectory import collate, episode_to_sample
from vagen.update import token_logprobs

FAST = ["train.iterations=2", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
        "rollout.max_turns=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false"]
# Responses long enough to parse (rewards, hence values, to learn), and a learning rate that moves the adapters
# far enough for adapted and base log-probabilities to differ clearly.
LORA = ["model.lora_rank=8", "rollout.max_new_tokens=64", "algo.kl_coef=0.1", "train.actor_lr=0.003", "train.critic_lr=0.01", "train.save_every=1"]


def _train(run_dir, name, *extra):
    """`vagen.train.main` on the shipped Sokoban warm start; returns (run directory, the run's Models)."""
    built = []
    real = vagen.train.build_models

    def recording(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vagen.train, "build_models", recording)
        overrides = [*FAST, *LORA, f"train.run_dir={run_dir}", f"train.run_name={name}", *extra]
        assert vagen.train.main(["--config", "sokoban_visual", *overrides]) == 0
    return run_dir / name, built[0]


def _metrics(run):
    return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.startswith("timing/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, distributed):
    run_dir = tmp_path_factory.mktemp("lora_runs")
    run, models = _train(run_dir, "lora")
    assert [r["iteration"] for r in _metrics(run)] == [0, 1]
    # the frame check through the adapted model: every turn of the 4 episodes scored in each iteration
    assert all(math.isfinite(r["rollout/frame_gap"]) and r["rollout/frame_gap_turns"] == 4 * r["rollout/turns"]
               for r in _metrics(run))
    cfg = load_config("sokoban_visual", [*FAST, *LORA])
    base_path = json.loads((run / "checkpoints" / "step_2" / "actor" / "adapter_config.json").read_text())[
        "base_model_name_or_path"]
    return run, models, cfg, base_path


@pytest.fixture(scope="module")
def batch(lora_run):
    """Two trajectories the trained policy plays, as a training batch."""
    from vagen.rollout import rollout

    _, models, cfg, _ = lora_run
    episodes, _ = rollout(models.actor.module, models.encoder, cfg, [3], 2, sample_seed=5)
    samples = [episode_to_sample(ep, models.encoder, models.actor.module) for ep in episodes]
    return collate(samples, models.encoder.pad_id)


def _base_name(name: str) -> str:
    return name.replace(".base_layer.", ".")


def test_only_the_adapters_and_the_value_head_change(lora_run):
    run, models, cfg, base_path = lora_run
    base, _ = load_policy(base_path)
    base_state = base.state_dict()
    actor = models.actor.module
    assert has_adapters(actor)
    trained = {n for n, p in actor.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained), sorted(trained)[:5]
    # one pair of adapters on each of the 7 projections of the 2 decoder layers, none in the vision tower
    assert len(trained) == 2 * 7 * 2 and not any(".visual." in n for n in trained)
    frozen = 0
    for name, param in actor.get_base_model().named_parameters():
        if ".lora_" in name:
            continue
        assert torch.equal(param, base_state[_base_name(name)]), name  # byte-identical after the updates
        frozen += 1
    assert frozen == len(base_state) - 1  # every weight but the LM head, which is tied to the embedding
    lora_b = [p for n, p in actor.named_parameters() if ".lora_B." in n]
    assert all(p.abs().max() > 0 for p in lora_b)  # zero at the start: every adapter was updated
    # the optimizer holds the adapters alone
    optimized = sum(p.numel() for group in models.actor.optimizer.param_groups for p in group["params"])
    assert optimized == sum(actor.get_parameter(n).numel() for n in trained)

    critic = models.critic.module
    critic_trained = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= critic_trained
    assert all(".lora_" in n for n in critic_trained - {"value_head.weight", "value_head.bias"})
    assert len(critic_trained) == 2 * 7 * 2 + 2
    for name, param in critic.backbone.get_base_model().named_parameters():
        if ".lora_" not in name:
            assert torch.equal(param, base_state["model." + _base_name(name)]), name
    assert critic.value_head.weight.abs().max() > 0  # zero-initialised, then trained


def test_the_reference_is_the_base_model(lora_run, batch):
    _, models, cfg, base_path = lora_run
    base, _ = load_policy(base_path)
    base.train()  # as annotate runs the actor
    temperature, suppress = cfg.rollout.temperature, models.encoder.suppress_ids
    with torch.no_grad():
        expected, _ = token_logprobs(base, batch, temperature, False, suppress)
        reference, _ = token_logprobs(models.reference, batch, temperature, False, suppress)
        adapted, _ = token_logprobs(models.actor, batch, temperature, False, suppress)
    assert isinstance(models.reference, AdaptersOff) and models.reference.model is models.actor
    mask = batch["loss_mask"].bool()
    assert mask.sum() > 10
    torch.testing.assert_close(reference[mask], expected[mask], rtol=0, atol=1e-6)
    assert (adapted[mask] - expected[mask]).abs().max() > 1e-3  # the adapters are on outside the reference
    # the adapters are back on after the reference's call
    with torch.no_grad():
        again, _ = token_logprobs(models.actor, batch, temperature, False, suppress)
    assert torch.equal(again, adapted)


def test_a_saved_adapter_loads_with_peft_and_merges_into_a_checkpoint(lora_run, batch, tmp_path):
    from vagen.eval import resolve_checkpoint
    from vagen.merge import main as merge_main
    from vagen.rollout import rollout

    run, models, cfg, base_path = lora_run
    actor_dir = run / "checkpoints" / "step_2" / "actor"
    assert not (actor_dir / "model.safetensors").exists()
    assert (actor_dir / "adapter_model.safetensors").exists() and (actor_dir / "processor_config.json").exists()
    base, _ = load_policy(base_path)
    loaded = PeftModel.from_pretrained(base, str(actor_dir))
    trained = {n: p for n, p in models.actor.module.named_parameters() if p.requires_grad}
    loaded_state = dict(loaded.named_parameters())
    for name, param in trained.items():
        assert torch.equal(loaded_state[name], param), name

    out = tmp_path / "merged"
    assert merge_main([str(run / "checkpoints" / "step_2"), str(out)]) == 0  # a step directory: its actor/
    assert resolve_checkpoint(str(out)) == out  # what vagen.eval loads
    merged, _ = load_policy(out)
    temperature, suppress = cfg.rollout.temperature, models.encoder.suppress_ids
    mask = batch["loss_mask"].bool()
    with torch.no_grad():
        adapted, _ = token_logprobs(models.actor, batch, temperature, False, suppress)
        from_merged, _ = token_logprobs(merged.train(), batch, temperature, False, suppress)
        # Computed in float64, the saved merged weights give the adapted model's log-probabilities to 1e-5.
        exact = [token_logprobs(m.double(), batch, temperature, False, suppress)[0][mask] for m in (merged, loaded)]
    torch.testing.assert_close(exact[0], exact[1], rtol=0, atol=1e-5)
    # In float32 the two computations differ by float32's own noise, seen up to 1.3e-5 at log-probs near -3
    # (where a batch and its rows run alone differ by 7e-6): within 1e-5 plus 1e-5 of the value.
    torch.testing.assert_close(from_merged[mask], adapted[mask], rtol=1e-5, atol=1e-5)

    # the HF decoder samples the adapted policy through peft's wrapper: greedy play equals the merged model's
    greedy = load_config("sokoban_visual", [*FAST, "rollout.temperature=0"])
    merged.float()
    played = [rollout(model, models.encoder, greedy, [11, 12], 1)[0] for model in (models.actor.module, merged)]
    assert [ep.input_ids for ep in played[0]] == [ep.input_ids for ep in played[1]]
    assert all(len(ep.turns) >= 1 for ep in played[0])


def test_the_end_of_a_lora_run_says_how_to_merge_and_evaluate_it(lora_run, distributed, capsys):
    from vagen.run import RunDir

    run, _, _, _ = lora_run
    RunDir(run, distributed).finish()
    actor = run / "checkpoints" / (run / "checkpoints" / "latest").read_text() / "actor"
    assert capsys.readouterr().out.splitlines()[-2:] == [
        f"merge it: python -m vagen.merge {actor} {run / 'merged'}",
        f"evaluate it: python -m vagen.eval --config {run / 'config.yaml'} --checkpoint {run / 'merged'} --episodes 128"]


@pytest.mark.parametrize("config, architecture", [("sokoban_visual", "Qwen2_5_VLForConditionalGeneration"),
                                                  ("sokoban_text", "Qwen2ForCausalLM")])
def test_a_target_module_that_does_not_exist_stops_training_before_any_work(config, architecture, tmp_path,
                                                                             played_tokens, monkeypatch, capsys):
    import vagen.models

    loaded = []
    real = vagen.models.load_policy
    monkeypatch.setattr(vagen.models, "load_policy", lambda *args, **kwargs: loaded.append(args) or real(*args, **kwargs))
    code = vagen.train.main(["--config", config, *FAST, *LORA, f"train.run_dir={tmp_path}", "train.run_name=wrong",
                             "model.lora_target_modules=[q_proj,attn_q]"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"config error: model.lora_target_modules=['q_proj', 'attn_q']: ['attn_q'] name no linear layer of "
        f"{architecture}'s language model; valid names: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, "
        f"v_proj; set model.lora_target_modules to some of them\n")
    # before any work: no run directory, no weights loaded, nothing played
    assert list(tmp_path.iterdir()) == [] and loaded == [] and played_tokens == []


def test_merge_says_what_it_expected(lora_run, tmp_path, capsys):
    from vagen.merge import adapter_dir
    from vagen.merge import main as merge_main

    assert merge_main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert f"{tmp_path}: no LoRA adapter there (expected adapter_config.json)" in capsys.readouterr().err
    run = lora_run[0]
    latest = (run / "checkpoints" / "latest").read_text()
    assert adapter_dir(run) == run / "checkpoints" / latest / "actor"  # a run directory: its latest checkpoint's


def test_resume_restores_adapters_and_optimizer_exactly(lora_run, tmp_path, distributed):
    run, _, _, _ = lora_run
    resumed, _ = _train(run.parent, "lora", "train.iterations=3", "train.resume=auto")
    assert resumed == run
    straight, _ = _train(tmp_path, "straight", "train.iterations=3")
    assert _metrics(resumed) == _metrics(straight)
    for part in ("actor/adapter_model.safetensors", "critic/backbone/adapter_model.safetensors"):
        expected = load_file(straight / "checkpoints" / "step_3" / part)
        got = load_file(resumed / "checkpoints" / "step_3" / part)
        assert expected.keys() == got.keys() and len(expected) == 2 * 7 * 2
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"{part}: {key}"
    head = [torch.load(r / "checkpoints" / "step_3" / "critic" / "value_head.pt") for r in (straight, resumed)]
    assert torch.equal(head[0]["weight"], head[1]["weight"]) and torch.equal(head[0]["bias"], head[1]["bias"])
    # the engine states hold the adapters, not the frozen base (but for the tied LM head, the embedding's
    # second name, which DeepSpeed's filter of frozen parameters does not see)
    states = list((resumed / "checkpoints" / "step_3" / "deepspeed" / "actor").glob("*model_states.pt"))
    module = torch.load(states[0], weights_only=False)["module"]
    assert sorted(k for k in module if ".lora_" not in k) == ["base_model.model.lm_head.weight"]
    assert len(module) == 2 * 7 * 2 + 1


def test_target_modules_must_name_language_model_layers(model_cache):
    from vagen.models import resolve_model_path

    model, _ = load_policy(resolve_model_path("builtin:tiny-vl", model_cache, seed=0))
    names = lora_targets(model, ["q_proj", "down_proj"])
    assert names == [f"model.language_model.layers.{i}.{part}" for i in (0, 1)
                     for part in ("self_attn.q_proj", "mlp.down_proj")]
    valid = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    with pytest.raises(ValueError) as err:
        lora_targets(model, ["q_proj", "qkv"])  # qkv exists only in the vision tower
    assert str(err.value) == (f"model.lora_target_modules=['q_proj', 'qkv']: ['qkv'] name no linear layer of "
                              f"Qwen2_5_VLForConditionalGeneration's language model; valid names: {valid}; set "
                              f"model.lora_target_modules to some of them")


def test_freeze_vision_false_trains_the_tower_and_the_reference_keeps_the_original(model_cache, tmp_path):
    from vagen.merge import merge
    from vagen.models import resolve_model_path

    cfg = load_config("sokoban_visual", ["model.path=builtin:tiny-vl", "model.lora_rank=4",
                                            "model.freeze_vision=false"])
    path = resolve_model_path("builtin:tiny-vl", model_cache, seed=0)
    model = add_adapters(load_policy(path)[0], cfg.model)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    tower = [n for n in trained if ".visual." in n]
    assert tower and all(".modules_to_save.default." in n for n in tower)
    assert len(trained) - len(tower) == 2 * 7 * 2
    plain = load_policy(path)[0]
    pixels = torch.randn(16, 3 * 2 * 14 * 14)  # 4 x 4 patches of 2 frames x 14 x 14 pixels
    grid = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        for p in [p for n, p in model.named_parameters() if ".modules_to_save." in n]:
            p.add_(0.1)
        tokens = model.get_base_model().model.visual(pixels, grid_thw=grid).pooler_output
        with model.disable_adapter():
            original = model.get_base_model().model.visual(pixels, grid_thw=grid).pooler_output
        expected = plain.model.visual(pixels, grid_thw=grid).pooler_output
    assert torch.equal(original, expected) and not torch.allclose(tokens, expected)
    # the trained tower is saved with the adapters, and merging puts it in place of the original
    model.save_pretrained(tmp_path / "adapter")
    merged, _ = load_policy(merge(tmp_path / "adapter", tmp_path / "merged", base=path))
    with torch.no_grad():
        assert torch.equal(merged.model.visual(pixels, grid_thw=grid).pooler_output, tokens)


@pytest.mark.parametrize("overrides, message", [
    (["model.lora_rank=-1"], "model.lora_rank=-1 must be >= 0 (0 = full fine-tuning; 8-64 is usual for LoRA)"),
    (["model.lora_rank=8", "model.lora_alpha=0"], "model.lora_alpha=0 must be > 0"),
    (["model.lora_rank=8", "model.lora_dropout=1.0"], "model.lora_dropout=1.0 must be in [0, 1)"),
    (["model.lora_rank=8", "model.lora_target_modules=[]"], "model.lora_target_modules=[] must list module names"),
    (["model.lora_rank=8", "model.path=builtin:tiny-vl"],
     "model.path=builtin:tiny-vl is randomly initialised: its vision tower"),
])
def test_lora_settings_that_cannot_work_fail_at_load(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config("sokoban_visual", overrides)
    assert str(err.value).startswith(message), str(err.value)


def test_the_random_built_in_is_accepted_with_lora_when_its_tower_trains():
    cfg = load_config("sokoban_visual", ["model.lora_rank=8", "model.path=builtin:tiny-vl",
                                            "model.freeze_vision=false"])
    assert cfg.model.lora_rank == 8 and not cfg.model.freeze_vision


@pytest.mark.parametrize("persistence", [0, 10**6], ids=["released", "persistent"])
def test_a_frozen_lm_head_under_zero3_gives_the_log_probabilities_and_gradients_of_a_whole_one(distributed,
                                                                                               persistence):
    """The log-probabilities' chunks are checkpointed, and backward recomputes each. Under ZeRO-3 a frozen head
    (LoRA's), released after each call or one to be kept whole (`stage3_param_persistence_threshold`, which
    ZeRO-3 still releases until its trace of the model's calls is complete), gives what the head gives
    unpartitioned: the same log-probabilities, entropies and gradients of the hidden states."""
    import copy

    import deepspeed

    from vagen.update import head_logprobs

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"head": torch.nn.Linear(16, 50, bias=False), "adapter": torch.nn.Linear(16, 16)})
    model["head"].requires_grad_(False)
    whole = copy.deepcopy(model["head"])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model["adapter"].parameters()), config=config)
    head = engine.module["head"]
    assert head.weight.numel() == 0 and head.weight.ds_persist == (persistence > 0)  # gathered at its first call
    hidden, targets = torch.randn(37, 16), torch.randint(0, 50, (37,))
    results = []
    for lm_head in (head, whole):
        states = hidden.clone().requires_grad_()
        logprobs, entropies = head_logprobs(lm_head, states, targets, 0.7, with_entropy=True, chunk_rows=8)
        (logprobs.sum() + 0.1 * entropies.sum()).backward()
        results.append((logprobs.detach(), entropies.detach(), states.grad))
    for partitioned, expected in zip(*results):
        torch.testing.assert_close(partitioned, expected, rtol=0, atol=1e-6)
    assert results[0][2].abs().max() > 0.1


ZERO3_WORKER = Path(__file__).parent / "lora_zero3_worker.py"


def test_lora_trains_under_zero3_on_two_ranks_as_under_zero0(tmp_path, model_cache):
    """Two gloo ranks, LoRA r = 8, two iterations with ZeRO-0, then with ZeRO-3 (every parameter partitioned,
    the frozen LM head gathered in each recomputed chunk of the log-probabilities, gradient checkpointing on)
    in float32 and in bfloat16 (tests/lora_zero3_worker.py). Only the adapters change; float32 ZeRO-3 changes
    them as ZeRO-0 does; the saved adapter loads with peft and holds the trained values."""
    from test_zero3 import _launch

    _launch(2, tmp_path, model_cache, ZERO3_WORKER, timeout=900)
    stages = {"zero0": (0, "float32"), "zero3": (3, "float32"), "zero3_bf16": (3, "bfloat16")}
    runs = {stage: torch.load(tmp_path / f"{stage}_actor.pt") for stage in stages}
    base_path = json.loads((tmp_path / "zero3" / "checkpoints" / "step_2" / "actor" / "adapter_config.json").read_text())[
        "base_model_name_or_path"]
    base_state = load_policy(base_path)[0].state_dict()
    for stage, (zero, dtype) in stages.items():
        run = runs[stage]
        assert run["stage"] == zero, (stage, run["stage"])
        parameters, trained = run["parameters"], run["trained"]
        assert len(trained) == 2 * 7 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trained), trained[:5]
        frozen = [n for n in parameters if ".lora_" not in n]
        assert len(frozen) == len(base_state) - 1  # every weight but the LM head, tied to the embedding
        for name in frozen:  # byte-identical after the updates
            expected = base_state[_base_name(name.removeprefix("base_model.model."))].to(DTYPES[dtype])
            assert torch.equal(parameters[name], expected), f"{stage}: {name}"
        # zero at the start: every adapter was updated
        assert all(parameters[n].abs().max() > 0 for n in trained if ".lora_B." in n), stage
        records = _metrics(tmp_path / stage)
        assert [r["iteration"] for r in records] == [0, 1], stage
        assert all(math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0 for r in records), (stage, records)
        assert records[-1]["actor/kl_to_ref"] > 0, stage  # the reference (adapters off) differs after an update
        loaded = PeftModel.from_pretrained(load_policy(base_path, dtype)[0],
                                           str(tmp_path / stage / "checkpoints" / "step_2" / "actor"))
        loaded_state = dict(loaded.named_parameters())
        for name in trained:
            # peft loads adapters of a bfloat16 base in float32: the same values
            assert torch.equal(loaded_state[name].to(parameters[name].dtype), parameters[name]), f"{stage}: {name}"
    # ZeRO-3 computes ZeRO-0's update: the same metrics, and the same adapters but where Adam divides by a
    # gradient near its eps. ZeRO-3 over two ranks runs each batch whole, ZeRO-0 shares the prompt prefix, so
    # sums differ in their last bits; measured: 0.1% of an adapter's entries at most differ by over 1e-5, the
    # largest by 5.5e-5, where a wrong gradient would move most entries by up to the learning rate (3e-3).
    for expected, got in zip(_metrics(tmp_path / "zero0"), _metrics(tmp_path / "zero3")):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_to_ref", "critic/vf_loss", "critic/grad_norm"):
            assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-7), key
    for name in runs["zero0"]["trained"]:
        gap = (runs["zero3"]["parameters"][name] - runs["zero0"]["parameters"][name]).abs()
        assert gap.max() < 2e-4 and (gap > 1e-5).float().mean() < 0.01, f"{name}: max {gap.max():.1e}"


@pytest.mark.parametrize("deepspeed, refused", [("0.19.2", True), ("0.19.3", False)])
def test_lora_with_gradient_checkpointing_under_zero3_needs_a_deepspeed_that_keeps_frozen_weights_gathered(
        deepspeed, refused, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: deepspeed if name == "deepspeed" else real(name))
    zero3 = ["model.lora_rank=8", "model.dtype=bfloat16", "train.deepspeed_config=deepspeed/zero3_bf16.json"]
    check_training(load_config("sokoban_visual", zero3))  # without gradient checkpointing, any version
    cfg = load_config("sokoban_visual", [*zero3, "model.gradient_checkpointing=true"])
    if not refused:
        check_training(cfg)
        return
    with pytest.raises(ConfigError) as err:
        check_training(cfg)
    assert str(err.value) == (
        "model.lora_rank=8 with model.gradient_checkpointing=true and train.deepspeed_config=deepspeed/zero3_bf16.json "
        "(ZeRO stage 3) needs DeepSpeed >= 0.19.3, which keeps a frozen base weight gathered while backward recomputes "
        "a checkpointed layer; DeepSpeed 0.19.2 partitions it again, and backward fails. pip install "
        "\"deepspeed>=0.19.3\", or set model.gradient_checkpointing=false")


def test_lora_trains_under_zero2_with_gradient_checkpointing(tmp_path, distributed):
    run, models = _train(tmp_path, "zero2", "model.dtype=bfloat16", "train.deepspeed_config=deepspeed/zero2_bf16.json",
                         "model.gradient_checkpointing=true")
    assert models.actor.zero_optimization_stage() == 2
    records = _metrics(run)
    assert [r["iteration"] for r in records] == [0, 1] and records[-1]["actor/grad_norm"] > 0
    lora_b = [p for n, p in models.actor.module.named_parameters() if ".lora_B." in n]
    assert len(lora_b) == 2 * 7 and all(p.abs().max() > 0 for p in lora_b)
    assert (run / "checkpoints" / "step_2" / "actor" / "adapter_model.safetensors").exists()


def test_a_killed_lora_run_resumes_exactly(tmp_path, model_cache):
    """SIGKILL in the update of the last iteration, then train.resume=auto: the metrics and the adapters are
    those of the run never interrupted (tests/test_resume.py's worker, on the text warm start)."""
    from test_resume import _record
    from test_resume import _train as train_child

    lora = ["model.lora_rank=8", "algo.kl_coef=0.1", "train.iterations=3", "train.actor_lr=0.003"]
    whole = train_child(tmp_path, model_cache, "whole", *lora)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = train_child(tmp_path, model_cache, "killed", *lora, kill=["--kill-in-update", "2"])
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL
    assert (tmp_path / "killed" / "checkpoints" / "latest").read_text() == "step_2"
    assert len(_record(tmp_path / "killed")) == 2
    resumed = train_child(tmp_path, model_cache, "killed", *lora, "train.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    expected = _record(tmp_path / "whole")
    assert [r["iteration"] for r in expected] == [0, 1, 2] and expected[-1]["actor/kl_to_ref"] > 0
    assert _record(tmp_path / "killed") == expected
    for part in ("actor/adapter_model.safetensors", "critic/backbone/adapter_model.safetensors"):
        want = load_file(tmp_path / "whole" / "checkpoints" / "step_3" / part)
        got = load_file(tmp_path / "killed" / "checkpoints" / "step_3" / part)
        assert want.keys() == got.keys() and len(want) == 2 * 7 * 2
        assert all(torch.equal(got[k], want[k]) for k in want), part
