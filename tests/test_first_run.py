"""What a new user meets first: config mistakes reported as one line before torch loads, a run that
trains the checkpoint it is given (never a warm start behind the user's back) and says what it
trains, where it writes and how to evaluate the result."""

import subprocess
import sys
from pathlib import Path

import pytest
from child_env import child_env

from vagen.config import ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("override, message", [
    ("env.name=sokobann", r"env.name='sokobann' is not an environment; did you mean 'sokoban'\? choices: bandit, "),
    ("env.params.dim_rom=[6,6]", r"env.params.dim_rom is not a parameter of env 'sokoban'; did you mean 'dim_room'\? "
                                 r"parameters: .*cell_size"),
    ("model.path=/nowhere/Qwen2.5-VL-3B", r"model.path='/nowhere/Qwen2.5-VL-3B' is not a checkpoint: no config.json "
                                          r"in /nowhere/Qwen2.5-VL-3B; download the checkpoint .*builtin:tiny-vl"),
    ("model.path=builtin:tiny", r"model.path='builtin:tiny' is not a built-in model; did you mean"),
    ("model.path=assets:sokoban_vision", r"model.path='assets:sokoban_vision' is not a shipped warm start"),
    ("algo.gamma=nan", r"algo.gamma: expected a finite number, received 'nan'"),
    ("train.actor_lr=.inf", r"train.actor_lr: expected a finite number, received inf"),
    ("algo.clip_high=-.inf", r"algo.clip_high: expected a finite number, received -inf"),
])
def test_config_mistakes_name_the_key_and_the_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("sokoban_visual", [override])


def test_env_mistakes_are_reported_before_other_sections_complain():
    # sft.cell_questions needs frozenlake or sokoban: a misspelt name must be reported as such
    with pytest.raises(ConfigError, match="env.name='sokobann' is not an environment"):
        load_config("sokoban_visual", ["env.name=sokobann"])


def test_non_finite_numbers_in_a_yaml_file_are_refused(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  critic_lr: .nan\n")
    with pytest.raises(ConfigError, match="train.critic_lr: expected a finite number"):
        load_config(str(path))


def test_a_config_mistake_is_one_line_and_loads_no_torch():
    code = ("import sys\nfrom vagen.config import ConfigError, load_config\n"
            "try:\n    load_config('sokoban_visual', ['model.path=/nowhere'])\nexcept ConfigError:\n    pass\n"
            "print('torch' in sys.modules, 'deepspeed' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["False", "False"], result.stderr
    run = subprocess.run([sys.executable, "vagen/train.py", "--config", "sokoban_visual", "model.path=/nowhere"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, env=child_env())
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [run.stderr.strip()] and "Traceback" not in run.stderr
    assert run.stderr.startswith("config error: model.path='/nowhere' is not a checkpoint")


def test_config_help_after_a_name():
    result = subprocess.run([sys.executable, "-m", "vagen.config", "sokoban_visual", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m vagen.config") and "sokoban_visual" in result.stdout


def test_a_checkpoint_in_model_path_is_trained_as_given(tmp_path, tiny_text):
    """No warm start is built or even imported; the run's first lines name the checkpoint, the config and
    the run directory, and its last ones the run directory and the command that evaluates it."""
    path, _, _ = tiny_text
    cache, runs = tmp_path / "cache", tmp_path / "runs"
    overrides = [f"model.path={path}", f"model.builtin_cache={cache}", f"train.run_dir={runs}", "train.run_name=given",
                 "train.iterations=1", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_turns=1",
                 "rollout.max_new_tokens=8", "train.mini_batch_size=4", "train.micro_batch_size=2",
                 "log.tensorboard=false"]
    code = ("import sys\nfrom vagen.train import main\n"
            f"code = main(['--config', 'frozenlake_text', *{overrides!r}])\n"
            "print('warm-start code imported:', any(m.startswith('vagen.warmstart') for m in sys.modules))\n"
            "raise SystemExit(code)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env=child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warm-start code imported: False" in result.stdout
    assert not cache.exists()  # nothing was built: no built-in, no warm start
    run = runs / "given"
    assert sorted(p.name for p in runs.iterdir()) == ["given"] and (run / "checkpoints" / "step_1").is_dir()
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    first = lines.index(f"checkpoint: {path}")
    assert all(line.startswith("DeepSpeed ") for line in lines[:first]), lines[:first]  # the library's own, if any
    assert lines[first + 1:first + 3] == [f"config: frozenlake_text ({run / 'config.yaml'})", f"run directory: {run}"]
    assert lines[-3:-1] == [f"run directory: {run}",
                            f"evaluate it: python -m vagen.eval --config {run / 'config.yaml'} --checkpoint {run} "
                            f"--episodes 128"]


def test_a_runs_saved_config_is_a_config_file(tmp_path):
    from vagen.config import to_yaml

    cfg = load_config("sokoban_visual", ["rollout.group_size=8", "train.iterations=7"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(str(path))  # what the end of a run prints: python -m vagen.eval --config <run>/config.yaml
    assert again == cfg and again.name == "sokoban_visual"
