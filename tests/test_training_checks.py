"""Settings a training run refuses because the update could not reproduce what was sampled, or would
silently do something else than asked."""

import subprocess
import sys
import textwrap

import pytest

from vagen.config import ConfigError, available_configs, check_training, load_config


@pytest.mark.parametrize("name", available_configs())
def test_every_shipped_config_is_trainable_as_it_is(name):
    check_training(load_config(name))


def test_rollouts_sample_from_the_whole_distribution_by_default():
    cfg = load_config(None)
    assert (cfg.rollout.top_p, cfg.rollout.top_k, cfg.rollout.off_policy_sampling) == (1.0, 0, False)
    assert cfg.rollout.temperature > 0


def test_greedy_training_rollouts_are_refused():
    with pytest.raises(ConfigError, match=r"rollout.temperature=0 makes training rollouts greedy.*set "
                                          r"rollout.temperature between 0.7 and 1.0"):
        check_training(load_config("sokoban_visual", ["rollout.temperature=0"]))


@pytest.mark.parametrize("override", ["rollout.top_p=0.95", "rollout.top_k=50"])
def test_truncated_sampling_needs_an_explicit_opt_in(override):
    with pytest.raises(ConfigError, match=r"truncate the sampling distribution.*set rollout.top_p=1.0 "
                                          r"rollout.top_k=0, or rollout.off_policy_sampling=true"):
        check_training(load_config("sokoban_visual", [override]))
    check_training(load_config("sokoban_visual", [override, "rollout.off_policy_sampling=true"]))


def test_a_bfloat16_model_needs_a_deepspeed_config_with_bf16():
    with pytest.raises(ConfigError, match=r"model.dtype=bfloat16 with train.deepspeed_config=deepspeed/zero0_fp32.json"
                                          r".*round updates of 1e-6 away.*deepspeed/zero2_bf16.json"):
        check_training(load_config("sokoban_visual", ["model.dtype=bfloat16"]))
    check_training(load_config("sokoban_visual", ["model.dtype=bfloat16",
                                                  "train.deepspeed_config=deepspeed/zero2_bf16.json"]))


@pytest.mark.parametrize("deepspeed", ["deepspeed/zero2_bf16.json", "deepspeed/zero3_bf16.json"])
def test_a_float32_model_with_a_bf16_deepspeed_config_is_refused_before_any_work(deepspeed):
    """DeepSpeed would cast actor and critic to bfloat16 while the reference stays float32."""
    with pytest.raises(ConfigError, match=rf"model.dtype=float32 with train.deepspeed_config={deepspeed}, which "
                                          r"enables bfloat16.*reference.*zero0_fp32.json.*model.dtype=bfloat16"):
        check_training(load_config("sokoban_visual", [f"train.deepspeed_config={deepspeed}"]))
    check_training(load_config("sokoban_visual", [f"train.deepspeed_config={deepspeed}", "model.dtype=bfloat16"]))


def test_kl_in_the_reward_of_grpo_is_refused():
    with pytest.raises(ConfigError, match=r"algo.kl_in_reward=true.*grpo uses only each trajectory's score.*"
                                          r"set algo.kl_in_reward=false"):
        load_config("bandit_text", ["algo.kl_coef=0.05", "algo.kl_in_reward=true", "algo.adv_estimator=grpo"])
    load_config("bandit_text", ["algo.kl_coef=0.05", "algo.adv_estimator=grpo"])  # KL as a loss term


def test_loss_norm_tokens_must_be_positive():
    with pytest.raises(ConfigError, match=r"algo.loss_norm_tokens=0 must be >= 1"):
        load_config(None, ["algo.loss_norm_tokens=0"])


def test_training_entry_refuses_greedy_rollouts_before_loading_torch():
    code = textwrap.dedent(
        """
        import sys
        from vagen.train import main
        code = main(["--config", "sokoban_visual", "rollout.temperature=0"])
        print(code, "torch" in sys.modules, "deepspeed" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False", "False"], out.stderr
    assert "config error: rollout.temperature=0 makes training rollouts greedy" in out.stderr
