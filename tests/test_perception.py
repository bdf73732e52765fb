import json

import numpy as np
import pytest

from vagen.config import ConfigError, load_config
from vagen.episode import ChatEncoder
from vagen.models import resolve_model_path
from vagen.rollout import make_env
from vagen.warmstart import sft
from vagen.warmstart.demos import eval_level_keys, level_key
from vagen.warmstart.perception import (
    cell_answer,
    cell_probes,
    perception_probes,
    question_sample,
    single_cell_objects,
    standing_cells,
)


def patch_loop(monkeypatch, name: str, value) -> None:
    """Replace `name` of the supervised loop (`vagen.warmstart.loop`) where the build and its stages look it up."""
    from vagen.warmstart import loop

    monkeypatch.setattr(loop, name, value)
    if hasattr(sft, name):
        monkeypatch.setattr(sft, name, value)



def test_single_cell_objects_are_the_player_and_lone_boxes_and_targets():
    state = {"size": (6, 6), "player": (2, 3), "boxes": [(3, 3)], "targets": [(4, 1)], "walls": [(0, 0), (0, 1)]}
    assert single_cell_objects(state) == {"the player": (2, 3), "the box": (3, 3), "the target": (4, 1)}
    two_boxes = dict(state, boxes=[(3, 3), (3, 4)], targets=[(4, 1), (4, 2)])
    assert single_cell_objects(two_boxes) == {"the player": (2, 3)}  # "the box" would be ambiguous
    assert single_cell_objects({"size": (4, 4), "player": (0, 0), "holes": [(1, 1)]}) == {"the player": (0, 0)}


def player_cells(env, frame) -> list:
    """The placements of the player on `env`'s current FrozenLake or Sokoban level that draw exactly
    `frame`."""
    frame, cells = np.asarray(frame), []
    for cell in np.ndindex(*env.state()["size"]):
        try:
            env.place_player(cell)
        except ValueError:  # a Sokoban wall or box
            continue
        if np.array_equal(np.asarray(env.render_image()), frame):
            cells.append(cell)
    return cells


def level_key_of(env, seed):
    env.reset(seed=seed)
    return level_key(env)


def test_frozenlake_answers_name_the_cell_the_frame_shows_the_player_in():
    cfg = load_config("frozenlake_visual")
    probes = perception_probes(cfg.env, 24, 8)
    env = make_env(cfg.env)
    moved = 0
    for probe in probes:
        env.reset(seed=probe.seed)
        start = env.player
        cells = player_cells(env, probe.frame)
        assert len(cells) == 1, probe.question
        row, col = cells[0]
        axis = "row" if probe.question.startswith("Which row") else "column"
        assert probe.answer == (row if axis == "row" else col), probe.question
        assert probe.question.endswith(f"{'Rows' if axis == 'row' else 'Columns'} are numbered 0 to 3 from the "
                                       f"{'top' if axis == 'row' else 'left'}.\n<image>")
        moved += cells[0] != start
    assert moved >= 12  # most frames come after some of the teacher's moves, not only level starts


def test_sokoban_probes_ask_about_every_object_on_distinct_non_evaluation_levels():
    cfg = load_config("sokoban_visual")
    exclude = eval_level_keys(cfg.env, 64)
    probes = perception_probes(cfg.env, 120, 8, exclude)
    names = {p.question.split(" in?")[0] for p in probes}
    assert names == {f"Which {axis} is the {name}" for axis in ("row", "column") for name in ("player", "box", "target")}
    assert all(1 <= p.answer <= 4 for p in probes)  # inside the surrounding walls of a 6x6 room
    env = make_env(cfg.env, {"render_mode": "text"})
    keys = []
    for probe in probes:
        env.reset(seed=probe.seed)
        keys.append(level_key(env))
    assert len(set(keys)) == len(keys) and not set(keys) & exclude
    again = perception_probes(cfg.env, 120, 8, exclude)
    assert [(p.seed, p.question, p.answer) for p in again] == [(p.seed, p.question, p.answer) for p in probes]
    assert all(np.array_equal(np.asarray(a.frame), np.asarray(b.frame)) for a, b in zip(again, probes))


