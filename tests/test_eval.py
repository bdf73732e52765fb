import json

import imageio.v2 as imageio
import pytest
import torch
from PIL import Image

import envs_visual
from vagen.config import load_config
from vagen.episode import ChatEncoder, eval_seeds
from vagen.eval import evaluate, main, play_reference, resolve_checkpoint, summarize
from vagen.models import load_policy, resolve_model_path


def test_evaluating_the_tiny_model_writes_results_with_reference_rows_and_videos(tiny_vl, tmp_path, capsys):
    path, _, _ = tiny_vl
    out = tmp_path / "eval"
    assert main(["--config", "sokoban_visual", "--checkpoint", str(path), "--episodes", "4", "--videos", "1",
                 "--out", str(out), "--decoy-frames", "rollout.max_new_tokens=16"]) == 0
    printed = capsys.readouterr()
    assert f"evaluating {path} on 4 held-out sokoban episodes" in printed.out
    assert "eval: 100%" in printed.err and "4/4" in printed.err  # the progress bar, with its total
    result = json.loads((out / "results.json").read_text())
    assert result["model"]["episodes"] == 4
    assert [r["seed"] for r in result["episodes"]] == eval_seeds(4)
    assert set(result["reference"]) == {"random", "solver"}
    # the solver succeeds exactly where the optimal plan fits in the turn budget (3 turns x 3 actions)
    cfg = load_config("sokoban_visual")
    fits = []
    for seed in eval_seeds(4):
        env = envs_visual.make("sokoban", **cfg.env.params)
        env.reset(seed=seed)
        fits.append(len(env.solve()) <= 9)
    assert result["reference"]["solver"]["success"] == sum(fits) / 4
    low, high = result["model"]["success_ci95"]
    assert 0.0 <= low <= result["model"]["success"] <= high <= 1.0
    table = (out / "results.md").read_text()
    assert "| model | 4 |" in table and "| random | 4 |" in table and "| solver | 4 |" in table
    # the frame gap over every turn of the episodes (each its own group), and the levels played with decoy frames
    model = result["model"]
    assert model["frame_gap_turns"] == sum(r["turns"] for r in result["episodes"])
    assert 0.0 <= model["frame_gap_positive"] <= 1.0 and f"{model['frame_gap']:.2f} nats/turn" in table
    decoy = result["decoy_frames"]
    assert decoy["episodes"] == 4 and model["decoy_success"] == decoy["success"]
    assert decoy["success_ci95"][0] <= decoy["success"] <= decoy["success_ci95"][1]
    assert "| model, decoy frames | 4 |" in table
    videos = sorted((out / "videos").iterdir())
    assert [v.suffix for v in videos] == [".gif", ".mp4"]
    assert videos[0].name.startswith("sokoban_seed1000000000_")
    episode = result["episodes"][0]
    # initial frame + one per executed action (one for a turn without any) + the outcome frame
    expected = 2 + sum(max(1, n) for n in episode["actions_per_turn"])
    with imageio.get_reader(videos[1], format="FFMPEG") as reader:  # imageio-ffmpeg, a base dependency
        assert reader.count_frames() == expected
    assert Image.open(videos[0]).n_frames == expected


def test_reference_policies_replay_deterministically():
    cfg = load_config("frozenlake_visual")
    seed = eval_seeds(1)[0]
    assert play_reference(cfg, seed, "random") == play_reference(cfg, seed, "random")
    solver = play_reference(cfg, seed, "solver")
    assert solver["format_ok"] == 1.0 and solver["action_valid"] == 1.0
    assert play_reference(load_config("countdown_text"), seed, "random") is None  # no action list to draw from


def test_resolve_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model there.*runs/<run>/checkpoints/step_N"):
        resolve_checkpoint(str(tmp_path))


def test_a_shipped_warm_start_is_evaluated_by_name():
    from vagen.config import checkpoints_dir

    assert resolve_checkpoint("assets:sokoban_visual") == checkpoints_dir() / "sokoban_visual"
    with pytest.raises(FileNotFoundError, match="'assets:sokoban_visua' is not a shipped warm start.*did you mean "
                                                "'assets:sokoban_visual'"):
        resolve_checkpoint("assets:sokoban_visua")


def test_sampled_evaluation_is_seeded_and_leaves_the_callers_random_state(model_cache, tmp_path, played_tokens):
    overrides = ["rollout.max_turns=2", "rollout.max_new_tokens=16", "eval.do_sample=true"]
    cfg = load_config("frozenlake_text", overrides)
    model, processor = load_policy(resolve_model_path(cfg.model.path, model_cache))
    encoder = ChatEncoder(processor)
    torch.manual_seed(123)
    evaluate(model, encoder, cfg, 8, tmp_path, with_baselines=False)
    after_call = torch.rand(3)
    torch.manual_seed(456)  # another state before the call: the same episodes
    evaluate(model, encoder, cfg, 8, tmp_path, with_baselines=False)
    evaluate(model, encoder, load_config("frozenlake_text", overrides + ["eval.sample_seed=1"]), 8, tmp_path,
             with_baselines=False)
    assert played_tokens[0] == played_tokens[1] != played_tokens[2]
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after_call)  # the caller's stream goes on as if nothing had drawn


