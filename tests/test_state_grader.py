"""The rule-based state grader (envs_visual.state_grader) and the envs' true relations."""

import json
import random
import re

import pytest

import envs_visual
from envs_visual.frozenlake import FrozenLakeLevel
from envs_visual.sokoban import SokobanLevel
from envs_visual.state_grader import (
    MAX_CHARS,
    UNKNOWN,
    Relation,
    describe_grid,
    egocentric_vocabulary,
    grade,
    grid_vocabulary,
    max_matching,
    parse_relations,
)

SOKOBAN_WEIGHTS = {"box": 0.5, "target": 0.5}
FROZENLAKE_WEIGHTS = {"goal": 0.7, "hole": 0.3}
SOKOBAN_VOCAB = grid_vocabulary({"box": "box", "crate": "box", "target": "target", "goal": "target"})
FROZENLAKE_VOCAB = grid_vocabulary({"goal": "goal", "flag": "goal", "hole": "hole", "pit": "hole"})
NAV_VOCAB = egocentric_vocabulary({"red table": "red table", "table": "red table", "target": "red table",
                                   "blue table": None, "green chair": None})
SOKOBAN_TRUE = [("box", "above", "left"), ("target", "same", "right")]
FROZENLAKE_TRUE = [("goal", "below", "right"), ("hole", "same", "right"), ("hole", "below", "left")]
NAV_TRUE = [("red table", "left", "far")]

ALL_NINE = ", ".join(f"{v} {h}" for v in ("above", "below", "in the same row")
                     for h in ("left", "right", "in the same column"))


def sokoban_grade(text, truth=SOKOBAN_TRUE):
    return grade(text, truth, SOKOBAN_WEIGHTS, SOKOBAN_VOCAB)


def frozenlake_grade(text, truth=FROZENLAKE_TRUE):
    return grade(text, truth, FROZENLAKE_WEIGHTS, FROZENLAKE_VOCAB)


def nav_grade(text, truth=NAV_TRUE):
    return grade(text, truth, {"red table": 1.0}, NAV_VOCAB)


# -- hand-written scores ------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("The box is above and to the left of me; the target is directly right", 1.0),
    ("Above and to the left of me is the box, and directly right is the target.", 1.0),
    ("target: east, same row. crate: north-west", 1.0),
    ("I am below and to the right of the box. I am directly left of the target.", 1.0),
    # half right: the box exactly, the target on the wrong side
    ("The box is above and to the left of me. The target is on my left, in the same row.", 0.5),
    # the box's horizontal axis unstated: half a match, F1 = 2 * 0.5 / (1 + 1) = 0.5 for the box
    ("The box is above me; the target is directly right", 0.75),
    ("The box is below and to the right of me. The target is above me.", 0.0),
    ("I see a room with walls.", 0.0),
    # a hedge: a second, different position of the one box zeroes the box
    ("The box is above and below me, to the left. The target is directly right.", 0.5),
    # kitchen sink: every combination for both kinds
    (f"The box is {ALL_NINE}. The target is {ALL_NINE}.", 0.0),
    # one-to-one matching: two boxes described, one true: F1 = 2 * 1 / (2 + 1)
    ("The box is above and to the left of me. Another box is above and to the left of me. "
     "The target is directly right.", 0.5 * 2 / 3 + 0.5),
    ("", 0.0),
    ("   \n\t ", 0.0),
])
def test_sokoban_scores(text, expected):
    assert sokoban_grade(text) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [
    ("The goal is below and to the right of me. A hole is on my right, in the same row. "
     "A hole is below and to the left of me.", 1.0),
    ("Holes: one directly right, one down-left. Goal: bottom right.", 1.0),
    ("The goal is below and to the right of me.", 0.7),
    # one of the two holes: F1 = 2 * 1 / (1 + 2)
    ("The goal is below and to the right of me. A hole is on my right, in the same row.", 0.7 + 0.3 * 2 / 3),
    # two holes below, column unstated: one half-match, F1 = 2 * 0.5 / (2 + 2)
    ("The goal is below and to the right of me. Two holes are below me.", 0.7 + 0.3 * 0.25),
    ("The goal is above me and to the left. There are no holes.", 0.0),
    (f"The goal is below and to the right of me. Holes: {ALL_NINE}.", 0.7),
    ("", 0.0),
])
def test_frozenlake_scores(text, expected):
    assert frozenlake_grade(text) == pytest.approx(expected)


