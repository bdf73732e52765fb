"""Training-curve plots from run directories (metrics.jsonl)."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from vagen.plot import DEFAULT_METRICS, load_run, main, plot_runs, warning_targets


def write_run(run_dir, n_lines=10, offset=0.0, warning_at=4):
    run_dir.mkdir(parents=True)
    lines = []
    for it in range(n_lines):
        record = {
            "iteration": it,
            "time": 3.0 * it,
            "rollout/success": min(1.0, 0.1 * it + offset),
            "rollout/reward_mean": -1.0 + 0.5 * it + offset,
            "rollout/in_group_reward_std": 1.0 / (1 + it),
            "actor/entropy": 2.0 - 0.1 * it,
            "actor/grad_norm": 0.5 + (3.0 if it == warning_at else 0.0),
            "rollout/response_length": 120.0 - 4 * it,
            "warnings": [],
        }
        if it % 3 == 0:
            record["eval/success"] = 0.05 * it
        if it == 2:
            del record["actor/grad_norm"], record["rollout/response_length"]
        if it == 3:
            record["actor/entropy"] = float("nan")
        if it == warning_at:
            record["warnings"] = ["grad_norm spike: 3.5 > 10x running median"]
        lines.append(json.dumps(record))
    text = "\n".join(lines) + '\n{"iteration": 10, "time": 31.0, "rollout/succ'  # run still writing
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "config.yaml").write_text("env: sokoban\n")
    return run_dir


def test_load_run_skips_missing_nan_and_truncated_line(tmp_path, capsys):
    run = load_run(write_run(tmp_path / "run_a"))
    assert run.name == "run_a"
    xs, ys = run.series["actor/grad_norm"]
    assert 2.0 not in xs and len(xs) == 9
    assert ys[xs.index(4.0)] == pytest.approx(3.5)
    xs, ys = run.series["actor/entropy"]
    assert 3.0 not in xs and all(math.isfinite(y) for y in ys)
    assert run.series["eval/success"][0] == [0.0, 3.0, 6.0, 9.0]
    assert run.series["rollout/success"][0] == [float(i) for i in range(10)]  # line 11 was cut short
    assert "time" not in run.series
    assert run.warnings == [(4.0, "grad_norm spike: 3.5 > 10x running median")]
    assert capsys.readouterr().err == ""  # a truncated last line is expected, not reported


def test_warning_targets_route_to_named_metric_or_all():
    metrics = list(DEFAULT_METRICS)
    assert warning_targets("grad_norm spike", metrics) == ["actor/grad_norm"]
    assert warning_targets("entropy collapsed below 0.05", metrics) == ["actor/entropy"]
    assert warning_targets("in_group reward std ~0 for 3 iterations", metrics) == [
        "rollout/in_group_reward_std"
    ]
    assert warning_targets("responses identical across the group", metrics) == metrics


def assert_real_png(path):
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("L"), dtype=np.float64)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.var() > 10.0


def test_plot_one_run_writes_png_per_metric_and_summary(tmp_path):
    run_dir = write_run(tmp_path / "run_a")
    paths = plot_runs([run_dir])
    expected = [run_dir / "plots" / (m.replace("/", "_") + ".png") for m in DEFAULT_METRICS]
    assert paths == [*expected, run_dir / "plots" / "summary.png"]
    for path in paths:
        assert_real_png(path)
    with Image.open(paths[-1]) as summary, Image.open(paths[0]) as single:
        assert summary.width > single.width  # a 3-column grid


def test_plot_two_runs_overlaid_with_metric_selection(tmp_path):
    run_a = write_run(tmp_path / "a" / "latest")
    run_b = write_run(tmp_path / "b" / "latest", offset=0.3, warning_at=7)
    out = tmp_path / "figures"
    paths = plot_runs([run_a, run_b], out, metrics=["success", "actor/grad_norm"])
    assert [p.name for p in paths] == ["rollout_success.png", "actor_grad_norm.png", "summary.png"]
    for path in paths:
        assert_real_png(path)
    one = tmp_path / "one"
    plot_runs([run_a], one, metrics=["rollout/success"])
    # The second run's curve adds pixels: the overlaid figure differs from the single-run one.
    with Image.open(paths[0]) as both, Image.open(one / "rollout_success.png") as single:
        assert both.size == single.size
        assert np.abs(np.asarray(both, dtype=int) - np.asarray(single, dtype=int)).sum() > 0


def test_unknown_metric_names_choices(tmp_path):
    with pytest.raises(ValueError, match="'kl' is not in these runs; choices: .*actor/entropy"):
        plot_runs([write_run(tmp_path / "r")], metrics=["kl"])


def test_missing_metrics_file_error_says_what_to_do(tmp_path):
    run_dir = tmp_path / "empty_run"
    run_dir.mkdir()
    with pytest.raises(FileNotFoundError) as error:
        plot_runs([run_dir])
    message = str(error.value)
    assert f"expected {run_dir / 'metrics.jsonl'}" in message
    assert "run training first" in message


def test_cli_prints_paths_and_reports_missing_runs(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run_a")
    assert main([str(run_dir), "--out", str(tmp_path / "out"), "--metrics", "rollout/success"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "out" / "rollout_success.png"), str(tmp_path / "out" / "summary.png")]
    with pytest.raises(SystemExit) as exit_info:
        main([str(run_dir), str(tmp_path / "nope")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "nope/metrics.jsonl" in err and "does not exist" in err and "run training first" in err
