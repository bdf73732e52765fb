"""What a 3B run on several GPUs relies on, checked on CPUs through the same code: the rank's device and
random state, dropout, the sampled support, the critic a run saved, the judge's and the head's memory at
the real vocabulary size, the graded-field curves, evaluation's image bounds."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vagen.config import load_config
from vagen.episode import ChatEncoder, Episode, Turn

# -- the rank's device and random state -----------------------------------------------------------------

def test_each_rank_samples_on_its_own_device_and_touches_no_other():
    from vagen.decoding import own_draws, rng_devices
    from vagen.distributed import rank_device

    assert rng_devices(None) == [] and rng_devices(torch.device("cpu")) == []
    assert rng_devices(torch.device("cuda", 3)) == [3]  # rank 3 forks and seeds GPU 3 alone
    if not torch.cuda.is_available():
        assert rank_device(5) == torch.device("cpu")
    before = torch.random.get_rng_state()
    with own_draws(7, torch.device("cpu")):
        first = torch.rand(3)
    with own_draws(7):
        assert torch.equal(torch.rand(3), first)  # the same seed, the same draws
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's state is as it was


def test_evaluation_starts_its_ranks_as_training_does(tiny_vl, tmp_path, monkeypatch):
    """One start for both: the rank's device (and on GPUs `torch.cuda.set_device`) before any collective."""
    import vagen.distributed
    from vagen.eval import main

    path, _, _ = tiny_vl
    started = []
    real = vagen.distributed.init_distributed
    monkeypatch.setattr(vagen.distributed, "init_distributed", lambda **kw: started.append(kw) or real(**kw))
    assert main(["--config", "frozenlake_visual", "--checkpoint", str(path), "--episodes", "1", "--videos", "0",
                 "--out", str(tmp_path / "eval"), "rollout.max_new_tokens=4", "rollout.max_turns=1"]) == 0
    assert started == [{"need_group": False}]


@pytest.mark.gpu
def test_on_a_gpu_the_rank_device_is_current_before_any_collective():
    from vagen.distributed import init_distributed

    dist = init_distributed(need_group=False)
    assert dist.device.type == "cuda" and torch.cuda.current_device() == dist.device.index
    assert os.environ["LOCAL_RANK"] == str(dist.device.index)  # what DeepSpeed and vLLM take as the device


def test_evaluation_reads_frames_at_the_configs_pixel_bounds(tiny_vl, tmp_path, monkeypatch):
    """model.min_pixels / model.max_pixels apply to evaluation as to training: 56x56 frames, 4 tokens each."""
    import vagen.models
    from vagen.eval import main

    path, _, _ = tiny_vl
    tokens = []
    real = vagen.models.load_policy

    def load(*args, **kwargs):
        model, processor = real(*args, **kwargs)
        tokens.append(processor.image_processor.size["longest_edge"])
        return model, processor

    monkeypatch.setattr(vagen.models, "load_policy", load)
    assert main(["--config", "frozenlake_visual", "--checkpoint", str(path), "--episodes", "1", "--videos", "0",
                 "--out", str(tmp_path / "eval"), "rollout.max_new_tokens=4", "rollout.max_turns=1",
                 "model.max_pixels=3136", "model.min_pixels=3136"]) == 0
    assert tokens == [3136]


# -- dropout, and the support the update's log-probabilities share with sampling -------------------------

def _with_dropout(path: Path, out: Path) -> Path:
    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    config["attention_dropout"] = 0.5
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_old_logprobs_of_a_checkpoint_with_dropout_are_those_of_the_sampled_policy(tiny_text, tmp_path, distributed):
    """Rollouts sample in eval mode and the update runs in train mode: dropout must not make them differ."""
    from update_fixtures import answer_samples

    from vagen.models import load_policy
    from vagen.update import annotate

    path, _, _ = tiny_text
    model, tokenizer = load_policy(_with_dropout(Path(path), tmp_path / "dropout"))
    encoder = ChatEncoder(tokenizer)
    cfg = load_config("bandit_text")
    samples = answer_samples(encoder, ["Left", "Right", "Up"], [1.0, 0.0, 0.5])
    in_train = copy.deepcopy(samples)
    model.train()
    annotate(in_train, model, None, None, cfg, encoder.pad_id, torch.device("cpu"))
    model.eval()
    annotate(samples, model, None, None, cfg, encoder.pad_id, torch.device("cpu"))
    for a, b in zip(in_train, samples):
        assert torch.equal(a.extra["old_logprobs"], b.extra["old_logprobs"])


def test_the_update_renormalises_over_the_tokens_sampling_can_draw(tiny_text, distributed):
    """Sampling never draws <|im_start|> or a vision token; the trainer's log-probabilities and entropies
    are those of the same distribution, renormalised without them."""
    from update_fixtures import answer_samples

    from vagen.trajectory import collate
    from vagen.update import annotate

    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    cfg = load_config("bandit_text")
    samples = answer_samples(encoder, ["Left", "Right"], [1.0, 0.0])
    annotate(samples, model, None, None, cfg, encoder.pad_id, torch.device("cpu"), suppress_ids=encoder.suppress_ids)
    batch = collate(samples, encoder.pad_id, ("old_logprobs", "entropies"))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logits[..., encoder.suppress_ids] = float("-inf")
    logits = logits / cfg.rollout.temperature
    expected = torch.log_softmax(logits, -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:] > 0
    assert torch.allclose(batch["old_logprobs"][:, 1:][mask], expected[mask], atol=1e-5)
    probs = torch.softmax(logits, -1)[:, :-1]
    entropy = -(probs * torch.log_softmax(logits, -1)[:, :-1].nan_to_num(neginf=0.0)).sum(-1)
    assert torch.allclose(batch["entropies"][:, 1:][mask], entropy[mask], atol=1e-4)
    assert len(encoder.suppress_ids) >= 1


