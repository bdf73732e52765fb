"""A run killed at any moment and started again with `train.resume=auto` is the run that would have
happened: the same metrics and the same final parameters as one never interrupted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import child_env
from safetensors.torch import load_file

from vagen.config import load_config
from vagen.run import ResumeError, check_resume_layout, find_checkpoint, prune_checkpoints, saved_layout

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


def test_prune_checkpoints_keeps_the_newest_and_the_one_latest_names(tmp_path):
    for name in ("step_2", "step_10", "step_9", "step_3.tmp", "step_x"):
        (tmp_path / name).mkdir()
    (tmp_path / "latest").write_text("step_2")
    prune_checkpoints(tmp_path, 5)  # fewer than 5: nothing goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_10", "step_2", "step_3.tmp", "step_9",
                                                         "step_x"]
    prune_checkpoints(tmp_path, 1)  # by step number, not by name; latest's checkpoint and other names stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_10", "step_2", "step_3.tmp", "step_x"]
    (tmp_path / "latest").write_text("step_10")
    prune_checkpoints(tmp_path, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_10", "step_3.tmp", "step_x"]


@pytest.mark.parametrize("keep", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_keep_checkpoints_never_holds_more_than_keep_plus_one(tmp_path, model_cache, distributed, monkeypatch, keep):
    """The checkpoints on disk while each one's engine states are written, and at the end: the oldest go
    before the write down to keep - 1, never the newest complete one (at keep 1 it stays until the new one
    is complete)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from vagen.train import main

    checkpoints = tmp_path / "kept" / "checkpoints"
    during, real_save = [], DeepSpeedEngine.save_checkpoint

    def save_checkpoint(self, *a, **k):
        during.append(sorted(p.name for p in checkpoints.iterdir()))
        return real_save(self, *a, **k)

    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", save_checkpoint)
    assert main([*SMALL, "train.iterations=4", "train.save_every=1", f"train.keep_checkpoints={keep}",
                 f"train.run_dir={tmp_path}", "train.run_name=kept", f"model.builtin_cache={model_cache}"]) == 0
    expected = {1: [["step_1.tmp"], ["latest", "step_1", "step_2.tmp"], ["latest", "step_2", "step_3.tmp"],
                    ["latest", "step_3", "step_4.tmp"]],
                2: [["step_1.tmp"], ["latest", "step_1", "step_2.tmp"], ["latest", "step_2", "step_3.tmp"],
                    ["latest", "step_3", "step_4.tmp"]],
                3: [["step_1.tmp"], ["latest", "step_1", "step_2.tmp"], ["latest", "step_1", "step_2", "step_3.tmp"],
                    ["latest", "step_2", "step_3", "step_4.tmp"]]}
    assert during == expected[keep]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", *[f"step_{n}" for n in range(5 - keep, 5)]]
    assert (checkpoints / "latest").read_text() == "step_4"


# -- which run train.resume=auto picks, and on how many ranks ----------------------------------------------

def _checkpoint(run: Path, step: int, **state) -> Path:
    """A complete checkpoint as save_checkpoint leaves it (the files find_checkpoint reads)."""
    ckpt = run / "checkpoints" / f"step_{step}"
    (ckpt / "deepspeed" / "actor").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"iteration": step - 1, **state}))
    (run / "checkpoints" / "latest").write_text(ckpt.name)
    return ckpt


def _age(run: Path, seconds: float) -> None:
    latest = run / "checkpoints" / "latest"
    mtime = latest.stat().st_mtime - seconds
    os.utime(latest, (mtime, mtime))


def test_resume_auto_with_a_run_name_resumes_that_run_and_says_so(tmp_path, capsys):
    exp = _checkpoint(tmp_path / "exp", 3)
    _checkpoint(tmp_path / "exp", 2)  # an older checkpoint of the same run: latest names step_2 now
    (tmp_path / "exp" / "checkpoints" / "latest").write_text("step_3")
    _checkpoint(tmp_path / "exp2", 7)  # newer runs: one whose name starts with "exp", one of the config
    _checkpoint(tmp_path / "sokoban_text-20300101-000000", 9)
    _age(tmp_path / "exp", 100)
    cfg = load_config("sokoban_text", [f"train.run_dir={tmp_path}", "train.run_name=exp", "train.resume=auto"])
    assert find_checkpoint(cfg) == exp
    out = capsys.readouterr().out
    assert out == (f"train.resume=auto: resuming run 'exp' (train.run_name) from its latest checkpoint step_3 "
                   f"({exp})\n")


