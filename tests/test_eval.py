import json

import imageio.v2 as imageio
import pytest
import torch
from PIL import Image

import envs_visual
from vagen.config import load_config
from vagen.episode import ChatEncoder, eval_seeds
from vagen.eval import evaluate, main, play_reference, resolve_checkpoint
from vagen.models import load_policy, resolve_model_path


def test_evaluating_the_tiny_model_writes_results_with_reference_rows_and_videos(tiny_vl, tmp_path, capsys):
    path, _, _ = tiny_vl
    out = tmp_path / "eval"
    assert main(["--config", "sokoban_visual", "--checkpoint", str(path), "--episodes", "4", "--videos", "1",
                 "--out", str(out), "rollout.max_new_tokens=16"]) == 0
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
    from vagen.eval import episode_record, summarize, think_with_scores

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
