import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmark_scripts import load


def _learning():
    return load("learning")


def test_a_failed_run_keeps_the_curves_of_the_runs_that_finished(tmp_path, monkeypatch):
    learning = _learning()

    class Child:  # a child process: PPO exits with 1 before writing its part, the others finish
        def __init__(self, command, env):
            method, part = command[command.index("--methods") + 1], Path(command[command.index("--part") + 1])
            self.returncode = 1 if method == "PPO" else 0
            if self.returncode == 0:
                part.write_text(json.dumps([{"iteration": 20, "method": method}]))

        def poll(self):
            return self.returncode

    monkeypatch.setattr(subprocess, "Popen", Child)
    args = SimpleNamespace(methods=["TRICO", "PPO", "GRPO"], seeds=1, jobs=2, minutes=1.0, eval_n=8, eval_every=1,
                           sft_steps_per_eval=2, max_iterations=None, threads=1, warm_start=None, overrides=[], extend=False)
    curves, failed = learning.run_in_children("frozenlake", args, tmp_path)
    assert failed == ["PPO seed 0 (exit 1)"]
    assert curves == {"TRICO": {0: [{"iteration": 20, "method": "TRICO"}]},
                      "GRPO": {0: [{"iteration": 20, "method": "GRPO"}]}}


def test_extend_continues_a_run_from_its_last_checkpoint_and_keeps_its_curve(tmp_path, monkeypatch):
    learning = _learning()
    calls = []

    def train(argv):  # each chunk of 20 iterations costs one CPU-minute
        calls.append(argv)
        return 0, 60.0

    monkeypatch.setattr(learning, "train_chunk", train)
    monkeypatch.setattr(learning, "evaluate", lambda checkpoint, cfg, seeds: {
        "greedy": {"success": 0.5, "at": str(checkpoint)}, "sampled": {"success": 0.25}})
    run = "frozenlake_visual-TRICO-seed0"
    (tmp_path / "runs" / run / "checkpoints" / "step_40").mkdir(parents=True)
    previous = [{"iteration": 20, "cpu_minutes": 1.0}, {"iteration": 40, "cpu_minutes": 2.0}]
    args = SimpleNamespace(minutes=3.5, eval_every=20, max_iterations=None, overrides=[])
    curve = learning.run_rl("TRICO", [], "WS", "frozenlake_visual", 0, args, [1, 2], tmp_path, None, previous)

    assert curve[:2] == previous
    assert [(p["iteration"], p["cpu_minutes"]) for p in curve[2:]] == [(60, 3.0), (80, 4.0)]
    assert curve[-1]["greedy"]["at"] == str(tmp_path / "runs" / run / "checkpoints" / "step_80" / "actor")
    assert [[a for a in argv if a.startswith(("train.iterations", "train.resume"))] for argv in calls] == [
        ["train.iterations=60", "train.resume=auto"], ["train.iterations=80", "train.resume=auto"]]


def test_max_iterations_stops_a_run_with_cpu_budget_left(tmp_path, monkeypatch):
    learning = _learning()
    calls = []

    def train(argv):  # each chunk costs one CPU-minute of a 10-minute budget
        calls.append([a for a in argv if a.startswith("train.iterations")])
        return 0, 60.0

    monkeypatch.setattr(learning, "train_chunk", train)
    monkeypatch.setattr(learning, "evaluate", lambda checkpoint, cfg, seeds: {
        "greedy": {"success": 0.5}, "sampled": {"success": 0.25}})
    args = SimpleNamespace(minutes=10.0, eval_every=25, max_iterations=50, overrides=[])
    curve = learning.run_rl("GRPO", [], "WS", "frozenlake_text", 0, args, [1, 2], tmp_path, None)

    assert [(p["iteration"], p["cpu_minutes"]) for p in curve] == [(25, 1.0), (50, 2.0)]
    assert calls == [["train.iterations=25"], ["train.iterations=50"]]


def test_extend_refuses_a_run_without_the_checkpoint_it_would_continue(tmp_path):
    learning = _learning()
    args = SimpleNamespace(minutes=3.0, eval_every=20, max_iterations=None, overrides=[])
    with pytest.raises(SystemExit, match="evaluated at iteration 40, but .* has no step_40"):
        learning.run_rl("TRICO", [], "WS", "frozenlake_visual", 0, args, [1], tmp_path, None,
                        [{"iteration": 40, "cpu_minutes": 2.0}])


