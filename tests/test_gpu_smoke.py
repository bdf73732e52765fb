"""scripts/gpu_smoke.sh: its report read from a run's files (scripts/gpu_smoke.py), a refusal before anything
runs, and (slow) the whole script on the CPU with a tiny model."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "scripts" / "gpu_smoke.py")
gpu_smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_smoke)

ESTIMATE = """sokoban_visual+qwen2.5-vl-3b: every check train.py runs before loading the model passes for 2 rank(s)
  total      33.2 GiB per GPU of model states
  GPU total  40.3 GiB of 80 GiB: fits
"""


def _smoke_folder(out: Path, memory: bool = True, gaps=(1e-3, 2e-3, 1.5e-3)) -> Path:
    """A check's folder as gpu_smoke.sh leaves it: three iterations, the evaluation after the last."""
    (out / "run").mkdir(parents=True)
    (out / "estimate.txt").write_text(ESTIMATE)
    (out / "train.log").write_text("[vllm] engine of vLLM 0.11.0 built in 41.5 s on cuda:0\n"
                                   "[vllm] engine of vLLM 0.11.0 built in 43.25 s on cuda:1\n")
    records = []
    for it, (iteration, update, gap, carried) in enumerate(zip((60.0, 31.0, 29.0), (30.25, 20.0, 18.0), gaps,
                                                                (0, 3, 2))):
        records.append({"iteration": it, "time": 130.0 + 35 * it, "timing/generate": 20.0 - 5 * bool(it),
                        "timing/update": update, "timing/iteration": iteration, "rollout/success": 0.5,
                        "rollout/inference_logprob_gap": gap, "rollout/carried_episodes": carried})
    records[-1].update({"eval/episodes": 4, "eval/success": 0.25, "eval/format_ok": 1.0})
    (out / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if memory:  # MiB, as nvidia-smi writes them
        (out / "gpu_memory.csv").write_text("0, 1024, 81920, NVIDIA H100 80GB HBM3\n1, 2048, 81920, NVIDIA H100 80GB HBM3\n"
                                            "0, 36864, 81920, NVIDIA H100 80GB HBM3\n1, 35840, 81920, NVIDIA H100 80GB HBM3\n"
                                            "0, 20480, 81920, NVIDIA H100 80GB HBM3\n")
    return out


def test_report_times_the_first_iteration_apart_and_reads_the_evaluation_after_the_last_sync(tmp_path):
    lines, failed = gpu_smoke.report(_smoke_folder(tmp_path), "qwen2.5-vl-3b", "sokoban_visual", "/models/q", 2,
                                     150.25, "recipe", 3)
    assert failed == []
    assert lines == [
        "recipe: 3 iteration(s) of qwen2.5-vl-3b on sokoban_visual, /models/q, 2 rank(s)",
        "  first iteration       60.0 s",
        "  steady iteration      30.0 s (mean of iterations 2-3); per phase:",
        "    generate           15.0 s",
        "    update             19.0 s",
        "  sampler log-prob gap by iteration: 0.001, 0.002, 0.0015",
        "  evaluation after the last sync: 4 episodes, success 0.25, format_ok 1.00",
        "  start-up         70.0 s (from the run directory's creation to the first iteration: models, engines)",
        "  whole command   150.2 s (start-up, the iterations, the evaluation and any checkpoint)",
        "  vLLM engine start-up: 43.2 s (slowest of 2 rank(s))",
        "  GPU 0 (NVIDIA H100 80GB HBM3): peak 36.0 of 80.0 GiB (estimate 40.3 GiB, 89% of it)",
        "  GPU 1 (NVIDIA H100 80GB HBM3): peak 35.0 of 80.0 GiB (estimate 40.3 GiB, 87% of it)",
        "gpu_smoke qwen2.5-vl-3b [recipe] on sokoban_visual, 2 x NVIDIA H100 80GB HBM3, 2 rank(s): 30.0 s/iteration "
        "steady (generate 15.0, update 19.0), first 60.0 s; peak 36.0 GiB/GPU, estimate 40.3 GiB; "
        "vLLM start-up 43.2 s; start-up 70.0 s",
    ]


def test_report_fails_an_engine_that_samples_other_weights_after_a_sync_or_a_run_cut_short(tmp_path):
    out = _smoke_folder(tmp_path / "a", gaps=(1e-3, 0.4, 0.5))  # the trainer's weights never reached the engine
    lines, failed = gpu_smoke.report(out, "r", "e", "c", 1, None, "lora", 3)
    assert failed == ["the sampler's log-prob gap grew after a sync (iteration(s) [2, 3]: 0.4, 0.5 against 0.001 "
                      "before any): the engine samples other weights than the trainer's"]
    assert lines[-1].endswith("; FAILED: " + failed[0])
    assert gpu_smoke.main(["report", str(out), "--check", "lora", "--iterations", "3"]) == 1
    # at rollout.max_staleness=1 the gap measures staleness too: reported, not judged; carried episodes counted
    lines, failed = gpu_smoke.report(out, "r", "e", "c", 1, None, "stale", 3)
    assert failed == [] and "  episodes carried over a sync: 0, 3, 2" in lines
    out = _smoke_folder(tmp_path / "b")
    rows = (out / "run" / "metrics.jsonl").read_text().splitlines()
    (out / "run" / "metrics.jsonl").write_text("\n".join(rows[:2]) + "\n")  # stopped before the last iteration
    assert gpu_smoke.report(out, "r", "e", "c", 1, None, "recipe", 3)[1] == [
        "2 of 3 iterations in metrics.jsonl", "no evaluation after the last sync in metrics.jsonl"]


def test_report_without_a_gpu_or_an_engine_says_what_it_did_not_measure(tmp_path):
    out = _smoke_folder(tmp_path, memory=False)
    (out / "train.log").write_text("")
    (out / "estimate.txt").write_text("memory estimate: model.path=builtin:tiny-vl is a built-in model: nothing\n")
    lines, failed = gpu_smoke.report(out, "r", "e", "builtin:tiny-vl", 1, None)
    assert failed == []
    assert "  vLLM engine start-up: none logged (rollout.backend=hf, or no engine)" in lines
    assert "  GPU memory: not measured (no nvidia-smi); estimate none" in lines
    assert lines[-1] == ("gpu_smoke r [recipe] on e, no GPU, 1 rank(s): 30.0 s/iteration steady (generate 15.0, "
                         "update 19.0), first 60.0 s; estimate none; start-up 70.0 s")
    # the estimate's model-state total when no --gpu-gib was given
    assert gpu_smoke.estimate_gib("  total      33.2 GiB per GPU of model states\n") == 33.2


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_the_plan_runs_each_check_for_three_iterations_with_an_evaluation_after_the_last_sync_and_no_checkpoint(
        tmp_path, capsys):
    assert gpu_smoke.main(["plan", str(tmp_path), "--env", "sokoban_visual", "--recipe", "qwen2.5-vl-3b",
                           "--checkpoint", "/models/Qwen2.5-VL-3B-Instruct", "--ranks", "8", "--",
                           "train.seed=4"]) == 0
    assert _lines(tmp_path / "checks") == ["recipe", "lora", "stale"]
    common = ["train.iterations=3", "train.resume=null", "eval.every=3", "eval.before_training=false",
              "eval.episodes=16", "eval.videos=0", "log.progress=false"]
    for check, extra in (("recipe", []), ("lora", ["model.lora_rank=16"]),
                         ("stale", ["rollout.max_staleness=1", "algo.rollout_correction=tis"])):
        run = [*common, f"train.run_dir={tmp_path / check}", "train.run_name=run", "train.save_last=false", *extra,
               "train.seed=4"]
        assert _lines(tmp_path / check / "train_args") == [
            "--config", "sokoban_visual", "--config", "recipes/qwen2.5-vl-3b", "model.path=/models/Qwen2.5-VL-3B-Instruct",
            *run]
        assert _lines(tmp_path / check / "check_args") == [
            "sokoban_visual", "--config", "recipes/qwen2.5-vl-3b", "model.path=/models/Qwen2.5-VL-3B-Instruct", *run]
    assert capsys.readouterr().out.splitlines()[0] == ("[gpu_smoke] check recipe: 3 iterations, 16 evaluation episodes "
                                                       "after the last sync, no checkpoint (train.save_last=false)")


def test_the_plan_skips_what_a_recipe_runs_already_or_cannot_and_refuses_a_run_too_short(tmp_path, capsys):
    # a LoRA recipe goes through sleep level 1 itself; the hf backend carries no episode over a sync
    assert gpu_smoke.main(["plan", str(tmp_path), "--env", "sokoban_visual", "--recipe", "qwen2.5-vl-3b-lora",
                           "--checkpoint", "/models/Qwen2.5-VL-3B-Instruct", "--", "rollout.backend=hf"]) == 0
    assert _lines(tmp_path / "checks") == ["recipe"]
    said = capsys.readouterr().out
    assert ("[gpu_smoke] check lora: skipped: recipes/qwen2.5-vl-3b-lora trains LoRA adapters itself "
            "(model.lora_rank=") in said
    assert ("[gpu_smoke] check stale: skipped: rollout.max_staleness carries episodes in a vLLM engine, and this run "
            "has rollout.backend=hf") in said
    for args, why in ((["--iterations", "2"], "ITERATIONS=2: at least 3"),
                      (["--checks", "recipe warp"], "CHECKS='recipe warp': unknown warp; choose among recipe, lora, stale")):
        with pytest.raises(SystemExit, match=why):
            gpu_smoke.main(["plan", str(tmp_path), "--env", "sokoban_visual", "--recipe", "qwen2.5-vl-3b",
                            "--checkpoint", "/m", *args])


def test_a_kept_checkpoint_is_announced_with_its_path_and_size_before_anything_runs(tmp_path, capsys):
    """KEEP_CHECKPOINT=1: 3,754,622,976 parameters of Qwen2.5-VL-3B's published shape, actor and critic under
    ZeRO-2, 16 bytes each (docs/training.md: 120.1 GB); LoRA r=16 keeps its adapters' share only."""
    assert gpu_smoke.main(["plan", str(tmp_path), "--env", "sokoban_visual", "--recipe", "qwen2.5-vl-3b",
                           "--checkpoint", "/models/Qwen2.5-VL-3B-Instruct", "--checks", "recipe lora",
                           "--keep-checkpoint"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (f"[gpu_smoke] check recipe: keeps its checkpoint: {tmp_path / 'recipe' / 'run' / 'checkpoints' / 'step_3'}, "
                       f"about {2 * 3_754_622_976 * 16 / 1e9:.1f} GB")
    assert said[2].startswith(f"[gpu_smoke] check lora: keeps its checkpoint: {tmp_path / 'lora' / 'run' / 'checkpoints' / 'step_3'}, about ")
    assert "train.save_last=true" in _lines(tmp_path / "recipe" / "train_args")


def _smoke(tmp_path, *args, **env):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_smoke.sh"), *args], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1",
                                            **env})


def test_a_run_the_checks_refuse_stops_every_run_before_anything_trains(tmp_path):
    done = _smoke(tmp_path, "qwen2.5-vl-3b", "/models/nowhere", "rollout.backend=hf", RANKS="3")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "must be divisible by the 3 ranks" in done.stdout
    assert "the checks refused run recipe on 3 rank(s): nothing was run" in done.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "recipe").iterdir()) == ["check_args", "estimate.txt", "train_args"]
    assert not (tmp_path / "out" / "lora" / "estimate.txt").exists()
    # a config that does not load has no plan
    done = _smoke(tmp_path, "qwen2.5-vl-3b", "/models/nowhere", "train.keep_checkpoints=0", OUT=str(tmp_path / "bad"))
    assert done.returncode == 1 and "config error: train.keep_checkpoints=0 must be >= 1" in done.stderr, done.stderr
    assert "no plan: nothing was run" in done.stderr and not (tmp_path / "bad" / "checks").exists()


