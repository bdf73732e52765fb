import json

import numpy as np
import pytest

import envs_visual
from envs_visual.grid import load_sprites
from envs_visual.sokoban import (
    PLAYER,
    TILE_NAMES,
    SokobanLevel,
    generate_level,
    solve_level,
    teacher_action,
)


def answer(*actions: str) -> str:
    return f"<think>t</think><answer>{', '.join(actions)}</answer>"


def make_level(text: str, **params):
    env = envs_visual.make("sokoban", render_mode="text", **params)
    env.load_level(SokobanLevel.from_text(text))
    return env


def play(env, actions, per_turn=3):
    """Feed `actions` as responses of `per_turn` actions; returns the rewards and the last step."""
    rewards, result = [], None
    for i in range(0, len(actions), per_turn):
        result = env.step(answer(*actions[i : i + per_turn]))
        rewards.append(result[1])
        if result[2] or result[3]:
            break
    return rewards, result


# -- levels ------------------------------------------------------------------------------------
def test_generate_level_is_a_pure_function_of_the_seed():
    assert generate_level(11) == generate_level(11)
    assert generate_level(11, dim_room=(7, 8), num_boxes=2) == generate_level(
        11, dim_room=(7, 8), num_boxes=2
    )
    assert len({generate_level(s).to_text() for s in range(50)}) > 40


def test_500_seeds_are_solvable_and_not_already_solved():
    lengths = []
    for seed in range(500):
        solution = solve_level(generate_level(seed))
        assert solution is not None, f"seed {seed} unsolvable"
        lengths.append(len(solution))
    assert min(lengths) >= 1
    assert np.mean(lengths) > 3


def test_two_box_levels_are_solvable():
    for seed in range(60):
        level = generate_level(seed, dim_room=(7, 7), num_boxes=2)
        assert len(level.boxes) == 2
        assert solve_level(level) is not None, f"seed {seed}"


@pytest.mark.parametrize("low, high", [(6, None), (None, 3), (4, 6)])
def test_difficulty_filter_bounds_the_optimal_solution_length(low, high):
    for seed in range(15):
        length = len(solve_level(generate_level(seed, min_solution_length=low, max_solution_length=high)))
        assert (low or 0) <= length <= (high or 10**9)


def test_impossible_difficulty_says_how_to_fix():
    with pytest.raises(RuntimeError, match="widen"):
        generate_level(0, min_solution_length=500, max_attempts=20)


def test_solver_node_budget_and_unsolvable_levels():
    dead = SokobanLevel.from_text("######\n#X__O#\n#_P__#\n######")  # box in a corner
    assert solve_level(dead) is None
    assert solve_level(generate_level(3), max_nodes=1) is None


def test_solver_actions_fed_as_responses_reach_success():
    env = envs_visual.make("sokoban", render_mode="text")
    for seed in range(100):
        env.reset(seed=seed)
        solution = env.solve()
        rewards, (_, _, terminated, _, info) = play(env, solution)
        assert terminated and info["success"], seed


def test_solve_from_the_middle_of_an_episode():
    env = envs_visual.make("sokoban", render_mode="text")
    env.reset(seed=5)
    full = env.solve()
    env.step(answer(full[0]))
    assert len(env.solve()) == len(full) - 1


# -- dynamics ----------------------------------------------------------------------------------
def test_push_into_wall_does_nothing():
    env = make_level("######\n#XP_O#\n######")
    before = env.state()
    _, reward, _, _, info = env.step(answer("Left"))
    assert env.state() == before
    assert reward == pytest.approx(-0.1 + 0.5) and not info["action_is_effective"]


def test_walk_into_wall_costs_a_step():
    env = make_level("######\n#XP_O#\n######")
    _, reward, _, _, info = env.step(answer("Up"))
    assert reward == pytest.approx(-0.1 + 0.5) and not info["action_is_effective"]


def test_two_boxes_in_a_row_cannot_be_pushed():
    env = make_level("#######\n#_XXP_#\n#_OO__#\n#######")
    before = env.state()
    _, reward, _, _, info = env.step(answer("Left"))
    assert env.state() == before and reward == pytest.approx(-0.1 + 0.5)
    assert not info["action_is_effective"]


def test_box_on_and_off_target_rewards_and_solved_bonus():
    env = make_level(
        """
        #######
        #P√_O_#
        #_X___#
        #_____#
        #######
        """,
        format_reward=0.0,
    )
    expected = [-1.1, 0.9, -0.1, -0.1, -0.1, 10.9]  # off, on, walk x3, on + solved
    for action, value in zip(["Right", "Right", "Down", "Down", "Left", "Up"], expected):
        _, reward, terminated, _, info = env.step(answer(action))
        assert reward == pytest.approx(value), action
    assert terminated and info["success"] and info["boxes_on_target"] == 2
    assert env.render_text().splitlines()[1:3] == ["#_√_√_#", "#_P___#"]


def test_single_box_onto_target_solves_with_bonus():
    env = make_level("######\n#OXP_#\n######", format_reward=0.0)
    _, reward, terminated, truncated, info = env.step(answer("Left", "Right"))
    assert reward == pytest.approx(-0.1 + 1 + 10) and terminated and not truncated
    assert info["actions"] == ["Left"], "actions after the episode ends are not executed"
    _, reward, _, _, info = env.step(answer("Right"))
    assert info["actions"] == [] and reward == pytest.approx(0.0)