def test_videos_and_results_show_the_grades_of_the_state_descriptions():
    from vagen.eval import episode_record, think_with_scores

    info = {"parsed": {"think": "a b c", "observation": "The box is above me.", "reasoning": "Go up.",
                       "prediction": "The box is gone."}, "grounding_score": 0.5, "worldmodel_score": None}
    assert think_with_scores(info) == ("observation [score 0.50]: The box is above me.  reasoning: Go up.  "
                                       "prediction: The box is gone.")
    assert think_with_scores({"parsed": {"think": "free text", "observation": "", "reasoning": "", "prediction": ""}}) == ""
    turns = [{"reward": 1.0, "info": {**info, "grounding_score": score, "worldmodel_score": None}}
             for score in (0.5, 1.0, None)]
    record = episode_record(7, turns, success=False)
    assert record["grounding_score"] == 0.75 and record["worldmodel_score"] is None
    summary = summarize([record, {**record, "grounding_score": 0.25}])
    assert summary["grounding_score"] == 0.5 and summary["worldmodel_score"] is None


RUN_SETTINGS = ["rollout.max_turns=1", "rollout.max_new_tokens=4", "model.dtype=bfloat16",
                "train.deepspeed_config=deepspeed/zero2_bf16.json", "env.params.size=3"]


@pytest.fixture
def trained_run(tiny_vl, tmp_path):
    """A run directory as training leaves it: the resolved config.yaml and a checkpoint (the tiny VLM)."""
    from vagen.config import to_yaml

    path, _, _ = tiny_vl
    run = tmp_path / "runs" / "frozenlake_visual-1"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "actor").symlink_to(path, target_is_directory=True)
    (run / "checkpoints" / "latest").write_text("step_2")
    (run / "config.yaml").write_text(to_yaml(load_config("frozenlake_visual", RUN_SETTINGS)))
    return run


@pytest.fixture
def loaded_dtypes(monkeypatch):
    """The dtype of every load_policy call vagen.eval makes."""
    import vagen.models

    dtypes = []
    real = vagen.models.load_policy
    monkeypatch.setattr(vagen.models, "load_policy", lambda path, dtype="float32", *a: dtypes.append(dtype)
                        or real(path, dtype, *a))
    return dtypes


