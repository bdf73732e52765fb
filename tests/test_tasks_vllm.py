"""Several tasks (rollout.tasks) played by the vLLM engine's agent loop, on real vLLM (the registry's CPU build):

    .venv-vllm/bin/python -m pytest -m vllm tests/test_tasks_vllm.py

Each task's requests take its own tokens per turn, and its groups keep their own ids.
"""

from __future__ import annotations

import pytest
from test_vllm import require_vllm

from vagen.config import checkpoints_dir, load_configs
from vagen.decoding_vllm import VLLMDecoder
from vagen.episode import ChatEncoder
from vagen.models import load_policy
from vagen.rollout import close_envs
from vagen.tasks import TaskRollouts

pytestmark = pytest.mark.vllm


def test_the_agent_loop_plays_each_task_with_its_own_tokens_per_turn(distributed, tmp_path):
    require_vllm()
    short = tmp_path / "frozenlake_short.yaml"
    short.write_text("env:\n  name: frozenlake\n  render_mode: text\nrollout:\n  max_new_tokens: 6\n")
    cfg = load_configs(None, [f"rollout.tasks=[{{config: sokoban_text, groups: 2}}, {{config: {short}, groups: 1, "
                              f"name: frozenlake_short}}]", "rollout.group_size=2", "rollout.max_turns=2",
                              "train.mini_batch_size=4", "model.path=assets:sokoban_text"])
    path = checkpoints_dir() / "sokoban_text"
    _, processor = load_policy(path)
    encoder = ChatEncoder(processor)
    decoder = VLLMDecoder(path, encoder, dtype="float32", seed=0)
    source = TaskRollouts(encoder, cfg)
    try:
        episodes, stats = source.play(decoder, version=0)
    finally:
        close_envs(source.all_envs())
        decoder.close()
    assert [(ep.task, ep.group_id, ep.seed) for ep in episodes] == [
        ("sokoban_text", 0, 0), ("sokoban_text", 0, 0), ("sokoban_text", 1, 1), ("sokoban_text", 1, 1),
        ("frozenlake_short", 2, 0), ("frozenlake_short", 2, 0)]
    short_turns = [t for ep in episodes if ep.task == "frozenlake_short" for t in ep.turns]
    assert short_turns and all(t.response_length <= 7 for t in short_turns)  # 6 sampled, and <|im_end|>
    # the Sokoban warm start writes a <think> longer than FrozenLake's 6 tokens
    assert max(t.response_length for ep in episodes if ep.task == "sokoban_text" for t in ep.turns) > 7
    assert stats["rollout/sokoban_text/format_ok"] > 0 and stats["rollout/frozenlake_short/format_ok"] == 0.0