def test_a_probe_sample_trains_on_the_answer_only(tiny_vl):
    _, model, processor = tiny_vl
    cfg = load_config("sokoban_visual")
    probe = perception_probes(cfg.env, 1, 8)[0]
    encoder = ChatEncoder(processor)
    sample = question_sample(encoder, model, probe.frame, probe.question, probe.answer)
    generated = sample.input_ids[sample.loss_mask.bool()].tolist()
    assert processor.tokenizer.decode(generated) == f"<answer>{probe.answer}</answer><|im_end|>"
    answer = sample.input_ids[sample.answer_mask.bool()].tolist()
    assert str(probe.answer) in processor.tokenizer.decode(answer)
    assert sample.image_grid_thw.tolist() == [[1, 12, 12]]  # 168 px: 6x6 merged image tokens


def test_perception_stage_settings_are_checked():
    with pytest.raises(ConfigError, match="sft.perception_steps=-1 must be >= 0"):
        load_config("sokoban_visual", ["sft.perception_steps=-1"])
    with pytest.raises(ConfigError, match="sft.perception_batch_size=0 >= 1"):
        load_config("sokoban_visual", ["sft.perception_batch_size=0"])
    with pytest.raises(ConfigError, match="must name row, column or both"):
        load_config("sokoban_visual", ["sft.perception_axes=[diagonal]"])
    with pytest.raises(ConfigError, match="env.render_mode=text"):
        load_config("frozenlake_text", ["sft.perception_steps=100"])
    with pytest.raises(ValueError, match="no grid state"):
        perception_probes(load_config("navigation_visual", []).env, 4, 8)
    with pytest.raises(ValueError, match="about \\['holes'\\] are not available; choose among player, boxes"):
        perception_probes(load_config("frozenlake_visual", []).env, 4, 8, objects=("player", "holes"))


# a Sokoban build with all three stages, each a few steps long
SOKOBAN_STAGES = ["sft.demos=16", "sft.val_demos=8", "sft.exclude_eval=16", "sft.batch_size=8",
                  "sft.micro_batch_size=8", "sft.check_every=2", "sft.max_steps=2", "sft.min_steps=0",
                  "sft.perception_steps=4", "sft.perception_levels=16", "sft.perception_batch_size=8",
                  "sft.cell_questions=12", "sft.cell_batch_size=8", "rollout.max_turns=2"]


def test_a_sokoban_build_runs_perception_demonstrations_and_cell_questions_in_order(tmp_path, model_cache, distributed):
    cfg = load_config("sokoban_visual", SOKOBAN_STAGES + ["sft.cell_steps=6"])
    base = resolve_model_path(sft.base_path_of(cfg), model_cache)
    said = []
    stats = sft.build_warm_start(cfg, base, tmp_path / "ws", "teacher", distributed, log=said.append)
    assert stats["sft/perception_steps"] == 4 and stats["sft/step"] == 6  # the last stage's steps
    assert 0.0 <= stats["sft/perception_accuracy"] <= 1.0 and 0.25 <= stats["sft/perception_majority"] <= 1.0
    assert sum(line.startswith("perception: sft/val_answer_accuracy=") for line in said) == 2  # steps 2 and 4
    # the demonstrations stage logs between the perception stage and the cell questions
    last_perception = max(i for i, line in enumerate(said) if line.startswith("perception:"))
    first_cells = min(i for i, line in enumerate(said) if line.startswith("cells:"))
    demos = [i for i, line in enumerate(said) if line.startswith("sft/val_answer_accuracy=")]
    assert demos and last_perception < demos[0] and any(i < first_cells for i in demos)
    assert [line.split(" held-out")[0] for line in said if "held-out question accuracy" in line] == [
        "cells: step 2", "cells: step 4", "cells: step 6"]
    assert 0.0 <= stats["sft/cell_accuracy"] <= 1.0
    state = json.loads((tmp_path / "ws" / sft.STATE_FILE).read_text())
    assert state["sft/perception_steps"] == 4 and state["settings"]["sft"]["perception_levels"] == 16
    assert state["settings"]["sft"]["cell_questions"] == 12