def test_resume_auto_with_a_run_name_that_has_no_checkpoint_starts_that_run(tmp_path, capsys):
    _checkpoint(tmp_path / "sokoban_text-20300101-000000", 9)  # never taken for another name
    (tmp_path / "fresh" / "checkpoints" / "step_1.tmp").mkdir(parents=True)  # killed before its first checkpoint
    for name, why in (("fresh", "it has no complete checkpoint yet"),
                      ("absent", f"there is no run of that name under {tmp_path}")):
        cfg = load_config("sokoban_text", [f"train.run_dir={tmp_path}", f"train.run_name={name}",
                                           "train.resume=auto"])
        assert find_checkpoint(cfg) is None
        assert capsys.readouterr().out == (f"train.resume=auto: nothing to resume for train.run_name={name!r}: "
                                           f"{why}; starting run {name!r} from iteration 0\n")


def test_resume_auto_without_a_run_name_takes_the_newest_run_the_config_named(tmp_path, capsys):
    older = _checkpoint(tmp_path / "sokoban_text-20300101-000000", 4)
    newer = _checkpoint(tmp_path / "sokoban_text-20300102-000000", 2)
    _checkpoint(tmp_path / "sokoban_text-lr3", 5)  # named by its user: resumed only by train.run_name
    _checkpoint(tmp_path / "sokoban_text_big-20300103-000000", 5)  # another config
    _age(older.parent.parent, 100)
    cfg = load_config("sokoban_text", [f"train.run_dir={tmp_path}", "train.resume=auto"])
    assert find_checkpoint(cfg) == newer
    out = capsys.readouterr().out
    assert out.startswith("train.resume=auto: no train.run_name, so resuming the run of config 'sokoban_text' "
                          f"whose checkpoint is newest, 'sokoban_text-20300102-000000', from step_2 ({newer}); "
                          "1 older run(s) of this config left alone"), out
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = load_config("sokoban_text", [f"train.run_dir={empty}", "train.resume=auto"])
    assert find_checkpoint(cfg) is None
    assert "no run of config 'sokoban_text' (sokoban_text-<date>-<time>) with a complete checkpoint" in \
        capsys.readouterr().out


def test_a_conversion_estimated_to_outlast_the_ranks_wait_is_refused_naming_the_setting(tmp_path):
    """3 GB of engine states (a sparse file) at the measured 40 MB/s: 75 s, more than train.dist_timeout_minutes=1
    that the other rank waits for rank 0's conversion. Refused with the setting to raise; at 2 minutes, or on one
    rank (nobody waits), it goes on."""
    from vagen.run import check_conversion_time, conversion_seconds

    ckpt = _checkpoint(tmp_path / "run", 2, ranks=2, zero_stage=3)
    with open(ckpt / "deepspeed" / "actor" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "wb") as states:
        states.truncate(3 * 10**9)
    assert conversion_seconds(ckpt) == pytest.approx(75.0, rel=1e-3)
    cfg = load_config("sokoban_text", ["train.deepspeed_config=deepspeed/zero3_fp32.json", "train.dist_timeout_minutes=1"])
    with pytest.raises(ResumeError) as err:
        check_conversion_time(ckpt, cfg, 2)
    assert ("3.0 GB of engine states to a universal checkpoint (it was saved on another number of ranks) is estimated "
            "at 1.2 minutes") in str(err.value)
    assert "train.dist_timeout_minutes=1; set train.dist_timeout_minutes=4 for this resume" in str(err.value)
    check_conversion_time(ckpt, cfg, 1)
    cfg.train.dist_timeout_minutes = 2
    check_conversion_time(ckpt, cfg, 2)


