"""Navigation env: level generation, dynamics, planner, renders and response fuzzing.

Dynamics and planner tests use render_mode="text" so that they never open a renderer; a handful
of tests render frames (MUJOCO_GL=egl, software Mesa on CPU).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import envs_visual
from envs_visual.assets import asset_path
from envs_visual.base import PROMPT_FORMATS, parse_response
from envs_visual.navigation import (
    AGENT_RADIUS,
    MAX_PITCH,
    NavigationEnv,
    _segment_hits_rects,
    generate_level,
    level_from_state,
    points_free,
    segments_free,
    teacher_action,
)

# mujoco through the env module, which sets MUJOCO_GL=egl before mujoco's first import
from envs_visual.navigation_scene import COLOURS, OBJECT_KINDS, mujoco, object_templates

ACTIONS = NavigationEnv.action_names


def answer(actions, prompt_format="free_think") -> str:
    text = ", ".join(actions)
    if prompt_format == "no_think":
        return f"<answer>{text}</answer>"
    return f"<think>going</think><answer>{text}</answer>"


def run_plan(env, plan):
    """Execute `plan` in turns of max_actions_per_turn; return the last step's results."""
    result = None
    for k in range(0, len(plan), env.max_actions_per_turn):
        result = env.step(answer(plan[k : k + env.max_actions_per_turn], env.prompt_format))
    return result


@pytest.fixture
def text_env():
    env = envs_visual.make("navigation", render_mode="text")
    yield env
    env.close()


@pytest.fixture(scope="module")
def vision_env():
    env = envs_visual.make("navigation", render_mode="vision")
    yield env
    env.close()


# -- level generation ------------------------------------------------------------------------------
def test_generate_level_is_a_pure_function_of_the_seed():
    assert generate_level(5) == generate_level(5)
    assert generate_level(5) != generate_level(6)
    assert generate_level(5, num_objects=3) != generate_level(5)


@pytest.mark.parametrize("seed", range(40))
def test_levels_are_well_formed(seed):
    level = generate_level(seed)
    pairs = [(o.colour, o.kind) for o in level.objects]
    assert len(set(pairs)) == len(pairs), pairs
    assert level.instruction == f"Navigate to the {level.objects[level.target].description}."
    for a in range(len(level.objects)):
        for b in range(a + 1, len(level.objects)):
            ra, rb = level.objects[a].footprint, level.objects[b].footprint
            assert ra[2] < rb[0] or rb[2] < ra[0] or ra[3] < rb[1] or rb[3] < ra[1], (ra, rb)
    x, y, yaw = level.start
    assert points_free(level, x, y, level.obstacles())
    assert yaw in (0.0, 90.0, 180.0, 270.0)
    assert len(level.walls) in (4, 6)  # outer walls, plus two segments per doorway wall


def test_templates_compile_on_their_own_and_have_footprints():
    for kind in OBJECT_KINDS:
        model = mujoco.MjModel.from_xml_path(str(asset_path("navigation", f"{kind}.xml")))
        assert model.ngeom >= 1
        t = object_templates()[kind]
        assert t.xmax > t.xmin and t.ymax > t.ymin and t.height > 0.3, t
    mujoco.MjModel.from_xml_path(str(asset_path("navigation", "room.xml")))


# -- dynamics (no rendering) ---------------------------------------------------------------------
def test_text_mode_never_opens_a_renderer(text_env):
    text_env.reset(seed=1)
    text_env.step(answer(["moveahead", "rotateleft", "lookdown"]))
    assert text_env._scene is None


def test_move_into_wall_leaves_the_pose_unchanged(text_env):
    text_env.reset(seed=2)
    level = text_env.level
    y = next(
        y for y in np.arange(0.25, level.depth, 0.5)
        if segments_free(level, [[0.25, y]], [[0.75, y]], level.obstacles())[0]
    )
    text_env.set_pose(0.25, y, yaw=180.0)  # at the west wall, facing it
    before = text_env.state()["agent"]
    obs, reward, _, _, info = text_env.step(answer(["moveahead"]))
    assert text_env.state()["agent"] == before
    assert info["action_is_effective"] is False and info["blocked"] == 1 and info["steps"] == 1
    assert info["actions"] == ["moveahead"] and "moveahead (blocked)" in obs.text
    # a step back into the room works
    _, _, _, _, info = text_env.step(answer(["moveback"]))
    assert info["action_is_effective"] and text_env.x == pytest.approx(0.75)


def test_move_into_object_is_blocked(text_env):
    text_env.reset(seed=4)
    level = text_env.level
    obj = next(o for o in level.objects if o is not level.objects[level.target])
    # stand just west of the object, facing east, and walk into it
    x = obj.footprint[0] - AGENT_RADIUS - 0.05
    y = (obj.footprint[1] + obj.footprint[3]) / 2
    if not points_free(level, x, y, level.obstacles()):
        pytest.skip("west side of this object is against something else")
    text_env.set_pose(x, y, yaw=0.0)
    _, _, _, _, info = text_env.step(answer(["moveahead"]))
    assert not info["action_is_effective"] and (text_env.x, text_env.y) == (round(x, 9), round(y, 9))


