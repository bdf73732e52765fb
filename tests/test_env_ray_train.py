"""`python vagen/train.py --config navigation_visual env.backend=ray env.workers=2` trains, with the metrics of
the same run with worker processes. Its own module: the run starts and stops its private Ray instance
(env.ray_address=local), which a module-wide connection of tests/test_env_ray.py would stand in for."""

import json

import pytest
import ray

from vagen.train import main

TINY = ["train.iterations=1", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
        "rollout.max_turns=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false",
        "env.workers=2"]


def _metrics(run_dir):
    (run,) = [p for p in run_dir.iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k != "time"} for r in records]


@pytest.mark.slow  # two training runs: 82 s on the 2-core machine beside other jobs (load 8), 165 s at load 20
def test_navigation_trains_an_iteration_with_ray_actors_as_with_worker_processes(tmp_path, model_cache, distributed):
    metrics = {}
    for backend in ("process", "ray"):
        run_dir = tmp_path / backend
        overrides = [*TINY, f"env.backend={backend}", f"train.run_dir={run_dir}", f"model.builtin_cache={model_cache}"]
        assert main(["--config", "navigation_visual", *overrides]) == 0
        metrics[backend] = _metrics(run_dir)
        assert not ray.is_initialized()  # the run stopped the instance it started
    assert [r["iteration"] for r in metrics["ray"]] == [0]
    assert metrics["ray"] == metrics["process"]
    assert metrics["ray"][0]["rollout/env_errors"] == 0 and metrics["ray"][0]["rollout/turns"] > 1


@pytest.mark.slow  # two training runs over two tasks
def test_several_tasks_train_with_ray_actors_of_one_private_instance(tmp_path, model_cache, distributed):
    """env.backend=ray over two text tasks: each task's environments in actors of their own, in one private Ray
    instance with room for every task's actors (the first task's pool alone would size it for its own), stopped at
    the end; the metrics, each task's included, those of worker processes."""
    tasks = tmp_path / "two_text_tasks.yaml"
    tasks.write_text("rollout:\n  tasks: [{config: sokoban_text, groups: 1}, {config: frozenlake_text, groups: 1}]\n")
    metrics = {}
    for backend in ("process", "ray"):
        run_dir = tmp_path / backend
        overrides = [*TINY, "model.path=assets:sokoban_text", "env.workers=1", f"env.backend={backend}",
                     f"train.run_dir={run_dir}"]
        assert main(["--config", str(tasks), *overrides]) == 0
        metrics[backend] = _metrics(run_dir)
        assert not ray.is_initialized()
    assert metrics["ray"] == metrics["process"]
    (record,) = metrics["ray"]
    for task in ("sokoban_text", "frozenlake_text"):
        assert record[f"rollout/{task}/env_errors"] == 0 and record[f"rollout/{task}/turns"] >= 1
    assert "actor/pg_loss" in record