def test_push_box_between_targets_nets_zero():
    env = make_level("#######\n#O√P__#\n#___X_#\n#_____#\n#######", format_reward=0.0)
    _, reward, _, _, _ = env.step(answer("Left"))
    assert reward == pytest.approx(-0.1)


def test_truncated_after_max_steps():
    env = make_level("######\n#XP_O#\n#____#\n######", max_steps=2)
    _, _, terminated, truncated, info = env.step(answer("Up", "Up", "Up"))
    assert truncated and not terminated and info["steps"] == 2


# -- rendering ---------------------------------------------------------------------------------
LEVEL_TEXT = "######\n#_√__#\n#_X_S#\n#____#\n######"


def test_text_render_round_trip_and_symbols():
    level = SokobanLevel.from_text(LEVEL_TEXT)
    assert level.to_text() == LEVEL_TEXT
    env = make_level(LEVEL_TEXT)
    assert env.render_text() == LEVEL_TEXT
    obs, _ = env.load_level(level)
    assert LEVEL_TEXT in obs.text and obs.images == [] and "<image>" not in obs.text


@pytest.mark.parametrize("bad", ["#_#\n#P#", "###\n#P#\n###", "#####\n#PXO_\n#####", "####\n#PZ#\n####"])
def test_from_text_rejects_bad_levels(bad):
    with pytest.raises(ValueError):
        SokobanLevel.from_text(bad)


@pytest.mark.parametrize("cell_size, pixels", [(28, 168), (16, 96), (14, 84)])
def test_observation_geometry(cell_size, pixels):
    env = envs_visual.make("sokoban", cell_size=cell_size)
    obs, _ = env.reset(seed=1)
    assert obs.text.count("<image>") == len(obs.images) == 1
    assert obs.images[0].size == (pixels, pixels) and obs.images[0].mode == "RGB"
    assert "#" not in obs.text, "vision observations never contain the symbol grid"
    obs, *_ = env.step(answer("Left"))
    assert obs.text.count("<image>") == len(obs.images) == 1


def test_frame_is_tiled_from_the_sprites():
    env = envs_visual.make("sokoban", cell_size=16)
    obs, _ = env.reset(seed=2)
    frame = np.asarray(obs.images[0])
    r, c = env.state()["player"]
    sheet = load_sprites("sokoban", TILE_NAMES, 16)
    assert np.array_equal(frame[r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16], sheet[PLAYER])
    assert len({sheet[i].tobytes() for i in range(len(TILE_NAMES))}) == len(TILE_NAMES)


def test_determinism_images_text_and_rewards():
    runs = []
    for _ in range(2):
        env = envs_visual.make("sokoban")
        obs, _ = env.reset(seed=42)
        trace = [obs.text, obs.images[0].tobytes()]
        for action in ["Left", "Up", "Right", "Down", "Down", "Left"]:
            obs, reward, terminated, truncated, info = env.step(answer(action))
            trace += [obs.text, obs.images[0].tobytes(), reward, terminated, truncated, env.render_text()]
        runs.append(trace)
    assert runs[0] == runs[1]
    text_env = envs_visual.make("sokoban", render_mode="text")
    assert text_env.reset(seed=42)[0].text != text_env.reset(seed=43)[0].text


# -- state and teacher ----------------------------------------------------------------------------
def test_state_is_plain_data():
    env = make_level(LEVEL_TEXT)
    state = env.state()
    assert set(state) == {"size", "player", "boxes", "targets", "walls"}
    assert state["player"] == (2, 4) and state["boxes"] == [(1, 2), (2, 2)]
    assert state["targets"] == [(1, 2), (2, 4)] and (0, 0) in state["walls"]
    assert json.loads(json.dumps(state))["size"] == [5, 6]


def test_teacher_plays_valid_moves_and_often_solves():
    env = envs_visual.make("sokoban", render_mode="text", max_steps=40)
    rng = np.random.default_rng(0)
    solved = 0
    for seed in range(40):
        env.reset(seed=seed)
        info = {"success": False}
        for _ in range(40):
            action = teacher_action(env.state(), rng)
            assert action in env.action_names
            _, _, terminated, truncated, info = env.step(answer(action))
            if terminated or truncated:
                break
        solved += info["success"]
    assert 0.5 <= solved / 40 < 1.0 or solved == 40


def test_teacher_pushes_toward_target_when_behind_the_box():
    env = make_level("#######\n#_OXP_#\n#_____#\n#######")
    assert teacher_action(env.state()) == "Left"
    env = make_level("#######\n#_OX__#\n#___P_#\n#######")
    assert teacher_action(env.state()) in ("Up", "Right")  # first step toward the pushing cell


def test_teacher_does_not_plan_around_walls():
    # the pushing cell (1, 4) is reached only via the right column; the teacher steps greedily
    # toward it and, below the wall, has no closer step left: a random valid move
    env = make_level("#######\n#_OX__#\n#_##__#\n#__P__#\n#######")
    assert teacher_action(env.state()) == "Right"  # closer to the pushing cell
    env = make_level("#######\n#_OX__#\n#_###_#\n#___P_#\n#######")
    moves = {teacher_action(env.state(), np.random.default_rng(seed)) for seed in range(20)}
    assert moves == {"Left", "Right"}
    assert env.solve()[0] == "Right"
