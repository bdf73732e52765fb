"""`python -m vagen.env_server --config sokoban_visual --port P` serves, and `python vagen/train.py --config
sokoban_visual env.backend=http env.urls=[http://127.0.0.1:P]` trains an iteration with the metrics of the same run
with worker processes (timing aside)."""

import json

import httpx
import pytest
from http_servers import free_port, server_process

from vagen.train import main

TINY = ["train.iterations=1", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=12",
        "rollout.max_turns=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false"]


def _metrics(run_dir):
    (run,) = [p for p in run_dir.iterdir() if p.is_dir()]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k != "time"} for r in records]


@pytest.mark.slow  # a server and two training runs: about a minute on the 2-core machine beside other jobs
def test_sokoban_trains_an_iteration_over_http_as_with_worker_processes(tmp_path, model_cache, distributed):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    metrics = {}
    with server_process("sokoban_visual", port, "--workers", "2"):
        for backend, extra in (("process", ["env.workers=2"]), ("http", [f"env.urls=[{url}]"])):
            run_dir = tmp_path / backend
            overrides = [*TINY, *extra, f"env.backend={backend}", f"train.run_dir={run_dir}",
                         f"model.builtin_cache={model_cache}"]
            assert main(["--config", "sokoban_visual", *overrides]) == 0
            metrics[backend] = _metrics(run_dir)
        assert httpx.get(f"{url}/sessions").json()["num_sessions"] == 0  # every session closed at the end
    assert [r["iteration"] for r in metrics["http"]] == [0]
    assert metrics["http"] == metrics["process"]
    assert metrics["http"][0]["rollout/env_errors"] == 0 and metrics["http"][0]["rollout/turns"] > 1