def test_frozenlake_without_holes_grades_the_goal_only():
    truth = [("goal", "below", "right")]
    assert frozenlake_grade("The goal is below and to the right of me. There are no holes.", truth) == 1.0
    assert frozenlake_grade("The goal is below and to the right of me.", truth) == 1.0
    # holes absent and unmentioned are left out: a wrong goal is 0, not 0.3
    assert frozenlake_grade("The goal is above me, in the same column.", truth) == 0.0
    # a hole claimed where there is none: F1 0 for holes, weights 0.7 / 0.3
    assert frozenlake_grade("The goal is below and to the right of me. A hole is on my left.", truth) \
        == pytest.approx(0.7)


@pytest.mark.parametrize("text, expected", [
    ("The red table is 34 degrees to my left, far, 3.2 m away.", 1.0),
    ("the table: left side of the view, far away", 1.0),
    ("The red table is ahead on the left, 3.5 metres away.", 1.0),
    ("The red table is on my left.", 0.5),
    ("The red table is on my right, far.", 0.0),
    ("The red table is 3 degrees to my left, far.", 0.0),  # under 5 degrees: straight ahead
    ("The red table is on my left, 1.5 m away.", 0.0),  # near, not far
    ("The blue table is on my left, far away.", 0.0),  # another object: nothing said of the target
    ("The table is on my left and on my right, near and far.", 0.0),
    ("", 0.0),
])
def test_navigation_scores(text, expected):
    assert nav_grade(text) == pytest.approx(expected)


def test_navigation_target_out_of_view():
    assert nav_grade("The red table is not in view.", []) == 1.0
    assert nav_grade("The red table is on my left, far.", []) == 0.0
    assert nav_grade("", []) == 0.0


# -- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "The box is above and to the left of me.",
    "the BOX is up-left!!!",
    "Box: upper left.",
    "To my upper left is the box.",
    "The crate is north west of me.",
    "The box is above me, to the left.",
    "The box is higher than me, on the left side.",
    "The box is above me. The box is to the left.",
    "The box is two rows above me, one column to the left.",
    "I am below and to the right of the box.",
    "The box is not below me but above, to the left.",
])
def test_word_order_and_synonyms_give_the_same_relation(text):
    assert parse_relations(text, SOKOBAN_VOCAB) == [("box", "above", "left")]


@pytest.mark.parametrize("text, expected", [
    ("The box is directly above me.", [("box", "above", "same")]),
    ("The box is right above me.", [("box", "above", "same")]),
    ("The box is in the same column, below me.", [("box", "below", "same")]),
    ("The target is level with me, east.", [("target", "same", "right")]),
    ("The target is at my position.", [("target", "same", "same")]),
    ("I am on the target.", [("target", "same", "same")]),
    ("The target is to my right.", [("target", UNKNOWN, "right")]),
    ("Two boxes are below me.", [("box", "below", UNKNOWN)] * 2),
    ("3 crates are to the west.", [("box", UNKNOWN, "left")] * 3),
    ("There are no boxes.", []),
    ("The box is above and below me.", [("box", "above", UNKNOWN), ("box", "below", UNKNOWN)]),
    ("A box is to my left and a box is below me.", [("box", UNKNOWN, "left"), ("box", "below", UNKNOWN)]),
    ("I see walls.", []),
])
def test_parse_cases(text, expected):
    assert parse_relations(text, SOKOBAN_VOCAB) == expected


def test_counts_and_lists_of_holes():
    assert parse_relations("holes: one above-left, one right", FROZENLAKE_VOCAB) == [
        ("hole", "above", "left"), ("hole", UNKNOWN, "right")]
    assert parse_relations("Two holes are below me.", FROZENLAKE_VOCAB) == [("hole", "below", UNKNOWN)] * 2
    assert parse_relations("There are no holes. The flag is south-east.", FROZENLAKE_VOCAB) == [
        ("goal", "below", "right")]


def test_relations_are_named_tuples_equal_to_plain_tuples():
    (relation,) = parse_relations("The box is below me, on my right.", SOKOBAN_VOCAB)
    assert isinstance(relation, Relation) and relation == ("box", "below", "right")
    assert (relation.object, relation.a, relation.b) == ("box", "below", "right")


def test_navigation_parse_uses_the_env_wording():
    assert parse_relations("- the red table: 3.2 m away, 34 degrees to your left", NAV_VOCAB) == [
        ("red table", "left", "far")]
    assert parse_relations("The red table is straight ahead, near, 1.5 m away.", NAV_VOCAB) == [
        ("red table", "ahead", "near")]
    assert parse_relations("The red table is 2.0 m away, right in front of me.", NAV_VOCAB) == [
        ("red table", "ahead", "near")]


