"""rollout.reuse_iterations: a batch of rollouts trains several consecutive iterations (RAGEN's rollout
frequency), with the old log-probs and advantages of the policy that sampled it."""

import json

import pytest
from test_train import FAST

from vagen.config import ConfigError, load_config
from vagen.train import main


def _records(tmp_path, model_cache, *extra):
    overrides = FAST + [f"train.run_dir={tmp_path}", f"model.builtin_cache={model_cache}", "train.iterations=3",
                        "train.actor_lr=1e-3", *extra]
    assert main(["--config", "frozenlake_visual", *overrides]) == 0
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_reused_batch_trains_again_off_policy_and_logs_its_staleness(tmp_path, model_cache, distributed):
    records = _records(tmp_path, model_cache, "rollout.reuse_iterations=2")
    assert [r["iteration"] for r in records] == [0, 1, 2]
    # one notion of staleness with rollout.max_staleness: the updates since a trained token was sampled
    assert [r["rollout/staleness_mean"] for r in records] == [0.0, 1.0, 0.0]
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 0.0]
    # One mini-batch an iteration: a fresh batch's first update is on-policy (ratios 1) ...
    assert records[0]["actor/approx_kl"] < 1e-9 and records[2]["actor/approx_kl"] < 1e-9
    # ... the reused batch's is not: its old log-probs are those of the policy before iteration 0's step
    assert records[1]["actor/approx_kl"] > 1e-4
    # rollouts are played (and their metrics logged) only when a batch is sampled
    assert "rollout/success" in records[0] and "rollout/success" not in records[1] and "rollout/success" in records[2]
    assert "timing/generate" not in records[1]
    assert records[1]["update/tokens"] == records[0]["update/tokens"]


def test_one_iteration_per_batch_samples_every_iteration(tmp_path, model_cache, distributed):
    records = _records(tmp_path, model_cache)  # the default, rollout.reuse_iterations=1
    assert [r["rollout/staleness_mean"] for r in records] == [0.0, 0.0, 0.0]
    assert [r["rollout/carried_episodes"] for r in records] == [0.0, 0.0, 0.0]
    assert all("rollout/success" in r and r["actor/approx_kl"] < 1e-9 for r in records)


@pytest.mark.parametrize("value", [0, -1])
def test_reuse_iterations_below_one_is_a_config_error(value):
    with pytest.raises(ConfigError, match=f"rollout.reuse_iterations={value} must be >= 1"):
        load_config("frozenlake_visual", [f"rollout.reuse_iterations={value}"])
