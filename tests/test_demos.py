import re

import numpy as np
import pytest
import torch
from scripted import ScriptedDecoder

import envs_visual
from envs_visual.base import PROMPT_FORMATS, format_response
from envs_visual.grid import DIRECTIONS
from envs_visual.sokoban import teacher_decision
from vagen.config import load_config
from vagen.episode import ChatEncoder
from vagen.rollout import make_env, rollout
from vagen.warmstart.demos import (
    blind_success,
    collect_demos,
    demo_episode,
    distinct_eval_seeds,
    distinct_levels,
    eval_level_keys,
    frozenlake_path,
    frozenlake_reasoning,
    level_key,
    play_demo,
    reasoning,
    scripted_baselines,
    scripted_success,
    sokoban_path,
    sokoban_reasoning,
)

CONFIGS = ["frozenlake_text", "sokoban_text"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("policy", ["teacher", "solver"])
def test_replayed_demonstrations_reach_their_recorded_success_exactly(config, policy):
    cfg = load_config(config)
    demos = collect_demos(cfg.env, policy, 60, cfg.rollout.max_turns)
    fresh = make_env(cfg.env)
    replayed = []
    for demo in demos:
        fresh.reset(seed=demo.seed)
        rewards, success = [], False
        for response in demo.responses:
            _, reward, terminated, truncated, info = fresh.step(response)
            rewards.append(reward)
            success = info["success"]
        assert rewards == demo.rewards and success == demo.success, demo.seed
        replayed.append(success)
    assert np.mean(replayed) == np.mean([d.success for d in demos])
    assert 0 < np.mean(replayed)  # the scripted policies solve levels


def test_solver_beats_teacher_and_teacher_beats_random_on_sokoban():
    cfg = load_config("sokoban_text", ["rollout.max_turns=5"])
    seeds = distinct_eval_seeds(cfg.env, 100)
    rates = {p: scripted_success(cfg.env, p, seeds, cfg.rollout.max_turns)["success"]
             for p in ("solver", "teacher", "random")}
    assert rates["solver"] > rates["teacher"] > rates["random"], rates


def test_blind_baseline_is_the_best_solver_plan_played_without_looking():
    cfg = load_config("frozenlake_visual")
    seeds = distinct_eval_seeds(cfg.env, 64)
    blind = blind_success(cfg.env, seeds, cfg.rollout.max_turns, candidates=16)
    plan = blind["plan"]
    assert sorted(plan) == ["Down"] * 3 + ["Right"] * 3  # a shortest way from corner to corner
    env = envs_visual.make("frozenlake", render_mode="text", prompt_format="no_think")
    successes = 0
    for seed in seeds:  # the same plan, one action per step
        env.reset(seed=seed)
        for action in plan:
            _, _, terminated, _, info = env.step(f"<answer>{action}</answer>")
            if terminated:
                break
        successes += info["success"]
    assert blind["successes"] == successes and blind["n"] == 64
    teacher = scripted_success(cfg.env, "teacher", seeds, cfg.rollout.max_turns)["success"]
    assert 0 < blind["success"] < teacher


def test_demonstrations_use_distinct_levels_and_never_evaluation_levels():
    cfg = load_config("frozenlake_text")
    held_out = eval_level_keys(cfg.env, 256)
    demos = collect_demos(cfg.env, "teacher", 300, cfg.rollout.max_turns, exclude=held_out)
    levels = [d.level for d in demos]
    assert len(set(levels)) == len(levels)
    assert not set(levels) & held_out
    # exclusion is by level identity, not seed: the level of training seed 0 is skipped when excluded
    first = collect_demos(cfg.env, "teacher", 1, cfg.rollout.max_turns)[0]
    assert first.seed == 0
    assert collect_demos(cfg.env, "teacher", 1, cfg.rollout.max_turns, exclude={first.level})[0].seed > 0
    seeds = distinct_eval_seeds(cfg.env, 64)
    env = make_env(cfg.env)
    keys = set()
    for seed in seeds:
        env.reset(seed=seed)
        keys.add(level_key(env))
    assert len(keys) == 64


@pytest.mark.parametrize("prompt_format", list(PROMPT_FORMATS))
def test_responses_parse_in_every_prompt_format(prompt_format):
    for config in CONFIGS:
        cfg = load_config(config, [f"env.prompt_format={prompt_format}"])
        for demo in collect_demos(cfg.env, "teacher", 20, cfg.rollout.max_turns):
            for response in demo.responses:
                parsed = envs_visual.parse_response(response, prompt_format)
                assert parsed.ok, response


def test_reasoning_is_derived_from_the_state_and_varied():
    state = {"size": (4, 4), "player": (0, 0), "goal": (2, 1), "start": (0, 0), "holes": [(0, 1)]}
    texts = {frozenlake_reasoning(state, ["Down"], np.random.default_rng(i))["reasoning"] for i in range(20)}
    assert len(texts) > 3
    for text in texts:
        assert "2 rows down and 1 column right" in text or "2 down, 1 right" in text, text
        assert "right" in text.split(".")[1] and "down" in text.split(".")[-2].lower(), text
    box_state = {"size": (6, 6), "player": (3, 3), "boxes": [(2, 3)], "targets": [(1, 3)], "walls": []}
    text = sokoban_reasoning(box_state, ["Up"], np.random.default_rng(0))["reasoning"]
    assert ("1 row up" in text or "1 up" in text) and "push up" in text.lower() or "Up first" in text, text
    assert format_response("no_think", "Up, Left", {}) == "<answer>Up, Left</answer>"


def test_distinct_levels_skip_repeats_and_excluded_levels_and_give_up_with_the_fix():
    cfg = load_config("frozenlake_text")
    env = make_env(cfg.env)
    env.reset(seed=1)
    # seeds 2 and 3 draw the same map
    assert list(distinct_levels(env, 3, [0, 0, 1, 2, 3, 4], exclude={level_key(env)})) == [0, 2, 4]
    with pytest.raises(RuntimeError, match="only 1 new distinct frozenlake levels in 3 seeds, 2 requested; do this"):
        list(distinct_levels(env, 2, [5, 5, 5, 6], max_draws=3, fix="do this"))


def test_path_reasoning_names_each_move_from_the_cell_it_starts_on():
    holes = [(1, 0), (1, 1), (3, 1)]
    states = [{"size": (4, 4), "player": p, "goal": (3, 3), "holes": holes} for p in [(0, 0), (0, 1), (0, 2)]]
    # rows first: below (0, 0) and (0, 1) are holes, below (0, 2) is ice
    assert frozenlake_path(states, ["Right", "Right", "Down"])["reasoning"] == (
        "row 0, column 0: hole below, so right. row 0, column 1: hole below, so right. row 0, column 2: down.")
    # columns first: right of (0, 0) is ice, so nothing was rejected
    assert frozenlake_path(states[:1], ["Right"], "columns")["reasoning"] == "row 0, column 0: right."
    # a fallback away from the goal names every move toward it that was a hole
    corner = {"size": (4, 4), "player": (2, 0), "goal": (3, 3), "holes": [(3, 0), (2, 1)]}
    assert frozenlake_path([corner], ["Up"])["reasoning"] == "row 2, column 0: holes below and right, so up."
    before = {"size": (6, 6), "player": (4, 2), "boxes": [(3, 2)], "targets": [(1, 2)], "walls": []}
    after = {**before, "player": (3, 2), "boxes": [(2, 2)]}
    assert sokoban_path([before, after], ["Up", "Left"])["reasoning"] == (
        "box at row 3, column 2; target at row 1, column 2. row 4, column 2: push up. row 3, column 2: go left.")


@pytest.mark.parametrize("config", CONFIGS)
def test_path_demonstrations_trace_the_moves_of_their_answer(config):
    cfg = load_config(config)
    env = make_env(cfg.env)
    for demo in collect_demos(cfg.env, "teacher", 30, cfg.rollout.max_turns, kind="path"):
        env.reset(seed=demo.seed)
        for response in demo.responses:
            clauses = response.split("<think>")[1].split("</think>")[0].split(". ")
            moves = response.split("<answer>")[1].split("</answer>")[0].split(", ")
            if config == "sokoban_text":  # first where the box and its target are
                (br, bc), (tr, tc) = env.state()["boxes"][0], env.state()["targets"][0]
                assert clauses.pop(0) == f"box at row {br}, column {bc}; target at row {tr}, column {tc}"
            assert len(clauses) == len(moves), response
            for clause, move in zip(clauses, moves):
                state = env.state()
                r, c = state["player"]
                assert clause.startswith(f"row {r}, column {c}: ") and clause.rstrip(".").endswith(move.lower())
                if config == "sokoban_text":
                    dr, dc = DIRECTIONS[move]
                    verb = "push" if (r + dr, c + dc) in {tuple(b) for b in state["boxes"]} else "go"
                    assert clause.split(": ")[1].startswith(verb + " "), clause
                env.step(format_response(env.prompt_format, move))
    with pytest.raises(ValueError, match="unknown demonstration reasoning 'far'; choices: near, path, plan"):
        reasoning("frozenlake", [{}], ["Up"], np.random.default_rng(0), kind="far")
    with pytest.raises(ValueError, match="no path reasoning for env 'countdown'.*sft.reasoning"):
        reasoning("countdown", [{}], ["Up"], np.random.default_rng(0), kind="path")


def test_plan_reasoning_names_the_cell_the_teacher_walks_to():
    # box at (3, 2), target above it: the teacher pushes up from (4, 2) and walks there around the box
    room = {"size": (6, 6), "boxes": [(3, 2)], "targets": [(2, 2)], "walls": []}
    states = [{**room, "player": p} for p in [(2, 3), (3, 3), (4, 3)]]
    assert sokoban_path(states, ["Down", "Down", "Left"], aims=True)["reasoning"] == (
        "box at row 3, column 2; target at row 2, column 2. row 2, column 3: to row 4, column 2, go down. "
        "row 3, column 3: to row 4, column 2, go down. row 4, column 3: to row 4, column 2, go left.")
    # a push, a move that is not the teacher's (e.g. the solver's) and a random move (from (2, 2) no
    # step gets closer to (4, 2): the box is in the way) read as in the path reasoning
    pushing, stuck = {**room, "player": (4, 2)}, {**room, "player": (2, 2)}
    assert sokoban_path([pushing], ["Up"], aims=True)["reasoning"].endswith("row 4, column 2: push up.")
    assert sokoban_path(states[:1], ["Right"], aims=True)["reasoning"].endswith("row 2, column 3: go right.")
    assert teacher_decision(stuck, np.random.default_rng(0))[1:] == ("random", None)
    assert sokoban_path([stuck], ["Right"], aims=True)["reasoning"].endswith("row 2, column 2: go right.")


def test_plan_demonstrations_play_the_path_demonstrations_moves():
    cfg = load_config("sokoban_text")
    path = collect_demos(cfg.env, "teacher", 30, cfg.rollout.max_turns, kind="path")
    plan = collect_demos(cfg.env, "teacher", 30, cfg.rollout.max_turns, kind="plan")
    aims = 0
    for a, b in zip(path, plan, strict=True):
        assert (a.seed, a.rewards, a.success) == (b.seed, b.rewards, b.success)
        for x, y in zip(a.responses, b.responses, strict=True):
            assert x.split("<answer>")[1] == y.split("<answer>")[1]
            stripped = re.sub(r"to row \d, column \d, ", "", y)
            assert stripped == x
            aims += len(y) > len(x)
    assert aims > 10
    with pytest.raises(ValueError, match="no plan reasoning for env 'frozenlake'.*sft.reasoning"):
        reasoning("frozenlake", [{}], ["Up"], np.random.default_rng(0), kind="plan")


def test_different_levels_get_different_reasoning():
    cfg = load_config("sokoban_text")
    demos = collect_demos(cfg.env, "teacher", 50, cfg.rollout.max_turns)
    thoughts = {r.split("</think>")[0] for d in demos for r in d.responses}
    assert len(thoughts) > 40


@pytest.mark.parametrize("config,fixture", [("frozenlake_visual", "tiny_vl"), ("sokoban_text", "tiny_text")])
def test_demo_episode_is_the_episode_rollout_builds(config, fixture, request):
    _, _, processor = request.getfixturevalue(fixture)
    encoder = ChatEncoder(processor)
    cfg = load_config(config, ["rollout.max_new_tokens=64"])
    # episodes of the same length so that every row of the scripted batch plays every turn
    demos = [d for d in collect_demos(cfg.env, "teacher", 40, cfg.rollout.max_turns)
             if len(d.responses) == cfg.rollout.max_turns][:2]
    episodes = [demo_episode(d, make_env(cfg.env), encoder) for d in demos]
    decoder = ScriptedDecoder(encoder, [d.responses for d in demos])
    played, _ = rollout(None, encoder, cfg, [d.seed for d in demos], 1, decoder=decoder)
    for ours, theirs in zip(episodes, played):
        assert ours.input_ids == theirs.input_ids
        assert [t.span for t in ours.turns] == [t.span for t in theirs.turns]
        assert [t.reward for t in ours.turns] == [t.reward for t in theirs.turns]
        assert ours.success == theirs.success
        assert len(ours.pixel_values) == len(theirs.pixel_values)
        for a, b in zip(ours.pixel_values, theirs.pixel_values):
            assert torch.equal(a, b)


def test_play_demo_rejects_unknown_policy():
    cfg = load_config("frozenlake_text")
    with pytest.raises(ValueError, match="choices: teacher, solver"):
        play_demo(make_env(cfg.env), 0, "oracle", 3)


def test_a_drawn_teacher_style_holds_for_the_episode_and_is_said():
    cfg = load_config("frozenlake_visual")
    env = make_env(cfg.env, {"render_mode": "text"})
    firsts = []
    for demo in collect_demos(cfg.env, "teacher", 40, cfg.rollout.max_turns, draw_style=True):
        sentences = {r.split("<think>")[1].split(".")[0] for r in demo.responses}
        assert len(sentences) == 1 and sentences <= {"Rows first", "Columns first"}, demo.responses
        style = "rows" if sentences == {"Rows first"} else "columns"
        replay = play_demo(env, demo.seed, "teacher", cfg.rollout.max_turns, style=style)
        assert [r.split("<answer>")[1] for r in replay.responses] == [r.split("<answer>")[1] for r in demo.responses]
        firsts.append(style)
    assert 10 < firsts.count("rows") < 30  # drawn per episode, about half each
    default = collect_demos(cfg.env, "teacher", 40, cfg.rollout.max_turns)  # rows first, unsaid (sft.teacher_styles)
    assert not any(r.startswith(("<think>Rows first", "<think>Columns first")) for d in default for r in d.responses)
    assert all(play_demo(env, d.seed, "teacher", cfg.rollout.max_turns, style="rows").responses[0].split("<answer>")[1]
               == d.responses[0].split("<answer>")[1] for d in default)
    solver = play_demo(env, 3, "solver", cfg.rollout.max_turns, draw_style=True)
    assert not any(r.startswith(("<think>Rows first", "<think>Columns first")) for r in solver.responses)


def test_each_teacher_style_solves_maps_the_other_does_not():
    """Which axis to prefer depends on the map: the better style per level beats either style."""
    cfg = load_config("frozenlake_visual")
    env = make_env(cfg.env, {"render_mode": "text"})
    seeds = distinct_eval_seeds(cfg.env, 64)
    solved = {style: {s for s in seeds if play_demo(env, s, "teacher", cfg.rollout.max_turns, style=style).success}
              for style in ("rows", "columns")}
    assert solved["rows"] - solved["columns"] and solved["columns"] - solved["rows"]
    assert len(solved["rows"] | solved["columns"]) >= 0.85 * len(seeds) > max(map(len, solved.values()))


def test_scripted_baselines_rank_the_scripted_policies_and_follow_teacher_styles():
    seeds = distinct_eval_seeds(load_config("frozenlake_visual").env, 64)
    rows = scripted_baselines(load_config("frozenlake_visual"), seeds)
    assert list(rows) == ["random", "teacher", "solver", "blind", "teacher, best style"]
    rate = {name: row["success"] for name, row in rows.items()}
    assert rate["random"] < rate["blind"] < rate["teacher"] < rate["teacher, best style"] <= rate["solver"] == 1.0
    drawn = scripted_baselines(load_config("frozenlake_visual", ["sft.teacher_styles=true"]), seeds)["teacher"]
    env = make_env(load_config("frozenlake_visual").env, {"render_mode": "text"})
    assert drawn["successes"] == sum(play_demo(env, s, "teacher", 3, draw_style=True).success for s in seeds)
    assert "teacher, best style" not in scripted_baselines(load_config("sokoban_text"), seeds[:4])


@pytest.mark.parametrize("name, policy", [("sokoban", "teacher"), ("frozenlake", "teacher"), ("navigation", "solver")])
def test_grounding_demonstrations_describe_the_state_before_and_after_each_turn(name, policy):
    env = envs_visual.make(name, render_mode="text", prompt_format="grounding_worldmodeling")
    scores = []
    for seed in range(8 if name == "navigation" else 20):
        demo = play_demo(env, seed, policy, max_turns=3)
        env.reset(seed=seed)
        for text in demo.responses:
            parsed = envs_visual.parse_response(text, env.prompt_format)
            assert parsed.observation == env.describe_state(), text
            _, _, _, _, info = env.step(text)
            assert parsed.prediction == env.describe_state(), text
            scores += [info["grounding_score"], info["worldmodel_score"]]
    assert len(scores) >= 16 and set(scores) == {1.0}
    if name == "navigation":  # some turns see the target, so their descriptions place it
        assert any("m away" in text for text in demo_texts(env, policy))


def demo_texts(env, policy):
    return [text for seed in range(8) for text in play_demo(env, seed, policy, max_turns=3).responses]


@pytest.mark.parametrize("prompt_format", ["free_think", "grounding_worldmodeling"])
def test_manipulation_demonstrations_parse_and_the_solvers_succeed(prompt_format):
    env = envs_visual.make("manipulation", task="stack", prompt_format=prompt_format, render_mode="text")
    for seed in range(3):
        solver = play_demo(env, seed, "solver", max_turns=3)  # play_demo checks that every response parses
        assert solver.success, seed
        teacher = play_demo(env, seed, "teacher", max_turns=3)
        assert len(teacher.responses) >= 1
    assert "I hold the" in solver.responses[-1] or "My gripper is empty." in solver.responses[0]