def test_text_past_the_length_cap_is_cut():
    correct = "The box is above and to the left of me; the target is directly right."
    assert sokoban_grade(correct + " x" * 1000) == 1.0
    padding = "I look around the room. " * (MAX_CHARS // 24 + 1)
    assert len(padding) > MAX_CHARS
    assert sokoban_grade(padding + correct) == 0.0
    assert parse_relations("a" * (MAX_CHARS - 20) + " the box is above me, left", SOKOBAN_VOCAB) == [
        ("box", "above", UNKNOWN)]


def test_max_matching_is_one_to_one_and_maximal():
    assert max_matching([]) == 0.0
    assert max_matching([[1.0], [1.0]]) == 1.0
    # greedy (row 0 takes column 0) would give 1.5; the optimum pairs 0-1 and 1-0
    assert max_matching([[1.0, 1.0], [1.0, 0.5]]) == 2.0
    assert max_matching([[0.5, 0.0, 1.0], [0.0, 0.0, 1.0]]) == 1.5


def test_grade_names_kinds_without_weights():
    with pytest.raises(ValueError, match="no weight"):
        grade("The box is above me.", [("crate", "above", "left")], SOKOBAN_WEIGHTS)


def test_fuzz_never_raises_and_stays_in_range():
    words = ("box boxes crate target targets goal hole holes above below left right up down north south east "
             "west same row column level with directly straight not one two 3 another no I am on the my "
             "position red table blue ahead near far m degrees 2.5 , . ; : ! ? - ( ) ' \" \n").split(" ")
    rng = random.Random(31)
    cases = [(SOKOBAN_VOCAB, SOKOBAN_TRUE, SOKOBAN_WEIGHTS), (FROZENLAKE_VOCAB, FROZENLAKE_TRUE, FROZENLAKE_WEIGHTS),
             (NAV_VOCAB, NAV_TRUE, {"red table": 1.0})]
    for i in range(10_000):
        parts = []
        for _ in range(rng.randint(0, 40)):
            if rng.random() < 0.25:
                parts.append("".join(chr(rng.randint(1, 0x2FFF)) for _ in range(rng.randint(1, 5))))
            else:
                parts.append(rng.choice(words))
        text = (" " if rng.random() < 0.7 else "").join(parts)
        vocab, truth, weights = cases[i % 3]
        score = grade(text, truth, weights, vocab)
        assert isinstance(score, float) and 0.0 <= score <= 1.0, (text, score)
    for odd in (None, 3, b"box above", ["box"]):
        assert grade(odd, SOKOBAN_TRUE, SOKOBAN_WEIGHTS, SOKOBAN_VOCAB) == 0.0
        assert parse_relations(odd, SOKOBAN_VOCAB) == []


# -- the envs' relations ------------------------------------------------------------------------
SOKOBAN_LEVEL = """
######
#____#
#_X__#
#O_P_#
#____#
######
"""


def sokoban_env(prompt_format="grounding_worldmodeling"):
    env = envs_visual.make("sokoban", render_mode="text", prompt_format=prompt_format)
    env.load_level(SokobanLevel.from_text(SOKOBAN_LEVEL))
    return env


def response(env, answer, observation=None, prediction=None):
    fields = {"observation": observation or "", "reasoning": "I move.", "prediction": prediction or "",
              "think": "I move."}
    return envs_visual.base.format_response(env.prompt_format, answer, fields)


def test_sokoban_relations_on_a_hand_placed_level():
    env = sokoban_env()
    assert env.state_relations() == [("box", "above", "left"), ("target", "same", "left")]
    env.step(response(env, "Left"))  # player (3, 2): box straight up
    assert env.state_relations() == [("box", "above", "same"), ("target", "same", "left")]
    env.step(response(env, "Up"))  # pushes the box to (1, 2), player (2, 2)
    assert env.state_relations() == [("box", "above", "same"), ("target", "below", "left")]


def test_frozenlake_relations_on_a_hand_placed_map():
    env = envs_visual.make("frozenlake", render_mode="text", prompt_format="grounding_worldmodeling")
    env.load_level(FrozenLakeLevel.from_text("P_O_\n____\n_O__\n___G"))
    assert env.state_relations() == [("goal", "below", "right"), ("hole", "same", "right"), ("hole", "below", "right")]
    env.step(response(env, "Down, Down"))  # (2, 0): the hole at (2, 1) is straight right
    assert env.state_relations() == [("goal", "below", "right"), ("hole", "above", "right"), ("hole", "same", "right")]


def test_navigation_relations_follow_the_text_observation():
    env = envs_visual.make("navigation", render_mode="text")
    checked = 0
    for seed in range(30):
        env.reset(seed=seed)
        target = env.level.objects[env.level.target].description
        line = next((ln for ln in env.render_text().splitlines() if ln.startswith(f"- the {target}:")), None)
        relations = env.state_relations()
        if line is None:
            assert relations == []
            continue
        metres = float(re.search(r"([0-9.]+) m away", line).group(1))
        side = "ahead" if "straight ahead" in line else re.search(r"to your (left|right)", line).group(1)
        assert relations == [(target, side, "near" if metres <= 2.0 else "far")]
        checked += 1
    assert checked >= 3, "too few seeds with the target in view to check anything"


@pytest.mark.parametrize("name, seeds", [("sokoban", 40), ("frozenlake", 40), ("navigation", 12)])
def test_describe_state_grades_one_on_many_states(name, seeds):
    env = envs_visual.make(name, render_mode="text", prompt_format="grounding_worldmodeling")
    for seed in range(seeds):
        env.reset(seed=seed)
        for _ in range(3):
            relations = env.state_relations()
            text = env.describe_state(relations)
            assert grade(text, relations, env.state_weights, env.state_vocabulary()) == 1.0, (seed, relations, text)
            env.step(response(env, (env.solve() or [env.action_names[0]])[0]))
            if env.done:
                break


# -- step info ----------------------------------------------------------------------------------
def test_step_info_scores_observation_before_and_prediction_after():
    env = sokoban_env()
    before = "The box is above and to the left of me. The target is on my left, in the same row."
    after = "The box is directly above me. The target is on my left, in the same row."
    _, _, _, _, info = env.step(response(env, "Left", before, after))
    assert info["grounding_score"] == 1.0 and info["worldmodel_score"] == 1.0
    assert info["state_before"] == [["box", "above", "left"], ["target", "same", "left"]]
    assert info["state_after"] == [["box", "above", "same"], ["target", "same", "left"]]
    json.dumps(info["state_before"] + info["state_after"])
    # the same prediction one turn later is wrong: the box is pushed, the target now below-left
    _, _, _, _, info = env.step(response(env, "Up", after, after))
    assert info["grounding_score"] == 1.0 and info["worldmodel_score"] == pytest.approx(0.5)


def test_step_scores_lie_in_the_unit_interval_in_grounding_worldmodeling():
    env = envs_visual.make("frozenlake", render_mode="text", prompt_format="grounding_worldmodeling")
    env.reset(seed=3)
    _, _, _, _, info = env.step(response(env, "Down", "The goal is below me.", "The goal is right, a hole is up."))
    assert 0.0 <= info["grounding_score"] <= 1.0 and 0.0 <= info["worldmodel_score"] <= 1.0


@pytest.mark.parametrize("prompt_format, keys", [
    ("free_think", (None, None)), ("no_think", (None, None)), ("grounding", ("float", None)),
    ("worldmodeling", (None, "float")), ("grounding_worldmodeling", ("float", "float"))])
def test_step_scores_exist_only_for_the_format_fields(prompt_format, keys):
    env = sokoban_env(prompt_format)
    _, _, _, _, info = env.step(response(env, "Left", "The box is up.", "The box is up."))
    got = tuple(None if info[k] is None else type(info[k]).__name__ for k in ("grounding_score", "worldmodel_score"))
    assert got == keys
    assert info["state_before"] and info["state_after"]


def test_unparsed_response_and_ungraded_env_give_none():
    env = sokoban_env()
    _, _, _, _, info = env.step("<observation>The box is up.</observation> Left")
    assert info["grounding_score"] is None and info["worldmodel_score"] is None
    assert info["state_before"] == [["box", "above", "left"], ["target", "same", "left"]]
    bandit = envs_visual.make("bandit", prompt_format="grounding_worldmodeling")
    bandit.reset(seed=0)
    assert bandit.state_relations() == [] and bandit.state_weights == {}
    _, _, _, _, info = bandit.step(response(bandit, bandit.action_names[0], "A lever.", "A reward."))
    assert info["grounding_score"] is None and info["worldmodel_score"] is None
    assert info["state_before"] == [] and info["state_after"] == []


def test_objects_in_the_same_relation_share_one_counted_sentence():
    relations = [("goal", "below", "right"), ("hole", "below", "same"), ("hole", "same", "left"),
                 ("hole", "below", "same"), ("hole", "below", "same")]
    names = {"goal": ("The goal", "A goal"), "hole": ("The hole", "A hole")}
    text = describe_grid(relations, names)
    assert text == ("The goal is below and to the right of me. Three holes are directly below me, in the same "
                    "column. A hole is on my left, in the same row.")
    assert grade(text, relations, FROZENLAKE_WEIGHTS, FROZENLAKE_VOCAB) == 1.0
