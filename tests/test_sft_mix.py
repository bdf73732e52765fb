"""A warm start for a run over several tasks: `python -m vagen.sft --config multitask_visual` (vagen.warmstart.mix)."""

import json
from collections import Counter

import pytest
import torch

from vagen.config import checkpoints_dir, load_config
from vagen.episode import ChatEncoder
from vagen.rollout import make_env
from vagen.warmstart import cli, sft
from vagen.warmstart.mix import mixed_tasks, task_demo_samples

SMALL = ["sft.demos=6", "sft.val_demos=2", "sft.exclude_eval=8", "sft.batch_size=4", "sft.micro_batch_size=4",
         "sft.warmup_steps=0", "sft.min_steps=0", "sft.cell_questions=0", "rollout.max_turns=2"]


def _text_mix(tmp_path, shares: str = "") -> str:
    path = tmp_path / "text_mix.yaml"
    path.write_text("rollout:\n  tasks:\n    - {config: frozenlake_text, groups: 2}\n"
                    "    - {config: sokoban_text, groups: 1}\n"
                    "train:\n  mini_batch_size: 4\n  micro_batch_size: 4\n" + shares)
    return str(path)


def test_each_task_keeps_its_own_demonstration_settings_and_the_run_its_schedule():
    cfg = load_config("multitask_visual", ["sft.demos=40"])
    tasks = mixed_tasks(cfg, ["sft.demos=40"])
    assert [name for name, _, _ in tasks] == ["sokoban_visual", "frozenlake_visual", "navigation_visual"]
    assert [sub.sft.reasoning for _, sub, _ in tasks] == ["path", "near", "view"]  # as each task's own build
    assert [sub.sft.teacher_slip for _, sub, _ in tasks] == [None, None, 0.0]
    assert [sub.sft.val_demos for _, sub, _ in tasks] == [128, 128, 64]
    assert [sub.sft.demos for _, sub, _ in tasks] == [40, 40, 40]  # the command line's sft.* reach every task
    assert [(sub.env.name, sub.rollout.max_turns, sub.rollout.max_new_tokens) for _, sub, _ in tasks] == [
        ("sokoban", 3, 64), ("frozenlake", 3, 64), ("navigation", 5, 48)]
    assert [share for _, _, share in tasks] == [0.25, 0.5, 0.25]  # sft.task_shares: [1, 2, 1]
    assert (cfg.sft.lr_schedule, cfg.sft.max_steps, cfg.sft.min_steps) == ("cosine", 3200, 3200)


def test_without_task_shares_each_task_has_its_share_of_the_level_groups(tmp_path):
    assert [share for _, _, share in mixed_tasks(load_config(_text_mix(tmp_path)))] == [2 / 3, 1 / 3]
    assert [share for _, _, share in mixed_tasks(load_config("multitask_visual", ["sft.task_shares=[]"]))] == [
        0.5, 0.25, 0.25]


