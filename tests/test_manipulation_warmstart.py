"""Manipulation's copy pieces: a slip-free teacher whose actions are the listed centres in the listing's
own spelling and tokens, and the copy question about the listing."""

from __future__ import annotations

import re

import numpy as np
import pytest

import envs_visual
from envs_visual.manipulation import copy_action, parse_actions, teacher_action
from vagen.config import load_config
from vagen.warmstart.demos import collect_demos
from vagen.warmstart.manipulation_questions import copy_probes


@pytest.fixture(scope="module")
def env():
    env = envs_visual.make("manipulation", task="place", render_mode="text")
    yield env
    env.close()


def listed(env, name: str) -> str:
    """The listing's bracket for `name`: `(94, 124, 20)`."""
    return re.search(rf"^{name} (\(.*\))$", env._describe(), re.M).group(1)


def test_copy_actions_are_spelled_as_the_listing_and_read_back_canonically():
    assert copy_action("pick", [-29.4, -6.0, 20.0]) == "pick (-29, -6, 20)"
    assert copy_action("push", [1.6, 0, 20, -0.4, 5, 20]) == "push (2, 0, 20, 0, 5, 20)"
    assert parse_actions("pick (-29, -6, 20), place (137, -65, 20)", 2) == (
        ["pick(-29, -6, 20)", "place(137, -65, 20)"], True)


def test_the_slip_free_teacher_picks_the_named_cube_at_its_listed_centre(env):
    for seed in range(10):
        env.reset(seed=seed)
        state = env.state()
        name = state["roles"]["object"]
        action = teacher_action(state, np.random.default_rng(seed), slip=0.0)
        assert action == f"pick {listed(env, name)}", (seed, action)
        jittered = teacher_action(state, np.random.default_rng(seed))  # the default jitters every action
        assert jittered.startswith("pick(") and jittered != action.replace(" (", "(")


def test_copied_digits_are_the_listings_tokens(tiny_vl):
    _, _, processor = tiny_vl
    tokenizer = processor.tokenizer
    listing = tokenizer.tokenize("orange cube (-29, -6, 20)")
    assert tokenizer.tokenize(copy_action("pick", [-29, -6, 20]))[1:] == listing[2:]


def test_copy_demonstrations_solve_place_levels_and_copy_every_pick():
    cfg = load_config("manipulation_visual", ["sft.teacher_slip=0"])
    demos = collect_demos(cfg.env, "teacher", 8, cfg.rollout.max_turns, slip=0.0)
    assert all(d.success for d in demos)
    for demo in demos:
        assert re.search(r"<answer>pick \(-?\d+, -?\d+, 20\), place \(-?\d+, -?\d+, 20\)</answer>", demo.responses[0])


def test_copy_questions_answer_with_the_listed_centre_of_the_object_asked_about(env):
    probes = copy_probes(env, 6)
    assert len({p.seed for p in probes}) == 6
    for probe in probes:
        name = re.search(r"picks up the (.+)\?", probe.question).group(1)
        env.reset(seed=probe.seed)
        assert probe.answer == f"pick {listed(env, name)}"
        assert probe.question.startswith(env._describe()) and probe.question.endswith("<image>")
    named = copy_probes(env, 2, named=True)
    assert [p.answer for p in named] == [f"purple cube (-60, -23, 20), {probes[0].answer}",
                                         f"purple cube (-56, -23, 20), {probes[1].answer}"]


def test_lookup_reasoning_writes_the_listing_lines_the_answer_goes_to(env):
    from vagen.warmstart.demos import demo_response, reasoning

    env.reset(seed=1)
    assert env.prompt_format == "free_think"
    response = demo_response(env, "teacher", np.random.default_rng(1), kind="lookup", slip=0.0)
    assert response == ("<think>Put the purple cube on the goal. My gripper is empty. purple cube (-56, -23, 20), goal "
                        "(-51, 86, 0). So I do pick (-56, -23, 20).</think><answer>pick (-56, -23, 20), place (-51, 86, "
                        "20)</answer>")
    # each line is the listing's own
    for line in ("purple cube (-56, -23, 20)", "goal (-51, 86, 0)"):
        assert line in env._describe().splitlines()
    with pytest.raises(ValueError, match="no lookup reasoning for env 'sokoban'"):
        reasoning("sokoban", [{}], ["Up"], np.random.default_rng(0), kind="lookup")
    assert load_config("manipulation_visual").sft.reasoning == "lookup"


def test_the_perception_stage_of_manipulation_asks_copy_questions_in_the_demonstrations_spelling():
    from vagen.warmstart.perception import stage_probes

    plain = stage_probes(load_config("manipulation_visual", ["sft.reasoning=near"]), 2)
    named = stage_probes(load_config("manipulation_visual"), 2)  # the config's lookup reasoning
    assert [p.answer for p in plain] == ["pick (-60, -23, 20)", "pick (-56, -23, 20)"]
    assert [p.answer for p in named] == ["purple cube (-60, -23, 20), pick (-60, -23, 20)",
                                         "purple cube (-56, -23, 20), pick (-56, -23, 20)"]
    assert plain[0].frame.size == (112, 112) and plain[0].question.endswith("Which action picks up the purple cube?\n<image>")