def test_rotations_and_look_limits(text_env):
    text_env.reset(seed=3)
    yaw = text_env.yaw
    _, _, _, _, info = text_env.step(answer(["rotateleft", "rotateleft", "rotateright"]))
    assert text_env.yaw == (yaw + 90.0) % 360 and info["action_is_effective"]
    _, _, _, _, info = text_env.step(answer(["lookup", "lookup"]))
    assert text_env.pitch == MAX_PITCH and info["action_is_effective"]
    _, _, _, _, info = text_env.step(answer(["lookup"]))
    assert text_env.pitch == MAX_PITCH and not info["action_is_effective"]
    text_env.step(answer(["lookdown"] * 4))
    assert text_env.pitch == -MAX_PITCH


def test_truncates_after_max_steps_executed_actions(text_env):
    text_env.reset(seed=0)
    for turn in range(6):
        _, _, terminated, truncated, info = text_env.step(answer(["rotateleft"] * 5))
        assert truncated == (turn == 5) and not terminated
    assert info["steps"] == 30 and text_env.done
    _, reward, _, _, info = text_env.step(answer(["moveahead"]))
    assert info["actions"] == [] and info["steps"] == 30


def test_state_info_and_prompts_are_plain_and_complete(text_env):
    obs, info = text_env.reset(seed=9)
    state = text_env.state()
    json.dumps(state)
    assert {"agent", "objects", "target", "walls", "doors", "room", "distance", "path", "instruction"} <= set(state)
    assert info["distance"] == pytest.approx(state["distance"], abs=1e-3) and info["distance"] > 1.0
    assert state["instruction"] in obs.text and "Free steps" in obs.text and obs.images == []
    for prompt_format in PROMPT_FORMATS:
        env = NavigationEnv(prompt_format=prompt_format, render_mode="text")
        prompt = env.system_prompt()
        assert "moveahead" in prompt and "lookdown" in prompt
        example = prompt.split("Example: ")[1]
        assert parse_response(example, prompt_format).ok, (prompt_format, example)


def test_bad_parameters_say_what_to_fix():
    with pytest.raises(ValueError, match="step_length must be > 0"):
        envs_visual.make("navigation", step_length=0)
    with pytest.raises(ValueError, match="did you mean 'step_length'"):
        envs_visual.make("navigation", step_lenght=0.5)
    with pytest.raises(ValueError, match="num_objects must be in"):
        envs_visual.make("navigation", num_objects=99)


# -- planner ---------------------------------------------------------------------------------------
def test_planner_reaches_success_on_200_seeds(text_env):
    for seed in range(200):
        _, info = text_env.reset(seed=seed)
        plan = text_env.solve()
        assert 3 <= len(plan) <= text_env.max_steps, (seed, plan)
        _, reward, terminated, truncated, info = run_plan(text_env, plan)
        assert info["success"] and terminated and not truncated, (seed, plan, info)
        assert reward >= text_env.success_reward and info["steps"] == len(plan)
        assert text_env.solve() == []


def test_planner_works_from_any_pose_and_with_45_degree_turns():
    env = envs_visual.make("navigation", render_mode="text", rotate_degrees=45, max_steps=60)
    for seed in range(10):
        env.reset(seed=seed)
        env.step(answer(["rotateleft", "moveahead", "moveleft"]))  # leave the axis-aligned heading
        if env.done:
            continue
        plan = env.solve()
        _, _, terminated, _, info = run_plan(env, plan)
        assert info["success"] and terminated, (seed, plan)


def test_the_teacher_walks_to_the_target_facing_each_step_and_slips_sometimes(text_env):
    """`teacher_action`, the demonstrations' imperfect policy: without `rng` it only steps ahead or turns
    to face the next cell of a shortest way, so it reaches the target on nearly every level, never in
    fewer steps than the planner and often in more; with `rng` it also slips into random moves."""
    reached, longer = {"plain": 0, "slips": 0}, 0
    for seed in range(30):
        text_env.reset(seed=seed)
        assert level_from_state(text_env.state()) == text_env.level
        shortest = len(text_env.solve())
        for kind in reached:
            text_env.reset(seed=seed)
            rng = np.random.default_rng(seed) if kind == "slips" else None
            info = {"success": False}
            while not text_env.done:
                action = teacher_action(text_env.state(), rng)
                assert action in (ACTIONS if rng else ("moveahead", "rotateleft", "rotateright")), action
                _, _, _, _, info = text_env.step(answer([action]))
            reached[kind] += info["success"]
            if kind == "plain" and info["success"]:
                assert info["steps"] >= shortest, (seed, info["steps"], shortest)
                longer += info["steps"] > shortest
    assert reached["plain"] >= 27 and reached["slips"] >= 24 and longer >= 10, (reached, longer)


# -- rendering -------------------------------------------------------------------------------------
def test_same_seed_gives_identical_frames_and_actions_change_them(vision_env):
    other = envs_visual.make("navigation")
    try:
        a, _ = vision_env.reset(seed=21)
        b, _ = other.reset(seed=21)
        assert a.images[0].tobytes() == b.images[0].tobytes()
        assert a.text.count("<image>") == 1 and a.images[0].size == (128, 128)
        frames = {}
        for action in ("rotateleft", "lookdown"):
            vision_env.reset(seed=21)
            obs, *_ = vision_env.step(answer([action]))
            frames[action] = obs.images[0].tobytes()
        assert len({a.images[0].tobytes(), *frames.values()}) == 3
    finally:
        other.close()