def test_the_perception_stage_ends_once_the_model_reads_the_frames_and_warns_if_it_never_does(tmp_path, model_cache, distributed, monkeypatch):
    # held-out accuracy at the target ends the stage at the first check, not at sft.perception_steps
    patch_loop(monkeypatch, "answer_accuracy", lambda *a, **k: {"sft/val_answer_accuracy": sft.PERCEPTION_TARGET,
                                                                "sft/val_nll": 0.1})
    cfg = load_config("sokoban_visual", ["sft.perception_batch_size=8", "sft.check_every=3",
                                         "sft.perception_steps=30", "sft.perception_levels=16"])
    from vagen.models import load_policy

    model, processor = load_policy(resolve_model_path(sft.base_path_of(cfg), model_cache))
    said = []
    stats = sft.perception_stage(model, ChatEncoder(processor), cfg, distributed, log=said.append)
    assert stats["sft/perception_steps"] == 3 and stats["sft/perception_accuracy"] == sft.PERCEPTION_TARGET
    assert not any(line.startswith("warning") for line in said)
    # a stage that never beats the most common answer says so
    patch_loop(monkeypatch, "answer_accuracy", lambda *a, **k: {"sft/val_answer_accuracy": 0.3, "sft/val_nll": 0.2})
    said.clear()
    stats = sft.perception_stage(model, ChatEncoder(processor), cfg, distributed, log=said.append)
    assert stats["sft/perception_steps"] == 30
    warnings = [line for line in said if line.startswith("warning")]
    assert len(warnings) == 1 and "has not learned to read the frames" in warnings[0]
    assert "sft.perception_steps" in warnings[0]


def test_probes_can_be_limited_to_level_starts_and_chosen_questions():
    cfg = load_config("sokoban_visual")
    probes = perception_probes(cfg.env, 12, 0, objects=("player",), axes=("row",))
    env = make_env(cfg.env)
    for probe in probes:
        env.reset(seed=probe.seed)
        assert np.array_equal(np.asarray(probe.frame), np.asarray(env.render_image()))  # no move made
        assert probe.question.startswith("Which row is the player in?")
        assert probe.answer == env.state()["player"][0]


# -- questions about the cells ahead of the player ---------------------------------------------------

def test_cell_answers_name_what_lies_that_many_moves_from_the_player():
    state = {"size": (4, 4), "player": (0, 0), "goal": (3, 3), "holes": [(1, 1), (2, 3)]}
    assert cell_answer(state, (0, 0), ["Right"]) == 0  # frozen ice
    assert cell_answer(state, (0, 0), ["Down", "Right"]) == 1  # the hole at (1, 1)
    assert cell_answer(state, (1, 3), ["Down"]) == 1
    assert cell_answer(state, (2, 2), ["Down", "Right"]) == 2  # the goal
    assert cell_answer(state, (0, 0), ["Up"]) == 3  # off the map
    # the moves add up to an offset: there and back is the player's own cell, even past the edge
    assert cell_answer(state, (0, 2), ["Right", "Left"]) == 0
    assert cell_answer(state, (0, 3), ["Right", "Left"]) == 0
    assert cell_answer(state, (3, 2), ["Right", "Right"]) == 3


