"""Several tasks in one run (rollout.tasks): the config, group ids that never mix tasks, the per-task filter and
whitening, per-task metrics, and an iteration of configs/multitask_visual.yaml."""

import json
import math

import pytest
import torch
import yaml
from scripted import ScriptedDecoder
from test_staleness import Answers, Steps, _saves_in

from envs_visual.base import format_response
from vagen.config import ConfigError, check_ranks, from_dict, load_configs, main, task_configs, to_yaml

TEXT_TASKS = "rollout.tasks=[{config: sokoban_text, groups: 2}, {config: frozenlake_text, groups: %d}]"
TASK_KEYS = ("max_turns", "max_new_tokens", "max_trajectory_length")


def _own(name, *more, overrides=()):
    cfg = load_configs([name, *more], list(overrides), require_checkpoint=False)
    return {key: getattr(cfg.rollout, key) for key in TASK_KEYS}, cfg.env


def test_each_task_keeps_its_environment_config():
    cfg = load_configs("multitask_visual")
    assert [(t.name, t.groups) for t in cfg.rollout.tasks] == [("sokoban_visual", 2), ("frozenlake_visual", 1),
                                                              ("navigation_visual", 1)]
    for task in cfg.rollout.tasks:
        rollout, env = _own(task.config, overrides=task.overrides)
        assert task.rollout == rollout
        assert task.env == dict(env.__dict__)
    # the run's env is the first task's, its lengths the largest (navigation's 5 turns), its groups their sum
    assert cfg.env.name == "sokoban" and cfg.rollout.max_turns == 5 and cfg.rollout.env_groups == 4
    subs = dict(task_configs(cfg))
    assert subs["navigation_visual"].env.max_actions_per_turn == 5
    assert (subs["frozenlake_visual"].env.name, subs["frozenlake_visual"].rollout.max_turns,
            subs["frozenlake_visual"].rollout.env_groups) == ("frozenlake", 3, 1)
    # a run's saved config.yaml holds the resolved tasks and reproduces the config alone
    assert from_dict(yaml.safe_load(to_yaml(cfg)), cfg.name) == cfg


def test_a_recipe_after_the_tasks_keeps_each_tasks_turns_and_lengths():
    cfg = load_configs(["multitask_visual", "recipes/qwen3-vl-4b"], require_checkpoint=False)
    for task in cfg.rollout.tasks:
        rollout, env = _own(task.config, "recipes/qwen3-vl-4b")
        assert task.rollout == rollout, task.name
        assert task.env["params"] == env.params, task.name
    sokoban, frozenlake, navigation = cfg.rollout.tasks
    assert sokoban.rollout == {"max_turns": 5, "max_new_tokens": 512, "max_trajectory_length": 5000}
    assert frozenlake.rollout == {"max_turns": 3, "max_new_tokens": 200, "max_trajectory_length": 2400}
    assert navigation.env["params"] == {"image_width": 128, "image_height": 128}
    # the recipe's 32 level groups shared out 2:1:1
    assert [t.groups for t in cfg.rollout.tasks] == [16, 8, 8] and cfg.rollout.env_groups == 32


def test_a_tasks_own_overrides_apply_to_it_alone_and_before_a_recipe():
    # multitask_visual's warm start learned navigation at 112 px; navigation_visual's own is 168
    cfg = load_configs("multitask_visual")
    sokoban, _, navigation = cfg.rollout.tasks
    assert navigation.overrides == ["env.params.image_width=112", "env.params.image_height=112"]
    assert navigation.env["params"] == {"image_width": 112, "image_height": 112}
    assert load_configs("navigation_visual").env.params == {"image_width": 168, "image_height": 168}
    assert sokoban.env == dict(_own("sokoban_visual")[1].__dict__)
    # a recipe after the tasks still sets its family's geometry (Qwen3-VL's 128 px), the command line wins over both
    recipe = load_configs(["multitask_visual", "recipes/qwen3-vl-4b"], require_checkpoint=False)
    assert recipe.rollout.tasks[2].env["params"] == {"image_width": 128, "image_height": 128}
    cfg = load_configs("multitask_visual", ["env.max_actions_per_turn=2"])
    assert [t.env["max_actions_per_turn"] for t in cfg.rollout.tasks] == [2, 2, 2]
    # the saved config.yaml reproduces it
    assert from_dict(yaml.safe_load(to_yaml(cfg)), cfg.name) == cfg


def test_command_line_turns_and_env_settings_apply_to_every_task():
    cfg = load_configs("multitask_visual", ["rollout.max_turns=2", "env.step_timeout=30"])
    assert [t.rollout["max_turns"] for t in cfg.rollout.tasks] == [2, 2, 2]
    assert [t.env["step_timeout"] for t in cfg.rollout.tasks] == [30.0, 30.0, 30.0]
    assert [t.rollout["max_new_tokens"] for t in cfg.rollout.tasks] == [64, 64, 48]