def test_zero_1_to_3_states_on_another_rank_count_are_converted_and_another_stage_is_refused(tmp_path, capsys):
    zero3 = ["train.deepspeed_config=deepspeed/zero3_fp32.json"]
    cfg = load_config("sokoban_text", zero3)
    ckpt = _checkpoint(tmp_path / "run", 2, ranks=2, zero_stage=3)
    assert check_resume_layout(ckpt, cfg, 2) is False  # as saved
    assert capsys.readouterr().out == ""
    assert check_resume_layout(ckpt, cfg, 1) is True  # through a universal checkpoint
    assert capsys.readouterr().out == (
        f"train.resume: step_2 was saved on 2 rank(s) with ZeRO-3 and resumes on 1: its per-rank optimizer states "
        f"are loaded through DeepSpeed's universal checkpoint ({ckpt / 'universal'}; batches are shared out anew)\n")
    with pytest.raises(ResumeError) as err:
        check_resume_layout(ckpt, load_config("sokoban_text"), 2)
    message = str(err.value)
    assert f"checkpoint {ckpt} holds ZeRO-3 engine states, and this run asks for ZeRO-0 (train" in message
    assert f"model.path={ckpt / 'actor'} model.critic_path={ckpt / 'critic'} train.resume=null" in message
    # a checkpoint written before the layout was recorded: read from DeepSpeed's file names
    old = _checkpoint(tmp_path / "old", 1)
    for rank in range(4):
        (old / "deepspeed" / "actor" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    assert saved_layout(old) == (4, 2)
    zero2 = load_config("sokoban_text", ["train.deepspeed_config=deepspeed/zero2_bf16.json", "model.dtype=bfloat16"])
    assert check_resume_layout(old, zero2, 8) is True
    assert "step_1 was saved on 4 rank(s) with ZeRO-2 and resumes on 8" in capsys.readouterr().out
    with pytest.raises(ResumeError, match=r"holds ZeRO-2 engine states, and this run asks for ZeRO-3"):
        check_resume_layout(old, cfg, 4)
    zero0 = _checkpoint(tmp_path / "zero0", 1, ranks=2, zero_stage=0)
    assert check_resume_layout(zero0, load_config("sokoban_text"), 1) is False  # loads as saved
    assert capsys.readouterr().out == (
        "train.resume: step_1 was saved on 2 rank(s) and resumes on 1: ZeRO-0 keeps the whole optimizer state "
        "on every rank, so it loads as saved (batches are shared out anew)\n")


TRAIN = Path(__file__).parent.parent / "vagen" / "train.py"
SMALL = ["--config", "bandit_text", "train.iterations=1", "rollout.env_groups=2", "rollout.group_size=2",
         "rollout.max_new_tokens=4", "train.mini_batch_size=2", "train.micro_batch_size=1", "log.progress=false",
         "log.tensorboard=false"]


def _train_on(ranks: int, tmp_path, model_cache, *extra):
    """vagen/train.py on `ranks` gloo ranks: through the DeepSpeed launcher when there are several."""
    args = [*SMALL, f"train.run_dir={tmp_path}", "train.run_name=hop", f"model.builtin_cache={model_cache}", *extra]
    if ranks == 1:
        cmd = [sys.executable, str(TRAIN), *args]
    else:
        from test_distributed import _free_port

        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
               str(_free_port()), str(TRAIN), *args]
    return subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)


def _engine_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "deepspeed" / "actor" / "mp_rank_00_model_states.pt", map_location="cpu",
                      weights_only=False)


