"""Environments in Ray actors (`env.backend=ray`) on a local Ray instance of 2 CPUs: the same episodes as in
worker processes, an actor killed from outside replaced without a trace in the episodes, faulty
environments ending only their own episode, placement failures named at once, and no actor left behind."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from child_env import child_env
from faulty_env import FaultyFactory

from vagen.config import ConfigError, load_config
from vagen.env_ray import RayEnvWorkers, placement_problem
from vagen.env_workers import EnvFactory, EnvWorkers
from vagen.episode import ChatEncoder
from vagen.rollout import rollout

TESTS = Path(__file__).parent
SEEDS = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def ray_address():
    """One local Ray instance for the module (its start costs seconds); its actors import what this process
    can (the faulty environments of tests/)."""
    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), *filter(None, sys.path)])}})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _played(episodes):
    return [(ep.seed, ep.input_ids, [t.observation for t in ep.turns], [t.response for t in ep.turns],
             [t.info.get("actions") for t in ep.turns], [t.reward for t in ep.turns],
             [[image.tobytes() for image in t.images] for t in ep.turns], ep.done, ep.success, ep.error)
            for ep in episodes]


def _in_namespace(namespace: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)


@pytest.mark.parametrize("config, overrides, model", [
    ("sokoban_text", ["rollout.max_new_tokens=12", "rollout.max_turns=3"], "tiny_text"),
    ("navigation_visual", ["rollout.max_new_tokens=12", "rollout.max_turns=2"], "tiny_vl"),
])
def test_ray_actors_play_the_same_episodes_as_worker_processes(config, overrides, model, request, ray_address):
    _, policy, processor = request.getfixturevalue(model)
    cfg = load_config(config, [*overrides, "rollout.temperature=1.0", "env.workers=2"])
    encoder = ChatEncoder(processor)
    played = {}
    for backend in ("process", "ray"):
        pool = (EnvWorkers(EnvFactory(cfg.env), 4, 2, None) if backend == "process"
                else RayEnvWorkers(EnvFactory(cfg.env), 4, 2, None))
        try:
            torch.manual_seed(0)  # the hf decoder draws from torch's generator
            episodes, _ = rollout(policy, encoder, cfg, [3, 4], group_size=2, envs=pool)
        finally:
            pool.close()
        played[backend] = _played(episodes)
    assert played["ray"] == played["process"]
    assert sum(len(ep[4]) for ep in played["ray"]) >= 8 and all(ep[-1] is None for ep in played["ray"])
    if config == "navigation_visual":  # frames came back, and they change as the agent moves
        frames = [image for ep in played["ray"] for turn in ep[6] for image in turn]
        assert len(frames) >= 8 and len(set(frames)) > 1


class KillsAnActor:
    """The pool a rollout steps, as it is, but the first step sent to environment 1 is followed at once by
    `ray.kill` of the actor that holds it, as an operator (or a node that goes down) would."""

    def __init__(self, pool: RayEnvWorkers):
        self.pool, self.killed = pool, None

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def __len__(self):
        return len(self.pool)

    def step(self, index, text):
        self.pool.step(index, text)
        if index == 1 and self.killed is None:
            self.killed = self.pool.owner(1).name
            ray.kill(ray.get_actor(self.killed, namespace=self.pool.namespace), no_restart=True)


def test_an_actor_killed_mid_rollout_is_replaced_and_its_episodes_replayed(tiny_text, ray_address, capfd):
    _, model, tokenizer = tiny_text
    cfg = load_config("sokoban_text", ["rollout.max_new_tokens=8", "rollout.max_turns=3", "rollout.temperature=1.0"])
    encoder = ChatEncoder(tokenizer)
    played = []
    for disturbed in (False, True):
        pool = RayEnvWorkers(EnvFactory(cfg.env), len(SEEDS), 2, None)
        try:
            capfd.readouterr()
            torch.manual_seed(0)
            episodes, _ = rollout(model, encoder, cfg, SEEDS, 1, envs=KillsAnActor(pool) if disturbed else pool)
            played.append(_played(episodes))
            log = capfd.readouterr().err
            assert pool.replaced == int(disturbed)
            assert log.count("env workers: Ray actor 1 replaced") == int(disturbed), log
            if disturbed:  # the step it ran (if the kill came first, the next) was not blamed: it ran again
                assert re.search(r"Ray actor 1 replaced, environment [135]'s step runs again \(ended from outside "
                                 r"\(pid \d+ on [\d.]+: it was killed by `ray.kill`\)\); environments \[[135, ]+\] "
                                 r"rebuilt by replay", log), log
                assert _in_namespace(pool.namespace) == ["env-worker-0-0", "env-worker-1-2"]
        finally:
            pool.close()
    assert played[1] == played[0]
    assert all(ep[-1] is None for ep in played[1]) and min(len(ep[4]) for ep in played[1]) >= 2


def test_a_step_that_raises_hangs_or_kills_its_actor_ends_only_its_episode(tiny_text, ray_address):
    _, model, tokenizer = tiny_text
    cfg = load_config("sokoban_text", ["rollout.max_new_tokens=8", "rollout.max_turns=3", "env.step_timeout=0.3",
                                       "rollout.temperature=1.0"])
    encoder = ChatEncoder(tokenizer)
    # Two actors: episodes 0, 2, 4 in one, 1, 3, 5 in the other (the faults of tests/test_env_workers.py). The
    # actors keep the default WORKER_GRACE of 2 s: a call reaches an actor later than a pipe reaches a process,
    # the more so while a replacement actor starts on the same two cores.
    faults = {(5, 0): "exit", (6, 0): "hang", (7, 1): "raise", (8, 1): "hang_in_c"}
    pool = RayEnvWorkers(FaultyFactory(cfg.env, faults), len(SEEDS), 2, cfg.env.step_timeout)
    raising = FaultyFactory(cfg.env, {key: "raise" for key in faults})
    try:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        there, stats = rollout(model, encoder, cfg, SEEDS, 1, envs=pool)
        assert time.perf_counter() - t0 < 40
        torch.manual_seed(0)
        here, _ = rollout(model, encoder, cfg, SEEDS, 1, envs=[raising() for _ in SEEDS])
        assert pool.replaced == 2  # the one that exited and the one stuck where the alarm cannot reach
        errors = [ep.error for ep in there]
        assert [p[:-1] for p in _played(there)] == [p[:-1] for p in _played(here)]
        assert errors[0].startswith("step 0: EnvWorkerDied: the Ray actor holding this environment ended (pid ")
        assert errors[0].endswith("its worker process has died) while it stepped; a new one took its place")
        # the alarm in the actor, and the environment's own exception: the text of worker processes
        assert errors[1].startswith("step 0: EnvTimeout: no answer within env.step_timeout=0.3 s (")
        assert "env_workers.py" in errors[1] and "in expired)" in errors[1]  # raised by the alarm's handler
        assert errors[2] == here[2].error and errors[2].startswith("step 1: ValueError: level state out of bounds")
        assert errors[3] == ("step 1: EnvTimeout: no answer within env.step_timeout=0.3 s (its Ray actor did not "
                             "return to Python within 2.0 s more, and was replaced)")
        assert errors[4] is None and errors[5] is None and stats["rollout/generated_tokens"] > 0
        assert len(there[4].turns) == len(here[4].turns) >= 2  # rebuilt in the new actor, and played on
        again, _ = rollout(model, encoder, cfg, [20, 21], 3, envs=pool)  # the replacements serve the next one
        assert all(ep.error is None and ep.turns for ep in again)
    finally:
        pool.close()
    assert _in_namespace(pool.namespace) == []


def test_close_leaves_no_actor_behind(ray_address):
    cfg = load_config("sokoban_text", [])
    pool = RayEnvWorkers(EnvFactory(cfg.env), 5, 2, None, cpus=0.5, namespace="vagen-test-close")
    other = RayEnvWorkers(EnvFactory(cfg.env), 1, 1, None, cpus=0.5)
    try:
        assert _in_namespace("vagen-test-close") == ["env-worker-0-0", "env-worker-1-1"]
        assert [w.node[0] for w in pool.workers] == [ray.util.get_node_ip_address()] * 2
        pool.close()
        assert _in_namespace("vagen-test-close") == []
        assert _in_namespace(other.namespace) == ["env-worker-0-0"]  # another pool's actors are its own
    finally:
        pool.close()
        other.close()
    assert _in_namespace(other.namespace) == [] and ray.is_initialized()  # the caller's connection stays


def test_an_actor_ray_cannot_place_fails_at_once_naming_the_resource(ray_address):
    cfg = load_config("sokoban_text", [])
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"env.backend=ray: no node of the cluster has the resource 'env_host' "
                                           r"that each environment actor asks for \(Ray at .*\); each actor asks "
                                           r"for \{'CPU': 1.0, 'env_host': 1\}.*--resources='\{\"env_host\": 1\}'"):
        RayEnvWorkers(EnvFactory(cfg.env), 4, 2, None, resources={"env_host": 1})
    with pytest.raises(RuntimeError, match=r"each environment actor asks for 3 'CPU', and no node has that much "
                                           r"\(the most is 2\)"):
        RayEnvWorkers(EnvFactory(cfg.env), 4, 2, None, cpus=3)
    assert time.perf_counter() - t0 < 5
    # Resources the cluster has, but another pool holds: the start timeout, with what is free.
    holder = RayEnvWorkers(EnvFactory(cfg.env), 2, 2, None)
    try:
        with pytest.raises(RuntimeError, match=r"1 of 1 environment actors were not placed within "
                                               r"env.ray_start_timeout=1.0 s; Ray at .* has \{CPU: 0\} free of "
                                               r"\{CPU: 2\}"):
            RayEnvWorkers(EnvFactory(cfg.env), 1, 1, None, start_timeout=1.0, namespace="vagen-test-late")
        assert _in_namespace("vagen-test-late") == []
    finally:
        holder.close()


def test_placement_counts_whole_actors_per_node():
    nodes = [{"Alive": True, "Resources": {"CPU": 2.0, "env_host": 1.0}},
             {"Alive": True, "Resources": {"CPU": 4.0, "env_host": 3.0}},
             {"Alive": False, "Resources": {"CPU": 64.0, "env_host": 64.0}}]
    assert placement_problem(nodes, {"CPU": 1.0, "env_host": 1.0}, 4) is None  # 1 on the first node, 3 on the second
    assert placement_problem(nodes, {"CPU": 1.5, "env_host": 1.0}, 3) is None  # 1 + 2 (the CPUs bound the second)
    assert placement_problem(nodes, {"CPU": 1.5, "env_host": 1.0}, 4) == (
        "env.workers=4 actors each asking for {CPU: 1.5, env_host: 1}, but the cluster's nodes hold 3 of them")
    assert placement_problem(nodes, {"CPU": 1.0, "gpu_host": 1.0}, 1) == (
        "no node of the cluster has the resource 'gpu_host' that each environment actor asks for")
    assert placement_problem(nodes, {"CPU": 0.0}, 100) is None  # actors that reserve nothing always fit


def test_env_backend_ray_is_refused_without_ray_naming_the_extra(monkeypatch):
    import importlib.util

    from vagen.config import machine_problems
    from vagen.train import check_before_loading

    find_spec = importlib.util.find_spec
    assert machine_problems(load_config("sokoban_text", ["env.backend=ray", "env.workers=2"])) == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else find_spec(name, *a))
    # refused by the checks that run before anything loads (training's, and python -m vagen.config's)
    with pytest.raises(ConfigError, match=r"env.backend=ray runs the environments as Ray actors, but Ray is not "
                                          r"installed in this environment; pip install -e \"\.\[ray\]\""):
        check_before_loading(load_config("sokoban_text", ["env.backend=ray", "env.workers=2"]))
    assert machine_problems(load_config("sokoban_text", ["env.workers=2"])) == []  # the process backend needs no Ray
    with pytest.raises(ConfigError, match="env.backend=ray runs env.workers Ray actors, but env.workers=0"):
        load_config("sokoban_text", ["env.backend=ray"])
    with pytest.raises(ConfigError, match=r"env.ray_resources=\{'CPU': 2\}: each entry is a custom resource"):
        load_config("sokoban_text", ["env.backend=ray", "env.workers=1", "env.ray_resources={CPU: 2}"])


@pytest.mark.slow
def test_two_gloo_ranks_share_a_ray_instance_in_disjoint_namespaces(ray_address, tiny_text, tmp_path):
    """Two ranks of one run join the module's Ray instance by its address: each keeps its actors in its own
    namespace, sees the other's there, and plays the same episodes as with worker processes."""
    import json
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path, _, _ = tiny_text
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RAY_ADDRESS_FOR_TEST=ray_address,
                    TINY_TEXT=str(path), OUT=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, str(TESTS / "ray_rank_worker.py")], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outputs]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(result["same_as_processes"] for result in results)
    namespaces = [result["namespace"] for result in results]
    assert namespaces[0] != namespaces[1] and all(ns.startswith(f"vagen-run-rank{r}-") for r, ns in enumerate(namespaces))
    for result in results:
        assert result["mine"] == ["env-worker-0-0", "env-worker-1-1"]
        assert sorted(result["seen"]) == sorted([[ns, name] for ns in namespaces for name in result["mine"]])
    assert _in_namespace(namespaces[0]) == [] and _in_namespace(namespaces[1]) == []


