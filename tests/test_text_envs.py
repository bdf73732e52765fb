from fractions import Fraction

import pytest

import envs_visual
from envs_visual import bandit, countdown
from envs_visual.countdown import ExpressionError, evaluate


def answer(text: str) -> str:
    return f"<think>t</think><answer>{text}</answer>"


# -- bandit ------------------------------------------------------------------------------------
def test_bandit_arms_come_from_the_seed():
    assert bandit.generate_level(4) == bandit.generate_level(4)
    levels = [bandit.generate_level(s) for s in range(200)]
    assert len({tuple(level["arms"]) for level in levels}) > 50
    first_is_low = sum(level["arms"][0] == level["low_risk"] for level in levels) / 200
    assert 0.35 < first_is_low < 0.65
    for level in levels:
        assert {level["low_risk"], level["high_risk"]} == set(level["arms"])


def test_bandit_prompt_labels_both_arms():
    env = envs_visual.make("bandit")
    obs, _ = env.reset(seed=1)
    low, high = env.state()["low_risk"], env.state()["high_risk"]
    for text in (env.system_prompt(), obs.text):
        assert f"{low} (low-risk)" in text or f"{low}: low-risk" in text
        assert f"{high} (high-risk)" in text or f"{high}: high-risk" in text
    assert "actions per turn" not in env.system_prompt()


def test_bandit_low_risk_pays_point_one_and_ends():
    env = envs_visual.make("bandit", format_reward=0.0)
    env.reset(seed=2)
    low = env.state()["low_risk"]
    _, reward, terminated, _, info = env.step(answer(low.upper()))
    assert reward == pytest.approx(0.1) and terminated and not info["success"] and info["actions"] == [low]


def test_bandit_high_risk_pays_one_a_quarter_of_the_time():
    env = envs_visual.make("bandit", format_reward=0.0)
    rewards = []
    for seed in range(2000):
        env.reset(seed=seed)
        _, reward, terminated, _, info = env.step(answer(env.state()["high_risk"]))
        assert terminated and info["success"] and reward in (0.0, 1.0)
        rewards.append(reward)
    assert abs(sum(rewards) / len(rewards) - 0.25) < 0.04


def test_bandit_unknown_arm_is_invalid_and_keeps_the_episode():
    env = envs_visual.make("bandit")
    env.reset(seed=3)
    _, reward, terminated, _, info = env.step(answer("Unicorn"))
    assert reward == 0.0 and not terminated and info["format_ok"] and not info["action_is_valid"] and env.state()["pulled"] is None


def test_bandit_only_first_pull_counts():
    env = envs_visual.make("bandit", format_reward=0.0)
    env.reset(seed=3)
    low, high = env.state()["low_risk"], env.state()["high_risk"]
    _, reward, _, _, info = env.step(answer(f"{low}, {high}"))
    assert info["actions"] == [low] and reward == pytest.approx(0.1)


def test_bandit_is_reproducible():
    env = envs_visual.make("bandit")
    outcomes = set()
    for _ in range(2):
        env.reset(seed=17)
        outcomes.add(env.step(answer(env.state()["high_risk"]))[1])
    assert len(outcomes) == 1


# -- countdown parser --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("1 + 2 * 3", 7, [1, 2, 3]),
        ("(1 + 2) * 3", 9, [1, 2, 3]),
        ("8 - 3 - 2", 3, [8, 3, 2]),
        ("8 / 4 / 2", 1, [8, 4, 2]),
        ("(1 / 3) * 3", 1, [1, 3, 3]),
        ("7 / 2", Fraction(7, 2), [7, 2]),
        ("6 × 4 ÷ 3 − 1", 7, [6, 4, 3, 1]),
        ("((((5))))", 5, [5]),
        ("5 / (3 - 3)", None, [5, 3, 3]),
    ],
)
def test_expression_values_are_exact(text, value, numbers):
    assert evaluate(text) == (value, numbers)


@pytest.mark.parametrize(
    "text",
    ["", "2 ** 3", "2 ^ 3", "-3 + 5", "3.5 + 1", "1e3", "(1 + 2", "1 + 2)", "1 2", "+", "__import__('os')",
     "abs(3)", "x + 1", "1 + + 2", "()", "1_000", "١ + 2", "(" * 1000 + "1" + ")" * 1000, "(" * 40 + "1" + ")" * 40, "1" * 12, "1+" * 150 + "1"],
)  # fmt: skip
def test_expression_rejections_never_eval(text):
    with pytest.raises(ExpressionError):
        evaluate(text)


# -- countdown env -----------------------------------------------------------------------------
def test_countdown_puzzles_are_solvable_by_construction():
    for seed in range(300):
        puzzle = countdown.generate_level(seed)
        value, used = evaluate(puzzle["solution"])
        assert value == puzzle["target"] and sorted(used) == sorted(puzzle["numbers"])
        assert 1 <= puzzle["target"] <= 100 and len(puzzle["numbers"]) == 4
    assert countdown.generate_level(5) == countdown.generate_level(5)


def test_countdown_rewards():
    env = envs_visual.make("countdown", format_reward=0.0)
    env.reset(seed=0)
    puzzle = countdown.generate_level(0)
    _, reward, terminated, _, info = env.step(answer(puzzle["solution"] + f" = {puzzle['target']}"))
    assert reward == 1.0 and terminated and info["success"]

    a, b, c, d = puzzle["numbers"]
    wrong = f"{a} + {b} + {c} + {d} + 0 * 1"  # extra numbers
    right_numbers_wrong_value = next(
        e
        for e in (f"{a} + {b} + {c} + {d}", f"{a} * {b} * {c} * {d}", f"{a} - {b} - {c} - {d}")
        if evaluate(e)[0] != puzzle["target"]
    )
    for text, expected in ((right_numbers_wrong_value, 0.1), (wrong, 0.0), (f"{a} + {b}", 0.0)):
        env.reset(seed=0)
        _, reward, terminated, _, info = env.step(answer(text))
        assert reward == pytest.approx(expected) and terminated and not info["success"], text


def test_countdown_format_reward_and_invalid_answers():
    env = envs_visual.make("countdown")
    obs, _ = env.reset(seed=1)
    assert "Numbers:" in obs.text and "Target:" in obs.text
    _, reward, terminated, _, info = env.step(answer("seven times three"))
    assert reward == 0.0 and not terminated and info["format_ok"] and not info["action_is_valid"] and env.state()["answer"] is None
    _, reward, terminated, _, info = env.step(answer("1 / 0"))
    assert reward == pytest.approx(0.5) and terminated and info["format_ok"] and info["value"] is None


def test_countdown_params():
    env = envs_visual.make("countdown", num_numbers=3, max_number=9, max_target=50)
    env.reset(seed=2)
    assert len(env.state()["numbers"]) == 3 and max(env.state()["numbers"]) <= 9
    with pytest.raises(ValueError, match="num_numbers"):
        envs_visual.make("countdown", num_numbers=1)
