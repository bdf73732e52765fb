"""Environment workers as Ray actors (`env.backend=ray`): the protocol of `vagen.env_workers.EnvWorkers`
(requests in order, per-step deadlines, replacement and replay), with Ray as the transport.

`env.workers` actors each own the environments `index % workers` and their renderers, on whichever node
Ray places them: `env.ray_cpus` CPUs and the custom resources `env.ray_resources` (e.g. `{env_host: 1}`,
which only the environment nodes declare) per actor. `env.ray_address=local` starts a private Ray
instance for this process (each rank its own) that `close()` stops; an address (`ray start` outside
vagen) joins that cluster, where every run and rank keeps its actors in a namespace of its own.

Failures are handled as with worker processes, by vagen and never by Ray (`max_restarts=0`, no task
retries, so no environment is silently re-created):
- an environment that raises answers with the same error (`env_error_summary`); one past
  `env.step_timeout` is interrupted by the actor's alarm (actor calls run in its main thread);
- an actor that does not answer within `WORKER_GRACE` s more, or dies with its process or node
  (`RayActorError`), is killed (`ray.kill`) and replaced, and its other environments are rebuilt in the new
  actor by replaying their resets and responses;
- an actor found dead while idle (`check_idle`, before each rollout) is replaced, and no request fails;
- an actor that Ray cannot place (no node has the resources it asks for, or none frees them within
  `env.ray_start_timeout`) fails the run at once, naming the resource.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
import uuid
from collections import deque

from vagen.env_workers import EnvWorkers, WorkerLost, _Worker, handle


class EnvActor:
    """The body of an environment actor: the environments of one slot, made on first use, and each
    request run in order (an actor runs one call at a time), answered as a worker process answers."""

    def __init__(self, factory, step_timeout: float | None):
        self.factory, self.step_timeout, self.envs = factory, step_timeout, {}

    def ready(self) -> tuple[str, int]:
        """Where the actor runs: its node's address and its process id."""
        import ray

        return ray.util.get_node_ip_address(), os.getpid()

    def run(self, index: int, kind: str, arg) -> tuple:
        return handle(self.envs, self.factory, self.step_timeout, index, kind, arg)


_REMOTE = None


def _remote_class():
    """`EnvActor` as a Ray actor class, made once Ray is imported (it is an optional dependency)."""
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(max_restarts=0, max_task_retries=0)(EnvActor)
    return _REMOTE


