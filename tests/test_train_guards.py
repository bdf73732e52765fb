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


class _Faulty:
    """An environment that raises in `step` on one level and in `reset` on another (the first time)."""

    def __init__(self, env, raise_on):
        self.env, self.raise_on, self.seed = env, raise_on, None

    def reset(self, seed):
        self.seed = seed
        if self.raise_on.pop(("reset", seed), False):
            raise OSError("renderer lost its context")
        return self.env.reset(seed=seed)

    def step(self, text):
        if self.raise_on.pop(("step", self.seed), False):
            raise ValueError("level state out of bounds")
        return self.env.step(text)

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_an_environment_that_raises_ends_only_its_episode(tmp_path, model_cache, distributed, monkeypatch, capsys):
    import vagen.rollout
    from vagen.episode import train_seeds

    first, second = train_seeds(0, 2)  # the two level seeds of iteration 0
    raise_on = {("step", first): True, ("reset", second): True}  # one episode each
    real = vagen.rollout.make_env
    monkeypatch.setattr(vagen.rollout, "make_env", lambda *a, **k: _Faulty(real(*a, **k), raise_on))
    code = main(["--config", "sokoban_text", *FAST, "train.iterations=2", "rollout.max_turns=2",
                 f"train.run_dir={tmp_path}", "train.run_name=faulty", f"model.builtin_cache={model_cache}"])
    assert code == 0 and not raise_on  # both faults happened, and the run finished
    records = [json.loads(line) for line in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/env_errors"] for r in records] == [2, 0]
    err = capsys.readouterr().err
    assert f"sokoban level {first}: step 0: ValueError: level state out of bounds" in err
    assert f"sokoban level {second}: reset: OSError: renderer lost its context" in err


def test_an_environment_step_that_hangs_is_cut_off_by_the_timeout(tiny_text):
    import time

    from vagen.config import load_config
    from vagen.episode import ChatEncoder
    from vagen.rollout import make_env, rollout

    _, model, tokenizer = tiny_text
    cfg = load_config("sokoban_text", ["rollout.max_new_tokens=8", "rollout.max_turns=2", "env.step_timeout=0.3"])

    class Hanging(_Faulty):
        def step(self, text):
            if self.seed == 5:
                time.sleep(30)
            return self.env.step(text)

    envs = [Hanging(make_env(cfg.env), {}) for _ in range(2)]
    t0 = time.perf_counter()
    episodes, _ = rollout(model, ChatEncoder(tokenizer), cfg, [5, 6], group_size=1, envs=envs)
    assert time.perf_counter() - t0 < 10
    assert episodes[0].error.startswith("step 0: EnvTimeout: no answer within env.step_timeout=0.3 s")
    assert not episodes[0].success and len(episodes[0].turns) == 1
    assert episodes[1].error is None and len(episodes[1].turns) >= 1
