import collections
from types import SimpleNamespace

from benchmark_scripts import load

from vagen.config import load_config
from vagen.rollout import make_env


def turn(clauses: str, actions: list[str]):
    return SimpleNamespace(response=f"<think>{clauses}</think><answer>{', '.join(actions)}</answer>",
                           info={"actions": actions})


def test_sokoban_replay_splits_moves_that_change_nothing_and_checks_each_clause_position():
    cfg = load_config("sokoban_visual", [])
    env = make_env(cfg.env, {"render_mode": "text"})
    env.reset(seed=3)
    assert env.render_text().split() == ["######", "#__###", "#X_###", "#O_###", "#P_###", "######"]
    episode = SimpleNamespace(seed=3, success=False, turns=[
        # Left walks into the wall, so the player still stands on row 4, column 1 for Right
        turn("row 4, column 1: go left. row 4, column 1: go right. row 4, column 2: go up.", ["Left", "Right", "Up"]),
        # Left pushes the box into the wall; the second clause names a cell the player is not on
        turn("row 3, column 2: go up. row 1, column 2: push left.", ["Up", "Left"]),
    ])
    counts = collections.Counter()
    assert load("failures").replay_sokoban(cfg, episode, counts) == "out of turns"
    assert [counts[i, "actions"] for i in range(3)] == [2, 2, 1]
    assert [counts[i, "no effect"] for i in range(3)] == [1, 1, 0]
    assert (counts[0, "into a wall"], counts[0, "box stuck"]) == (1, 0)
    assert (counts[1, "into a wall"], counts[1, "box stuck"]) == (0, 1)
    assert [counts[i, "where"] for i in range(3)] == [2, 1, 1]
    assert counts[1, "deadlock"] == 0  # the box did not move, the level is still solvable
    # the teacher would walk up toward (1, 1), above the box, to push it down onto the target: the
    # agent's third move and its first of the second turn are that step, its others are not
    assert [counts[i, "approach"] for i in range(3)] == [2, 2, 1]
    assert [counts[i, "teacher approach"] for i in range(3)] == [1, 0, 1]
    assert sum(counts[i, "push"] for i in range(3)) == 0
