"""The manipulation environment: primitives on hand-placed scenes, the expert on generated levels,
determinism, the strict action parser under fuzzing, and frames."""

import copy
import math
import random

import numpy as np
import pytest

import envs_visual
from envs_visual.base import PROMPT_FORMATS, format_response, parse_response
from envs_visual.manipulation import (
    TASKS,
    _split,
    format_action,
    generate_level,
    parse_actions,
    plan,
    task_success,
    teacher_action,
)


def act(env, *actions):
    return env.step(format_response(env.prompt_format, ", ".join(actions)))


def position(env, name):
    return np.array(next(o["position"] for o in env.state()["objects"] if o["name"] == name))


@pytest.fixture(scope="module")
def stack_env():
    """Two cubes (red on the left, blue on the right) placed by hand; text mode, no frames."""
    env = envs_visual.make("manipulation", task="stack", num_objects=2, render_mode="text", max_steps=100)
    yield env
    env.close()


def hand_placed(env, **positions):
    env.reset(seed=0)
    names = [o["name"] for o in env.state()["objects"]]
    for name, (x, y) in zip(names, positions.values()):
        env.set_object(name, x, y)
    return names


# -- primitives ---------------------------------------------------------------------------------
def test_pick_lifts_the_cube_under_the_gripper(stack_env):
    first, second = hand_placed(stack_env, a=(-60, 30), b=(80, -40))
    _, reward, terminated, _, info = act(stack_env, "pick(-60, 30, 20)")
    assert info["messages"] == [f"pick(-60, 30, 20): picked up the {first}."]
    assert info["holding"] == first and info["action_is_effective"] and not terminated
    assert position(stack_env, first)[2] >= 20 + 50  # lifted at least 5 cm
    assert np.allclose(position(stack_env, second), [80, -40, 20], atol=0.5)  # the other cube stays
    assert info["sim_time"] > 0.5  # carried out over simulated time, not teleported
    # the grasp holds by contact: carried across the table, the cube stays between the fingers
    _, _, _, _, info = act(stack_env, "place(100, 100, 20)")
    assert np.linalg.norm(position(stack_env, first) - [100, 100, 20]) <= 10.0
    assert info["holding"] is None


def test_place_leaves_the_cube_within_a_centimetre_of_the_target(stack_env):
    first, second = hand_placed(stack_env, a=(0, 0), b=(-150, 150))
    for target in ([-150, -100, 20], [60, -120, 20], [150, 150, 20]):
        here = position(stack_env, first)
        act(stack_env, format_action("pick", *here), format_action("place", *target))
        assert np.linalg.norm(position(stack_env, first) - target) <= 10.0, target
        assert stack_env.state()["objects"][0]["tilt"] < 5.0


def test_place_on_another_cube_stacks_it_and_a_low_target_lands_on_the_table(stack_env):
    first, second = hand_placed(stack_env, a=(-80, 0), b=(80, 0))
    # z = 0 asks for the centre below the table top: the cube lands on the table and is released
    _, reward, _, _, info = act(stack_env, "pick(-80, 0, 20)", "place(-80, 100, 0)")
    assert np.linalg.norm(position(stack_env, first) - [-80, 100, 20]) <= 10.0
    assert reward == 0.5 + 1.0  # the first stage: holding the cube to stack
    _, reward, terminated, _, info = act(stack_env, "pick(-80, 100, 20)", "place(80, 0, 60)")
    assert np.linalg.norm(position(stack_env, first) - [80, 0, 60]) <= 10.0
    assert terminated and info["success"] and reward == 0.5 + 10.0  # a stage is paid once


