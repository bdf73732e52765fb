"""A run survives a bad step, and stops with a checkpoint when steps keep failing."""

import json

import torch

from vagen.models import load_policy
from vagen.train import main

FAST = ["rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "train.mini_batch_size=4",
        "train.micro_batch_size=2", "log.progress=false", "log.tensorboard=false"]


def test_steps_that_keep_failing_stop_the_run_with_the_weights_before_them(tmp_path, model_cache, distributed,
                                                                          monkeypatch, capsys):
    import vagen.update

    real = vagen.update.core.ppo_policy_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(vagen.update.core, "ppo_policy_loss", nan_loss)
    code = main(["--config", "bandit_text", *FAST, "train.iterations=6", "train.max_bad_steps=2",
                 f"train.run_dir={tmp_path}", "train.run_name=bad", f"model.builtin_cache={model_cache}"])
    assert code == 1
    run = tmp_path / "bad"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]  # one skipped step per iteration, two in a row
    assert [r["actor/skipped_steps"] for r in records] == [1, 1]
    assert [r["update/bad_steps_in_a_row"] for r in records] == [1, 2]
    assert "the last 2 optimizer steps were skipped for a non-finite loss or gradient" in capsys.readouterr().err
    saved, _ = load_policy(run / "checkpoints" / "step_2" / "actor")
    from vagen.models import resolve_model_path

    initial, _ = load_policy(resolve_model_path("builtin:tiny-text", model_cache, seed=0))
    for name, value in saved.state_dict().items():
        assert torch.equal(value, initial.state_dict()[name]), name