def test_zero0_resumes_on_another_rank_count_with_its_optimizer_state_and_zero3_is_refused(tmp_path, tiny_text,
                                                                                            model_cache):
    """1 rank -> 2 -> 1 under ZeRO-0: each resumed run continues the optimizer (AdamW's step count and the
    engine's global steps carry on from the checkpoint); asking 2 ranks for ZeRO-3 on it stops both before
    any work."""
    checkpoints = tmp_path / "hop" / "checkpoints"
    steps = 0
    for it, ranks in enumerate((1, 2, 1), start=1):
        resume = ["train.resume=auto"] if it > 1 else []
        done = _train_on(ranks, tmp_path, model_cache, f"train.iterations={it}", *resume)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        if it > 1:
            assert (f"train.resume: step_{it - 1} was saved on {3 - ranks} rank(s) and resumes on {ranks}: "
                    f"ZeRO-0 keeps the whole optimizer state") in done.stdout, done.stdout[-3000:]
        state = _engine_state(checkpoints / f"step_{it}")
        if it == 1:
            steps = state["global_steps"]  # one per mini-batch of 2
            assert steps == 2
        assert state["dp_world_size"] == ranks
        assert state["global_steps"] == it * steps  # the steps before the checkpoint are counted
        assert {s["step"].item() for s in state["optimizer"]["state"].values()} == {it * steps}
        assert json.loads((checkpoints / f"step_{it}" / "trainer_state.json").read_text())["ranks"] == ranks
    assert [r["iteration"] for r in _record(tmp_path / "hop")] == [0, 1, 2]
    before = (tmp_path / "hop" / "config.yaml").read_text()
    refused = _train_on(2, tmp_path, model_cache, "train.iterations=4", "train.resume=auto",
                        "train.deepspeed_config=deepspeed/zero3_fp32.json")
    assert refused.returncode != 0
    output = refused.stdout + refused.stderr
    assert (f"refused: train.resume: checkpoint {checkpoints / 'step_3'} holds ZeRO-0 engine states, and this run "
            f"asks for ZeRO-3") in output, output[-3000:]
    assert "checkpoint: " not in output  # stopped before the models were built
    assert (tmp_path / "hop" / "config.yaml").read_text() == before
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_1", "step_2", "step_3"]


# -- ZeRO 1-3 on another rank count: DeepSpeed's universal checkpoint ------------------------------------------

RESUME_WORKER = Path(__file__).parent / "resume_worker.py"


