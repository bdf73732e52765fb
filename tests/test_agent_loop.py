"""The agent loop of `rollout.backend=vllm` (`VLLMDecoder.play`) against the per-turn schedule, on real
vLLM (the registry's CPU build, in the environment scripts/vllm_env.sh builds):

    .venv-vllm/bin/python -m pytest -m vllm tests/test_agent_loop.py

Scheduling must not change what an episode is: greedy episodes equal the per-turn schedule's, sampled
ones replay from the seeds whatever the order in which requests finish, and the log-probability the
engine reports for each sampled token is the trainer's.
"""

from __future__ import annotations

import pytest
from test_vllm import TOLERANCE, config, require_vllm, sampled_gaps, standard_copy

from vagen.config import checkpoints_dir, load_config
from vagen.decoding_vllm import VLLMDecoder
from vagen.episode import ChatEncoder
from vagen.models import load_policy, resolve_model_path
from vagen.rollout import rollout

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def text_engine(distributed):
    """(model, encoder, decoder) of the shipped text warm start, a trained Qwen2 policy. Both engines of this
    module run under a process group of one (as a trainer's rank does): the first engine built without one
    would leave vLLM's own group behind, which the second would take for a trainer's."""
    require_vllm()
    path = checkpoints_dir() / "sokoban_text"
    model, processor = load_policy(path)
    encoder = ChatEncoder(processor)
    return model.eval(), encoder, VLLMDecoder(path, encoder, dtype="float32", seed=0)


@pytest.fixture(scope="module")
def vl_engine(model_cache, tmp_path_factory, distributed):
    """(model, encoder, decoder) of the built-in tiny Qwen2.5-VL without vagen's image hooks."""
    require_vllm()
    path = standard_copy(resolve_model_path("builtin:tiny-vl", model_cache, seed=0),
                         tmp_path_factory.mktemp("loop_vl") / "tiny-vl")
    model, processor = load_policy(path)
    encoder = ChatEncoder(processor)
    return model.eval(), encoder, VLLMDecoder(path, encoder, dtype="float32", seed=0)


def _played(episodes):
    return [(ep.input_ids, [t.info.get("actions") for t in ep.turns], [t.reward for t in ep.turns], ep.success)
            for ep in episodes]


def test_greedy_agent_loop_plays_the_per_turn_episodes(text_engine):
    model, encoder, decoder = text_engine
    cfg = load_config(None, ["rollout.max_turns=3", "rollout.max_new_tokens=64", "env.name=sokoban",
                             "env.render_mode=text"])
    played = dict(seeds=[1_000_000_000 + k for k in range(16)], group_size=1, do_sample=False, decoder=decoder)
    turns, _ = rollout(model, encoder, cfg, schedule="turns", **played)
    loop, stats = rollout(model, encoder, cfg, **played)
    assert _played(loop) == _played(turns)
    assert sum(len(ep.turns) for ep in loop) > 16 and stats["timing/generate"] > 0
    # the loop's forward passes carried several requests each: episodes joined the running batch
    assert decoder.engine_sequences / decoder.engine_steps > 2


def test_environments_in_workers_add_no_forward_pass(text_engine):
    """With rollout.env_wait_ms=null the loop takes every answer due before each pass, so an episode whose
    environment steps in a worker joins the pass it would join if its environment stepped in this process."""
    model, encoder, decoder = text_engine
    cfg = load_config(None, ["rollout.max_turns=3", "rollout.max_new_tokens=64", "env.name=sokoban",
                             "env.render_mode=text", "rollout.env_wait_ms=null"])
    played = dict(seeds=[1_000_000_000 + k for k in range(16)], group_size=1, do_sample=False, decoder=decoder)
    here, _ = rollout(model, encoder, cfg, **played)
    passes = (decoder.engine_steps, decoder.engine_sequences)
    cfg.env.workers = 2
    there, stats = rollout(model, encoder, cfg, **played)
    assert _played(there) == _played(here) and sum(len(ep.turns) for ep in there) > 16
    assert (decoder.engine_steps, decoder.engine_sequences) == passes


def test_an_error_in_the_agent_loop_leaves_no_request_in_the_engine(text_engine):
    model, encoder, decoder = text_engine
    cfg = load_config(None, ["rollout.max_turns=2", "rollout.max_new_tokens=64", "env.name=sokoban",
                             "env.render_mode=text"])
    played = dict(seeds=[1_000_000_000 + k for k in range(8)], group_size=1, do_sample=False, decoder=decoder)
    running = []

    def fail(*args):
        running.append(decoder.llm.llm_engine.get_num_unfinished_requests())
        raise RuntimeError("on_step failed")

    with pytest.raises(RuntimeError, match="on_step failed"):
        rollout(model, encoder, cfg, on_step=fail, **played)
    assert running[0] > 0  # the loop stopped with requests still running
    assert decoder.llm.llm_engine.get_num_unfinished_requests() == 0
    again, _ = rollout(model, encoder, cfg, **played)
    turns, _ = rollout(model, encoder, cfg, schedule="turns", **played)
    assert _played(again) == _played(turns)


