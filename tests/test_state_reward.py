"""The state reward in training: coefficients on the environment's grades, the repetition check,
the optional local judge, the config's checks."""

import types

import pytest

from vagen.config import ConfigError, load_config
from vagen.episode import Episode, Turn
from vagen.state_reward import RepetitionTracker, StateJudge, StateRewarder

BEFORE = [["box", "above", "left"], ["target", "same", "right"]]
AFTER = [["box", "same", "left"], ["target", "same", "right"]]


def _algo(**overrides):
    cfg = load_config("sokoban_visual", ["env.prompt_format=grounding_worldmodeling", "algo.state_reward=rules",
                                         *[f"algo.{k}={v}" for k, v in overrides.items()]])
    return cfg.algo


def _turn(observation, prediction, grounding, worldmodel, reward=1.0, before=BEFORE, after=AFTER):
    info = {"parsed": {"observation": observation, "prediction": prediction}, "grounding_score": grounding,
            "worldmodel_score": worldmodel, "state_before": before, "state_after": after}
    return Turn("obs", [], "response", reward, info, (0, 1), 1)


def _episode(*turns):
    ep = Episode("sokoban", 0, 0, "")
    ep.turns = list(turns)
    return ep


def test_turn_rewards_gain_the_coefficients_times_the_grades():
    rewarder = StateRewarder(_algo(grounding_coef=0.5, worldmodeling_coef=0.25))
    graded = _turn("the box is up-left", "the box is left", 1.0, 0.5)
    unparsed = _turn("", "", None, None, reward=-0.5)  # the environment gives no grade: nothing is added
    stats = rewarder([_episode(graded, unparsed)])
    assert graded.reward == 1.0 + 0.5 * 1.0 + 0.25 * 0.5
    assert unparsed.reward == -0.5
    assert stats == {"rollout/grounding_score": 1.0, "rollout/worldmodel_score": 0.5, "rollout/state_repeats": 0.0,
                     "rollout/grounding_score_raw": 1.0, "rollout/worldmodel_score_raw": 0.5}


def test_only_the_fields_the_format_has_are_graded():
    rewarder = StateRewarder(_algo())
    turn = _turn("the box is up-left", "", 0.5, None)  # grounding format: no <prediction>
    stats = rewarder([_episode(turn)])
    assert turn.reward == 1.25
    assert stats == {"rollout/grounding_score": 0.5, "rollout/state_repeats": 0.0, "rollout/grounding_score_raw": 0.5}


def test_a_description_written_for_too_many_different_states_scores_zero():
    rewarder = StateRewarder(_algo(state_repeat_states=2))
    states = [[["box", "above", v]] for v in ("left", "right", "same")]
    # The same text (up to case and spacing) for three different true states: the third is a template.
    turns = [_turn(text, "", 1.0, None, before=state)
             for text, state in zip(["The box is up.", "the box  is up.", "THE BOX IS UP."], states)]
    stats = rewarder([_episode(*turns)])
    assert [t.reward for t in turns] == [1.5, 1.5, 1.0]
    assert turns[2].info["grounding_score"] == 0.0
    assert stats["rollout/state_repeats"] == pytest.approx(1 / 3)
    assert stats["rollout/grounding_score"] == pytest.approx(2 / 3)
    assert stats["rollout/grounding_score_raw"] == 1.0  # before the check, the template's own grade


def test_the_same_description_of_the_same_state_is_never_a_repeat():
    tracker = RepetitionTracker(window=8, max_states=1)
    assert [tracker.add("the box is above", BEFORE) for _ in range(20)] == [False] * 20


def test_repeats_are_counted_in_a_window_and_the_window_survives_a_checkpoint():
    tracker = RepetitionTracker(window=3, max_states=1)
    assert tracker.add("same", [1]) is False
    assert tracker.add("same", [2]) is True  # two states within the window
    assert tracker.add("other", [1]) is False
    assert tracker.add("other", [1]) is False  # "same" for [1] has left the window; [2] is still in it
    restored = RepetitionTracker(window=1, max_states=5)
    restored.load_state_dict(tracker.state_dict())
    for text, state in (("same", [3]), ("other", [1]), ("same", [4]), ("same", [4]), ("same", [4])):
        assert restored.add(text, state) == tracker.add(text, state), (text, state)


def test_the_judge_scores_the_same_in_any_batch_and_replaces_the_rules(tiny_text):
    path, _, _ = tiny_text
    judge = StateJudge(path, batch_size=3)
    pairs = [("The box is above me.", "The box is above me."), ("The goal is below me.", "no idea"),
             ("x", "y"), ("The target is on my right.", "The target is on my left, far away.")]
    batched = judge.score(pairs)
    judge.batch_size = 1
    assert judge.score(pairs) == pytest.approx(batched, abs=1e-6)
    assert all(0.0 < s < 1.0 for s in batched)

    rewarder = StateRewarder(_algo(), judge=judge)
    turn = _turn("The box is above me.", "", 1.0, None)
    rewarder([_episode(turn)])
    from envs_visual.state_grader import describe_relations

    expected = judge.score([(describe_relations(BEFORE), "The box is above me.")])[0]
    assert turn.info["grounding_score"] == pytest.approx(expected)
    assert turn.reward == pytest.approx(1.0 + 0.5 * expected)


