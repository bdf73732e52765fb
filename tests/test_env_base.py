"""The shared response contract (envs_visual/base.py): formats, strict parsing, the turn loop,
format reward and `make` errors. Turn-loop cases run on a hand-made Sokoban room, whose -0.1 per
executed action makes the reward count the actions."""

import re

import pytest

import envs_visual
from envs_visual.base import PROMPT_FORMATS, parse_response
from envs_visual.sokoban import SokobanLevel

OPEN_ROOM = """
#######
#_____#
#__P__#
#_____#
#X___O#
#######
"""

VALID = {
    "no_think": "<answer>Left</answer>",
    "free_think": "<think>go left</think><answer>Left</answer>",
    "grounding": "<think><observation>I see</observation><reasoning>so</reasoning></think><answer>Left</answer>",
    "worldmodeling": "<think><reasoning>so</reasoning><prediction>then</prediction></think><answer>Left</answer>",
    "grounding_worldmodeling": (
        "<think><observation>I see</observation><reasoning>so</reasoning>"
        "<prediction>then</prediction></think><answer>Left</answer>"
    ),
}

INVALID = {
    "no_think": [
        "<think>x</think><answer>Left</answer>",  # think not allowed
        "Left",
        "<answer>Left",
        "<answer>Left</answer> thanks",  # text outside
        "Sure: <answer>Left</answer>",
        "<answer><answer>Left</answer></answer>",  # nested
        "<answer>Left</answer><answer>Up</answer>",  # duplicated
    ],
    "free_think": [
        "<answer>Left</answer>",  # think missing
        "<think>x</think>",  # answer missing
        "<think>x</think>Left",
        "<think>x<think>y</think></think><answer>Left</answer>",  # nested
        "<think>x</think><think>y</think><answer>Left</answer>",  # duplicated
        "<think>x</think><answer>Left</answer><answer>Up</answer>",
        "<answer>Left</answer><think>x</think>",  # wrong order
        "<think>x</think> and <answer>Left</answer>",  # text between blocks
        "<think>x</think><answer>Left</answer>.",
        "<THINK>x</THINK><answer>Left</answer>",
        "<think>x</think><answer>Left</answer",
    ],
    "grounding": [
        "<think>free text</think><answer>Left</answer>",  # fields missing
        "<think><reasoning>so</reasoning><observation>I see</observation></think><answer>Left</answer>",
        "<think><observation>I see</observation></think><answer>Left</answer>",
        "<think><observation>a</observation> b <reasoning>c</reasoning></think><answer>Left</answer>",
        "<think><observation>a</observation><reasoning>c</reasoning><prediction>p</prediction></think>"
        "<answer>Left</answer>",
        "<think><observation><observation>a</observation></observation><reasoning>c</reasoning></think>"
        "<answer>Left</answer>",
    ],
    "worldmodeling": [
        "<think><reasoning>so</reasoning></think><answer>Left</answer>",
        "<think><prediction>p</prediction><reasoning>so</reasoning></think><answer>Left</answer>",
        "<think><observation>a</observation><reasoning>so</reasoning><prediction>p</prediction></think>"
        "<answer>Left</answer>",
        "<think><reasoning>so</reasoning><prediction>p<answer>Left</answer></prediction></think>",
    ],
    "grounding_worldmodeling": [
        "<think><observation>a</observation><reasoning>b</reasoning></think><answer>Left</answer>",
        "<think><reasoning>b</reasoning><observation>a</observation><prediction>c</prediction></think>"
        "<answer>Left</answer>",
        "<think><observation>a</observation><reasoning>b</reasoning><prediction>c</prediction>"
        "<prediction>d</prediction></think><answer>Left</answer>",
        "<observation>a</observation><reasoning>b</reasoning><prediction>c</prediction><answer>Left</answer>",
    ],
}


def sokoban(**params):
    env = envs_visual.make("sokoban", render_mode="text", **params)
    env.load_level(SokobanLevel.from_text(OPEN_ROOM))
    return env


@pytest.mark.parametrize("prompt_format", PROMPT_FORMATS)
def test_valid_response_parses_with_fields(prompt_format):
    parsed = parse_response("\n  " + VALID[prompt_format] + "\n", prompt_format)
    assert parsed.ok and parsed.answer == "Left"
    fields = PROMPT_FORMATS[prompt_format] or ()
    for name in fields:
        assert (
            getattr(parsed, name) == {"observation": "I see", "reasoning": "so", "prediction": "then"}[name]
        )
    if prompt_format == "free_think":
        assert parsed.think == "go left"


@pytest.mark.parametrize(
    "prompt_format, response", [(f, r) for f, responses in INVALID.items() for r in responses]
)
def test_invalid_response_is_rejected(prompt_format, response):
    assert not parse_response(response, prompt_format).ok