@pytest.mark.parametrize("shares", ["[1, 2]", "[1, 0, 1]", "[1, 2, -1, 1]"])
def test_task_shares_that_do_not_fit_the_tasks_are_refused(shares, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", "multitask_visual", f"sft.task_shares={shares}"])
    assert exit_.value.code == 2
    assert (f"sft.task_shares={shares.replace(' ', '').replace(',', ', ')} must give a positive share to each of "
            f"the 3 tasks (sokoban_visual, frozenlake_visual, navigation_visual)") in capsys.readouterr().err


def test_tasks_of_two_modalities_are_refused_before_anything_loads(tmp_path, capsys):
    path = tmp_path / "two_modalities.yaml"
    path.write_text("rollout:\n  tasks:\n    - {config: frozenlake_text, groups: 1}\n"
                    "    - {config: frozenlake_visual, groups: 1}\n"
                    "train:\n  mini_batch_size: 8\n  micro_batch_size: 4\n")
    with pytest.raises(SystemExit):
        cli.main(["--config", str(path)])
    assert "the tasks of two_modalities observe in text and vision (frozenlake_text: text, frozenlake_visual: " \
           "vision)" in capsys.readouterr().err


def test_a_single_stage_of_a_mixed_warm_start_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--config", "multitask_visual", "--base", "x", "--out", "y", "--cells-only"])
    assert "without a cell-question or on-policy stage; drop --cells-only" in capsys.readouterr().err


def test_task_batches_hold_one_task_each_drawn_by_share_and_fixed_by_the_seed():
    lengths = [10, 50, 20, 40, 30, 60, 15, 45] * 3
    tasks = [0] * 8 + [1] * 8 + [2] * 8
    shares = [0.25, 0.5, 0.25]

    def draw(seed):
        generator = torch.Generator().manual_seed(seed)
        return [b for _ in range(400) for b in sft.task_batches(lengths, tasks, shares, 4, 4, generator)]

    batches = draw(0)
    assert draw(0) == batches and draw(1) != batches
    assert all(len({tasks[i] for i in batch}) == 1 and len(batch) == 4 for batch in batches)
    counts = Counter(tasks[batch[0]] for batch in batches)
    assert len(batches) == 1600 and all(abs(counts[k] / 1600 - shares[k]) < 0.04 for k in range(3)), counts
    # within a task, every sample is drawn alike: the samples are few, the tasks' sizes do not weigh
    drawn = Counter(i for batch in batches if tasks[batch[0]] == 1 for i in batch)
    assert sorted(drawn) == list(range(8, 16)) and max(drawn.values()) < 1.3 * min(drawn.values())


def test_the_union_holds_each_tasks_demonstrations_in_its_own_prompt_format(tmp_path, tiny_text):
    _, model, processor = tiny_text
    encoder = ChatEncoder(processor)
    cfg = load_config(_text_mix(tmp_path), SMALL)
    tasks = mixed_tasks(cfg, SMALL)
    data = task_demo_samples(tasks, encoder, model, "teacher", log=lambda _: None)
    assert [(len(train), len(val)) for train, val, _ in data] == [(6, 2), (6, 2)]
    for (name, sub, _), (train, val, success) in zip(tasks, data):
        prompt = make_env(sub.env).system_prompt()
        for sample in train + val:
            assert prompt in getattr(processor, "tokenizer", processor).decode(sample.input_ids), name
        assert 0 < success <= 1
    again = task_demo_samples(tasks, encoder, model, "teacher", log=lambda _: None)
    assert all(torch.equal(a.input_ids, b.input_ids) for (x, _, _), (y, _, _) in zip(data, again)
               for a, b in zip(x, y))


def _build(tmp_path, model_cache, *extra):
    out = tmp_path / "ws"
    overrides = SMALL + ["sft.max_steps=3", "sft.check_every=3", f"model.builtin_cache={model_cache}",
                         "sft.task_shares=[1, 3]"]
    assert cli.main(["--config", _text_mix(tmp_path), "--out", str(out), *extra, *overrides]) == 0
    return out


def test_a_mixed_build_saves_what_built_it(tmp_path, model_cache, capsys):
    out = _build(tmp_path, model_cache)
    printed = capsys.readouterr().out
    assert "frozenlake_text: 6 teacher demonstrations" in printed and "sokoban_text: 6 teacher" in printed
    state = json.loads((out / sft.STATE_FILE).read_text())
    assert state["command"].startswith("python -m vagen.sft --config ") and state["stages"] == "all"
    assert state["sft/step"] == 3 and set(state["demonstration_code"]) == {"frozenlake_text", "sokoban_text"}
    assert {name: task["share"] for name, task in state["settings"]["tasks"].items()} == {
        "frozenlake_text": 0.25, "sokoban_text": 0.75}
    assert state["settings"]["tasks"]["sokoban_text"]["env"]["name"] == "sokoban"
    assert {"sft/frozenlake_text/val_answer_accuracy", "sft/sokoban_text/demo_success"} <= set(state)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()



@pytest.mark.parametrize("base, perception", [(None, True), ("runs/a_warm_start", False)])
def test_a_tasks_perception_stage_runs_only_on_a_builtin_base(tmp_path, model_cache, monkeypatch, base, perception):
    """--base names a warm start, which had its perception stage: the mixed build must not run it again,
    whatever sft.base says."""
    from vagen import distributed
    from vagen.warmstart import mix

    seen = {}
    monkeypatch.setattr(distributed, "init_distributed", lambda **_: None)
    monkeypatch.setattr(mix, "build_mixed_warm_start", lambda *a, **k: seen.update(k))
    extra = ["--base", base] if base else []
    assert cli.main(["--config", _text_mix(tmp_path), "--out", str(tmp_path / "ws"), *extra, *SMALL,
                     f"model.builtin_cache={model_cache}"]) == 0
    assert seen["from_builtin"] is perception

@pytest.mark.slow
def test_a_mixed_build_writes_a_card_per_task_beside_the_single_task_warm_starts(tmp_path, model_cache):
    out = _build(tmp_path, model_cache, "--eval", "4")
    card = json.loads((out / sft.CARD_FILE).read_text())
    assert set(card["evaluation"]["tasks"]) == {"frozenlake_text", "sokoban_text"}
    for name, task in card["evaluation"]["tasks"].items():
        assert {"sft greedy", "sft sampled", "teacher", "solver", "random"} <= set(task["rows"]), name
        for row in task["rows"].values():
            low, high = row["interval_95"]
            assert row["n"] == 4 and low <= row["success"] <= high
        shipped = json.loads((checkpoints_dir() / name / sft.CARD_FILE).read_text())
        assert task["single_task_warm_start"] == {"checkpoint": f"assets:{name}", "rows": {
            key: shipped["evaluation"]["rows"][key] for key in ("sft greedy", "sft sampled")}}