def test_push_moves_the_block_along_the_segment():
    env = envs_visual.make("manipulation", task="push", num_objects=2, render_mode="text", max_steps=100)
    env.reset(seed=0)
    block, cube = (o["name"] for o in env.state()["objects"])
    env.set_object(cube, -150, 150)
    for start, end in (((0, -40), (0, 40)), ((-40, 0), (40, 0)), ((-30, -30), (30, 30))):
        env.set_object(block, 0, 0)
        direction = np.subtract(end, start) / np.linalg.norm(np.subtract(end, start))
        # start 15 mm behind the block's side or corner, sweep 100 mm
        back = 30 * (abs(direction[0]) + abs(direction[1])) + 15 + 20
        x1, y1 = -direction * back
        x2, y2 = np.array([x1, y1]) + direction * 100
        _, _, _, _, info = act(env, format_action("push", x1, y1, 20, x2, y2, 20))
        moved = position(env, block)[:2]
        along, across = moved @ direction, abs(moved @ [-direction[1], direction[0]])
        assert info["messages"][0].endswith(")."), info["messages"]
        assert 40 <= along <= 110 and across <= 0.25 * along, (start, moved)
        assert np.allclose(position(env, cube), [-150, 150, 20], atol=0.5)
    env.close()


def test_primitives_that_cannot_run_say_why_and_change_nothing(stack_env):
    first, second = hand_placed(stack_env, a=(-60, 30), b=(80, -40))
    before = stack_env.state()
    cases = {
        "pick(0, 0, 300)": "not done: (0, 0, 300) is outside the workspace (x and y from -200 to 200, z from 0 to 250 mm).",
        "pick(-250, 0, 20)": "not done: (-250, 0, 20) is outside the workspace",
        "place(0, 0, 20)": "not done: the gripper holds nothing; pick an object first.",
        "push(0, 0, 20, 0, 500, 20)": "not done: (0, 500, 20) is outside the workspace",
    }
    for action, message in cases.items():
        _, reward, _, _, info = act(stack_env, action)
        assert info["messages"][0].startswith(f"{action}: {message}"), info["messages"]
        assert info["format_ok"] and not info["action_is_effective"] and info["sim_time"] == 0.0
        assert reward == 0.5  # well-formed: the format reward, nothing else
    assert stack_env.state()["objects"] == before["objects"]
    # the gripper closes on air where there is nothing, and cannot pick twice or push while holding
    _, _, _, _, info = act(stack_env, "pick(0, -150, 20)")
    assert info["messages"] == ["pick(0, -150, 20): the gripper closed on nothing."] and info["holding"] is None
    _, _, _, _, info = act(stack_env, "pick(80, -40, 20)", "pick(-60, 30, 20)")
    assert info["messages"][1] == f"pick(-60, 30, 20): not done: the gripper already holds the {second}; place it first."
    _, _, _, _, info = act(stack_env, "push(0, 0, 20, 50, 0, 20)")
    assert "place it before pushing" in info["messages"][0]


def test_the_block_is_too_wide_to_pick_and_a_push_may_not_start_on_top_of_it():
    env = envs_visual.make("manipulation", task="push", num_objects=2, render_mode="text")
    env.reset(seed=0)
    block = env.state()["roles"]["object"]
    env.set_object(block, 0, 0)
    _, _, _, _, info = act(env, "pick(0, 0, 30)", "push(0, 0, 20, 80, 0, 20)")
    assert info["holding"] is None
    assert info["messages"][0].startswith("pick(0, 0, 30): the fingers landed on something at z = ")
    assert "start a push beside the object" in info["messages"][1]
    assert np.allclose(position(env, block), [0, 0, 30], atol=1.0)
    env.close()


# -- levels and the expert -------------------------------------------------------------------------
def test_levels_are_pure_functions_of_the_seed_and_parameters_are_checked():
    for seed in range(20):
        assert generate_level(seed, "any") == generate_level(seed, "any")
    assert {generate_level(seed, "any").task for seed in range(20)} == set(TASKS)
    for task in TASKS:
        counts = {len(generate_level(seed, task).objects) for seed in range(30)}
        assert counts == ({3, 4} if task == "align" else {2, 3, 4}), (task, counts)
    with pytest.raises(ValueError, match="unknown task 'stak'; did you mean 'stack'"):
        envs_visual.make("manipulation", task="stak")
    with pytest.raises(ValueError, match="num_objects must be in 3..4 for task 'align'"):
        envs_visual.make("manipulation", task="align", num_objects=2)


def play_expert(env, seed, turns=4):
    env.reset(seed=seed)
    for _ in range(turns):
        _, _, terminated, truncated, info = act(env, *env.solve()[: env.max_actions_per_turn])
        assert info["format_ok"], info
        if terminated or truncated:
            break
    return info["success"]


