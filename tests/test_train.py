import json
import math
from pathlib import Path

import pytest
import yaml

from vagen.config import available_configs, from_dict, load_config
from vagen.distributed import cpu_threads
from vagen.train import main

FAST = ["train.iterations=2", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
        "rollout.max_turns=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false"]


def _run(config, tmp_path, model_cache, *extra):
    overrides = FAST + [f"train.run_dir={tmp_path}", f"model.builtin_cache={model_cache}", *extra]
    assert main(["--config", config, *overrides]) == 0
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    return runs[-1], overrides


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# multitask_visual's tasks share out level groups in proportions FAST's 2 groups do not meet (tests/test_tasks.py)
@pytest.mark.parametrize("config", [name for name in available_configs() if name != "multitask_visual"])
def test_two_iterations_of_each_config(config, tmp_path, model_cache, distributed):
    # navigation's frame check asked for explicitly, the other configs' as their defaults have it
    run, overrides = _run(config, tmp_path, model_cache, *["log.frame_check_every=1"] * (config == "navigation_visual"))
    records = _metrics(run)
    assert [r["iteration"] for r in records] == [0, 1]
    # the frame check in every iteration of a visual config (two level groups: each scored with the other's frames)
    visual = load_config(config).env.render_mode == "vision"
    for record in records:
        for key in ("rollout/frame_gap", "rollout/frame_gap_positive"):
            assert (key in record) == visual, (key, record["iteration"])
        if visual:
            assert math.isfinite(record["rollout/frame_gap"]) and 0 <= record["rollout/frame_gap_positive"] <= 1
            # every turn of the 4 episodes (2 groups of 2)
            assert record["rollout/frame_gap_turns"] == pytest.approx(4 * record["rollout/turns"])
    for key in ("rollout/success", "rollout/reward_mean", "rollout/in_group_reward_std", "rollout/response_length",
                "rollout/format_ok", "rollout/action_valid", "actor/pg_loss", "actor/entropy", "actor/grad_norm",
                "actor/clipfrac", "actor/approx_kl", "timing/generate", "timing/update"):
        assert key in records[-1], key
    cfg = load_config(config, overrides)
    if cfg.algo.adv_estimator != "grpo":
        assert "critic/vf_loss" in records[-1] and "critic/explained_var" in records[-1]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert from_dict(saved, config) == cfg  # the run can be reproduced from its directory
    ckpt = run / "checkpoints" / (run / "checkpoints" / "latest").read_text()
    assert ckpt.name == "step_2"
    assert (ckpt / "actor" / "config.json").exists() and (ckpt / "actor" / "model.safetensors").exists()
    assert json.loads((ckpt / "trainer_state.json").read_text())["iteration"] == 1
    assert (ckpt / "critic").exists() == (cfg.algo.adv_estimator != "grpo")


def test_resume_continues_the_step_counter_and_metrics(tmp_path, model_cache, distributed):
    run, _ = _run("sokoban_text", tmp_path, model_cache, "train.run_name=resumable", "train.save_every=1")
    assert [r["iteration"] for r in _metrics(run)] == [0, 1]
    again, _ = _run("sokoban_text", tmp_path, model_cache, "train.run_name=resumable", "train.iterations=3",
                    "train.resume=auto")
    assert again == run
    assert [r["iteration"] for r in _metrics(run)] == [0, 1, 2]
    assert (run / "checkpoints" / "latest").read_text() == "step_3"
    # weights, optimizer state and per-iteration seeding restored: the resumed iteration is the one an
    # uninterrupted run computes
    straight, _ = _run("sokoban_text", tmp_path, model_cache, "train.run_name=straight", "train.iterations=3")
    assert _deterministic(_metrics(straight)[2]) == _deterministic(_metrics(run)[2])