def test_a_run_is_evaluated_with_its_own_config(trained_run, tmp_path, capsys, loaded_dtypes):
    out = tmp_path / "eval"
    assert main(["--checkpoint", str(trained_run), "--episodes", "2", "--videos", "0", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert f"(config frozenlake_visual: {trained_run / 'config.yaml'})" in printed.out
    assert "warning" not in printed.err
    result = json.loads((out / "results.json").read_text())
    assert [r["turns"] for r in result["episodes"]] == [1, 1]  # the run's rollout.max_turns=1, not the config's 3
    # its 4 tokens per turn (+ the closing <|im_end|>), not the config's 64
    assert max(r["response_length"] for r in result["episodes"]) <= 5
    assert loaded_dtypes == ["bfloat16"]
    # the run's 3x3 lake: the solver's episodes are those of the run's levels
    cfg = load_config("frozenlake_visual", RUN_SETTINGS)
    assert result["reference"]["solver"] == summarize([play_reference(cfg, s, "solver") for s in eval_seeds(2)])


def test_an_explicit_config_wins_over_the_runs_and_says_what_differs(trained_run, tmp_path, capsys, loaded_dtypes):
    step = trained_run / "checkpoints" / "step_2"
    assert main(["--config", "frozenlake_visual", "--checkpoint", str(step), "--episodes", "1", "--videos", "0",
                 "--out", str(tmp_path / "eval"), "rollout.max_new_tokens=4"]) == 0
    err = capsys.readouterr().err
    warning = next(line for line in err.splitlines() if line.startswith("warning:"))
    assert warning == (f"warning: --config frozenlake_visual differs from the run's config {trained_run / 'config.yaml'} "
                       "in rollout.max_turns=3 (the run: 1), model.dtype=float32 (the run: bfloat16), "
                       "env.params={'size': 4, 'cell_size': 28} (the run: {'size': 3, 'cell_size': 28}); evaluating "
                       "with --config's (leave --config out to evaluate as the run was trained)")
    assert loaded_dtypes == ["float32"]


def test_the_runs_config_itself_raises_no_warning(trained_run, tmp_path):
    from vagen.eval import choose_config

    actor = resolve_checkpoint(str(trained_run / "checkpoints" / "step_2" / "actor"))
    cfg, source, warning = choose_config(str(trained_run / "config.yaml"), "x", actor, [])
    assert warning is None and cfg.rollout.max_turns == 1 and source == str(trained_run / "config.yaml")


def test_the_run_directory_is_found_from_each_checkpoint_form(trained_run, tmp_path):
    from vagen.eval import run_dir_of

    for given in (trained_run, trained_run / "checkpoints" / "step_2", trained_run / "checkpoints" / "step_2" / "actor"):
        assert run_dir_of(resolve_checkpoint(str(given))) == trained_run
    merged = trained_run / "merged"  # where `python -m vagen.merge` puts a LoRA run's whole checkpoint
    merged.symlink_to(trained_run / "checkpoints" / "step_2" / "actor", target_is_directory=True)
    assert run_dir_of(resolve_checkpoint(str(merged))) == trained_run
    (tmp_path / "config.yaml").write_text("")  # a config.yaml without checkpoints/ is no run
    outside = tmp_path / "hf"
    outside.symlink_to(trained_run / "checkpoints" / "step_2" / "actor", target_is_directory=True)
    assert run_dir_of(resolve_checkpoint(str(outside))) is None


def test_a_run_whose_config_no_longer_loads_is_evaluated_with_an_explicit_config(tmp_path):
    from vagen.config import ConfigError
    from vagen.eval import choose_config

    run = tmp_path / "old-run"
    step = run / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  warm_start: true\n")  # a key vagen no longer has
    with pytest.raises(ConfigError, match=r"^the run's config .*old-run/config.yaml does not load: .*model.warm_start"
                                          r".*; pass the config to evaluate it with \(--config NAME\)$"):
        choose_config(None, "x", step, [])
    cfg, source, warning = choose_config("frozenlake_visual", "x", step, [])
    assert source == "frozenlake_visual" and cfg.env.name == "frozenlake"
    assert warning.startswith(f"warning: the run's config {run / 'config.yaml'} does not load (")
    assert warning.endswith("); evaluating with --config's")


def test_a_checkpoint_outside_a_run_needs_a_config(tiny_vl, capsys):
    path, _, _ = tiny_vl
    assert main(["--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: --checkpoint {str(path)!r} is not inside a run directory")
    assert err.rstrip().endswith("pass the config it plays, e.g. --config sokoban_visual")
    assert main(["--checkpoint", "assets:frozenlake_text"]) == 2  # a shipped warm start: its card names the config
    assert capsys.readouterr().err.rstrip().endswith("e.g. --config frozenlake_text")


def test_format_ok_counts_parsed_responses_and_action_valid_the_legal_ones():
    """A parsed response naming an unknown action is format ok but not action valid, and earns no format reward."""
    from vagen.episode import Episode, Turn
    from vagen.eval import episode_record
    from vagen.rollout import rollout_metrics

    env = envs_visual.make("sokoban", **load_config("sokoban_visual").env.params)
    env.reset(seed=5)
    played = []
    for response in ("<think>t</think><answer>Left</answer>", "<think>t</think><answer>Jump</answer>", "Left"):
        _, reward, _, _, info = env.step(response)
        played.append((response, reward, info))
    assert [(i["format_ok"], i["action_is_valid"]) for _, _, i in played] == [(True, True), (True, False), (False, False)]
    assert played[1][1] == 0.0  # parsed, but no action: neither format reward nor step penalty
    record = episode_record(5, [{"reward": r, "info": i} for _, r, i in played], success=False)
    assert (record["format_ok"], record["action_valid"]) == (pytest.approx(2 / 3), pytest.approx(1 / 3))
    episode = Episode("sokoban", 5, 0, "", turns=[Turn("", [], text, r, i, (0, 0), 1) for text, r, i in played])
    metrics = rollout_metrics([episode])
    assert metrics["rollout/format_ok"] == pytest.approx(2 / 3)
    assert metrics["rollout/action_valid"] == pytest.approx(1 / 3)


def test_several_configs_apply_in_order_as_in_training(trained_run):
    from vagen.eval import choose_config

    actor = resolve_checkpoint(str(trained_run / "checkpoints" / "step_2" / "actor"))
    cfg, source, warning = choose_config(["frozenlake_visual", "recipes/qwen2.5-vl-3b"], "x", actor,
                                         [f"model.path={actor}", "model.dtype=bfloat16"])
    assert source == "frozenlake_visual,recipes/qwen2.5-vl-3b"
    assert cfg.env.name == "frozenlake" and cfg.rollout.max_new_tokens == 200  # the recipe's, over the env config's
    assert "rollout.max_new_tokens=200 (the run: " in warning