def test_sokoban_cell_answers_name_walls_boxes_and_targets():
    state = {"size": (6, 6), "player": (2, 2), "boxes": [(3, 2)], "targets": [(2, 3), (4, 4)],
             "walls": [(r, c) for r in range(6) for c in range(6) if r in (0, 5) or c in (0, 5)] + [(1, 1)]}
    assert cell_answer(state, (2, 2), ["Up"]) == 0  # floor
    assert cell_answer(state, (2, 2), ["Up", "Left"]) == 1  # the inner wall at (1, 1)
    assert cell_answer(state, (2, 2), ["Down"]) == 2  # the box
    assert cell_answer(state, (2, 2), ["Right"]) == 3  # a target
    assert cell_answer(state, (1, 2), ["Up", "Up"]) == 4  # past the outer wall: off the map
    assert cell_answer(state, (1, 2), ["Up"]) == 1
    boxed = dict(state, boxes=[(4, 4)])  # a box on a target is a box: it decides the move
    assert cell_answer(boxed, (3, 4), ["Down"]) == 2
    assert standing_cells(state) == [(r, c) for r in range(1, 5) for c in range(1, 5) if (r, c) not in {(1, 1), (3, 2)}]


@pytest.mark.parametrize("config, legend", [
    ("frozenlake_visual", "0 = frozen ice, 1 = a hole, 2 = the goal, 3 = off the map."),
    ("sokoban_visual", "0 = floor, 1 = a wall, 2 = a box, 3 = a target, 4 = off the map."),
])
def test_cell_probes_show_the_player_where_it_can_stand_and_ask_about_a_cell_ahead(config, legend):
    cfg = load_config(config)
    probes = cell_probes(cfg.env, 24, moves=(1, 2))
    env = make_env(cfg.env)
    assert len(probes) == 24 and len({p.seed for p in probes}) == 12  # two questions per distinct level
    counts, answers = set(), set()
    for probe in probes:
        env.reset(seed=probe.seed)
        state = env.state()
        cells = player_cells(env, probe.frame)
        # FrozenLake: never on a hole or the goal; Sokoban: never on a wall or a box
        assert len(cells) == 1 and cell_answer(state, cells[0], []) in (0, 3), probe.question
        moves = probe.question.split("by moving ")[1].split("?")[0].split(", then ")
        counts.add(len(moves))
        assert probe.answer == cell_answer(state, cells[0], moves), probe.question
        assert probe.question.endswith(legend + "\n<image>")
        answers.add(probe.answer)
    assert counts == {1, 2} and len(answers) >= 3
    again = cell_probes(cfg.env, 24, moves=(1, 2))  # seeded by the level: the same questions again
    assert [(p.seed, p.question, p.answer) for p in again] == [(p.seed, p.question, p.answer) for p in probes]
    skipped = {level_key_of(env, probes[0].seed)}
    assert probes[0].seed not in {p.seed for p in cell_probes(cfg.env, 4, exclude=skipped)}


def test_placing_the_player_refuses_cells_it_cannot_stand_on():
    sokoban = make_env(load_config("sokoban_visual").env)
    sokoban.reset(seed=0)
    with pytest.raises(ValueError, match="holds a wall or a box"):
        sokoban.place_player((0, 0))
    with pytest.raises(ValueError, match="holds a wall or a box"):
        sokoban.place_player(sokoban.state()["boxes"][0])
    lake = make_env(load_config("frozenlake_visual").env)
    lake.reset(seed=0)
    with pytest.raises(ValueError, match="off the 4x4 map"):
        lake.place_player((4, 0))


def test_cell_questions_are_refused_where_they_mean_nothing():
    with pytest.raises(ValueError, match="defined for frozenlake, sokoban, not 'navigation'; set sft.cell_questions=0"):
        cell_probes(load_config("navigation_visual").env, 4)
    with pytest.raises(ValueError, match="at least one move"):
        cell_probes(load_config("frozenlake_visual").env, 4, moves=(0, 2))
    with pytest.raises(ConfigError, match="asks about FrozenLake or Sokoban frames, but env.name=navigation"):
        load_config("navigation_visual", ["sft.cell_questions=100"])
    with pytest.raises(ConfigError, match="env.render_mode=text; set sft.cell_questions=0"):
        load_config("sokoban_text", ["sft.cell_questions=100"])
    with pytest.raises(ConfigError, match="sft.cell_moves=\\[\\] must list move counts"):
        load_config("frozenlake_visual", ["sft.cell_questions=100", "sft.cell_moves=[]"])