@pytest.mark.parametrize("task", TASKS)
def test_the_expert_solves_each_task(task):
    env = envs_visual.make("manipulation", task=task, render_mode="text")
    assert all(play_expert(env, seed) for seed in range(4))
    assert env.solve() == []
    env.close()


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
def test_the_expert_solves_95_percent_of_100_levels_per_task(task):
    env = envs_visual.make("manipulation", task=task, render_mode="text")
    wins = sum(play_expert(env, seed) for seed in range(100))
    assert wins >= 95, f"{task}: the expert solved {wins}/100"
    env.close()


def test_the_expert_recovers_and_the_teacher_is_imperfect():
    env = envs_visual.make("manipulation", task="stack", num_objects=3, render_mode="text")
    env.reset(seed=5)
    top, base = env.state()["roles"]["top"], env.state()["roles"]["base"]
    # holding the wrong cube: the expert puts it down first, then stacks
    other = next(o["name"] for o in env.state()["objects"] if o["name"] not in (top, base))
    act(env, format_action("pick", *position(env, other)))
    assert env.state()["holding"] == other and env.solve()[0].startswith("place(")
    assert play_expert_from_here(env)
    # the teacher is the expert with jittered millimetres: it misses sometimes
    state = generate_state(env, 5)
    rng = np.random.default_rng(0)
    draws = [teacher_action(state, rng) for _ in range(200)]
    assert all(parse_actions(a, 1) == ([a], True) for a in draws)
    expert = np.array(_split(plan(state)[0])[1])
    # the expert's millimetres to within rounding on fewer than one draw in ten
    assert sum(np.abs(np.array(_split(a)[1]) - expert).max() <= 0.5 for a in draws) < 20
    assert len({a.split("(")[0] for a in draws}) == 1  # the same primitive as the expert's
    assert not any("." in a for a in draws)  # whole millimetres, as the observation lists them


def play_expert_from_here(env, turns=4):
    for _ in range(turns):
        _, _, terminated, truncated, info = act(env, *env.solve()[: env.max_actions_per_turn])
        if terminated or truncated:
            break
    return info["success"]


def generate_state(env, seed):
    env.reset(seed=seed)
    return env.state()


def test_success_needs_the_task_met_and_nothing_held():
    env = envs_visual.make("manipulation", task="align", num_objects=3, render_mode="text")
    env.reset(seed=1)
    state = env.state()
    row = state["roles"]["row"]
    for k, obj in enumerate(state["objects"]):
        obj["position"] = [-100.0 + 80 * k, 37.0 + (k % 2) * 8, 20.0]
    assert task_success(state)
    state["objects"][1]["position"][1] += 15  # 23 mm off the line of the other two: not a row
    assert not task_success(state)
    state["objects"][1]["position"][1] -= 15
    state["objects"][1]["position"][0] = state["objects"][0]["position"][0] + 30  # touching: too close
    assert not task_success(state)
    assert set(row) == {o["name"] for o in state["objects"]}
    env.close()


# -- determinism, frames, contract --------------------------------------------------------------------
def test_same_seed_same_frames_and_rewards_in_either_render_mode():
    runs = []
    for render_mode in ("vision", "vision", "text"):
        env = envs_visual.make("manipulation", task="stack", render_mode=render_mode)
        obs, _ = env.reset(seed=11)
        frames, rewards, states = [obs.images[0].tobytes() if obs.images else b""], [], [env.state()]
        for _ in range(2):
            obs, reward, terminated, _, info = act(env, *env.solve()[:1])
            frames.append(obs.images[0].tobytes() if obs.images else b"")
            rewards.append(reward)
            states.append(env.state())
        runs.append((frames, rewards, states))
        env.close()
    assert runs[0] == runs[1]
    assert runs[2][1:] == runs[0][1:]  # frames drawn or not, the physics is the same
    assert runs[0][1] == [0.5 + 1.0, 0.5 + 10.0]  # a stage (holding the top cube), then success


