"""benchmarks/bench_staleness.py's arithmetic and table (what scripts/gpu_check.sh prints from a GPU's runs), on
hand-made records of the kind its instrumented training runs write."""

import json

import pytest
from benchmark_scripts import load

bench = load("bench_staleness")


def _iteration(passes, sequences, step_s, rollout_s, iteration_s, turns, samples, carried=0.0, staleness=0.0,
               requests=None):
    return {"passes": passes, "sequences": sequences, "tokens": 10 * sequences, "step_s": step_s, "rollout_s": rollout_s,
            "requests": turns if requests is None else requests,
            "timing/iteration": iteration_s, "trained_turns": turns, "samples": samples,
            "rollout/carried_episodes": carried, "rollout/staleness_max": staleness, "update/optimizer_steps": 1.0}


# k = 0: four iterations, the middle two steady, each playing the turns it trains; k = 1 plays turns in fewer,
# fuller passes, and its steady rollouts played 300 turns while its updates trained 200 (the rest after the window)
SYNCHRONOUS = [_iteration(999, 9999, 50.0, 60.0, 90.0, 100, 32),
               _iteration(200, 4000, 6.0, 8.0, 20.0, 150, 32),
               _iteration(100, 2000, 3.0, 4.0, 12.0, 50, 32),
               _iteration(999, 9999, 50.0, 60.0, 90.0, 100, 32)]
CARRIED = [_iteration(999, 9999, 50.0, 60.0, 90.0, 100, 32, 10.0),
           _iteration(120, 4200, 5.0, 6.0, 18.0, 160, 32, 20.0, 1.0, requests=250),
           _iteration(30, 1200, 1.0, 2.0, 10.0, 40, 32, 10.0, 1.0, requests=50),
           _iteration(999, 9999, 50.0, 60.0, 90.0, 100, 32, 0.0, 1.0)]


def test_a_run_is_measured_over_its_steady_iterations():
    assert bench.summarise(SYNCHRONOUS) == {
        "iterations": 2, "passes_per_turn": 300 / 200, "sequences_per_pass": 6000 / 300, "tokens_per_turn": 60000 / 200,
        "idle_rollout": 1 - 9.0 / 12.0, "idle_iteration": 1 - 9.0 / 32.0, "rollout_s_per_sample": 12.0 / 64, "other_s_per_sample": 20.0 / 64,
        "s_per_sample": 32.0 / 64, "carried": 0.0, "samples_per_update": 32.0, "optimizer_steps": 1.0, "staleness_max": 0.0,
        "samples": 64}
    carried = bench.summarise(CARRIED)
    assert (carried["passes_per_turn"], carried["sequences_per_pass"]) == (150 / 300, 5400 / 150)
    # 8 s of rollout for 300 turns played, 200 of them trained here; 20 s of updates; 64 samples
    assert carried["rollout_s_per_sample"] == pytest.approx(8.0 * 200 / 300 / 64)
    assert carried["s_per_sample"] == pytest.approx((8.0 * 200 / 300 + 20.0) / 64)
    assert carried["idle_iteration"] == pytest.approx(1 - 6.0 * 200 / 300 / (8.0 * 200 / 300 + 20.0))
    assert (carried["carried"], carried["staleness_max"], carried["samples"]) == (15.0, 1.0, 64)
    # two iterations or fewer: all of them
    assert bench.summarise(SYNCHRONOUS[1:3]) == {**bench.summarise(SYNCHRONOUS), "iterations": 2}


def test_ratios_to_k0_pair_runs_of_the_same_seed_with_a_t_interval_over_seeds():
    runs = {("sokoban_visual", 0, 0): bench.summarise(SYNCHRONOUS), ("sokoban_visual", 1, 0): bench.summarise(CARRIED),
            ("sokoban_visual", 0, 1): bench.summarise(SYNCHRONOUS), ("sokoban_visual", 1, 1): bench.summarise(SYNCHRONOUS)}
    k0, k1 = bench.compare(runs)
    assert (k0["k"], k1["k"], k1["seeds"]) == (0, 1, [0, 1])
    assert "passes_per_turn_ratio" not in k0
    mean, half = k1["passes_per_turn_ratio"]  # seed 0: 0.5 / 1.5 = 1/3; seed 1: 1.0
    assert mean == pytest.approx(2 / 3) and half == pytest.approx(12.706 / 3)
    assert k1["passes_per_turn"] == pytest.approx((0.5 + 1.5) / 2)
    lines = bench.table([k0, k1])
    assert lines[0].startswith("| env | k | seeds | passes / trained turn | sequences / pass |")
    assert lines[2] == "| sokoban_visual | 0 | 2 | 1.50 | 20.0 | 300 | 25.0% | 71.9% | 0.188 | 0.312 | 0.500 | 32.0 | 0.0 | 0 |"
    assert lines[3].startswith("| sokoban_visual | 1 | 2 | 1.00 (0.67x ± 4.24) | 28.0 (1.40x ± 5.08) |")


def test_the_table_is_printed_from_a_saved_json_without_running_anything(tmp_path, capsys):
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"runs": [{"env": "navigation_visual", "k": 0, "seed": 0, "iterations": SYNCHRONOUS},
                                          {"env": "navigation_visual", "k": 1, "seed": 0, "iterations": CARRIED}]}))
    assert bench.main(["--table", str(saved)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| navigation_visual | 0 | 1 | 1.50 | 20.0 | 300 | 25.0% | 71.9% | 0.188 | 0.312 | 0.500 | 32.0 | 0.0 | 0 |"
    assert out[3] == ("| navigation_visual | 1 | 1 | 0.50 (0.33x) | 36.0 (1.80x) | 180 (0.60x) | 25.0% | 84.2% | 0.083 (0.44x) | "
                      "0.312 (1.00x) | 0.396 (0.79x) | 32.0 | 15.0 | 1 |")


def test_a_comparison_without_k0_is_refused():
    with pytest.raises(SystemExit):
        bench.main(["--ks", "1", "2"])
