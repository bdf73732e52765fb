"""`info["state_key"]` and the state scores after the per-step cost cut: the keys GiGPO groups turns by are
the same values, hashes included, as the plain reference `reference_key(env.state())` gives on fixed seeds
and actions, and the graded relations match a fresh computation on every step."""

from __future__ import annotations

import numpy as np
import pytest

import envs_visual
from envs_visual.base import format_response
from envs_visual.frozenlake import FrozenLakeLevel
from envs_visual.sokoban import SokobanLevel
from envs_visual.state_grader import grade, grid_relation


def reference_key(value):
    """The state key as first defined: `state()` made hashable by one recursive walk (dicts as sorted
    (str(key), value) pairs, sequences and arrays as tuples, sets sorted, numpy scalars as numbers)."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), reference_key(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(reference_key(v) for v in value)
    if isinstance(value, np.ndarray):
        return tuple(reference_key(v) for v in value.tolist())
    if isinstance(value, set | frozenset):
        return tuple(sorted(reference_key(v) for v in value))
    if isinstance(value, np.generic):
        return value.item()
    return value


def same_key(key, expected) -> None:
    assert key == expected, (key, expected)
    assert hash(key) == hash(expected)
    # the same types too (an int where the reference has an int), so that pickled and logged keys match
    assert repr(key) == repr(expected)


def play(env, seeds, turns: int, answers) -> int:
    """Plays `turns` turns per seed, answers drawn from `answers` by a fixed rule; checks every key."""
    checked = 0
    for seed in seeds:
        _, info = env.reset(seed=seed)
        same_key(info["state_key"], reference_key(env.state()))
        for turn in range(turns):
            answer = answers[(seed * 5 + turn * 3) % len(answers)]
            _, _, terminated, truncated, info = env.step(format_response(env.prompt_format, answer))
            same_key(info["state_key"], reference_key(env.state()))
            checked += 1
            if terminated or truncated:
                break
    return checked


GRID_ANSWERS = ["Up", "Left, Left", "Down, Right", "Right, Up, Up", "Down", "Left, Down, Right", "up, up"]


@pytest.mark.parametrize("params", [{}, {"dim_room": (8, 8), "num_boxes": 2}, {"render_mode": "text"}])
def test_sokoban_state_key_equals_the_reference(params):
    env = envs_visual.make("sokoban", **params)
    assert play(env, range(12), 15, GRID_ANSWERS) > 100


@pytest.mark.parametrize("params", [{}, {"size": 6, "is_slippery": True, "random_start_goal": True}])
def test_frozenlake_state_key_equals_the_reference(params):
    env = envs_visual.make("frozenlake", render_mode="text", **params)
    assert play(env, range(12), 10, GRID_ANSWERS) > 40


def test_state_key_of_hand_made_levels_and_moved_players():
    sokoban = envs_visual.make("sokoban", render_mode="text")
    for text in ("#####\n#P_O#\n#_X_#\n#___#\n#####", "######\n#S___#\n#_X__#\n#__XO#\n######"):
        _, info = sokoban.load_level(SokobanLevel.from_text(text))
        same_key(info["state_key"], reference_key(sokoban.state()))
    sokoban.place_player((3, 1))
    same_key(sokoban.state_key(), reference_key(sokoban.state()))
    lake = envs_visual.make("frozenlake", render_mode="text")
    _, info = lake.load_level(FrozenLakeLevel.from_text("P_O\n_O_\n__G"))
    same_key(info["state_key"], reference_key(lake.state()))
    lake.place_player((2, 1))
    same_key(lake.state_key(), reference_key(lake.state()))


def test_text_envs_state_key_equals_the_reference():
    bandit = envs_visual.make("bandit")
    for seed in range(6):
        _, info = bandit.reset(seed=seed)
        same_key(info["state_key"], reference_key(bandit.state()))
        arm = bandit.action_names[seed % 2]
        info = bandit.step(format_response(bandit.prompt_format, arm))[4]
        same_key(info["state_key"], reference_key(bandit.state()))
    countdown = envs_visual.make("countdown")
    for seed, answer in enumerate(["(7 - 3) * 5 + 2", "1 / 0", "not an expression", "8 + 4 - 8 - 2"]):
        _, info = countdown.reset(seed=seed)
        same_key(info["state_key"], reference_key(countdown.state()))
        info = countdown.step(format_response(countdown.prompt_format, answer))[4]
        same_key(info["state_key"], reference_key(countdown.state()))


def test_navigation_state_key_is_the_quantised_pose():
    env = envs_visual.make("navigation", render_mode="text")
    answers = ["moveahead", "rotateleft, moveahead", "lookdown, rotateright", "moveleft, moveback", "lookup"]
    for seed in range(3):
        _, info = env.reset(seed=seed)
        for turn in range(6):
            pose = env.state()["agent"]
            expected = (seed, round(pose["x"] / 0.001), round(pose["y"] / 0.001), round(pose["yaw"] / 0.1) % 3600,
                        round(pose["pitch"] / 0.1))
            same_key(info["state_key"], expected)
            info = env.step(format_response(env.prompt_format, answers[(seed + turn) % len(answers)]))[4]


@pytest.mark.parametrize("name", ["sokoban", "frozenlake"])
def test_graded_relations_and_scores_follow_every_step(name):
    """The relations of the state before and after each turn, and the grounding and world-model scores, equal
    a fresh computation from the positions (no stale relations across steps, levels or moved players)."""
    env = envs_visual.make(name, render_mode="text", prompt_format="grounding_worldmodeling")

    def relations() -> list[list[str]]:
        state = env.state()
        if name == "sokoban":
            cells = [("box", b) for b in state["boxes"]] + [("target", t) for t in state["targets"]]
        else:
            cells = [("goal", state["goal"])] + [("hole", h) for h in state["holes"]]
        return [list(grid_relation(kind, state["player"], cell)) for kind, cell in cells]

    graded = 0
    for seed in range(8):
        env.reset(seed=seed)
        if seed % 3 == 2:  # a moved player between turns must not reuse the last turn's relations
            free = [(r, c) for r in range(env.state()["size"][0]) for c in range(env.state()["size"][1])
                    if (r, c) not in env.state().get("walls", []) and (r, c) not in env.state().get("boxes", [])
                    and (r, c) not in env.state().get("holes", [])]
            env.place_player(free[seed % len(free)])
        for turn in range(8):
            before = relations()
            text = env.describe_state()
            answer = GRID_ANSWERS[(seed + turn) % len(GRID_ANSWERS)]
            response = format_response(env.prompt_format, answer, {"observation": text, "prediction": text})
            _, _, terminated, truncated, info = env.step(response)
            assert info["state_before"] == before
            assert info["state_after"] == relations()
            vocabulary = env.state_vocabulary()
            assert info["grounding_score"] == grade(text, before, env.state_weights, vocabulary) == 1.0
            assert info["worldmodel_score"] == grade(text, info["state_after"], env.state_weights, vocabulary)
            graded += 1
            if terminated or truncated:
                break
    assert graded > 20


def test_free_think_steps_carry_the_relations_but_no_scores():
    env = envs_visual.make("sokoban", render_mode="text", prompt_format="free_think")
    env.reset(seed=4)
    info = env.step(format_response("free_think", "Up", {"think": "The box is above me."}))[4]
    assert info["grounding_score"] is None and info["worldmodel_score"] is None
    assert info["state_after"] == [list(r) for r in env.state_relations()] and len(info["state_after"]) == 2