def test_the_judge_names_a_missing_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        StateJudge(str(tmp_path))


@pytest.mark.parametrize("overrides, message", [
    (["algo.state_reward=rules"], "env.prompt_format=free_think has neither; use env.prompt_format="
                                  "grounding_worldmodeling"),
    (["algo.state_reward=judge", "env.prompt_format=grounding"], "algo.state_judge_path is not set"),
    (["algo.state_reward=judge", "env.prompt_format=grounding", "algo.state_judge_path=/nowhere"],
     "no config.json in /nowhere"),
    (["algo.state_judge_path=/nowhere"], "is used only with algo.state_reward=judge"),
    (["algo.state_reward=rules", "env.prompt_format=grounding", "algo.grounding_coef=-1"], "must be >= 0"),
    (["algo.state_reward=rulez"], "did you mean 'rules'"),
])
def test_state_reward_settings_are_checked_before_training(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("sokoban_visual", overrides)


def test_no_rewarder_without_a_state_reward():
    from vagen.state_reward import state_rewarder

    assert state_rewarder(types.SimpleNamespace(algo=load_config("sokoban_visual").algo)) is None


def test_the_judge_reads_the_true_state_as_sentences():
    from envs_visual.state_grader import describe_relations

    assert describe_relations(BEFORE) == "The box is above and to the left of me. The target is on my right, in the same row."
    assert describe_relations([["hole", "below", "same"], ["hole", "same", "left"]]) == (
        "A hole is directly below me, in the same column. A hole is on my left, in the same row.")
    assert describe_relations([["red table", "ahead", "far"]]) == "The red table is straight ahead, far."
    assert describe_relations([]) == "Nothing to describe is in view."


class _Describing:
    """Sokoban that plays a scripted response in place of the model's: "Left", with an <observation>
    and a <prediction> that are the true states' descriptions or their mirror images."""

    MIRROR = {"above": "below", "below": "above", "left": "right", "right": "left", "same": "same"}

    def __init__(self, env, truthful: bool):
        self.env, self.truthful = env, truthful

    def _say(self, relations) -> str:
        from envs_visual.state_grader import describe_relations

        if not self.truthful:
            relations = [(kind, self.MIRROR[a], self.MIRROR[b]) for kind, a, b in relations]
        return describe_relations(relations)

    def step(self, text):
        import copy

        from envs_visual.base import format_response

        shadow = copy.deepcopy(self.env)
        shadow.step(format_response(self.env.prompt_format, "Left"))
        response = format_response(self.env.prompt_format, "Left", {
            "observation": self._say(self.env.state_relations()), "reasoning": "I go left.",
            "prediction": self._say(shadow.state_relations())})
        return self.env.step(response)

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_a_run_logs_both_scores_and_with_the_state_reward_pays_for_true_descriptions(
        tmp_path, model_cache, distributed, monkeypatch):
    import json

    import vagen.rollout
    from vagen.train import main

    real = vagen.rollout.make_env
    common = ["train.iterations=2", "rollout.env_groups=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
              "rollout.max_turns=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false",
              "log.tensorboard=false", "env.prompt_format=grounding_worldmodeling", f"train.run_dir={tmp_path}",
              f"model.builtin_cache={model_cache}"]
    records = {}
    for name, truthful, reward in (("truthful", True, "rules"), ("mirrored", False, "rules"), ("unrewarded", True, "none")):
        monkeypatch.setattr(vagen.rollout, "make_env", lambda *a, t=truthful, **k: _Describing(real(*a, **k), t))
        assert main(["--config", "sokoban_text", *common, f"train.run_name={name}", f"algo.state_reward={reward}"]) == 0
        records[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    for true, mirrored, unrewarded in zip(records["truthful"], records["mirrored"], records["unrewarded"]):
        assert true["rollout/grounding_score"] == true["rollout/worldmodel_score"] == 1.0
        assert mirrored["rollout/grounding_score"] < 0.5 and mirrored["rollout/worldmodel_score"] < 0.5
        assert true["rollout/state_repeats"] == mirrored["rollout/state_repeats"] == 0.0
        # unrewarded, the descriptions are still graded and logged: the same scores, no reward for them
        assert unrewarded["rollout/grounding_score"] == unrewarded["rollout/worldmodel_score"] == 1.0
        assert "rollout/state_repeats" not in unrewarded
        # The scripted episodes are the same in the three runs, and every turn parses: each turn gains
        # 0.5 x its observation's score + 0.5 x its prediction's.
        assert true["rollout/turns"] == mirrored["rollout/turns"] == unrewarded["rollout/turns"]
        for run in (true, mirrored):
            gain = 0.5 * (run["rollout/grounding_score"] + run["rollout/worldmodel_score"]) * run["rollout/turns"]
            assert run["rollout/reward_mean"] == pytest.approx(unrewarded["rollout/reward_mean"] + gain)
