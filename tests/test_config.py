import subprocess
import sys
import textwrap
import time

import pytest

from vagen.config import (
    ConfigError,
    available_configs,
    from_dict,
    load_config,
    parse_override,
    to_yaml,
)


@pytest.mark.parametrize("name", available_configs())
def test_every_config_file_loads(name):
    cfg = load_config(name)
    assert cfg.name == name
    # a saved config round-trips to the same values
    import yaml

    assert from_dict(yaml.safe_load(to_yaml(cfg)), name) == cfg


def test_expected_configs_exist():
    for name in ["sokoban_visual", "frozenlake_visual", "sokoban_text", "frozenlake_text", "bandit_text",
                 "countdown_text"]:
        assert name in available_configs()


def test_yaml_overrides_defaults_and_command_line_overrides_yaml():
    cfg = load_config("sokoban_visual", ["rollout.group_size=8", "train.actor_lr=3e-5"])
    assert cfg.env.params["dim_room"] == [6, 6]
    assert cfg.rollout.group_size == 8
    assert cfg.train.actor_lr == pytest.approx(3e-5)
    assert cfg.algo.gamma_turn == 0.95  # untouched default


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("rollout.max_turns=5", ("rollout", "max_turns"), 5),
        ("algo.clip_high=0.28", ("algo", "clip_high"), 0.28),
        ("train.actor_lr=1e-6", ("train", "actor_lr"), 1e-6),  # YAML reads 1e-6 as a string
        ("algo.clip_low=0", ("algo", "clip_low"), 0.0),
        ("log.tensorboard=false", ("log", "tensorboard"), False),
        ("eval.do_sample=True", ("eval", "do_sample"), True),
        ("train.resume=null", ("train", "resume"), None),
        ("model.critic_path=/ckpt/critic", ("model", "critic_path"), "/ckpt/critic"),
        ("env.params.dim_room=[7, 7]", ("env", "params"), {"dim_room": [7, 7], "num_boxes": 1, "cell_size": 28}),
    ],
)
def test_override_coercion(override, key, expected):
    cfg = load_config("sokoban_visual", [override])
    value = getattr(getattr(cfg, key[0]), key[1])
    assert value == expected
    assert type(value) is type(expected)


def test_int_given_for_float_becomes_float_and_float_for_int_is_rejected():
    assert load_config(None, ["algo.entropy_coef=0"]).algo.entropy_coef == 0.0
    with pytest.raises(ConfigError, match=r"rollout.group_size: expected int, received 2.5"):
        load_config(None, ["rollout.group_size=2.5"])


def test_unknown_key_names_closest_valid_keys():
    with pytest.raises(ConfigError) as err:
        load_config("sokoban_visual", ["rollout.group_sise=8"])
    msg = str(err.value)
    assert "unknown config key 'rollout.group_sise'" in msg
    assert "did you mean 'rollout.group_size'" in msg
    assert "valid keys of [rollout]" in msg


def test_unknown_section_names_sections(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rolout:\n  group_size: 8\n")
    with pytest.raises(ConfigError, match=r"unknown config section 'rolout'.*did you mean 'rollout'"):
        load_config(str(path))


def test_wrong_type_names_key_value_and_type():
    with pytest.raises(ConfigError) as err:
        load_config("sokoban_visual", ["rollout.group_size=many"])
    assert "rollout.group_size: expected int, received 'many' (str)" in str(err.value)
    with pytest.raises(ConfigError, match=r"log.progress: expected bool, received 3"):
        load_config(None, ["log.progress=3"])


def test_unknown_config_name_lists_files():
    with pytest.raises(ConfigError) as err:
        load_config("sokobn_visual")
    msg = str(err.value)
    assert "unknown config 'sokobn_visual'" in msg
    assert "did you mean 'sokoban_visual'" in msg
    for name in available_configs():
        assert name in msg


def test_invalid_choice_lists_choices():
    with pytest.raises(ConfigError, match=r"algo.adv_estimator='gpro'.*did you mean 'grpo'.*choices: turn_gae, gae, grpo"):
        load_config(None, ["algo.adv_estimator=gpro"])


def test_cross_field_checks_say_how_to_fix():
    with pytest.raises(ConfigError, match=r"set rollout.group_size=2 or more"):
        load_config(None, ["algo.adv_estimator=grpo", "rollout.group_size=1"])
    with pytest.raises(ConfigError, match=r"needs rollout.group_size >= 2.*or set algo.filter_mode=none"):
        load_config(None, ["algo.filter_mode=std", "rollout.group_size=1", "train.mini_batch_size=4"])
    with pytest.raises(ConfigError, match=r"cannot see images.*use model.path=builtin:tiny-vl"):
        load_config(None, ["model.path=builtin:tiny-text"])
    with pytest.raises(ConfigError, match=r"exceeds the 16 trajectories.*lower it to 16"):
        load_config(None, ["train.mini_batch_size=32"])


def test_out_of_range_value():
    with pytest.raises(ConfigError, match=r"algo.clip_low=1.0 must be in \[0, 1\)"):
        load_config(None, ["algo.clip_low=1"])


def test_override_without_equals_sign():
    with pytest.raises(ConfigError, match=r"has no '='; write it as section.key=value"):
        parse_override("rollout.group_size")


def test_cli_prints_help_texts_and_exits_2_on_error():
    ok = subprocess.run([sys.executable, "-m", "vagen.config", "sokoban_visual", "rollout.group_size=8"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "group_size: 8" in ok.stdout
    assert "# rollouts per level seed" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "vagen.config", "sokoban_visual", "rollout.nope=1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unknown config key 'rollout.nope'" in bad.stderr


def test_config_errors_surface_fast_without_heavy_imports():
    code = textwrap.dedent(
        """
        import sys, time
        t0 = time.perf_counter()
        from vagen.config import ConfigError, load_config
        try:
            load_config("sokoban_visual", ["algo.adv_estimator=grpo", "rollout.group_size=1"])
        except ConfigError:
            pass
        else:
            raise SystemExit("no error")
        heavy = [m for m in ("torch", "transformers", "deepspeed", "mujoco") if m in sys.modules]
        print(repr(heavy), time.perf_counter() - t0)
        """
    )
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    heavy, elapsed = out.stdout.split(" ")
    assert heavy == "[]"
    assert float(elapsed) < 2.0
    assert wall < 10.0  # the interpreter start included; generous for a loaded machine


def test_unknown_rollout_backend_and_misplaced_rollout_correction_are_config_errors():
    assert load_config(None, ["rollout.backend=vllm"]).rollout.backend == "vllm"
    with pytest.raises(ConfigError, match=r"algo.rollout_correction=tis .* set rollout.backend=vllm"):
        load_config(None, ["algo.rollout_correction=tis"])
    with pytest.raises(ConfigError, match=r"algo.rollout_correction_cap=0.5 must be >= 1"):
        load_config(None, ["rollout.backend=vllm", "algo.rollout_correction=tis", "algo.rollout_correction_cap=0.5"])
    with pytest.raises(ConfigError, match=r"rollout.backend='sglang' is not a valid choice"):
        load_config(None, ["rollout.backend=sglang"])


def test_training_entry_reports_config_errors_before_loading_torch():
    code = textwrap.dedent(
        """
        import sys
        from vagen.train import main
        try:
            main(["--config", "sokoban_visual", "rollout.group_size=0"])
        except SystemExit as exit:
            print(exit.code, "torch" in sys.modules, "deepspeed" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2", "False", "False"], out.stderr
    assert "config error: rollout.group_size=0 must be >= 1" in out.stderr