def test_an_actor_killed_while_idle_is_replaced_before_the_next_rollout_and_no_step_fails(ray_address):
    """An actor's process killed between steps (as the kernel kills one for memory during an update): the check a
    rollout starts with (`check_idle`) replaces it, rebuilding its environment by replay, and the next step there
    answers as in this process."""
    import signal

    from vagen.env_workers import InProcessEnvs
    from vagen.rollout import make_env

    cfg = load_config("sokoban_text", [])
    here = InProcessEnvs([make_env(cfg.env)], None)
    pool = RayEnvWorkers(EnvFactory(cfg.env), 1, 1, 30.0)
    try:
        for envs in (here, pool):
            envs.reset(0, 5)
            envs.step(0, "<think>go</think><answer>Up</answer>")
        got = []
        while len(got) < 2:
            got += pool.answers(block=True)
        _, pid = ray.get(pool.workers[0].actor.ready.remote())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not pool.replaced and time.monotonic() < deadline:  # Ray learns of the death within moments
            pool.check_idle()
        assert pool.replaced == 1
        for envs in (here, pool):
            envs.step(0, "<think>go</think><answer>Left</answer>")
        (answer,) = pool.answers(block=True)
        expected = here.answers()[-1]
        assert answer.error is None and answer.value[4]["state_key"] == expected.value[4]["state_key"]
    finally:
        pool.close()