@pytest.mark.parametrize("override, message", [
    ("rollout.tasks=[{config: sokobn_visual, groups: 1}]",
     r"rollout.tasks\[0\] \(config: sokobn_visual\): unknown config 'sokobn_visual'; did you mean 'sokoban_visual'"),
    ("rollout.tasks=[{config: sokoban_visual, grups: 1}]",
     r"rollout.tasks\[0\]: unknown key 'grups'; did you mean 'groups'\? keys: config, groups, name, overrides"),
    ("rollout.tasks=[{config: sokoban_visual, groups: 1, overrides: [train.seed=3]}]",
     r"rollout.tasks\[0\] \(sokoban_visual\) overrides \['train.seed=3'\]: a task's overrides set env.\* and "
     r"rollout.max_turns, rollout.max_new_tokens, rollout.max_trajectory_length only"),
    ("rollout.tasks=[{config: sokoban_visual, groups: 0}]", r"rollout.tasks\[0\] \(sokoban_visual\) groups=0 must be >= 1"),
    ("rollout.tasks=[sokoban_visual]", r"rollout.tasks\[0\]: expected a mapping with keys config, groups"),
    ("rollout.tasks=[{config: sokoban_visual, groups: 1}, {config: sokoban_visual, groups: 1}]",
     r"rollout.tasks names sokoban_visual more than once"),
    ("rollout.tasks=[{config: multitask_visual, groups: 1}]", r"lists tasks of its own"),
    ("rollout.env_groups=6", r"rollout.env_groups=6 cannot be shared out in the proportions of rollout.tasks "
                             r"\(sokoban_visual 2, frozenlake_visual 1, navigation_visual 1 of 4\).*a multiple of 4"),
])
def test_task_mistakes_are_refused_saying_how_to_fix(override, message):
    with pytest.raises(ConfigError, match=message):
        load_configs("multitask_visual", [override])


def test_each_tasks_groups_are_checked_against_the_ranks(capsys):
    cfg = load_configs("multitask_visual")
    check_ranks(cfg, 1)
    with pytest.raises(ConfigError, match=r"rollout.tasks\[1\] \(frozenlake_visual\) groups=1 must be divisible by "
                                          r"the 2 ranks"):
        check_ranks(cfg, 2)
    check_ranks(load_configs("multitask_visual", ["rollout.env_groups=8"]), 2)  # 4, 2, 2
    assert main(["multitask_visual", "--ranks", "2"]) == 2
    assert "frozenlake_visual) groups=1 must be divisible by the 2 ranks" in capsys.readouterr().err


def _text_tasks(*overrides, frozenlake_groups=1):
    return load_configs(None, [TEXT_TASKS % frozenlake_groups, "rollout.group_size=2", "rollout.max_turns=2",
                               "train.mini_batch_size=4", "model.path=builtin:tiny-text", *overrides])


def _play(cfg, tiny_text, rank=0, world_size=1):
    from vagen.episode import ChatEncoder
    from vagen.rollout import close_envs
    from vagen.tasks import TaskRollouts

    encoder = ChatEncoder(tiny_text[2])
    source = TaskRollouts(encoder, cfg, rank, world_size)
    sokoban = cfg.rollout.tasks[0].env["prompt_format"]
    # every slot answers a valid move; FrozenLake's rows answer without the format
    script = {row: [format_response(sokoban, "Left"), format_response(sokoban, "Right")] for row in range(4)}
    try:
        decoder = ScriptedDecoder(encoder, script)
        frozen = {row: ["no format", "no format"] for row in range(4)}
        # the tasks play one after the other, each from row 0: answer FrozenLake's rows from their own script
        plays = []
        original = decoder.start_rollout

        def start_rollout():
            plays.append(len(plays))
            decoder.script = script if len(plays) == 1 else frozen
            original()

        decoder.start_rollout = start_rollout
        episodes, stats = source.play(decoder, version=0)
    finally:
        close_envs(source.all_envs())
    return episodes, stats


def test_group_ids_never_mix_tasks(tiny_text):
    episodes, _ = _play(_text_tasks(), tiny_text)
    # hand-checked: Sokoban's 2 groups of 2 (levels 0 and 1 of iteration 0), then FrozenLake's one (level 0)
    assert [(ep.task, ep.env_name, ep.group_id, ep.seed) for ep in episodes] == [
        ("sokoban_text", "sokoban", 0, 0), ("sokoban_text", "sokoban", 0, 0),
        ("sokoban_text", "sokoban", 1, 1), ("sokoban_text", "sokoban", 1, 1),
        ("frozenlake_text", "frozenlake", 2, 0), ("frozenlake_text", "frozenlake", 2, 0)]


def test_group_ids_of_a_second_rank_never_mix_tasks(tiny_text):
    episodes, _ = _play(_text_tasks(frozenlake_groups=2), tiny_text, rank=1, world_size=2)
    # rank 1 plays the second level of each task: local ids 0 (Sokoban) and 1 (FrozenLake)
    assert [(ep.task, ep.group_id, ep.seed) for ep in episodes] == [
        ("sokoban_text", 0, 1), ("sokoban_text", 0, 1), ("frozenlake_text", 1, 1), ("frozenlake_text", 1, 1)]