def test_frames_show_the_table_the_objects_and_their_motion():
    env = envs_visual.make("manipulation", task="place", num_objects=2)
    obs, info = env.reset(seed=3)
    frame = np.asarray(obs.images[0]).astype(float)
    assert obs.images[0].size == (168, 168) and obs.text.count("<image>") == 1
    assert frame.std() > 20 and len(np.unique(frame.reshape(-1, 3), axis=0)) > 200  # not blank
    name = env.state()["roles"]["object"]
    colour = np.array(envs_visual.manipulation.COLOURS[name.split()[0]]) * 255
    close = np.linalg.norm(frame - colour, axis=-1) < 90
    assert close.sum() >= 20, f"the {name} is not visible"
    obs, *_ = act(env, *env.solve())
    after = np.asarray(obs.images[0]).astype(float)
    assert np.abs(after - frame).sum(-1).astype(bool).sum() > 100  # the cube moved on the picture
    assert "\ngoal (" in obs.text and f"\n{name} (" in obs.text and "released the" in obs.text
    env.close()


def test_observation_text_system_prompt_and_info_keys():
    env = envs_visual.make("manipulation", task="push", render_mode="text", prompt_format="grounding")
    obs, info = env.reset(seed=0)
    assert obs.images == [] and "Centres in mm:" in obs.text
    assert obs.text.startswith(f"Push the {env.state()['roles']['object']} onto the goal.")
    prompt = env.system_prompt()
    for word in ("pick(x, y, z)", "place(x, y, z)", "push(x1, y1, z1, x2, y2, z2)", "positions in mm", "up to 2 actions"):
        assert word in prompt, word
    assert parse_response(prompt.split("Example: ")[1], "grounding").ok
    _, _, _, _, info = env.step("<think><observation>o</observation><reasoning>r</reasoning></think>"
                                "<answer>Pick(0, 0, 20)</answer>")
    for key in ("success", "format_ok", "action_is_valid", "action_is_effective", "actions", "task", "messages",
                "holding", "stage", "sim_time"):
        assert key in info, key
    assert info["actions"] == ["pick(0, 0, 20)"]
    env.close()


def test_the_env_copies_for_a_shadow_simulation():
    env = envs_visual.make("manipulation", task="place")
    env.reset(seed=2)
    env.render_image()
    shadow = copy.copy(env)
    shadow.__dict__ = {k: copy.deepcopy(v) for k, v in env.__dict__.items()}
    shadow.render_mode = "text"
    act(shadow, *shadow.solve())
    assert shadow.state()["objects"] != env.state()["objects"]  # the copy moved, the original did not
    assert env.state() == generate_state(envs_visual.make("manipulation", task="place", render_mode="text"), 2)
    env.close()


# -- the action parser ------------------------------------------------------------------------------
def test_parse_actions_reads_primitives_strictly():
    assert parse_actions("pick(1, 2, 3), PLACE( -4.50 ,+5,6 )", 2) == (["pick(1, 2, 3)", "place(-4.5, 5, 6)"], True)
    assert parse_actions("pick(1,2,3), place(4,5,6), push(1,2,3,4,5,6)", 2) == (
        ["pick(1, 2, 3)", "place(4, 5, 6)"], True)  # beyond the limit: not read
    assert parse_actions("push(.5, 0, 0, 1, 1, 1)", 2) == (["push(0.5, 0, 0, 1, 1, 1)"], True)
    for bad in ("pick(1, 2)", "place(1, 2, 3, 4)", "grab(1, 2, 3)", "pick 1 2 3", "pick(1, 2, 3),", "pick(x, 2, 3)",
                "pick(1e3, 2, 3)", "pick(nan, 0, 0)", "__import__('os').system('ls')", "pick(1, 2, 3) place(1, 2, 3)",
                "", "pick((1), 2, 3)", "pick(1, 2, 3)" + " " * 600):
        actions, ok = parse_actions(bad, 2)
        assert not ok, bad
    assert parse_actions("pick(1, 2, 3), jump(1)", 2) == (["pick(1, 2, 3)"], False)


