import json
from collections import Counter

import numpy as np
import pytest

import envs_visual
from envs_visual.frozenlake import FrozenLakeLevel, generate_level, teacher_action
from envs_visual.grid import bfs_path


def answer(*actions: str) -> str:
    return f"<think>t</think><answer>{', '.join(actions)}</answer>"


def make_level(text: str, seed: int = 0, **params):
    env = envs_visual.make("frozenlake", render_mode="text", **params)
    env.load_level(FrozenLakeLevel.from_text(text), seed=seed)
    return env


MAP = """
P_O_
__O_
____
O__G
"""


def test_generate_level_is_pure_and_varied():
    a, b = generate_level(3), generate_level(3)
    assert np.array_equal(a.holes, b.holes) and (a.start, a.goal) == (b.start, b.goal)
    assert len({generate_level(s).holes.tobytes() for s in range(40)}) > 20
    assert {(generate_level(s).start, generate_level(s).goal) for s in range(40)} == {((0, 0), (3, 3))}
    random_levels = [generate_level(s, random_start_goal=True) for s in range(40)]
    assert len({(level.start, level.goal) for level in random_levels}) > 20


@pytest.mark.parametrize("size, p", [(4, 0.8), (6, 0.6), (8, 0.8)])
@pytest.mark.parametrize("random_start_goal", [False, True])
def test_every_map_has_a_path(size, p, random_start_goal):
    for seed in range(500 if size == 4 else 100):
        level = generate_level(seed, size, p, random_start_goal=random_start_goal)
        assert level.start != level.goal
        assert not level.holes[level.start] and not level.holes[level.goal]
        assert bfs_path(~level.holes, level.start, level.goal) is not None, seed


def test_low_p_fails_with_a_hint():
    with pytest.raises(ValueError, match="p"):
        envs_visual.make("frozenlake", p=0.0)


def test_solver_actions_fed_as_responses_reach_success():
    env = envs_visual.make("frozenlake", render_mode="text", size=6)
    for seed in range(100):
        env.reset(seed=seed)
        solution = env.solve()
        info = {}
        for i in range(0, len(solution), 3):
            _, reward, terminated, _, info = env.step(answer(*solution[i : i + 3]))
        assert info["success"] and terminated and reward == pytest.approx(1.5), seed


def test_walking_off_the_map_stays_in_place():
    env = make_level(MAP)
    _, reward, terminated, _, info = env.step(answer("Up", "Left"))
    assert env.state()["player"] == (0, 0) and reward == pytest.approx(0.5)
    assert not info["action_is_effective"] and not terminated


def test_hole_terminates_without_success():
    env = make_level(MAP)
    _, reward, terminated, truncated, info = env.step(answer("Right", "Right", "Down"))
    assert info["actions"] == ["Right", "Right"], "the hole ends the episode before the third action"
    assert terminated and not truncated and not info["success"] and info["fell_in_hole"]
    assert reward == pytest.approx(0.5)
    assert env.render_text().splitlines()[0] == "__X_"


def test_goal_pays_one_and_terminates():
    env = make_level(MAP, format_reward=0.0)
    env.step(answer("Down", "Down", "Right"))
    _, reward, terminated, _, info = env.step(answer("Right", "Down", "Right"))
    assert info["actions"] == ["Right", "Down", "Right"]
    assert reward == pytest.approx(1.0) and terminated and info["success"]
    assert env.render_text().splitlines()[3] == "O__√"


def test_text_symbols_and_round_trip():
    env = make_level(MAP)
    assert env.render_text() == MAP.strip()
    obs, _ = env.load_level(FrozenLakeLevel.from_text(MAP))
    assert MAP.strip() in obs.text and obs.images == []


def test_slip_distribution():
    """Intended direction or either perpendicular one, 1/3 each; never backwards."""
    level = FrozenLakeLevel.from_text("_____\n_____\n__P__\n_____\n____G")
    env = envs_visual.make("frozenlake", render_mode="text", is_slippery=True)
    moves = Counter()
    n = 3000
    for seed in range(n):
        env.load_level(level, seed=seed)
        env.step(answer("Down"))
        moves[env.state()["player"]] += 1
    assert set(moves) == {(3, 2), (2, 1), (2, 3)}
    for cell in ((3, 2), (2, 1), (2, 3)):
        assert abs(moves[cell] / n - 1 / 3) < 0.04, moves


def test_slipping_is_reproducible_per_seed():
    env = envs_visual.make("frozenlake", render_mode="text", is_slippery=True, size=6)
    runs = []
    for _ in range(2):
        env.reset(seed=9)
        runs.append([env.step(answer("Down", "Right"))[4]["position"] for _ in range(5)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("cell_size, pixels", [(28, 112), (16, 64), (14, 56)])
def test_observation_geometry(cell_size, pixels):
    env = envs_visual.make("frozenlake", cell_size=cell_size)
    obs, _ = env.reset(seed=0)
    assert obs.text.count("<image>") == len(obs.images) == 1
    assert obs.images[0].size == (pixels, pixels)
    assert "_" not in obs.text.split("\n")[-1]


def test_determinism_images_text_and_rewards():
    runs = []
    for _ in range(2):
        env = envs_visual.make("frozenlake", is_slippery=True)
        obs, _ = env.reset(seed=5)
        trace = [obs.text, obs.images[0].tobytes()]
        for action in ["Down", "Right", "Right", "Down", "Left"]:
            obs, reward, terminated, truncated, _ = env.step(answer(action))
            trace += [obs.text, obs.images[0].tobytes(), reward, terminated, truncated]
        runs.append(trace)
    assert runs[0] == runs[1]


def test_state_is_plain_data():
    env = make_level(MAP)
    state = env.state()
    assert state == {
        "size": (4, 4),
        "player": (0, 0),
        "start": (0, 0),
        "goal": (3, 3),
        "holes": [(0, 2), (1, 2), (3, 0)],
    }
    json.dumps(state)


def test_teacher_avoids_adjacent_holes_and_usually_succeeds():
    env = envs_visual.make("frozenlake", render_mode="text", max_steps=30)
    rng = np.random.default_rng(0)
    successes = 0
    for seed in range(60):
        env.reset(seed=seed)
        info = {}
        for _ in range(30):
            _, _, terminated, truncated, info = env.step(answer(teacher_action(env.state(), rng)))
            assert not info["fell_in_hole"], seed
            if terminated or truncated:
                break
        successes += info["success"]
    assert successes / 60 > 0.6
    assert teacher_action(make_level("P_O\n_OG\n___").state()) == "Down"


def test_teacher_styles_mirror_each_other_and_reject_unknown_styles():
    # P _ _      "rows" steps down, "columns" right; on the transposed map each does the other's move
    # _ O _
    # _ _ G
    level = make_level("P__\n_O_\n__G").state()
    assert teacher_action(level, style="rows") == "Down"
    assert teacher_action(level, style="columns") == "Right"
    env = envs_visual.make("frozenlake", render_mode="text")
    swap = {"Down": "Right", "Right": "Down", "Up": "Left", "Left": "Up"}
    for seed in range(40):
        env.reset(seed=seed)
        state = env.state()
        transposed = {**state, "player": state["player"][::-1], "goal": state["goal"][::-1],
                      "holes": [tuple(h)[::-1] for h in state["holes"]]}
        assert teacher_action(transposed, style="columns") == swap[teacher_action(state, style="rows")], seed
    with pytest.raises(ValueError, match="unknown FrozenLake teacher style 'diagonal'.*rows, columns"):
        teacher_action(level, style="diagonal")