def _hop(ranks: int, tmp_path, model_cache, stage_args, iterations: int, worker: tuple = ()):
    """`iterations` in all of the run "hop" on `ranks` gloo ranks (resumed when it has a checkpoint), through
    tests/resume_worker.py (`worker`: its options), which writes the actor's whole optimizer states under
    tmp_path/dumps."""
    dumps = tmp_path / "dumps"
    dumps.mkdir(exist_ok=True)
    args = [f"--dump={dumps}", *worker, *SMALL, f"train.run_dir={tmp_path}", "train.run_name=hop",
            f"model.builtin_cache={model_cache}", f"train.iterations={iterations}", "train.resume=auto", *stage_args]
    if ranks == 1:
        cmd = [sys.executable, str(RESUME_WORKER), *args]
    else:
        from test_distributed import _free_port

        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
               str(_free_port()), str(RESUME_WORKER), *args]
    done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _steps(ckpt: Path) -> tuple[set, set]:
    """(the engines' global step counts, AdamW's step counts) in every engine-state file of the actor."""
    def found(value, key):
        if isinstance(value, dict):
            for k, v in value.items():
                if k == key:
                    yield v.item() if torch.is_tensor(v) else v
                else:
                    yield from found(v, key)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from found(v, key)

    global_steps, adam_steps = set(), set()
    for path in (ckpt / "deepspeed" / "actor").glob("*.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        global_steps.update(found({k: v for k, v in state.items() if k == "global_steps"}, "global_steps"))
        adam_steps.update(found(state.get("optimizer_state_dict", {}), "step"))
    return global_steps, adam_steps


def _assert_same_states(saved: dict, resumed: dict) -> None:
    assert saved.keys() == resumed.keys()
    for name, states in saved.items():
        for key, value in states.items():
            assert torch.equal(value, resumed[name][key]), f"{name} {key}"
    assert any(s["exp_avg"].abs().sum() > 0 for s in saved.values())  # the moments are not a fresh optimizer's


def _resume_on_other_rank_counts(tmp_path, model_cache, stage_args, hops, worker: tuple = ()):
    """`hops` (rank counts), one iteration each: every resumed run starts from exactly the fp32 weights and
    AdamW moments that were saved, and the step counts and metrics carry on."""
    checkpoints = tmp_path / "hop" / "checkpoints"
    for it, ranks in enumerate(hops, start=1):
        done = _hop(ranks, tmp_path, model_cache, stage_args, it, worker)
        if it > 1:
            saved_on = hops[it - 2]
            assert (f"train.resume: step_{it - 1} was saved on {saved_on} rank(s) with ZeRO-"
                    in done.stdout), done.stdout[-3000:]
            assert f"and resumes on {ranks}: its per-rank optimizer states are loaded through DeepSpeed's " \
                   f"universal checkpoint ({checkpoints / f'step_{it - 1}' / 'universal'}" in done.stdout
            assert "train.resume: converted in " in done.stdout
            _assert_same_states(torch.load(tmp_path / "dumps" / f"saved_step_{it - 1}.pt"),
                                torch.load(tmp_path / "dumps" / f"resumed_step_{it - 1}.pt"))
        global_steps, adam_steps = _steps(checkpoints / f"step_{it}")
        assert global_steps == {2 * it} and adam_steps == {2 * it}, (global_steps, adam_steps)  # 2 per iteration
        state = json.loads((checkpoints / f"step_{it}" / "trainer_state.json").read_text())
        assert (state["ranks"], state["iteration"]) == (ranks, it - 1)
    assert [r["iteration"] for r in _record(tmp_path / "hop")] == list(range(len(hops)))


ZERO3 = ["train.deepspeed_config=deepspeed/zero3_fp32.json"]
ZERO2 = ["train.deepspeed_config=deepspeed/zero2_bf16.json", "model.dtype=bfloat16"]


def test_zero3_saved_on_one_rank_resumes_on_two_with_its_optimizer_state(tmp_path, tiny_text, model_cache):
    _resume_on_other_rank_counts(tmp_path, model_cache, ZERO3, (1, 2))


@pytest.mark.slow
def test_a_critic_saved_on_one_rank_resumes_on_two_with_its_optimizer_state(tmp_path, tiny_text, model_cache):
    """GAE, so a critic beside the actor, under ZeRO-3: saved on 1 rank and resumed on 2 through the universal
    checkpoint (`vagen.run.to_universal` converts critic/ too), the critic starts from exactly the fp32 weights and
    AdamW moments that were saved, as the actor does."""
    _resume_on_other_rank_counts(tmp_path, model_cache, [*ZERO3, "algo.adv_estimator=gae"], (1, 2),
                                 worker=("--reward-bonus", "1.0"))
    dumps = tmp_path / "dumps"
    _assert_same_states(torch.load(dumps / "saved_critic_step_1.pt"), torch.load(dumps / "resumed_critic_step_1.pt"))
    assert (tmp_path / "hop" / "checkpoints" / "step_2" / "critic").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("stage_args", [ZERO3, ZERO2, [*ZERO3, "model.lora_rank=8"], [*ZERO2, "model.lora_rank=8"]],
                         ids=["zero3", "zero2", "zero3_lora", "zero2_lora"])
def test_zero_1_to_3_resume_one_two_one_ranks(tmp_path, tiny_text, model_cache, stage_args):
    _resume_on_other_rank_counts(tmp_path, model_cache, stage_args, (1, 2, 1))


def test_a_missing_resume_path_is_refused_on_every_rank_by_name(tmp_path, model_cache):
    """Every rank stops with the path it was given and what was expected there, before any model is built,
    and none with a traceback (rank 0 alone used to raise, and the others lost their peer)."""
    missing = tmp_path / "nope"
    done = _train_on(2, tmp_path, model_cache, f"train.resume={missing}")
    output = done.stdout + done.stderr
    assert done.returncode != 0
    said = f"refused: train.resume={missing}: no such path (expected trainer_state.json in a runs/<run>/checkpoints/"
    assert sum(line.startswith(said) for line in output.splitlines()) == 1, output[-3000:]
    assert sum(line.startswith(f"rank 1: {said}") for line in output.splitlines()) == 1, output[-3000:]
    assert "Traceback" not in output and "checkpoint: " not in output
    assert not (tmp_path / "hop").exists()