@pytest.mark.parametrize("prompt_format", PROMPT_FORMATS)
def test_other_formats_are_rejected(prompt_format):
    for other, response in VALID.items():
        if other != prompt_format:
            assert not parse_response(response, prompt_format).ok, (other, prompt_format)


def test_whitespace_between_tags_is_allowed():
    text = "  <think>\n <observation> a </observation>\n<reasoning>b</reasoning> </think>\n<answer> Up </answer> \n"
    parsed = parse_response(text, "grounding")
    assert parsed.ok and parsed.observation == "a" and parsed.answer == "Up"


@pytest.mark.parametrize("prompt_format", PROMPT_FORMATS)
def test_system_prompt_states_format_with_a_parsable_example(prompt_format):
    env = envs_visual.make("sokoban", prompt_format=prompt_format)
    env.reset(seed=0)
    prompt = env.system_prompt()
    example = re.search(r"^Example: (.*)$", prompt, re.MULTILINE).group(1)
    parsed = parse_response(example, prompt_format)
    assert parsed.ok
    _, _, _, _, info = env.step(example)
    assert info["format_ok"]
    for name in PROMPT_FORMATS[prompt_format] or ():
        assert f"<{name}>" in prompt
    assert "Up, Down, Left, Right" in prompt


@pytest.mark.parametrize("prompt_format", PROMPT_FORMATS)
def test_parsed_fields_are_returned_in_info(prompt_format):
    env = sokoban(prompt_format=prompt_format)
    _, _, _, _, info = env.step(VALID[prompt_format])
    assert info["format_ok"] and info["actions"] == ["Left"]
    for name in PROMPT_FORMATS[prompt_format] or ():
        assert info["parsed"][name]


def test_info_has_the_contract_keys():
    env = sokoban()
    _, _, _, _, info = env.step("<think>t</think><answer>Left</answer>")
    for key in ("success", "format_ok", "action_is_valid", "action_is_effective", "actions"):
        assert key in info
    assert info["action_is_effective"] and info["action_is_valid"] and not info["success"]


def test_actions_are_case_insensitive_and_comma_separated():
    env = sokoban()
    _, reward, _, _, info = env.step("<think>t</think><answer> lEFT ,up,DOWN </answer>")
    assert info["actions"] == ["Left", "Up", "Down"]
    assert reward == pytest.approx(-0.3 + 0.5)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_max_actions_per_turn_truncates(limit):
    env = sokoban(max_actions_per_turn=limit)
    _, reward, _, _, info = env.step("<think>t</think><answer>Left, Left, Right, Right, Up</answer>")
    assert info["actions"] == ["Left", "Left", "Right", "Right", "Up"][:limit]
    assert info["format_ok"]
    assert reward == pytest.approx(-0.1 * limit + 0.5)


def test_actions_past_the_limit_are_ignored_even_if_invalid():
    env = sokoban()
    _, _, _, _, info = env.step("<think>t</think><answer>Left, Left, Left, Fly</answer>")
    assert info["actions"] == ["Left"] * 3 and info["format_ok"]


def test_execution_stops_at_first_invalid_action_without_format_reward():
    env = sokoban()
    _, reward, _, _, info = env.step("<think>t</think><answer>Right, Jump, Left</answer>")
    assert info["actions"] == ["Right"]
    assert info["format_ok"] and not info["action_is_valid"]  # it parses, but "Jump" is no action
    assert reward == pytest.approx(-0.1)
    assert env.state()["player"] == (2, 4)


@pytest.mark.parametrize(
    "response, parses",
    [
        ("Left", False),
        ("<think>t</think><answer></answer>", True),  # the format holds, the answer names no action
        ("<think>t</think><answer>Left Up</answer>", True),  # the format holds, "Left Up" is no action
        ("", False),
        ("<answer>Left", False),
    ],
)
def test_bad_response_takes_no_action_and_no_reward(response, parses):
    env = sokoban()
    before = (env.state(), env.render_text())
    obs, reward, terminated, truncated, info = env.step(response)
    assert (env.state(), env.render_text()) == before
    assert reward == 0.0 and not terminated and not truncated
    assert info["format_ok"] == parses
    assert not info["action_is_valid"] and info["actions"] == [] and not info["action_is_effective"]
    assert "did not follow" in obs.text


def test_format_penalty_applies_to_unparsable_responses_only():
    env = sokoban(format_penalty=0.2)
    assert env.step("no tags")[1] == pytest.approx(-0.2)
    assert env.step("<think>t</think><answer>Fly</answer>")[1] == pytest.approx(0.0)