def test_a_dry_run_says_what_each_run_would_train_and_trains_nothing(tmp_path):
    done = _smoke(tmp_path, "qwen2.5-vl-3b", "/models/Qwen2.5-VL-3B-Instruct", "rollout.backend=hf", DRY_RUN="1",
                  RANKS="8", CHECKS="recipe lora")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    for check in ("recipe", "lora"):
        assert f"[gpu_smoke] {check} would run: vagen/train.py --config sokoban_visual --config recipes/qwen2.5-vl-3b " \
               f"model.path=/models/Qwen2.5-VL-3B-Instruct train.iterations=3" in done.stdout
        assert "every check train.py runs before loading the model passes for 8 rank(s)" in (out / check / "estimate.txt").read_text()
        assert not (out / check / "run").exists()
    assert done.stdout.splitlines()[-1] == f"[gpu_smoke] DRY_RUN=1: nothing was trained; files: {out}"


@pytest.mark.slow
def test_three_iterations_of_a_recipe_and_its_lora_run_on_the_cpu_with_a_tiny_model(tmp_path, model_cache):
    done = _smoke(tmp_path, "qwen2.5-vl-3b", "builtin:tiny-vl", "rollout.backend=hf", "rollout.env_groups=2",
                  "rollout.group_size=2", "rollout.max_turns=1", "rollout.max_new_tokens=8", "train.mini_batch_size=4",
                  "train.micro_batch_size=2", "model.gradient_checkpointing=false", f"model.builtin_cache={model_cache}",
                  "model.freeze_vision=false")  # LoRA over a random built-in: its vision tower trains too
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "out"
    summary = _lines(out / "summary.txt")
    assert len(summary) == 2  # recipe and lora; stale needs vLLM
    for check, line in zip(("recipe", "lora"), summary):
        records = [json.loads(row) for row in _lines(out / check / "run" / "metrics.jsonl")]
        assert [r["iteration"] for r in records] == [0, 1, 2] and "eval/success" in records[-1]
        steady = (records[1]["timing/iteration"] + records[2]["timing/iteration"]) / 2
        assert line.startswith(f"gpu_smoke qwen2.5-vl-3b [{check}] on sokoban_visual, no GPU, 1 rank(s): "
                               f"{steady:.1f} s/iteration steady ("), line
        assert not (out / check / "run" / "checkpoints").exists()  # no checkpoint was written
    assert done.stdout.splitlines()[-3:-1] == summary  # printed, then the folder's name
