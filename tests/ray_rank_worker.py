"""Run by tests/test_env_ray.py as one of two gloo ranks that join one Ray instance (RAY_ADDRESS_FOR_TEST):
the rank plays its share of levels with worker processes, then with Ray actors in its own namespace, and
writes to OUT/rank<R>.json its namespace, its actors, every actor it sees while both ranks hold theirs,
and whether the two backends played the same episodes."""

import datetime
import json
import os
import sys
from pathlib import Path

import torch

from vagen.config import load_config
from vagen.env_workers import EnvFactory, EnvWorkers
from vagen.episode import ChatEncoder
from vagen.models import load_policy
from vagen.rollout import make_envs, rollout


def played(episodes):
    return [(ep.seed, ep.input_ids, [t.info.get("actions") for t in ep.turns], [t.reward for t in ep.turns],
             ep.error) for ep in episodes]


def main() -> None:
    import ray

    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = torch.distributed.get_rank()
    model, tokenizer = load_policy(os.environ["TINY_TEXT"])
    encoder = ChatEncoder(tokenizer)
    cfg = load_config("sokoban_text", ["rollout.max_new_tokens=8", "rollout.max_turns=2", "rollout.temperature=1.0",
                                       "env.workers=2", "env.backend=ray", "env.ray_cpus=0.5",
                                       f"env.ray_address={os.environ['RAY_ADDRESS_FOR_TEST']}"])
    seeds = [3 + 2 * rank, 4 + 2 * rank]
    results = {}
    processes = EnvWorkers(EnvFactory(cfg.env), 4, 2, None)
    try:
        torch.manual_seed(rank)
        results["process"], _ = rollout(model, encoder, cfg, seeds, 2, envs=processes)
    finally:
        processes.close()
    actors = make_envs(cfg.env, 4, owner=f"run-rank{rank}")
    try:
        torch.manual_seed(rank)
        results["ray"], _ = rollout(model, encoder, cfg, seeds, 2, envs=actors)
        torch.distributed.barrier()  # both ranks hold their actors now
        seen = [[a["namespace"], a["name"]] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"].startswith("vagen-run-rank")]
        mine = actors.actor_names()
        torch.distributed.barrier()
    finally:
        actors.close()
    assert not ray.is_initialized()  # the rank's connection ends with its actors; the instance goes on
    Path(os.environ["OUT"], f"rank{rank}.json").write_text(json.dumps({
        "namespace": actors.namespace, "mine": mine, "seen": seen,
        "same_as_processes": played(results["ray"]) == played(results["process"])}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