def test_each_task_steps_in_worker_processes_of_its_own(tiny_text):
    episodes, _ = _play(_text_tasks("env.workers=1"), tiny_text)
    assert [(ep.task, ep.env_name, ep.group_id, ep.seed) for ep in episodes] == [
        ("sokoban_text", "sokoban", 0, 0), ("sokoban_text", "sokoban", 0, 0),
        ("sokoban_text", "sokoban", 1, 1), ("sokoban_text", "sokoban", 1, 1),
        ("frozenlake_text", "frozenlake", 2, 0), ("frozenlake_text", "frozenlake", 2, 0)]
    assert all(ep.error is None and len(ep.turns) >= 1 for ep in episodes)


def test_a_task_whose_environments_fail_to_start_leaves_no_worker_of_another_task_behind(tiny_text, monkeypatch):
    import vagen.tasks
    from vagen.episode import ChatEncoder
    from vagen.tasks import TaskRollouts

    real, made = vagen.tasks.make_envs, []

    def make_envs(env, count, owner=None):
        if made:
            raise RuntimeError("frozenlake's workers did not start")
        made.append(real(env, count, owner))
        return made[-1]

    monkeypatch.setattr(vagen.tasks, "make_envs", make_envs)
    with pytest.raises(RuntimeError, match="did not start"):
        TaskRollouts(ChatEncoder(tiny_text[2]), _text_tasks("env.workers=1"))
    (sokoban,) = made
    assert sokoban.workers and all(worker.process.poll() is not None for worker in sokoban.workers)


def test_per_task_metrics_beside_the_totals(tiny_text):
    episodes, stats = _play(_text_tasks(), tiny_text)
    per_task = ("success", "reward_mean", "turns", "actions", "format_ok", "action_valid", "action_effective",
                "response_length", "truncated_trajectories", "env_errors")
    expected = {f"rollout/{task}/{key}" for task in ("sokoban_text", "frozenlake_text") for key in per_task}
    assert {k for k in stats if k.count("/") == 2} == expected
    assert stats["rollout/sokoban_text/format_ok"] == 1.0 and stats["rollout/frozenlake_text/format_ok"] == 0.0
    assert stats["rollout/frozenlake_text/actions"] == 0.0
    assert stats["rollout/sokoban_text/turns"] == 2.0
    sokoban = [ep for ep in episodes if ep.task == "sokoban_text"]
    assert stats["rollout/sokoban_text/reward_mean"] == pytest.approx(sum(ep.total_reward for ep in sokoban) / 4)


class Lasting(Steps):
    """Steps (an episode on level `seed` lasts 1 + seed % 3 turns) in the text prompt format, state not graded."""
    prompt_format, state_weights = "free_think", None