def test_sampled_agent_loop_replays_from_the_seeds_whatever_finishes_first(vl_engine):
    model, encoder, decoder = vl_engine
    cfg = config("rollout.max_turns=3")
    played = dict(seeds=[7, 8, 9, 10], group_size=3, decoder=decoder, sample_seed=5)
    loop, _ = rollout(model, encoder, cfg, **played)
    # Another finishing order: each request's turn in one batch, and environments answering from two workers.
    turns, _ = rollout(model, encoder, cfg, schedule="turns", **played)
    cfg.env.workers = 2  # the default wait (rollout.env_wait_ms): passes run with whichever answers came
    workers, _ = rollout(model, encoder, cfg, **played)
    cfg.rollout.env_wait_ms = None  # every answer due
    waited, _ = rollout(model, encoder, cfg, **played)
    assert _played(loop) == _played(turns) == _played(workers) == _played(waited)
    assert len({tuple(ep.input_ids) for ep in loop}) == 12  # each episode drew its own responses
    other, _ = rollout(model, encoder, cfg, **{**played, "sample_seed": 6})
    assert _played(other) != _played(loop)


def test_agent_loop_logprobs_are_the_trainers(vl_engine):
    model, encoder, decoder = vl_engine
    cfg = config("rollout.max_turns=3")
    episodes, _ = rollout(model, encoder, cfg, [3, 4], 2, decoder=decoder, sample_seed=1)
    gaps = sampled_gaps(model, encoder, episodes, cfg.rollout.temperature)
    assert len(gaps) == sum(t.response_length - (not t.end_sampled) for ep in episodes for t in ep.turns) > 40
    assert max(gaps) < TOLERANCE, max(gaps)


def test_episodes_carried_over_updates_are_at_most_k_updates_old(tmp_path):
    """rollout.max_staleness=1 on sokoban_visual from a standard tiny Qwen2.5-VL: the shipped warm start with its
    image hooks off (in the config the trainer reads too, so both run one policy), whose episodes end after 1 to
    5 turns. Episodes still unfinished when the 4 groups due have ended wait for the next weights and are trained
    one update later, never more; every update trains 4 groups; the last rollout drains before the checkpoint."""
    from test_vllm import _train

    path = standard_copy(checkpoints_dir() / "sokoban_visual", tmp_path / "sokoban_visual")
    records = _train(tmp_path / "runs", 1, "sokoban_visual", f"model.path={path}", "rollout.backend=vllm",
                     "algo.rollout_correction=tis", "rollout.max_staleness=1", "train.iterations=3", "train.seed=3",
                     "rollout.group_size=2", "rollout.max_turns=5", "eval.every=0", "log.progress=false")
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert records[0]["rollout/staleness_max"] == 0
    # the 4 groups admitted beside the first 4 are trained at the next update, one version old at most: carried
    # mid-way, or, where they had ended with the first ones, their successors wait for the next weights
    assert records[1]["rollout/staleness_max"] == 1 and 0 < records[1]["rollout/staleness_mean"] <= 1
    assert records[0]["rollout/carried_episodes"] + records[1]["rollout/carried_episodes"] > 0
    assert (records[0]["rollout/carried_episodes"] > 0) == (records[1]["rollout/cross_version_episodes"] > 0)
    assert all(r["rollout/staleness_max"] <= 1 for r in records)
    assert records[2]["rollout/carried_episodes"] == 0  # drained before the checkpoint at the end
    assert all(r["rollout/filter_total_groups"] == 4 for r in records)
    assert all(r["actor/tis_clamped_fraction"] < 0.5 for r in records)


@pytest.mark.slow
def test_carried_episodes_under_zero3_on_two_ranks_do_not_deadlock(tmp_path):
    """rollout.max_staleness=1 over two gloo ranks under ZeRO-3: each rank's rollout closes at its own share and
    carries its own episodes, and the ranks meet at the weight sync and the update (sokoban_text's warm start,
    whose episodes end after 1 to 5 turns)."""
    from test_vllm import _train

    records = _train(tmp_path, 2, "sokoban_text", "rollout.backend=vllm", "algo.rollout_correction=tis",
                     "rollout.max_staleness=1", "train.iterations=3", "rollout.env_groups=4", "rollout.group_size=2",
                     "rollout.max_turns=5", "train.mini_batch_size=4", "train.micro_batch_size=2", "eval.every=0",
                     "log.progress=false", "train.deepspeed_config=deepspeed/zero3_fp32.json")
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all(r["rollout/staleness_max"] <= 1 for r in records)
    assert any(r["rollout/carried_episodes"] > 0 for r in records) and records[-1]["rollout/carried_episodes"] == 0