def test_frames_are_not_blank(vision_env):
    for seed in range(3):
        obs, _ = vision_env.reset(seed=seed)
        pixels = np.asarray(obs.images[0], dtype=np.float64)
        assert pixels.std() > 10 and pixels.mean() > 30, (seed, pixels.std(), pixels.mean())


def _colour_class(pixels: np.ndarray) -> np.ndarray:
    """Nearest palette colour name per pixel by hue-like direction (brightness removed); greys -> 'grey'."""
    names = [*COLOURS, "grey"]
    refs = np.array([*COLOURS.values(), (1.0, 1.0, 1.0)])
    refs = refs / refs.max(1, keepdims=True)
    norm = pixels / np.maximum(pixels.max(-1, keepdims=True), 1.0)
    return np.array(names)[np.argmin(((norm[..., None, :] - refs) ** 2).sum(-1), -1)]


def test_target_dominates_the_frame_centre_when_faced_at_close_range(vision_env):
    checked = 0
    for seed in range(12):
        vision_env.reset(seed=seed)
        level = vision_env.level
        target = level.objects[level.target]
        fx0, fy0, fx1, fy1 = target.footprint
        cx, cy = (fx0 + fx1) / 2, (fy0 + fy1) / 2
        others = np.array([o.footprint for o in level.objects if o is not target] + list(level.walls[4:]))
        for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1)):
            x = cx + dx * ((fx1 - fx0) / 2 + 0.8)
            y = cy + dy * ((fy1 - fy0) / 2 + 0.8)
            if not points_free(level, x, y, level.obstacles()) or _segment_hits_rects(x, y, cx, cy, others):
                continue
            aim = object_templates()[target.kind].paint_height
            pitch = -math.degrees(math.atan2(vision_env.eye_height - aim, math.hypot(x - cx, y - cy)))
            vision_env.set_pose(x, y, yaw=math.degrees(math.atan2(cy - y, cx - x)), pitch=pitch)
            centre = np.asarray(vision_env.render_image(), dtype=np.float64)[48:80, 48:80]
            names, counts = np.unique(_colour_class(centre), return_counts=True)
            share = dict(zip(names, counts / counts.sum()))
            assert max(share, key=share.get) == target.colour, (seed, target.description, share)
            checked += 1
            break
    assert checked >= 8


def test_vision_episodes_with_the_planner(vision_env):
    for seed in (0, 1, 2):
        vision_env.reset(seed=seed)
        obs, reward, terminated, _, info = run_plan(vision_env, vision_env.solve())
        assert terminated and info["success"] and len(obs.images) == 1


def test_topdown_video_frame_and_close(vision_env):
    vision_env.reset(seed=7)
    vision_env.step(answer(vision_env.solve()[:2]))
    topdown = vision_env.render_topdown(128)
    assert max(topdown.size) == 128 and np.asarray(topdown).std() > 10
    assert vision_env.render_video_frame(size=128).size == (128 + topdown.width, 128)
    assert vision_env.render_video_frame(with_topdown=False, size=64).size == (64, 64)
    before = vision_env.render_image().tobytes()
    vision_env.close()
    assert vision_env._scene is None
    assert vision_env.render_image().tobytes() == before  # a fresh renderer draws the same frame


# -- fuzzed responses -----------------------------------------------------------------------------
WORDS = st.sampled_from([*ACTIONS, "MoveAhead", "jump", "", " ", "moveahead ", "rotate left", "<answer>", "</think>"])
RESPONSES = st.one_of(
    st.text(max_size=80),
    st.builds(lambda ws, sep: f"<think>x</think><answer>{sep.join(ws)}</answer>", st.lists(WORDS, max_size=8),
              st.sampled_from([",", ", ", ";", " "])),
    st.builds(lambda ws: f"<answer>{','.join(ws)}</answer>", st.lists(WORDS, max_size=6)),
)


def _check_response(env, seed, response):
    env.reset(seed=seed)
    before = json.dumps(env.state())
    obs, reward, terminated, truncated, info = env.step(response)
    assert isinstance(reward, float) and isinstance(obs.text, str)
    assert set(info) >= {"success", "format_ok", "action_is_valid", "action_is_effective", "actions", "distance"}
    if not parse_response(response, env.prompt_format).ok:
        assert json.dumps(env.state()) == before and info["actions"] == [] and not info["format_ok"]
    assert len(info["actions"]) <= env.max_actions_per_turn


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(response=RESPONSES, seed=st.integers(0, 50))
def test_fuzzed_responses_never_raise_text_mode(text_env, response, seed):
    _check_response(text_env, seed, response)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(response=RESPONSES, seed=st.integers(0, 5))
def test_fuzzed_responses_never_raise_vision_mode(vision_env, response, seed):
    _check_response(vision_env, seed, response)