def test_extend_refuses_runs_the_earlier_results_do_not_hold(tmp_path):
    learning = _learning()
    args = learning.parse_args(["--out", str(tmp_path), "--extend", "--envs", "sokoban", "--methods", "TRICO"])
    with pytest.raises(SystemExit, match="no .*results.json; run the command without --extend first"):
        learning.earlier_results(args, tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"sokoban": {"methods": {"TRICO": {"0": []}}}}))
    with pytest.raises(SystemExit, match=r"no sokoban curve for TRICO seed 1, TRICO seed 2; it holds \{'TRICO': \['0'\]\}"):
        learning.earlier_results(args, tmp_path)
    args.methods = ["TRICO", "more-SFT"]
    with pytest.raises(SystemExit, match="the more-SFT control keeps none"):
        learning.earlier_results(args, tmp_path)
    args.methods, args.seeds = ["TRICO"], 1
    assert learning.earlier_results(args, tmp_path)["sokoban"]["methods"]["TRICO"] == {"0": []}


def test_compare_learning_reads_several_methods_of_one_folder(tmp_path, capsys):
    compare = load("compare_learning")

    def point(iteration, cpu, successes):
        row = {"success": successes / 8, "successes": successes, "n": 8}
        return {"iteration": iteration, "cpu_minutes": cpu, "greedy": row, "sampled": row}

    results = {"frozenlake": {"warm_start": {"greedy": {"success": 0.5}},
                              "methods": {"GiGPO": {"0": [point(12, 2.0, 5), point(24, 4.5, 6)]},
                                          "GRPO": {"0": [point(12, 1.5, 4)]}}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    run = tmp_path / "runs" / "frozenlake_visual-GiGPO-seed0"
    run.mkdir(parents=True)
    rows = [{"rollout/step_group_share": share, "rollout/step_group_size": 2.0, "rollout/success": 0.5}
            for share in (0.5, 0.5, 0.5, 1.0, 1.0, 1.0)]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    assert compare.main([f"GiGPO={tmp_path}@GiGPO", f"GRPO={tmp_path}@GRPO", "--minutes", "4"]) == 0
    out = capsys.readouterr().out
    assert "| GiGPO | 0 | 24, 4.5 | 0.750 (" in out and "| 12, 2.0, 0.625 |" in out
    assert "| GRPO | 0 | 12, 1.5 | 0.500 (" in out
    assert "| GiGPO | 0 | 0.750 (0.500 → 1.000) | 2.00 (2.00 → 2.00) |" in out  # step groups: GiGPO only
    assert "| GRPO | 0 | 0." not in out.split("turns in a step group")[1]
    with pytest.raises(SystemExit, match="no 'PPO' runs for frozenlake; it has GiGPO, GRPO"):
        compare.main([f"PPO={tmp_path}@PPO"])


def test_targets_are_checked_only_for_runs_of_the_budget_they_were_set_for():
    learning = _learning()

    def curve(cpu, successes):  # 8 levels: the teacher solves 4, so +0.15 needs 0.65 and the floor 0.90
        row = {"success": successes / 8, "successes": successes, "n": 8}
        return [{"iteration": 10, "cpu_minutes": cpu, "greedy": row, "sampled": row}]

    def results(cpu):
        return {"frozenlake": {"baselines": {"teacher": {"success": 0.5}},
                               "methods": {"TRICO": {"0": curve(cpu, 8)}, "GRPO": {"0": curve(cpu + 1, 6)}}}}

    assert learning.check_targets(results(6.0)) == [
        "targets not checked: they are set for 30 CPU-minutes of training and these runs trained for 6.0-7.0; "
        "compare methods with benchmarks/compare_learning.py"]
    lines = learning.check_targets(results(30.0))
    assert "frozenlake TRICO: final 1.000 vs teacher 0.500 + 0.15 and >= 0.90: PASS" in lines
    assert "frozenlake GRPO: final 0.750 vs teacher 0.500 + 0.15 and >= 0.90: FAIL" in lines
    # frozenlake_text (the text agent, for rollout.backend=vllm) has no targets: none are checked for it
    assert learning.check_targets({"frozenlake_text": results(30.0)["frozenlake"]}) == []


def test_the_seed_plot_draws_every_arm_even_past_its_palette(tmp_path):
    compare = load("compare_learning")
    import matplotlib.pyplot as plt

    curves = {f"arm {i}": [[(0.0, 0.5), (2.0, 0.05 * i)], [(0.0, 0.5), (2.5, 0.04 * i)]]
              for i in range(len(compare.COLORS) + 2)}
    compare.plot_seed_curves(curves, tmp_path / "plot.png", "title", warm_start=0.5, budget=2.0)
    ax = plt.gcf().axes[0]
    assert [line.get_label() for line in ax.lines if not line.get_label().startswith("_")][:len(curves)] == list(curves)
    assert len(ax.lines) == 2 * len(curves) + 2  # every seed's curve, the warm start and the budget
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_staleness_intervals_on_published_cases():
    staleness = load("staleness_learning")
    # Newcombe (1998), method 10: 56/70 - 48/80 = 0.200, 95% interval 0.0524 to 0.3339
    assert staleness.newcombe(56, 70, 48, 80) == pytest.approx((0.2, 0.0524, 0.3339), abs=5e-5)
    # mean 2, sd 1 over 3 values: 2 +- 4.303 / sqrt(3)
    assert staleness.t_interval([1.0, 2.0, 3.0]) == pytest.approx((2.0, -0.4843, 4.4843), abs=5e-5)
    with pytest.raises(ValueError, match="over 1 values: needs 2 to 11"):
        staleness.t_interval([1.0])


def test_staleness_learning_pairs_seeds_and_counts_each_trained_iteration_once(tmp_path, capsys):
    staleness = load("staleness_learning")

    def point(iteration, cpu, successes):
        row = {"success": successes / 8, "successes": successes, "n": 8}
        return {"iteration": iteration, "cpu_minutes": cpu, "greedy": row, "sampled": row}

    def folder(name, k, curves, episodes):
        out = tmp_path / name
        warm = {"greedy": {"success": 0.25, "successes": 2, "n": 8}, "sampled": {"success": 0.25}}
        (out / "runs").mkdir(parents=True)
        (out / "results.json").write_text(json.dumps({"frozenlake_text": {"warm_start": warm,
                                                                            "methods": {"GRPO": curves}}}))
        for seed, curve in curves.items():
            rows = [{"iteration": i, "rollout/filter_kept_trajectories": episodes, "timing/iteration": 2.0,
                     "rollout/staleness_mean": 0.1 * k, "rollout/staleness_max": float(k),
                     "rollout/carried_episodes": float(k), "rollout/filter_kept_groups": episodes / 8,
                     "rollout/cross_version_episodes": 0.05 * k, "update/optimizer_steps": 2.0}
                    for i in range(curve[-1]["iteration"])]
            rows.insert(1, dict(rows[1], **{"timing/iteration": 99.0}))  # a chunk's first try, logged again
            run = out / "runs" / f"frozenlake_text-GRPO-seed{seed}"
            run.mkdir()
            (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return out

    k0 = folder("k0", 0, {"0": [point(4, 1.0, 4)], "1": [point(4, 1.0, 5)]}, 64)
    k1 = folder("k1", 1, {"0": [point(2, 1.0, 6)], "1": [point(2, 2.0, 5)]}, 128)
    assert staleness.main([str(k0), str(k1), "--minutes", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "| k=1 | 1 | 0.250 / 0.250 | 2, 2.0 | 0.625 (" in out
    # seed 0: 6/8 - 4/8, seed 1: 5/8 - 5/8; within 1.5 CPU-minutes seed 1 of k=1 has no evaluation
    assert "| last evaluation (CPU-min 1.0 / 1.5) | +0.250 / +0.000 | +0.125 (" in out
    assert "| evaluation 1 (CPU-min 1.0 / 1.5) | +0.250 / +0.000 |" in out
    assert "| last within 1.5 CPU-min | – (a run has no evaluation within the budget) | | |" in out
    # 4 iterations x 64 episodes in 60 CPU-seconds; 2 x 128 in 60 and in 120; iterations of 2 wall-seconds each
    assert "| k=0 | 0 | 256 | 1.00 | 4.27 | 32.00 | 15.00 |" in out
    assert "| k=1 | 1 | 256 | 2.00 | 2.13 | 64.00 | 60.00 |" in out
    assert "episodes per CPU-s, k=1 / k=0 by seed: 1.00 / 0.50; mean 0.75" in out
    assert "| k=1 | 0 | 2 | 0.100 | 1 | 1.00 (2) | 0.0500 | 16.00 | 2.00 |" in out


def test_multitask_arms_differ_only_in_their_tasks_and_keep_the_episodes_per_iteration():
    from vagen.config import load_config

    multitask = load("multitask_learning")
    cfg = load_config("multitask_visual")  # 2 + 1 + 1 level groups
    assert multitask.arm_overrides("mixed", cfg) == []
    assert multitask.arm_overrides("frozenlake_visual", cfg) == [
        "rollout.tasks=[{config: frozenlake_visual, groups: 4}]", "sft.task_shares=[1]"]
    single = load_config("multitask_visual", multitask.arm_overrides("navigation_visual", cfg))
    assert [(t.name, t.groups, t.rollout["max_turns"]) for t in single.rollout.tasks] == [("navigation_visual", 4, 5)]
    with pytest.raises(SystemExit, match="arm 'frozenlake': expected mixed or one of the tasks of multitask_visual: "
                                         "sokoban_visual, frozenlake_visual, navigation_visual"):
        multitask.arm_overrides("frozenlake", cfg)


def test_multitask_tables_pair_seeds_per_task(capsys):
    multitask = load("multitask_learning")

    def row(successes, n=8):
        return {"success": successes / n, "successes": successes, "n": n}

    def run(sokoban, frozenlake):
        return {"cpu_minutes": 2.0, "iterations": 10, "trained_episodes": {"sokoban_visual": 80},
                "eval": {"sokoban_visual": row(sokoban), "frozenlake_visual": row(frozenlake)}}

    results = {"warm_start": {"sokoban_visual": row(4), "frozenlake_visual": row(1)},
               "arms": {"mixed": {"0": run(5, 3), "1": run(4, 2)},
                        "sokoban_visual": {"0": run(6, 0), "1": run(6, 1)},
                        "frozenlake_visual": {"0": run(2, 3)}}}
    text = multitask.tables(results)
    assert "| warm start | – | – | 0 | 0 | 0.500 (" in text
    assert "| mixed | pooled | | | | 0.562 (" in text  # 9 of 16
    # sokoban: seed 0 5/8 - 6/8, seed 1 4/8 - 6/8; mean -0.1875 with a t interval over 2 seeds
    assert "| sokoban_visual | -0.125, -0.250 | -0.188 (-0.982 to +0.607) | -0.188 (" in text
    # frozenlake: only seed 0 ran in both arms
    assert "| frozenlake_visual | +0.000 | – | +0.000 (" in text


def test_multitask_training_success_counts_each_iteration_once(tmp_path):
    multitask = load("multitask_learning")
    rows = [{"iteration": i, "rollout/success": 0.0, "rollout/sokoban_visual/success": i / 10,
             "rollout/sokoban_visual/turns": 3.0} for i in range(8)]
    rows.insert(3, {**rows[6], "rollout/sokoban_visual/success": 9.0})  # iteration 6's first try, logged again after
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    # iterations 0-1 (window 2) and 6-7, the retried iteration 6 counted once with its last row
    assert multitask.training_success(tmp_path / "metrics.jsonl", window=2) == {
        "sokoban_visual": [pytest.approx(0.05), pytest.approx(0.65)]}


def test_a_training_chunk_runs_in_a_process_of_its_own_and_reports_its_exit_code_and_cpu(monkeypatch):
    learning = _learning()
    monkeypatch.setenv("MASTER_PORT", "1")  # the caller's group: the chunk must not try to join it
    code, seconds = learning.train_chunk(["--config", "no_such_config"])
    assert code == 2  # a config error, printed by the child
    assert seconds > 0  # the child's start and imports, counted as its CPU time