def fuzzed_answer(rng: random.Random) -> str:
    """An arbitrary string, a near-miss of a primitive list, or a well-formed list with numbers anywhere
    (mostly outside the workspace, where a primitive ends at once)."""
    def number(good: bool) -> str:
        if good:
            return rng.choice(["0", "-0", "+20", "1.", ".5", "-.25", "99999999", str(rng.randint(-900, 900)),
                               f"{rng.uniform(-999, 999):.2f}"])
        return rng.choice(["abc", "", "1e3", "nan", "--1", "1..2", "0x10", "½", "1,5"])

    def primitive(good: bool) -> str:
        name = rng.choice(["pick", "place", "push", "PICK", "Push"] if good else ["pik", "eval", "", "pick pick"])
        arity = {"pick": 3, "place": 3, "push": 6}.get(name.lower(), 3) if good else rng.choice([0, 2, 4, 7])
        return f"{name}({', '.join(number(good or rng.random() < 0.5) for _ in range(arity))})"

    kind = rng.randrange(4)
    if kind == 0:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randint(0, 60)))
    text = rng.choice([",", ", ", " ,"]).join(primitive(kind == 1 or rng.random() < 0.7)
                                              for _ in range(rng.randint(1, 3)))
    if kind == 3:
        cut = rng.randrange(len(text) + 1)
        return text[:cut] + rng.choice(["(", ")", ",", ";", "\x00", "💥", "", "<answer>"]) + text[cut:]
    return text


def test_ten_thousand_fuzzed_action_strings_never_raise():
    rng = random.Random(0)
    envs = {f: envs_visual.make("manipulation", prompt_format=f, render_mode="text", max_steps=10**6)
            for f in PROMPT_FORMATS}
    for env in envs.values():
        env.reset(seed=0)
    parsed = executed = 0
    for i in range(10_000):
        answer = fuzzed_answer(rng)
        actions, ok = parse_actions(answer, 2)
        parsed += ok
        prompt_format = rng.choice(sorted(envs))
        env = envs[prompt_format]
        # every string is parsed; those that hold no action all go through step(), and every 50th of the
        # others too (their primitives run the physics, ~30 ms each; benchmarks/robustness.py steps all)
        if not actions or i % 50 == 0:
            response = format_response(prompt_format, answer)
            before = env.state()
            _, reward, _, _, info = env.step(response)
            assert math.isfinite(reward)
            executed += bool(info["actions"])
            if not parse_response(response, prompt_format).ok:  # e.g. a tag inside the answer
                assert info["actions"] == [] and env.state() == before
            elif not ok:
                assert info["actions"] == actions and info["format_ok"] and not info["action_is_valid"]
                if not actions:
                    assert env.state() == before
        if env.done:
            env.reset(seed=i)
    assert 1_500 <= parsed <= 8_000 and executed >= 50, (parsed, executed)


# -- training and evaluation ------------------------------------------------------------------------
def test_evaluation_of_the_tiny_model_has_the_solver_row_and_an_episode_video(tiny_vl, tmp_path):
    """The two-iteration training run of `manipulation_visual` is tests/test_train.py's (every config)."""
    import json

    from PIL import Image

    from vagen.eval import main

    path, _, _ = tiny_vl
    out = tmp_path / "eval"
    assert main(["--config", "manipulation_visual", "--checkpoint", str(path), "--episodes", "1", "--videos", "1",
                 "--out", str(out), "rollout.max_new_tokens=16", "rollout.max_turns=2"]) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["model"]["episodes"] == 1
    assert result["reference"]["solver"]["success"] == 1.0  # the expert places the cube in one turn
    random_row = result["reference"]["random"]  # primitives with coordinates uniform over the workspace
    assert random_row["episodes"] == 1 and random_row["action_valid"] == 1.0
    gif = next((out / "videos").glob("manipulation_seed*.gif"))
    with Image.open(gif) as frames:
        assert frames.n_frames >= 2


def test_random_primitives_are_valid_and_drawn_from_the_seed():
    env = envs_visual.make("manipulation", task="place", render_mode="text")
    env.reset(seed=0)
    first = env.random_actions(np.random.default_rng(5), 40)
    assert first == env.random_actions(np.random.default_rng(5), 40)
    assert {a.split("(")[0] for a in first} == {"pick", "place", "push"}
    actions, valid = env._parse_actions(", ".join(first[:2]))
    assert valid and actions == first[:2]  # canonical spellings the env's own parser reads back
    for action in first:
        values = [float(v) for v in action[action.index("(") + 1:-1].split(",")]
        assert all(-200 <= v <= 200 for v in values[0::3] + values[1::3]) and all(0 <= v <= 250 for v in values[2::3])
