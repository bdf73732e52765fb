"""Navigation's warm-start pieces: the slip-free teacher, the perception questions about what the frame
shows, and demonstrations whose reasoning says it in the frame's words."""

from __future__ import annotations

import re

import numpy as np
import pytest

import envs_visual
from envs_visual.navigation_teacher import teacher_action
from vagen.config import ConfigError, load_config
from vagen.warmstart.demos import collect_demos, level_key
from vagen.warmstart.navigation_questions import (
    ahead_degrees,
    navigation_probes,
    steps_ahead,
    target_side,
    view_words,
)


@pytest.fixture(scope="module")
def env():
    env = envs_visual.make("navigation", render_mode="text", image_width=112, image_height=112)
    yield env
    env.close()


def face(env, bearing: float) -> None:
    """Turn the agent so that the target's centre lies `bearing` degrees to its left."""
    obj = env.level.objects[env.level.target]
    cx, cy = (obj.footprint[0] + obj.footprint[2]) / 2, (obj.footprint[1] + obj.footprint[3]) / 2
    toward = np.degrees(np.arctan2(cy - env.y, cx - env.x))
    env.yaw = (toward - bearing) % 360.0


def test_ahead_is_the_middle_two_token_columns():
    """90 degrees across: 4 columns of 22.5 degrees at 112 px, 6 of 15 at 168, 2 of 45 at 56."""
    for size, width in ((112, 22.5), (168, 15.0), (56, 45.0)):
        assert ahead_degrees(envs_visual.make("navigation", render_mode="text", image_width=size,
                                              image_height=size)) == pytest.approx(width)


def test_the_side_of_the_target_follows_its_bearing(env):
    env.reset(seed=3)
    target = env.level.objects[env.level.target].description
    for bearing, side, words in ((0.0, 2, "ahead"), (10.0, 2, "ahead"), (30.0, 1, "on my left"),
                                 (-30.0, 3, "on my right"), (180.0, 0, "not in view")):
        face(env, bearing)
        if side and env._target_in_view() is None:  # behind an inner wall from this start
            pytest.skip("level 3's target is hidden from its start")
        assert target_side(env) == side, bearing
        assert view_words(env).startswith(f"The {target} is {words}."), view_words(env)


def test_free_steps_ahead_are_capped_at_three_and_said_as_a_wall_at_zero(env):
    env.reset(seed=0)
    env.set_pose(*env.level.start[:2], yaw=0.0)
    for yaw in (0.0, 90.0, 180.0, 270.0):
        env.yaw = yaw
        free = env.free_steps()["ahead"]
        assert steps_ahead(env) == min(free, 3)
        words = view_words(env)
        assert words.endswith("Wall ahead." if free == 0 else
                              "3 or more steps free ahead." if free >= 3 else
                              f"{free} step{'s' * (free > 1)} free ahead."), (free, words)


def test_probes_are_deterministic_on_distinct_levels_and_answer_what_the_pose_shows():
    vision = envs_visual.make("navigation", image_width=112, image_height=112)
    first = navigation_probes(vision, 12, exclude=set())
    again = navigation_probes(vision, 12, exclude=set())
    assert [(p.seed, p.question, p.answer) for p in first] == [(p.seed, p.question, p.answer) for p in again]
    assert np.array_equal(np.asarray(first[5].frame), np.asarray(again[5].frame))
    assert all(p.frame.size == (112, 112) and 0 <= p.answer <= 3 for p in first)
    kinds = {p.question.split("?")[0].split()[0] for p in first}
    assert kinds == {"Where", "How"}, kinds  # both questions are asked
    vision.reset(seed=first[0].seed)
    skipped = navigation_probes(vision, 3, exclude={level_key(vision)})
    assert first[0].seed not in [p.seed for p in skipped]
    with pytest.raises(ValueError, match="choose among side, steps"):
        navigation_probes(vision, 2, questions=("colour",))


def test_the_slip_free_teacher_never_slips_and_the_default_one_does(env):
    env.reset(seed=0)
    state, rng = env.state(), np.random.default_rng(0)
    slip_free = {teacher_action(state, rng, slip=0.0) for _ in range(30)}
    default = [teacher_action(state, rng) for _ in range(30)]
    assert slip_free == {teacher_action(state)}, slip_free  # always the planned step
    assert set(default) - slip_free, default  # 15% of the default's actions are random


def test_view_demonstrations_say_what_the_frame_shows_without_metres():
    cfg = load_config("navigation_visual", ["sft.reasoning=view", "sft.teacher_slip=0"])
    demos = collect_demos(cfg.env, "teacher", 12, cfg.rollout.max_turns, kind="view", slip=0.0)
    assert sum(d.success for d in demos) >= 11
    pattern = re.compile(r"<think>The \w+ \w+ is (not in view|on my left|ahead|on my right)\. "
                         r"(Wall ahead|\d( or more)? steps? free ahead)\. .*</think><answer>")
    for demo in demos:
        for response in demo.responses:
            assert pattern.match(response), response
            assert " m " not in response and "away" not in response
            answer = response.split("<answer>")[1]
            assert not re.search(r"moveleft|moveright|moveback", answer), response  # no slips


def test_teacher_slip_must_be_a_share():
    with pytest.raises(ConfigError, match=r"sft.teacher_slip=1.5 is a share of actions"):
        load_config("navigation_visual", ["sft.teacher_slip=1.5"])


def test_the_perception_stage_asks_navigation_its_own_questions_at_the_configs_frame_size():
    from vagen.warmstart.perception import stage_probes

    cfg = load_config("navigation_visual", ["env.params.image_width=168", "env.params.image_height=168"])
    probes = stage_probes(cfg, 4)
    assert all(p.frame.size == (168, 168) for p in probes)
    assert all(p.question.startswith(("Where is the ", "How many steps")) for p in probes)