def test_resume_from_a_missing_path_says_what_was_expected(tmp_path, model_cache, distributed, capsys):
    (tmp_path / "empty").mkdir()
    for path, why in ((tmp_path / "nope", "no such path"), (tmp_path / "empty", "no checkpoint there")):
        with pytest.raises(SystemExit) as stop:  # a refusal, not a traceback
            _run("sokoban_text", tmp_path, model_cache, f"train.resume={path}")
        assert stop.value.code == 2
        assert capsys.readouterr().err == (
            f"refused: train.resume={path}: {why} (expected trainer_state.json in a runs/<run>/checkpoints/step_N "
            f"directory, or a run directory with checkpoints/latest); give the path of a checkpoint, "
            f"train.resume=auto to resume the run train.run_name names, or train.resume=null for a new run\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no run directory was made


def test_periodic_evaluation_logs_eval_metrics_and_writes_videos(tmp_path, model_cache, distributed):
    run, _ = _run("frozenlake_visual", tmp_path, model_cache, "eval.every=2", "eval.episodes=2", "eval.videos=1")
    records = _metrics(run)
    assert "eval/success" not in records[0] and "eval/success" in records[1]
    assert records[1]["eval/episodes"] == 2
    assert len(list((run / "eval" / "step_2" / "videos").glob("frozenlake_seed1000000000_*.mp4"))) == 1


def test_evaluation_before_training_is_the_starting_checkpoints(tmp_path, model_cache, distributed):
    """eval.before_training: eval/step_0 and the metrics record of iteration -1 hold the shipped warm start's own
    greedy evaluation (what python -m vagen.eval gives it), before the first update; a resumed run skips it."""
    budget = ["rollout.max_new_tokens=64", "rollout.max_turns=3"]
    run, overrides = _run("frozenlake_visual", tmp_path, model_cache, *budget, "eval.before_training=true",
                          "eval.every=2", "eval.episodes=4", "eval.videos=0", "train.run_name=first",
                          "train.save_every=1")
    records = _metrics(run)
    assert [r["iteration"] for r in records] == [-1, 0, 1]
    assert records[0]["eval/episodes"] == 4 and "rollout/success" not in records[0]
    assert "eval/success" not in records[1] and records[2]["eval/episodes"] == 4
    step_0 = json.loads((run / "eval" / "step_0" / "results.json").read_text())
    assert step_0["model"]["success"] == records[0]["eval/success"]
    from vagen.eval import main as evaluate_main

    out = tmp_path / "warm_start_eval"
    assert evaluate_main(["--config", "frozenlake_visual", "--checkpoint", "assets:frozenlake_visual", "--episodes",
                          "4", "--videos", "0", "--out", str(out), f"model.builtin_cache={model_cache}",
                          "log.progress=false", *budget]) == 0
    alone = json.loads((out / "results.json").read_text())
    assert step_0["episodes"] == alone["episodes"] and step_0["seeds"] == alone["seeds"]
    # resumed at iteration 2, the run does not evaluate its starting checkpoint again
    (run / "eval" / "step_0" / "results.json").unlink()
    _run("frozenlake_visual", tmp_path, model_cache, *budget, "eval.before_training=true", "eval.every=0",
         "train.run_name=first", "train.iterations=3", "train.resume=auto")
    assert [r["iteration"] for r in _metrics(run)] == [-1, 0, 1, 2]
    assert not (run / "eval" / "step_0" / "results.json").exists()


def _deterministic(record):
    return {k: v for k, v in record.items() if not k.startswith("timing/") and k != "time"}


def test_same_seed_same_run(tmp_path, model_cache, distributed):
    runs = []
    for name in ("a", "b"):
        run, _ = _run("bandit_text", tmp_path, model_cache, f"train.run_name={name}", "train.seed=3")
        runs.append([_deterministic(r) for r in _metrics(run)])
    assert runs[0] == runs[1]
    # Training seeds share the built-in base (and so its warm start): its seed is model.builtin_seed.
    assert not list(Path(model_cache).glob("*-seed3")) and list(Path(model_cache).glob("tiny-text-*-seed0"))


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["algo.kl_coef=0.05", "algo.filter_mode=std", "algo.clip_high=0.28", "algo.token_selection=answer"],
         {"actor/kl_loss", "actor/kl_to_ref"}),
        (["algo.kl_coef=0.05", "algo.kl_in_reward=true", "train.critic_warmup=1", "algo.loss_agg=seq-mean-token-mean",
          "train.ppo_epochs=2"], {"actor/kl_to_ref"}),
    ],
)
def test_optional_algorithm_pieces_run(extra, expected, tmp_path, model_cache, distributed):
    run, _ = _run("sokoban_text", tmp_path, model_cache, *extra)
    first, last = _metrics(run)
    assert expected <= set(last)
    if "algo.filter_mode=std" in extra:
        assert last["rollout/filter_kept_groups"] == 1 and last["rollout/filter_total_groups"] == 2
    if "train.critic_warmup=1" in extra:
        assert "actor/pg_loss" not in first and "critic/vf_loss" in first and "actor/pg_loss" in last
        assert "actor/kl_loss" not in last  # KL went into the reward, not the loss


