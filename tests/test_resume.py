"""A run killed at any moment and started again with `train.resume=auto` is the run that would have
happened: the same metrics and the same final parameters as one never interrupted."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from child_env import child_env
from safetensors.torch import load_file

WORKER = Path(__file__).parent / "kill_worker.py"
RUN = ["--config", "sokoban_text", "train.iterations=5", "train.save_every=1", "rollout.env_groups=2",
       "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.max_turns=2", "train.mini_batch_size=4",
       "train.micro_batch_size=2", "log.progress=false"]


def _train(tmp_path, model_cache, name, *extra, kill=()):
    env = child_env()
    cmd = [sys.executable, str(WORKER), *kill, *RUN, f"train.run_dir={tmp_path}", f"train.run_name={name}",
           f"model.builtin_cache={model_cache}", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _record(run: Path) -> list[dict]:
    """metrics.jsonl without what depends on the clock."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.startswith("timing/")}
            for line in lines]


def _weights(checkpoint: Path) -> dict:
    weights = {}
    for part in ("actor", "critic/backbone"):
        for shard in sorted((checkpoint / part).glob("*.safetensors")):
            weights.update({f"{part}/{k}": v for k, v in load_file(shard).items()})
    weights["critic/value_head"] = torch.load(checkpoint / "critic" / "value_head.pt")["weight"]
    return weights


def test_a_killed_run_resumes_exactly(tmp_path, model_cache):
    whole = _train(tmp_path, model_cache, "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected_record = _record(tmp_path / "whole")
    expected = _weights(tmp_path / "whole" / "checkpoints" / "step_5")
    assert [r["iteration"] for r in expected_record] == [0, 1, 2, 3, 4]
    for name, kill in (("in_update", ["--kill-in-update", "3"]), ("in_save", ["--kill-in-save", "4"])):
        run = tmp_path / name
        killed = _train(tmp_path, model_cache, name, kill=kill)
        assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL
        checkpoints = run / "checkpoints"
        assert (checkpoints / "latest").read_text() == "step_3"  # the last complete checkpoint
        assert not (checkpoints / "step_4").exists()
        assert (checkpoints / "step_4.tmp").exists() == (name == "in_save")  # half-written, never named
        done = len(_record(run))
        assert done == (3 if name == "in_update" else 4)
        resumed = _train(tmp_path, model_cache, name, "train.resume=auto")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resuming from" in resumed.stdout and not (checkpoints / "step_4.tmp").exists()
        assert _record(run) == expected_record, name
        weights = _weights(checkpoints / "step_5")
        assert weights.keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(weights[key], value), f"{name}: {key}"


def test_keep_checkpoints_keeps_the_newest(tmp_path, model_cache):
    done = _train(tmp_path, model_cache, "kept", "train.iterations=3", "train.keep_checkpoints=2")
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoints = tmp_path / "kept" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_2", "step_3"]
    assert (checkpoints / "latest").read_text() == "step_3"