def test_ineffective_penalty_is_charged_per_move_that_changes_nothing():
    # The player stands in row 2 of a 4-row room: one Up moves it, the next two walk into the wall.
    plain, penalised = sokoban(format_reward=0.0), sokoban(format_reward=0.0, ineffective_penalty=0.5)
    assert plain.step("<think>t</think><answer>Up, Up, Up</answer>")[1] == pytest.approx(-0.3)
    _, reward, _, _, info = penalised.step("<think>t</think><answer>Up, Up, Up</answer>")
    assert reward == pytest.approx(-0.3 - 2 * 0.5) and info["actions"] == ["Up", "Up", "Up"]
    assert penalised.step("<think>t</think><answer>Down</answer>")[1] == pytest.approx(-0.1)
    lake = envs_visual.make("frozenlake", render_mode="text", format_reward=0.0, ineffective_penalty=0.25)
    lake.reset(seed=0)
    assert lake.step("<think>t</think><answer>Up</answer>")[1] == pytest.approx(-0.25)  # off the map from the top row
    with pytest.raises(ValueError, match="ineffective_penalty must be >= 0"):
        sokoban(ineffective_penalty=-1.0)


def test_non_string_response_never_raises():
    env = sokoban()
    _, reward, _, _, info = env.step(None)
    assert reward == 0.0 and not info["format_ok"]


def test_action_text_is_never_evaluated():
    env = sokoban()
    _, _, _, _, info = env.step("<think>t</think><answer>__import__('os').system('false')</answer>")
    assert info["actions"] == [] and info["format_ok"] and not info["action_is_valid"]


def test_max_steps_counts_executed_actions():
    env = sokoban(max_steps=4)
    _, _, terminated, truncated, info = env.step("<think>t</think><answer>Left, Left, Left</answer>")
    assert not truncated and info["steps"] == 3
    _, _, terminated, truncated, info = env.step("<think>t</think><answer>Up, Up, Up</answer>")
    assert truncated and not terminated and info["actions"] == ["Up"] and info["steps"] == 4


def test_step_before_reset_raises_with_a_hint():
    env = envs_visual.make("sokoban")
    with pytest.raises(RuntimeError, match="reset"):
        env.step("<think>t</think><answer>Left</answer>")


def test_make_unknown_env_suggests_the_closest_name():
    with pytest.raises(ValueError, match="did you mean 'sokoban'") as error:
        envs_visual.make("sokobn")
    assert "frozenlake" in str(error.value)


def test_make_unknown_param_names_the_valid_params():
    with pytest.raises(ValueError, match="did you mean 'dim_room'") as error:
        envs_visual.make("sokoban", dim_rom=(6, 6))
    assert "num_boxes" in str(error.value) and "prompt_format" in str(error.value)
    with pytest.raises(ValueError, match="cell_size"):
        envs_visual.make("frozenlake", cellsize=28)


@pytest.mark.parametrize(
    "params, match",
    [
        ({"prompt_format": "free_thinking"}, "did you mean 'free_think'"),
        ({"render_mode": "image"}, "render_mode"),
        ({"max_actions_per_turn": 0}, "max_actions_per_turn"),
        ({"cell_size": 0}, "cell_size"),
        ({"dim_room": (3, 3)}, "dim_room"),
        ({"num_boxes": 9}, "num_boxes"),
    ],
)
def test_bad_param_values_explain_the_fix(params, match):
    with pytest.raises(ValueError, match=match):
        envs_visual.make("sokoban", **params)


def test_text_only_envs_reject_vision():
    for name in ("bandit", "countdown"):
        with pytest.raises(ValueError, match="render_mode"):
            envs_visual.make(name, render_mode="vision")


def test_format_response_round_trips_through_the_parser_in_every_format():
    from envs_visual.base import PROMPT_FORMATS, format_response, parse_response

    fields = {"observation": "box left", "reasoning": "push", "prediction": "box moves", "think": "push left"}
    for prompt_format in PROMPT_FORMATS:
        parsed = parse_response(format_response(prompt_format, "Left, Up", fields), prompt_format)
        assert parsed.ok and parsed.answer == "Left, Up", prompt_format


def test_recorded_frames_follow_each_executed_action():
    import envs_visual

    env = envs_visual.make("sokoban", prompt_format="no_think")
    env.reset(seed=5)
    env.record_frames = True
    plan = env.solve()[:3]
    _, reward, _, _, info = env.step(f"<answer>{', '.join(plan)}</answer>")
    assert [a for a, _, _ in info["frames"]] == info["actions"] == plan[: len(info["actions"])]
    assert sum(r for _, r, _ in info["frames"]) + env.format_reward == pytest.approx(reward)
    assert info["frames"][-1][2].tobytes() == env.render_image().tobytes()


def test_an_ended_episode_pays_nothing():
    import envs_visual

    env = envs_visual.make("sokoban", prompt_format="no_think")
    env.reset(seed=5)
    plan = env.solve()
    while plan:
        _, _, terminated, _, _ = env.step(f"<answer>{', '.join(plan[:3])}</answer>")
        plan = plan[3:]
    assert terminated
    _, reward, _, _, info = env.step("<answer>Left</answer>")
    assert reward == 0.0 and info["actions"] == []