class RayEnvWorkers(EnvWorkers):
    """`env.backend=ray`: `count` environments made by `factory` in `workers` Ray actors, environment `index`
    in actor `index % workers`. `address`: `local` (a private instance, stopped by `close()`) or a cluster's
    address; when this process is already connected to Ray (`ray.init` done by the caller), that
    connection is used and left open. Each actor asks for `cpus` CPUs and the custom `resources`;
    `namespace` holds this pool's actors (default: a new one). Raises RuntimeError, naming the resource,
    when Ray cannot place an actor."""

    what = "Ray actor"

    def __init__(self, factory, count: int, workers: int, step_timeout: float | None, *, address: str = "local",
                 cpus: float = 1.0, resources: dict | None = None, namespace: str | None = None,
                 start_timeout: float = 60.0):
        import ray

        if workers < 1:
            raise ValueError(f"env.workers={workers}: env.backend=ray needs at least one actor")
        self.cpus, self.resources, self.start_timeout = float(cpus), dict(resources or {}), start_timeout
        self.namespace = namespace or f"vagen-{uuid.uuid4().hex[:8]}"
        self.started_ray = False
        self.actors_started = 0
        self.workers, self.example_env = [], None
        actors, room_cpus, room_resources = pool_room(workers, count, self.cpus, self.resources)
        if not ray.is_initialized():
            # a private instance has room for exactly this pool's actors
            connect(address, room_cpus, room_resources, self.namespace)
            self.started_ray = True
        self.address = ray.get_runtime_context().gcs_address
        try:
            problem = placement_problem(ray.nodes(), self.asked(), actors)
            if problem:
                raise RuntimeError(f"env.backend=ray: {problem} (Ray at {self.address}); "
                                   f"{self._how_to_place()}")
            super().__init__(factory, count, workers, step_timeout)
            self._await_started(self.workers)
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, cfg_env, factory, count: int, owner: str | None = None) -> RayEnvWorkers:
        """The pool an `env` config section asks for; `owner` (a run and rank) names its namespace."""
        namespace = f"vagen-{owner}-{uuid.uuid4().hex[:6]}" if owner else None
        return cls(factory, count, cfg_env.workers, cfg_env.step_timeout, address=cfg_env.ray_address,
                   cpus=cfg_env.ray_cpus, resources=cfg_env.ray_resources, namespace=namespace,
                   start_timeout=cfg_env.ray_start_timeout)

    def asked(self) -> dict[str, float]:
        """The resources each actor asks Ray for."""
        return {"CPU": self.cpus, **self.resources}

    def _how_to_place(self) -> str:
        custom = ", ".join(f'"{name}": {amount:g}' for name, amount in self.resources.items())
        return (f"each actor asks for {self.asked()}; lower env.ray_cpus or env.workers, or start the environment "
                f"nodes with them (ray start --address=<head> --num-cpus=N"
                + (f" --resources='{{{custom}}}'" if custom else "") + ")")

    def _start(self, slot: int) -> _Worker:

        options = {"name": f"env-worker-{slot}-{self.actors_started}", "namespace": self.namespace,
                   "num_cpus": self.cpus}
        if self.resources:
            options["resources"] = self.resources
        self.actors_started += 1
        worker = _RayWorker(_remote_class().options(**options).remote(self.factory, self.step_timeout),
                            self.step_timeout, options["name"])
        if self.workers:  # a replacement: placed before the requests waiting for it count against the timeout
            self._await_started([worker])
        return worker

    def _await_started(self, workers: list[_RayWorker]) -> None:
        """Wait until every actor of `workers` has started, or raise RuntimeError: Ray could not place one
        within `start_timeout`, or its constructor failed (vagen missing on its node)."""
        import ray

        refs = {worker.actor.ready.remote(): worker for worker in workers}
        done, late = ray.wait(list(refs), num_returns=len(refs), timeout=self.start_timeout)
        if late:
            raise RuntimeError(
                f"env.backend=ray: {len(late)} of {len(refs)} environment actors were not placed within "
                f"env.ray_start_timeout={self.start_timeout} s; Ray at {self.address} has "
                f"{_resources(ray.available_resources(), ray.cluster_resources())} free of "
                f"{_resources(ray.cluster_resources())}; "
                f"{self._how_to_place()}")
        for ref in done:
            try:
                refs[ref].node = ray.get(ref)
            except ray.exceptions.RayError as err:
                raise RuntimeError(
                    f"env.backend=ray: an environment actor failed to start: {err}; every node that runs "
                    f"environment actors needs this vagen and its dependencies installed (pip install -e "
                    f"\".[ray]\" in the same checkout, with the same Ray and Python versions)") from None
        for worker in workers:  # started: its requests' deadlines need no allowance for a start any more
            worker.started, worker.answered = time.monotonic(), True

    def _arrived(self, waiting: list[_Worker], timeout: float | None) -> list[_Worker]:
        import ray

        heads = {worker.refs[0]: worker for worker in waiting}
        ready, _ = ray.wait(list(heads), num_returns=1, timeout=timeout)
        if ready:  # every answer that is there, not only the first
            ready, _ = ray.wait(list(heads), num_returns=len(heads), timeout=0)
        return [heads[ref] for ref in ready]

    def check_idle(self, timeout: float = 10.0) -> None:
        """Replace every idle actor that died (its process killed for memory during an update, say): each is
        asked where it runs, and one whose call raises RayActorError is replaced, no request failing. An actor
        that does not answer within `timeout` s is left to its next request's deadline."""
        import ray

        idle = {worker.actor.ready.remote(): worker for worker in self.workers if not worker.pending}
        if not idle:
            return
        done, _ = ray.wait(list(idle), num_returns=len(idle), timeout=timeout)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self._replace(idle[ref], f"found dead while idle ({actor_death(err)})", blame=False)

    def actor_names(self) -> list[str]:
        """The names of the actors alive in this pool's namespace, as Ray lists them."""
        import ray

        return sorted(actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                      if actor["namespace"] == self.namespace)

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            for worker in self.workers:
                worker.stop()
            # ray.kill returns at once; wait (briefly) until Ray no longer lists the actors.
            deadline = time.monotonic() + 10.0
            while self.workers and self.actor_names() and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.example_env is not None and hasattr(self.example_env, "close"):
            self.example_env.close()
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False