# -- a critic that a run saved ------------------------------------------------------------------------------

def test_model_critic_path_restores_a_critic_vagen_saved(tiny_text, tmp_path):
    from vagen.models import ValueModel, load_policy
    from vagen.train import build_critic

    path, _, _ = tiny_text
    policy, _ = load_policy(Path(path))
    trained = ValueModel(policy)
    with torch.no_grad():
        trained.value_head.weight.normal_()
        trained.value_head.bias.fill_(0.25)
        next(trained.backbone.parameters()).add_(1.0)
    trained.save(tmp_path / "run" / "checkpoints" / "step_3" / "critic")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_3")
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_3"):
        cfg = load_config("sokoban_text", [f"model.path={path}", f"model.critic_path={where}"])
        critic = build_critic(cfg, Path(path))
        for (name, a), b in zip(trained.state_dict().items(), critic.state_dict().values()):
            assert torch.equal(a, b), name
    fresh = build_critic(load_config("sokoban_text", [f"model.path={path}"]), Path(path))
    assert float(fresh.value_head.weight.detach().abs().sum()) == 0.0  # without critic_path: the policy and a zero head


# -- the graded fields' curves ---------------------------------------------------------------------------

def _turn(info):
    return Turn("obs", [], "response", 0.0, info, (0, 1), 1)


def test_graded_field_scores_are_logged_when_nothing_parses():
    from vagen.rollout import graded_scores, make_env, rollout_metrics

    cfg = load_config("frozenlake_visual", ["env.prompt_format=grounding_worldmodeling"])
    assert graded_scores(make_env(cfg.env)) == ("grounding_score", "worldmodel_score")
    assert graded_scores(make_env(load_config("frozenlake_visual").env)) == ()  # free_think has no graded field
    episode = Episode("frozenlake", 0, 0, "")
    episode.turns = [_turn({"grounding_score": None}), _turn({"grounding_score": None})]
    metrics = rollout_metrics([episode], ("grounding_score", "worldmodel_score"))
    assert metrics["rollout/grounding_score"] == 0.0 and metrics["rollout/worldmodel_score"] == 0.0
    episode.turns[0] = _turn({"grounding_score": 0.8, "worldmodel_score": 0.6})
    metrics = rollout_metrics([episode], ("grounding_score", "worldmodel_score"))
    assert metrics["rollout/grounding_score"] == pytest.approx(0.4) and metrics["rollout/worldmodel_score"] == 0.3
    assert "rollout/grounding_score" not in rollout_metrics([Episode("frozenlake", 0, 0, "")])


# -- memory at the real vocabulary size ---------------------------------------------------------------------

def test_head_chunks_stay_within_their_memory_budget():
    from vagen.update import HEAD_CHUNK_BYTES, head_chunk_rows

    vocab = 151_936
    for rows in (1, 320, 4096, 32_768, 1_000_000):
        size = head_chunk_rows(rows, vocab)
        assert 1 <= size <= max(1, rows) and size * vocab * 4 * 4 <= HEAD_CHUNK_BYTES
    assert head_chunk_rows(32_768, vocab) == 110  # 1/32 would be 1,024 rows, 0.6 GB a float32 tensor
    assert head_chunk_rows(320, 2048) == 10  # small vocabularies keep 1/32 of the positions


def _memory(mode: str, tmp_path, *args) -> dict:
    from child_env import child_env

    worker = Path(__file__).parent / "memory_worker.py"
    env = child_env(MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run([sys.executable, str(worker), mode, *map(str, args)], env=env, capture_output=True,
                            text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_state_judge_reads_only_the_answer_positions_at_the_real_vocabulary(tiny_text, tmp_path):
    """16 rows of ~120 tokens: the whole float32 log-softmax would be 1.2 GB (3.9 GB at 32 x 200)."""
    path, _, _ = tiny_text
    measured = _memory("judge", tmp_path, path)
    assert measured["full_logits"] > 1e9
    assert measured["rise"] < 0.1 * measured["full_logits"], measured
    assert measured["dtype"] == "torch.bfloat16"  # the run's dtype


def test_annotation_never_asks_the_model_for_every_layers_hidden_states(tiny_text, distributed):
    from update_fixtures import answer_samples

    from vagen.update import annotate

    _, model, tokenizer = tiny_text
    encoder = ChatEncoder(tokenizer)
    calls = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: calls.append(dict(kw)), with_kwargs=True)
    try:
        annotate(answer_samples(encoder, ["Left", "Right"], [1.0, 0.0]), model, None, None,
                 load_config("bandit_text"), encoder.pad_id, torch.device("cpu"))
    finally:
        handle.remove()
    assert calls and not any(kw.get("output_hidden_states") for kw in calls)