def test_cpu_threads_share_the_cores_unless_omp_num_threads_says_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert [cpu_threads(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two runs side by side on a laptop
    assert cpu_threads(1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two' is not a positive whole number"):
        cpu_threads(1)


def test_deepspeed_config_batches_and_optimizer():
    from vagen.train import deepspeed_config

    cfg = load_config("sokoban_visual", ["rollout.env_groups=8", "train.mini_batch_size=32", "train.micro_batch_size=4", "train.actor_lr=2e-5",
                                         "train.grad_clip=0.5", "train.deepspeed_config=deepspeed/zero2_bf16.json"])
    ds = deepspeed_config(cfg, 2e-5, world_size=2, on_gpu=True)
    # 32 per mini-batch over 2 ranks: 16 per rank, micro-batches of 4, so 4 accumulation steps
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == (4, 4, 32)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] and ds["zero_optimization"]["stage"] == 2
    # torch's AdamW, fused on CUDA: no nvcc build of DeepSpeed's FusedAdam at start
    assert ds["optimizer"]["params"] == {"betas": [0.9, 0.999], "eps": 1e-8, "lr": 2e-5, "weight_decay": cfg.train.weight_decay,
                                         "torch_adam": True, "fused": True}
    assert deepspeed_config(cfg, 2e-5, world_size=1, on_gpu=False)["optimizer"]["params"]["fused"] is False


def test_cosine_learning_rate_decay_reaches_zero_at_its_step(distributed):
    import torch

    from vagen.train import make_engine

    cfg = load_config("sokoban_visual", ["train.mini_batch_size=1", "train.micro_batch_size=1", "train.warmup_steps=2",
                                         "train.lr_decay_steps=10"])
    engine = make_engine(torch.nn.Linear(2, 1), cfg, 1e-2, distributed)
    seen = []
    for _ in range(12):
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
        seen.append(engine.get_lr()[0])
    # a linear warm-up over steps 0-1 (0, 5e-3), then a cosine from 1e-2 that is half way (5e-3) at step 5 and
    # reaches 0 at step 9, held there
    assert seen[0] == 0.0 and seen[1] == pytest.approx(5e-3) and seen[5] == pytest.approx(5e-3)
    assert seen[9:] == [0.0, 0.0, 0.0] and max(seen) < 1e-2
    assert load_config("sokoban_visual").train.lr_decay_steps == 0  # constant unless asked


@pytest.mark.parametrize("decay", [0, 1000])
def test_learning_rate_warm_up_is_linear(distributed, decay):
    """A 100-step warm-up is at 10% of the peak after 10 steps (DeepSpeed's default, logarithmic, is at 50%)."""
    import torch

    from vagen.train import make_engine

    cfg = load_config("sokoban_visual", ["train.mini_batch_size=1", "train.micro_batch_size=1",
                                         "train.warmup_steps=100", f"train.lr_decay_steps={decay}"])
    engine = make_engine(torch.nn.Linear(2, 1), cfg, 1e-2, distributed)
    seen = []
    for _ in range(101):
        engine.backward(engine(torch.ones(1, 2)).sum())
        engine.step()
        seen.append(engine.get_lr()[0])  # seen[k]: the rate of step k
    assert seen[0] == 0.0
    assert seen[10] == pytest.approx(1e-3, rel=1e-6)
    assert seen[50] == pytest.approx(5e-3, rel=1e-6)
    assert seen[100] == pytest.approx(1e-2, rel=1e-3)


def test_zero3_trains_and_saves_one_model_on_a_cpu(tmp_path, model_cache, distributed):
    """ZeRO-3 partitions parameters and gathers them per module call; the shared-prefix forward calls
    the engine twice per micro-batch, which must still give gradients and a whole saved model."""
    import math

    run, _ = _run("frozenlake_visual", tmp_path, model_cache, "train.deepspeed_config=deepspeed/zero3_bf16.json",
                  "model.dtype=bfloat16")
    last = _metrics(run)[-1]
    assert math.isfinite(last["actor/pg_loss"]) and math.isfinite(last["critic/vf_loss"]) and last["actor/grad_norm"] > 0
    assert math.isfinite(last["rollout/frame_gap"])  # the frame check's forward under ZeRO-3
    assert (run / "checkpoints" / "step_2" / "actor" / "model.safetensors").exists()


def test_a_reused_run_name_without_resume_is_refused_and_the_first_run_is_left_as_it_was(tmp_path, model_cache,
                                                                                         distributed, capsys):
    run, _ = _run("sokoban_text", tmp_path, model_cache, "train.run_name=taken", "train.iterations=1")
    kept = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "config.yaml")}
    latest = (run / "checkpoints" / "latest").read_text()
    entries = sorted(path.name for path in run.iterdir())  # tensorboard's events file besides the three named
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:  # a refusal before any model is built, not a traceback
        _run("sokoban_text", tmp_path, model_cache, "train.run_name=taken", "train.iterations=1", "train.seed=1")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"refused: train.run_name='taken': {run} holds a run already (metrics.jsonl, config.yaml, "
                          f"checkpoints, {len(entries) - 3} other entries), and train.resume is not set")
    assert "give a new train.run_name for a new run, or train.resume=auto to continue that one" in err
    assert {name: (run / name).read_bytes() for name in kept} == kept
    assert (run / "checkpoints" / "latest").read_text() == latest
    assert sorted(path.name for path in run.iterdir()) == entries
    (tmp_path / "made_by_hand").mkdir()  # an empty directory of that name is taken
    from vagen.run import reused_run_name

    assert reused_run_name(tmp_path / "made_by_hand", load_config("sokoban_text", ["train.run_name=made_by_hand"])) is None
    assert reused_run_name(run, load_config("sokoban_text", ["train.run_name=taken", "train.resume=auto"])) is None


def test_the_last_iteration_saves_unless_train_save_last_is_false(tmp_path, monkeypatch):
    """A smoke run (scripts/gpu_smoke.sh) keeps no weights: train.save_last=false leaves only save_every's."""
    import vagen.run
    from vagen.distributed import Dist

    saved = []
    monkeypatch.setattr(vagen.run, "save_checkpoint", lambda path, it, *args, **kwargs: saved.append(path.name))
    run = vagen.run.RunDir(tmp_path, Dist(0, 1, 0, None))

    class Monitor:
        def state_dict(self):
            return {}

    for save_last, every, expected in ((True, 0, ["step_3"]), (False, 0, []), (False, 2, ["step_2"]),
                                       (True, 2, ["step_2", "step_3"])):
        saved.clear()
        cfg = load_config("sokoban_text", ["train.iterations=3", f"train.save_last={str(save_last).lower()}",
                                           f"train.save_every={every}"])
        for it in range(3):
            run.maybe_save(it, cfg, None, None, None, Monitor())
        assert saved == expected, (save_last, every)