def connect(address: str, cpus: float, resources: dict[str, float], namespace: str) -> None:
    """Connect this process to Ray: `address=local` starts a private instance of `cpus` CPUs (rounded up) and the
    custom `resources` (totals), whose workers find vagen (and the environments' modules) where this process
    does; another address joins that cluster."""
    import ray

    if address == "local":
        ray.init(address="local", num_cpus=max(1, math.ceil(cpus)), resources=resources, include_dashboard=False,
                 namespace=namespace, logging_level="warning",
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    else:
        ray.init(address=address, namespace=namespace, logging_level="warning")


def pool_room(workers: int, count: int, cpus: float, resources: dict) -> tuple[int, float, dict[str, float]]:
    """The actors a pool of `count` environments starts on env.workers=`workers`, and the CPUs and custom
    resources they ask for in all (env.ray_cpus and env.ray_resources are per actor)."""
    actors = min(workers, max(count, 1))
    return actors, actors * float(cpus), {name: amount * actors for name, amount in resources.items()}


class SharedRay:
    """One Ray connection for several pools of one process (the tasks of rollout.tasks, each a `RayEnvWorkers`):
    made before them, with a private instance's room for all their actors (env.ray_address=local), so that each
    pool finds this process connected, uses the connection and leaves it open; `close`, after theirs, ends it."""

    def __init__(self, address: str, cpus: float, resources: dict[str, float], namespace: str):
        connect(address, cpus, resources, namespace)

    @classmethod
    def for_pools(cls, pools: list[tuple], owner: str | None) -> SharedRay | None:
        """The connection for `pools`, (env config section, environments) pairs, all on one env.ray_address (a
        process connects to one cluster: ValueError otherwise, as the config's checks say); None when this process
        is connected already (by its caller, which then closes it)."""
        import ray

        addresses = sorted({cfg_env.ray_address for cfg_env, _ in pools})
        if len(addresses) > 1:
            raise ValueError(f"env.backend=ray pools on different Ray clusters (env.ray_address {', '.join(addresses)}) "
                             f"cannot share one connection; give every task the same env.ray_address")
        if ray.is_initialized():
            return None
        cpus, resources = 0.0, {}
        for cfg_env, count in pools:
            _, pool_cpus, pool_resources = pool_room(cfg_env.workers, count, cfg_env.ray_cpus, cfg_env.ray_resources)
            cpus += pool_cpus
            for name, amount in pool_resources.items():
                resources[name] = resources.get(name, 0.0) + amount
        namespace = f"vagen-{owner}-{uuid.uuid4().hex[:6]}" if owner else f"vagen-{uuid.uuid4().hex[:8]}"
        return cls(pools[0][0].ray_address, cpus, resources, namespace)

    def close(self) -> None:
        import ray

        ray.shutdown()


class _RayWorker(_Worker):
    """An environment actor; `refs` the answers of `pending`'s requests, in the same order."""

    def __init__(self, actor, step_timeout: float | None, name: str):
        super().__init__(step_timeout)
        self.actor, self.name, self.node = actor, name, None
        self.refs: deque = deque()

    def post(self, request: tuple) -> None:
        self.refs.append(self.actor.run.remote(*request))

    def receive(self) -> tuple:
        import ray

        try:
            return ray.get(self.refs.popleft())
        except ray.exceptions.RayActorError as err:
            raise WorkerLost(actor_death(err), blame=not ended_from_outside(err)) from None

    def stop(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
        self.refs.clear()


def actor_death(err) -> str:
    """How an actor died, in a few words, from the RayActorError its calls raise: its process, its node
    and Ray's reason (`pid 812 on 10.0.0.5: its worker process has died`)."""
    text = str(err)
    pid, ip = re.search(r"\bpid: (\d+)", text), re.search(r"\bip: (\S+)", text)
    reason = re.search(r"The actor (?:is dead|died) because (.+?)\.(\s|$)", text)
    where = f"pid {pid.group(1)} on {ip.group(1)}: " if pid and ip else ""
    return where + (reason.group(1) if reason else text.splitlines()[0] if text else type(err).__name__)


def ended_from_outside(err) -> bool:
    """Whether the actor of a RayActorError was ended by something other than the call it ran: `ray.kill`
    (an operator; vagen's own kills never reach here), or its node died or was preempted."""
    text = str(err)
    return bool(getattr(err, "preempted", False)) or "killed by `ray.kill`" in text or "its node has died" in text


def placement_problem(nodes: list[dict], asked: dict[str, float], actors: int) -> str | None:
    """Why `actors` actors each asking for `asked` resources cannot all be placed on the alive `nodes` of
    `ray.nodes()` even when the cluster is idle (None when they can): a resource no node has, or too little
    of it."""
    alive = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
    for name, amount in asked.items():
        if amount > 0 and not any(resources.get(name, 0) >= amount - 1e-9 for resources in alive):
            having = [resources.get(name, 0) for resources in alive if resources.get(name)]
            if not having:
                return f"no node of the cluster has the resource {name!r} that each environment actor asks for"
            return (f"each environment actor asks for {amount:g} {name!r}, and no node has that much (the most "
                    f"is {max(having):g})")
    positive = {name: amount for name, amount in asked.items() if amount > 0}
    if not positive:
        return None
    fits = sum(min(math.floor(resources.get(name, 0) / amount + 1e-9) for name, amount in positive.items())
               for resources in alive)
    if fits < actors:
        return (f"env.workers={actors} actors each asking for {_resources(asked)}, but the cluster's nodes hold "
                f"{fits} of them")
    return None


def _resources(resources: dict, names: dict | None = None) -> str:
    """Ray's resources without its bookkeeping ones (nodes, memory), those of `names` shown even at 0."""
    shown = {name: resources.get(name, 0.0) for name in (names or resources)
             if not name.startswith("node:") and name not in ("memory", "object_store_memory")}
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in sorted(shown.items())) + "}"