def test_carried_episodes_stay_in_their_tasks_groups_and_are_at_most_k_updates_old(tiny_text, monkeypatch):
    """rollout.max_staleness=1 with two tasks: each task admits its own groups and carries its own unfinished
    episodes over the update; a group never mixes tasks, no turn is trained more than k updates after it was
    sampled, every admitted group of every task is trained (or filtered) or in flight, none twice, and the
    per-task metrics are those of the task's episodes that ended. Scripted decoder (the per-turn schedule) and
    environments whose episode lengths their level seed gives."""
    import vagen.tasks
    from vagen.episode import ChatEncoder
    from vagen.tasks import TaskRollouts

    k, versions = 1, 6
    cfg = _text_tasks("rollout.max_turns=3", "rollout.backend=vllm", "algo.rollout_correction=tis",
                      f"rollout.max_staleness={k}", frozenlake_groups=2)
    built = []
    monkeypatch.setattr(vagen.tasks, "make_envs", lambda env, count, owner=None: built.append(count) or
                        [Lasting() for _ in range(count)])
    encoder = ChatEncoder(tiny_text[2])
    source = TaskRollouts(encoder, cfg)
    assert built == [2 * 2 * (k + 1)] * 2  # (k + 1) x each task's share of episodes
    decoder = Answers(encoder)
    trained = {"sokoban_text": [], "frozenlake_text": []}
    carried = dict.fromkeys(trained, 0)
    for version in range(versions):
        episodes, stats = source.play(decoder, version, saves_in=_saves_in(version, {versions - 1}, k))
        groups = {}
        for ep in episodes:
            groups.setdefault(ep.group_id, set()).add((ep.task, ep.admission, ep.seed))
            assert ep.done and all(version - k <= t.version <= version for t in ep.turns)
        assert sorted(groups) == list(range(len(episodes) // 2))  # one id per group, two episodes each
        assert all(len(members) == 1 for members in groups.values())  # of one task, admission and level
        tasks = [next(iter(groups[g]))[0] for g in sorted(groups)]
        assert tasks == sorted(tasks, key=list(trained).index)  # the first task's groups, then the second's
        for name, part in source.parts:
            mine = [ep for ep in episodes if ep.task == name]
            numbers = sorted({ep.admission for ep in mine})
            assert len(numbers) == 2  # exactly the task's 2 groups, those it admitted first
            trained[name] += numbers
            in_flight = set(part.game.groups)
            assert len(trained[name]) == len(set(trained[name])) and not set(trained[name]) & in_flight
            assert set(trained[name]) | in_flight == set(range(part.admission.started))
            assert stats[f"rollout/{name}/turns"] == pytest.approx(sum(len(ep.turns) for ep in mine) / len(mine))
            carried[name] += len(part.game.waiting)
        assert stats["rollout/carried_episodes"] == sum(len(part.game.waiting) for _, part in source.parts)
    assert all(carried.values()), carried  # each task's episodes did go on after an update
    assert all(not part.game.groups for _, part in source.parts)  # the last rollout drained every group


def test_a_run_over_several_tasks_resumed_after_a_drained_checkpoint_plays_what_the_uninterrupted_one_did(
        tiny_text, monkeypatch):
    """k = 1: the rollout before a checkpoint ends every group each task started; each task's admission counts
    (`TaskAdmissions`, what the checkpoint keeps) restore its numbering, so a run resumed at the next iteration
    plays what the uninterrupted run played, task for task and group for group. A checkpoint of a synchronous
    run that kept no per-task counts numbers each task's groups as the synchronous run does."""
    import vagen.tasks
    from vagen.episode import ChatEncoder
    from vagen.tasks import TaskAdmissions, TaskRollouts

    cfg = _text_tasks("rollout.max_turns=3", "rollout.backend=vllm", "algo.rollout_correction=tis",
                      "rollout.max_staleness=1", frozenlake_groups=2)
    monkeypatch.setattr(vagen.tasks, "make_envs", lambda env, count, owner=None: [Lasting() for _ in range(count)])
    encoder, saved_after = ChatEncoder(tiny_text[2]), 2

    def played(source, versions):
        out = []
        for version in versions:
            episodes, stats = source.play(Answers(encoder), version, saves_in=_saves_in(version, {saved_after, 5}, 1))
            out.append([(ep.task, ep.group_id, ep.admission, ep.seed, [t.version for t in ep.turns], ep.input_ids)
                        for ep in episodes])
            if version == saved_after:
                assert stats["rollout/carried_episodes"] == 0
        return out

    admissions = TaskAdmissions(cfg)
    source = TaskRollouts(encoder, cfg, admissions=admissions)
    uninterrupted = played(source, range(3))
    saved = json.loads(json.dumps(admissions.state_dict()))  # as trainer_state.json keeps it
    # every update trained each task's share: 3 iterations' shares, none in flight
    assert [(c["started"], c["ended"]) for c in saved["tasks"].values()] == [(3 * 2, 3 * 2)] * 2, saved
    uninterrupted += played(source, range(3, 6))
    restored = TaskAdmissions(cfg)
    restored.load_state_dict(saved)
    resumed = played(TaskRollouts(encoder, cfg, start=saved_after + 1, admissions=restored), range(3, 6))
    assert resumed == uninterrupted[3:]
    old = TaskAdmissions(cfg)
    old.load_state_dict({"started": 0, "ended": 0})  # one count, never advanced: a run over tasks before this
    TaskRollouts(encoder, cfg, start=3, admissions=old)
    assert [(a.started, a.ended) for a in old.parts.values()] == [(6, 6), (6, 6)]


def test_each_tasks_admission_counts_carry_over_a_change_of_rank_count(tiny_text, monkeypatch):
    """k = 1, two tasks of 2 groups: 2 ranks (one group of each task per rank) play 3 iterations and save, drained;
    resumed on 1 rank (`TaskAdmissions.load_ranks`, as `vagen.train.EveryRank` calls it), each task goes on with
    the synchronous run's levels of iteration 3, none of the levels its ranks played before. (Before, counts of
    another rank count were dropped: harmless after a drained save, but a save forced with groups in flight
    replayed levels already trained.) The counts saved with groups in flight skip the iteration they had started."""
    import vagen.tasks
    from vagen.episode import ChatEncoder, train_seeds
    from vagen.tasks import TaskAdmissions, TaskRollouts

    cfg = _text_tasks("rollout.max_turns=3", "rollout.backend=vllm", "algo.rollout_correction=tis",
                      "rollout.max_staleness=1", frozenlake_groups=2)
    monkeypatch.setattr(vagen.tasks, "make_envs", lambda env, count, owner=None: [Lasting() for _ in range(count)])
    encoder, played = ChatEncoder(tiny_text[2]), {}
    states = []
    for rank in range(2):
        admissions = TaskAdmissions(cfg, world_size=2)
        source = TaskRollouts(encoder, cfg, rank, 2, admissions=admissions)
        for version in range(3):
            for ep in source.play(Answers(encoder), version, saves_in=_saves_in(version, {2}, 1))[0]:
                played.setdefault(ep.task, set()).add(ep.seed)
        states.append(json.loads(json.dumps(admissions.state_dict())))
    restored = TaskAdmissions(cfg, world_size=1)
    restored.load_ranks(states)
    assert [(a.started, a.ended) for a in restored.parts.values()] == [(6, 6), (6, 6)]
    resumed = TaskRollouts(encoder, cfg, start=3, admissions=restored)
    episodes, _ = resumed.play(Answers(encoder), 3)
    for name, sub in task_configs(cfg):
        levels = {ep.seed for ep in episodes if ep.task == name}
        assert levels == set(train_seeds(3, sub.rollout.env_groups, sub.train.seed)) and not levels & played[name]
    in_flight = [{"tasks": {name: {"started": 5, "ended": 3, "groups_per_rank": 1} for name in restored.parts}}] * 2
    skipping = TaskAdmissions(cfg, world_size=1)
    skipping.load_ranks(in_flight)
    assert [(a.started, a.ended) for a in skipping.parts.values()] == [(10, 10), (10, 10)]


def test_the_reward_std_filter_ranks_groups_within_their_task():
    from vagen.batch_plan import filter_by_task, plan_groups

    # Sokoban's groups 0 and 1 (std 7.07 and 1.41) both vary more than FrozenLake's 2 and 3 (0.71 and 0)
    scores = torch.tensor([0.0, 10.0, 0.0, 2.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    tasks = ["sokoban"] * 4 + ["frozenlake"] * 4
    keep, stats = filter_by_task(scores, group_ids, tasks, 0.5, "std")
    assert keep.tolist() == [0, 1, 4, 5]  # a group of each task, not Sokoban's two
    assert (stats["kept_groups"], stats["total_groups"], stats["kept_trajectories"]) == (2.0, 4.0, 4.0)
    assert stats["reward_std_before"] == pytest.approx((math.sqrt(50) + math.sqrt(2) + math.sqrt(0.5)) / 4)
    assert stats["reward_std_after"] == pytest.approx((math.sqrt(50) + math.sqrt(0.5)) / 2)
    cfg = _text_tasks("algo.filter_mode=std", "algo.filter_keep_ratio=0.5", frozenlake_groups=2)
    plan = plan_groups(scores.tolist(), group_ids.tolist(), cfg, tasks=tasks)
    assert sorted(plan.destination) == [0, 2]
    assert sorted(plan_groups(scores.tolist(), group_ids.tolist(), cfg).destination) == [0, 1]  # one task: global


def test_advantages_are_whitened_within_each_task():
    from vagen.update import whiten_by_task

    advantages = torch.tensor([[10.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    tasks = ["sokoban", "sokoban", "frozenlake", "frozenlake"]
    out = whiten_by_task(advantages, mask, tasks, ["sokoban", "frozenlake"], reduce=None)
    # each task's two values: mean 5 (0.5), unbiased variance 50 (0.5), so +-1/sqrt(2) in both tasks
    half = 1 / math.sqrt(2)
    assert out[:, 0].tolist() == pytest.approx([half, -half, half, -half], abs=1e-6)
    assert out[:, 1].tolist() == [0.0] * 4
    assert whiten_by_task(advantages, mask, tasks, [], reduce=None)[2, 0] < 0  # one whitening: FrozenLake's 1 is low


def test_multitask_visual_trains_an_iteration_with_per_task_success(tmp_path, model_cache, distributed):
    from vagen.train import main as train

    overrides = ["train.iterations=1", "rollout.group_size=2", "rollout.max_turns=1", "train.mini_batch_size=8",
                 "log.progress=false", f"train.run_dir={tmp_path}", f"model.builtin_cache={model_cache}"]
    assert train(["--config", "multitask_visual", *overrides]) == 0
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    tasks = ("sokoban_visual", "frozenlake_visual", "navigation_visual")
    for task in tasks:
        for key in ("success", "reward_mean", "format_ok", "turns"):
            assert f"rollout/{task}/{key}" in record, (task, key)
        assert record[f"rollout/{task}/turns"] == 1.0
        assert record[f"rollout/{task}/format_ok"] > 0, task  # the mixed warm start answers every task's prompts
    # the total is over every episode: 4 of Sokoban, 2 of FrozenLake, 2 of navigation
    weights = {"sokoban_visual": 4, "frozenlake_visual": 2, "navigation_visual": 2}
    assert record["rollout/success"] == pytest.approx(sum(weights[t] * record[f"rollout/{t}/success"]
                                                          for t in tasks) / 8)
    assert record["rollout/reward_mean"] == pytest.approx(sum(weights[t] * record[f"rollout/{t}/reward_mean"]
                                                              for t in tasks) / 8)
    assert record["rollout/filter_total_groups"] == 4.0 and "actor/pg_loss" in record
    # the frame check swaps within a task: Sokoban's 2 groups are scored with each other's frames; FrozenLake and
    # navigation have one group each here, so nothing of theirs is scored
    assert record["rollout/sokoban_visual/frame_gap_turns"] == 4.0 and record["rollout/frame_gap_turns"] == 4.0
    assert record["rollout/frame_gap"] == record["rollout/sokoban_visual/frame_gap"]
    assert "rollout/frozenlake_visual/frame_gap" not in record and "rollout/navigation_visual/frame_gap" not in record
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert [t["name"] for t in saved["rollout"]["tasks"]] == list(tasks)
    assert from_dict(saved, "multitask_visual") == load_configs("multitask_visual", overrides)


def test_evaluation_plays_each_tasks_held_out_levels(tiny_text, tmp_path):
    from vagen.episode import ChatEncoder, eval_seeds
    from vagen.eval import evaluate_tasks

    cfg = _text_tasks("rollout.max_turns=1", "rollout.max_new_tokens=8")
    _, model, processor = tiny_text
    summary = evaluate_tasks(model, ChatEncoder(processor), cfg, 2, tmp_path, with_baselines=False)
    for task, env in (("sokoban_text", "sokoban"), ("frozenlake_text", "frozenlake")):
        result = json.loads((tmp_path / task / "results.json").read_text())
        assert (result["env"], result["config"]) == (env, task)
        assert [r["seed"] for r in result["episodes"]] == eval_seeds(2)  # the held-out levels, each task's own
        assert summary[f"{task}/episodes"] == 2 and f"{task}/success" in summary
    assert summary["success"] == pytest.approx((summary["sokoban_text/success"] + summary["frozenlake_text/success"]) / 2)
    assert set(json.loads((tmp_path / "results.json").read_text())["tasks"]) == {"sokoban_text", "frozenlake_text"}
    table = (tmp_path / "results.md").read_text()
    assert "### sokoban" in table and "### frozenlake" in table
    browser = (tmp_path / "index.html").read_text()  # the episode browsers, one per task
    assert 'href="sokoban_text/index.html"' in browser and 'href="frozenlake_text/index.html"' in browser
    assert (tmp_path / "sokoban_text" / "index.html").is_file()
    only = evaluate_tasks(model, ChatEncoder(processor), cfg, 2, tmp_path / "one", with_baselines=False,
                          tasks=["frozenlake_text"])
    assert "frozenlake_text/success" in only and "sokoban_text/success" not in only


def test_eval_task_names_a_task_of_the_config():
    from vagen.eval import check_tasks

    cfg = load_configs("multitask_visual")
    check_tasks(cfg, ["frozenlake_visual"])
    with pytest.raises(ConfigError, match=r"--task frozenlake is not a task of config multitask_visual; did you mean "
                                          r"'frozenlake_visual'.*tasks: sokoban_visual, frozenlake_visual, "
                                          r"navigation_visual"):
        check_tasks(cfg, ["frozenlake"])
    with pytest.raises(ConfigError, match=r"--task sokoban_visual: config sokoban_visual trains one environment"):
        check_tasks(load_configs("sokoban_visual"), ["sokoban_visual"])


def test_a_saved_run_config_takes_command_line_turns_and_env_settings_for_every_task(tmp_path):
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(load_configs("multitask_visual")))
    assert load_configs(str(saved)) == load_configs("multitask_visual")
    cfg = load_configs(str(saved), ["rollout.max_turns=2", "env.step_timeout=9", "env.params.max_steps=7"])
    assert [t.rollout["max_turns"] for t in cfg.rollout.tasks] == [2, 2, 2]
    assert [(t.env["step_timeout"], t.env["params"]["max_steps"]) for t in cfg.rollout.tasks] == [(9.0, 7)] * 3
    with pytest.raises(ConfigError, match=r"rollout.tasks\[2\] \(navigation_visual\): env.params.cell_size is not a "
                                          r"parameter of env 'navigation'"):
        load_configs(str(saved), ["env.params.cell_size=14"])


def test_the_state_reward_needs_graded_fields_in_every_tasks_format(tmp_path):
    graded = tmp_path / "sokoban_graded.yaml"
    graded.write_text("env:\n  name: sokoban\n  render_mode: text\n  prompt_format: grounding_worldmodeling\n")
    tasks = f"rollout.tasks=[{{config: {graded}, groups: 1}}, {{config: frozenlake_text, groups: 1}}]"
    with pytest.raises(ConfigError, match=r"rollout.tasks \(frozenlake_text\): algo.state_reward=rules grades "
                                          r"<observation> and <prediction>, but env.prompt_format=free_think"):
        load_configs(None, [tasks, "algo.state_reward=rules", "model.path=builtin:tiny-text",
                            "train.mini_batch_size=8"])
    cfg = load_configs(None, [tasks, "algo.state_reward=rules", "model.path=builtin:tiny-text", "train.mini_batch_size=8",
                              "env.prompt_format=grounding_worldmodeling"])
    assert [t.env["prompt_format"] for t in cfg.rollout.tasks] == ["grounding_worldmodeling"] * 2


# -- tasks with the rest of training: LoRA, resume -----------------------------------------------------------

TEXT_RUN = ["model.path=assets:sokoban_text", "rollout.group_size=2", "rollout.max_turns=2", "rollout.max_new_tokens=24",
            "train.mini_batch_size=4", "train.micro_batch_size=2", "log.progress=false", "eval.every=0"]
TEXT_TASK_NAMES = ("sokoban_text", "frozenlake_text")


def text_tasks_config(tmp_path):
    """A config file listing two text tasks, a level group of each per iteration."""
    path = tmp_path / "two_text_tasks.yaml"
    path.write_text("rollout:\n  tasks: [{config: sokoban_text, groups: 1}, {config: frozenlake_text, groups: 1}]\n")
    return str(path)


def _train_tasks(config, run_dir, name, *extra):
    from vagen.train import main as train

    assert train(["--config", config, *TEXT_RUN, f"train.run_dir={run_dir}", f"train.run_name={name}", *extra]) == 0
    return run_dir / name


def _records(run):
    return [{k: v for k, v in json.loads(line).items() if k != "time" and not k.startswith("timing/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


def _has_task_metrics(record):
    return all(f"rollout/{task}/{key}" in record for task in TEXT_TASK_NAMES for key in ("success", "reward_mean",
                                                                                          "turns", "format_ok"))


@pytest.mark.slow  # a training run: 13 s on the 2-core machine at load 13
def test_lora_trains_the_adapters_over_several_tasks(tmp_path, distributed):
    from safetensors.torch import load_file

    run = _train_tasks(text_tasks_config(tmp_path), tmp_path, "lora", "train.iterations=1", "model.lora_rank=8",
                       "train.actor_lr=0.003")
    (record,) = _records(run)
    assert _has_task_metrics(record) and record["rollout/filter_total_groups"] == 2.0
    assert record["rollout/success"] == pytest.approx((record["rollout/sokoban_text/success"]
                                                       + record["rollout/frozenlake_text/success"]) / 2)
    adapters = load_file(run / "checkpoints" / "step_1" / "actor" / "adapter_model.safetensors")
    # peft starts each B matrix at zero: the update moved them
    moved = [key for key, value in adapters.items() if "lora_B" in key and value.abs().max() > 0]
    assert moved and all(".lora_" in key for key in adapters)


@pytest.mark.slow  # three training runs: 20 s on the 2-core machine at load 13
def test_a_resumed_run_over_several_tasks_is_the_uninterrupted_one(tmp_path, distributed):
    """Stopped after 2 of 3 iterations and resumed from its checkpoint: the same metrics (each task's included)
    and the same parameters as the run never stopped; the checkpoint keeps each task's count of level groups."""
    from safetensors.torch import load_file

    config = text_tasks_config(tmp_path)
    straight = _train_tasks(config, tmp_path, "straight", "train.iterations=3")
    _train_tasks(config, tmp_path, "resumed", "train.iterations=2", "train.save_every=1")
    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["admission"]["ranks"] == [{"tasks": {task: {"started": 2, "ended": 2} for task in TEXT_TASK_NAMES}}]
    resumed = _train_tasks(config, tmp_path, "resumed", "train.iterations=3", "train.save_every=1", "train.resume=auto")
    expected = _records(straight)
    assert [r["iteration"] for r in expected] == [0, 1, 2] and all(_has_task_metrics(r) for r in expected)
    assert _records(resumed) == expected
    files = sorted(p.relative_to(straight / "checkpoints" / "step_3")
                   for p in (straight / "checkpoints" / "step_3").rglob("*.safetensors"))
    assert files
    for file in files:
        want, got = (load_file(run / "checkpoints" / "step_3" / file) for run in (straight, resumed))
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"{file}: {key}"


# -- each task's environment settings, failures and graded fields ------------------------------------------------

def _task_file(tmp_path, name, env):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"env": env}))
    return str(path)


def test_every_tasks_workers_and_ray_settings_are_checked(tmp_path, monkeypatch):
    import importlib.util

    from vagen.config import machine_problems

    text = {"name": "sokoban", "render_mode": "text"}
    first = _task_file(tmp_path, "first", text)
    second = {"name": "frozenlake", "render_mode": "text", "workers": 1, "backend": "ray"}

    def tasks(env):
        return [f"rollout.tasks=[{{config: {first}, groups: 1}}, {{config: {_task_file(tmp_path, 'second', env)}, "
                f"groups: 1}}]", "model.path=builtin:tiny-text", "train.mini_batch_size=4"]

    with pytest.raises(ConfigError, match=r"rollout.tasks\[1\] \(.*second.*\): env.backend=ray runs env.workers "
                                          r"Ray actors, but env.workers=0"):
        load_configs(None, tasks({**second, "workers": 0}))
    with pytest.raises(ConfigError, match=r"rollout.tasks\[1\] \(.*second.*\): env.step_timeout=-1.0 must be > 0"):
        load_configs(None, tasks({**second, "step_timeout": -1}))
    on_ray = {**second, "name": "sokoban", "ray_address": "10.0.0.1:6379"}
    first = _task_file(tmp_path, "first", on_ray)
    with pytest.raises(ConfigError, match=r"rollout.tasks run Ray actors on different clusters \(env.ray_address="
                                          r"10.0.0.1:6379 for first; env.ray_address=10.0.0.2:6379 for second\)"):
        load_configs(None, tasks({**second, "ray_address": "10.0.0.2:6379"}))
    assert load_configs(None, tasks({**second, "ray_address": "10.0.0.1:6379"})).rollout.env_groups == 2
    first = _task_file(tmp_path, "first", text)
    # the second task's Ray, not the first's process backend, is what needs the package
    cfg = load_configs(None, tasks(second))
    assert cfg.env.backend == "process" and machine_problems(cfg) == []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    assert any(problem.startswith("env.backend=ray (rollout.tasks: second) runs the environments as Ray actors, but "
                                  "Ray is not installed") for problem in machine_problems(cfg))


class FailsAtReset:
    """A real environment whose first `failing` resets raise, as a renderer that cannot start would."""

    def __init__(self, env, failing: list):
        self.env, self.failing = env, failing

    def reset(self, seed):
        if self.failing:
            self.failing.pop()
            raise OSError("no EGL display")
        return self.env.reset(seed=seed)

    def __getattr__(self, name):
        return getattr(self.env, name)


def _failing_frozenlake(monkeypatch, failing: int):
    import vagen.rollout

    real, budget = vagen.rollout.make_env, [None] * failing
    monkeypatch.setattr(vagen.rollout, "make_env", lambda env, *a: FailsAtReset(real(env, *a), budget)
                        if env.name == "frozenlake" else real(env, *a))


def test_a_tasks_reset_failures_count_in_its_own_metrics(tiny_text, monkeypatch):
    _failing_frozenlake(monkeypatch, 1)
    episodes, stats = _play(_text_tasks(), tiny_text)
    frozen = [ep for ep in episodes if ep.task == "frozenlake_text"]
    assert frozen[0].error.startswith("reset: OSError: no EGL display") and not frozen[0].turns
    assert frozen[1].error is None and frozen[1].turns
    assert stats["rollout/frozenlake_text/env_errors"] == 1.0 and stats["rollout/sokoban_text/env_errors"] == 0.0
    # over both of its episodes, the one that never played a turn included
    assert stats["rollout/frozenlake_text/turns"] == len(frozen[1].turns) / 2


def test_a_task_whose_environments_all_fail_is_refused_by_name(tiny_text, monkeypatch):
    _failing_frozenlake(monkeypatch, 2)
    with pytest.raises(RuntimeError, match=r"rollout.tasks: the environments of task frozenlake_text failed in all of "
                                           r"its 2 episodes \(on this rank: reset: OSError: no EGL display.*\)\. Fix "
                                           r"that task's environment config"):
        _play(_text_tasks(), tiny_text)


def test_graded_metrics_follow_each_tasks_own_prompt_format(tmp_path, tiny_text):
    """Sokoban in the grounding format grades <observation>, FrozenLake in worldmodeling <prediction>: each turn
    counts (0 where its description did not parse) in its own task's score only. Hand-checked: grounding (1 + 0) / 2,
    where the first task's format for all gave (1 + 0 + 0) / 3; world model 0.5 from FrozenLake's turn."""
    from types import SimpleNamespace

    from vagen.episode import ChatEncoder
    from vagen.rollout import close_envs, rollout_metrics
    from vagen.tasks import TaskRollouts

    sokoban = _task_file(tmp_path, "sokoban_grounding", {"name": "sokoban", "render_mode": "text",
                                                         "prompt_format": "grounding"})
    frozen = _task_file(tmp_path, "frozenlake_wm", {"name": "frozenlake", "render_mode": "text",
                                                    "prompt_format": "worldmodeling"})
    cfg = load_configs(None, [f"rollout.tasks=[{{config: {sokoban}, groups: 1}}, {{config: {frozen}, groups: 1}}]",
                              "model.path=builtin:tiny-text", "train.mini_batch_size=4", "rollout.group_size=2"])
    source = TaskRollouts(ChatEncoder(tiny_text[2]), cfg)
    try:
        graded = source.graded()
    finally:
        close_envs(source.all_envs())
    assert graded == {"sokoban_grounding": ("grounding_score",), "frozenlake_wm": ("worldmodel_score",)}

    def turn(**scores):
        return SimpleNamespace(info={"grounding_score": None, "worldmodel_score": None, **scores}, response_length=1)

    def episode(task, *turns):
        return SimpleNamespace(task=task, turns=list(turns), success=False, total_reward=0.0,
                               truncated_by_length=False, error=None)

    episodes = [episode("sokoban_grounding", turn(grounding_score=1.0), turn()),
                episode("frozenlake_wm", turn(worldmodel_score=0.5))]
    stats = rollout_metrics(episodes, graded)
    assert stats["rollout/grounding_score"] == 0.5 and stats["rollout/worldmodel_score"] == 0.5
    first_for_all = rollout_metrics(episodes, graded["sokoban_grounding"])
    assert first_for_all["rollout/grounding_score"] == pytest.approx(1 / 3)


def test_two_gloo_ranks_whiten_and_refuse_tasks_alike_where_a_rank_holds_no_row_of_a_task():
    """Rank 1 holds no row of the second task: it still joins that task's reductions, so each task is whitened
    over both ranks' rows (as one process would over all of them), and a task is refused on both ranks only where
    every rank's episodes of it failed."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from child_env import child_env

    from vagen.update import whiten_by_task

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    worker = Path(__file__).parent / "tasks_ranks_worker.py"
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, str(worker)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outputs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    # one process over the four rows of both ranks
    whole = whiten_by_task(torch.tensor([[1.0, 2.0], [4.0, 0.0], [3.0, 5.0], [7.0, 9.0]]),
                           torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]),
                           ["sokoban_text", "frozenlake_text", "sokoban_text", "sokoban_text"],
                           ["sokoban_text", "frozenlake_text"], reduce=None)
    assert torch.allclose(torch.tensor(results[0]["whitened"] + results[1]["whitened"]), whole, atol=1e-6)
    # hand-checked: FrozenLake's one row holds a single masked-in value, whitened alone to 0
    assert results[0]["whitened"][1] == [0.0, 0.0]
    assert [r["outcomes"][0] for r in results] == ["played", "played"]  # rank 0's FrozenLake episodes ran
    assert results[0]["outcomes"][1] == results[1]["outcomes"][1]  # the same refusal on both ranks
    for result in results:
        assert result["outcomes"][1].startswith("raised: rollout.tasks: the environments of task frozenlake_text "
                                                "failed in all of its 2 episodes (on this rank: reset: OSError")