def test_the_cell_stage_runs_its_own_schedule_whatever_the_first_stage_used():
    for config in ("frozenlake_visual", "sokoban_visual"):  # cosine and constant first stages
        first = load_config(config, ["sft.cell_questions=10", "sft.cell_steps=7", "sft.cell_batch_size=8"]).sft
        stage = sft.cell_stage_settings(first)
        assert (stage.lr_schedule, stage.max_steps, stage.min_steps, stage.batch_size) == ("cosine", 7, 7, 8)
        assert stage.lr == first.lr and stage.micro_batch_size <= 8


def test_a_build_with_cell_questions_mixes_them_into_a_last_stage(tmp_path, model_cache, distributed):
    overrides = ["sft.demos=16", "sft.val_demos=8", "sft.exclude_eval=16", "sft.batch_size=8",
                 "sft.micro_batch_size=8", "sft.check_every=2", "sft.max_steps=2", "sft.min_steps=0",
                 "sft.cell_questions=12", "sft.cell_steps=4", "sft.cell_batch_size=8", "rollout.max_turns=2"]
    cfg = load_config("frozenlake_visual", overrides)
    base = resolve_model_path(sft.base_path_of(cfg), model_cache)
    said = []
    stats = sft.build_warm_start(cfg, base, tmp_path / "ws", "teacher", distributed, log=said.append)
    assert stats["sft/step"] == 4  # the last stage's steps: its metrics are the warm start's
    assert any(line.startswith("cells: 12 questions mixed into 16 demonstrations") for line in said)
    assert [line.split(" held-out")[0] for line in said if "held-out question accuracy" in line] == [
        "cells: step 2", "cells: step 4"]
    assert 0.0 <= stats["sft/cell_accuracy"] <= 1.0 and 0.25 <= stats["sft/cell_majority"] <= 1.0
    state = json.loads((tmp_path / "ws" / sft.STATE_FILE).read_text())
    assert state["settings"]["sft"]["cell_questions"] == 12 and "sft/val_answer_accuracy_other_frames" in state
    assert state["settings"]["env"]["name"] == "frozenlake" and state["config"] == "frozenlake_visual"


def test_a_cells_only_build_continues_a_warm_start_with_the_cell_stage_alone(tmp_path, model_cache, distributed):
    overrides = SOKOBAN_STAGES + ["sft.cell_steps=4"]
    cfg = load_config("sokoban_visual", overrides)
    base = resolve_model_path(sft.base_path_of(cfg), model_cache)
    said = []
    stats = sft.build_warm_start(cfg, base, tmp_path / "ws", "teacher", distributed, log=said.append, cells_only=True)
    # no perception stage and no demonstration stage: every check is the cell stage's
    assert not any(line.startswith("perception:") for line in said) and "sft/perception_steps" not in stats
    assert [line.split(" held-out")[0] for line in said if "held-out question accuracy" in line] == [
        "cells: step 2", "cells: step 4"]
    assert sum(line.startswith("sft/val_answer_accuracy=") for line in said) == 2  # steps 2 and 4, inside the stage
    state = json.loads((tmp_path / "ws" / sft.STATE_FILE).read_text())
    assert state["stages"] == "cells" and state["sft/step"] == 4 and state["base"] == str(base)
    with pytest.raises(ValueError, match="sft.cell_questions=0; set sft.cell_questions"):
        sft.build_warm_start(load_config("sokoban_visual", overrides + ["sft.cell_questions=0"]), base,
                             tmp_path / "ws2", "teacher", distributed, cells_only=True)
