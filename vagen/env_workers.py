"""Where a rollout's environments step: in the trainer's process (`env.workers=0`), or in worker processes
(`env.workers=N`), each owning its share of the environments and their renderers. Ray actors in place of
the processes (`env.backend=ray`, `vagen.env_ray`) follow the same protocol, which `EnvWorkers` holds.

Both sides take the same requests (`reset(index, seed)`, `step(index, text)`) and hand back `Answer`s. In
the trainer's process a request runs at once, in the order it was made. In workers it runs while the
trainer goes on (a vLLM engine decoding other episodes, or the next environments of a turn being sent),
and `answers(block=True)` waits for the next ones. The trainer sends response text and receives the
observation (PIL frames pickled), reward, terminated/truncated and info.

Failures end one episode, never the rollout:
- an environment that raises answers with the error (`env_error_summary`);
- one that runs past `env.step_timeout` is interrupted by an alarm (`time_limit`), in the worker as in the
  trainer's process; one stuck where the alarm cannot reach (inside a C call) gets `WORKER_GRACE` more
  seconds, then its worker is killed;
- a worker that dies (killed, `os._exit`, a crash in a renderer) fails the request it was running; one found
  dead while it ran nothing (killed for memory during an update) fails none. A new worker takes its place
  and rebuilds its other environments by replaying each one's reset and steps
  (the environments are deterministic given the seed and the responses), then runs the requests that
  were waiting, so their episodes go on as if nothing happened. A worker ended from outside (a Ray actor
  killed by an operator, or whose node died) fails no request: the one it ran runs again in the new one.
Each replacement is logged on stderr.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import envs_visual

# Seconds a worker may overrun `env.step_timeout` (its own alarm had the chance to stop the call) before
# it is killed and replaced.
WORKER_GRACE = 2.0
# Seconds more a new worker has for its first answer: it starts Python and imports vagen and the environment
# first (a second on an idle machine, several on a loaded one).
WORKER_START = 30.0


def build_env(cfg_env, seed_env_params: dict | None = None):
    """The environment `env` config section describes (`envs_visual.make`)."""
    return envs_visual.make(cfg_env.name, **env_params(cfg_env, seed_env_params))


def env_params(cfg_env, seed_env_params: dict | None = None) -> dict:
    """The parameters `build_env` makes the environment with (what env.backend=http sends to /connect)."""
    params = dict(cfg_env.params)
    params.setdefault("prompt_format", cfg_env.prompt_format)
    params.setdefault("render_mode", cfg_env.render_mode)
    params.setdefault("max_actions_per_turn", cfg_env.max_actions_per_turn)
    params.setdefault("format_reward", cfg_env.format_reward)
    if seed_env_params:
        params.update(seed_env_params)
    return params


class EnvFactory:
    """A picklable maker of the environments of an `env` config section, for worker processes."""

    def __init__(self, cfg_env):
        self.cfg_env = cfg_env

    def __call__(self):
        return build_env(self.cfg_env)


@dataclass
class Answer:
    """What an environment returned for one request: `value` is `(obs, info, system_prompt)` for a reset,
    `(obs, reward, terminated, truncated, info)` for a step; `error` the failure in one line instead."""

    index: int
    kind: str  # reset | step
    value: tuple | None = None
    error: str | None = None


class EnvTimeout(TimeoutError):
    """An environment's reset or step ran past `env.step_timeout`."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise EnvTimeout in the code inside if it runs longer than `seconds` (None: no limit). An alarm
    signal, so only in the main thread of a Unix process, and only between Python bytecodes."""
    import threading

    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise EnvTimeout(f"no answer within env.step_timeout={seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def env_error_summary(err: BaseException) -> str:
    """An environment's exception in one line: its type, message and the innermost frame it came from."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    where = f" ({frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    return f"{type(err).__name__}: {err}{where}"


def run_request(env, kind: str, arg, step_timeout: float | None) -> Answer:
    """One request on `env` under the time limit; what it raised becomes the answer's error."""
    try:
        with time_limit(step_timeout):
            if kind == "reset":
                obs, info = env.reset(seed=arg)
                return Answer(-1, kind, (obs, info, env.system_prompt()))
            return Answer(-1, kind, tuple(env.step(arg)))
    except Exception as err:
        return Answer(-1, kind, error=env_error_summary(err))


class InProcessEnvs:
    """`env.workers=0`: the environments of the trainer's process, each request run when it is made."""

    def __init__(self, envs: list, step_timeout: float | None):
        self.envs, self.step_timeout = envs, step_timeout
        self.ready: deque[Answer] = deque()

    def __len__(self) -> int:
        return len(self.envs)

    def env(self, index: int):
        return self.envs[index]

    def reset(self, index: int, seed: int) -> None:
        self._run(index, "reset", seed)

    def step(self, index: int, text: str) -> None:
        self._run(index, "step", text)

    def _run(self, index: int, kind: str, arg) -> None:
        answer = run_request(self.envs[index], kind, arg, self.step_timeout)
        answer.index = index
        self.ready.append(answer)

    def busy(self) -> bool:
        """Whether a request is still running (never here: each ran when it was made)."""
        return False

    def check_idle(self) -> None:
        """Nothing to check: the environments live in this process."""

    def answers(self, block: bool = False, timeout: float | None = None) -> list[Answer]:
        out = list(self.ready)
        self.ready.clear()
        return out

    def close(self) -> None:
        for env in self.envs:
            if hasattr(env, "close"):
                env.close()


class WorkerLost(Exception):
    """A worker ended while requests were waiting on it; `how` says how it ended (`exit code 3`). `blame`:
    whether the request it was running may have ended it (a crash in an environment), so that it fails;
    False where the worker was ended from outside (its node died, an operator killed it), so that it runs
    again in the new worker."""

    def __init__(self, how: str, blame: bool = True):
        super().__init__(how)
        self.how, self.blame = how, blame


class EnvWorkers:
    """`env.workers=N`: `count` environments made by `factory` (a picklable callable; `EnvFactory` for a
    config) in `workers` processes, environment `index` in worker `index % workers`. Lives as long as the
    run; `close()` ends the processes.

    What a worker is, how requests reach it and how its answers are waited for is the transport (`_start`,
    `_arrived`, and the worker's `post`, `receive`, `stop`); `vagen.env_ray.RayEnvWorkers` puts Ray actors
    there. The protocol above it (order, deadlines, replacement and replay) is this class's, for both."""

    what = "worker process"  # names the worker in failures

    def __init__(self, factory, count: int, workers: int, step_timeout: float | None):
        if workers < 1:
            raise ValueError(f"env.workers={workers}: EnvWorkers needs at least one process; env.workers=0 steps "
                             f"the environments in the trainer's process (InProcessEnvs)")
        self.factory, self.count, self.step_timeout = factory, count, step_timeout
        # To rebuild an environment in a new worker: its reset seed and the texts of its answered steps.
        self.history: dict[int, tuple[int, list[str]]] = {}
        self.broken: dict[int, str] = {}  # environments lost with a worker while being rebuilt
        self.ready: deque[Answer] = deque()
        self.example_env = None
        self.replaced = 0  # workers that died or hung and were replaced
        self.workers: list[_Worker] = []
        self.workers = [self._start(slot) for slot in range(min(workers, max(count, 1)))]

    def _start(self, slot: int) -> _Worker:
        """A new worker for slot `slot` (`index % workers`), first or replacing one."""
        return _ProcessWorker(self.factory, self.step_timeout)

    def _arrived(self, waiting: list[_Worker], timeout: float | None) -> list[_Worker]:
        """The workers of `waiting` that have an answer to receive, waiting up to `timeout` s (None: until
        one has)."""
        ready = wait([worker.answers for worker in waiting], timeout)
        return [worker for worker in waiting if worker.answers in ready]

    def __len__(self) -> int:
        return self.count

    def example(self):
        """One environment of the kind the workers hold, built in this process once (for its prompt
        format and graded fields, never stepped)."""
        if self.example_env is None:
            self.example_env = self.factory()
        return self.example_env

    def owner(self, index: int) -> _Worker:
        return self.workers[index % len(self.workers)]

    def reset(self, index: int, seed: int) -> None:
        self.history.pop(index, None)  # starts over: nothing of it to rebuild in a replacement
        self.broken.pop(index, None)
        self._idle_dead(self.owner(index))
        self.history[index] = (seed, [])
        self.owner(index).send((index, "reset", seed))

    def step(self, index: int, text: str) -> None:
        if index in self.broken:
            self.ready.append(Answer(index, "step", error=self.broken.pop(index)))
            return
        self._idle_dead(self.owner(index))
        self.owner(index).send((index, "step", text))

    def _idle_dead(self, worker: _Worker) -> None:
        """Replace `worker` if it ended while it ran nothing, before a request is sent to it: no request was
        its cause, so none fails, and its environments are rebuilt in the new worker."""
        if not worker.pending:
            how = worker.gone()
            if how is not None:
                self._replace(worker, f"found dead while idle ({how})", blame=False)

    def check_idle(self) -> None:
        """Replace every worker that ended while it ran nothing (killed for memory during an update, say), so
        that the next request sent there finds a live one. Called before each rollout."""
        for worker in list(self.workers):
            self._idle_dead(worker)

    def busy(self) -> bool:
        return bool(self.ready) or any(worker.pending for worker in self.workers)

    def answers(self, block: bool = False, timeout: float | None = None) -> list[Answer]:
        """The answers that arrived; with `block`, at least one when any request is still running, or none
        once `timeout` seconds have passed (None: no bound but the requests' deadlines)."""
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            waiting = [worker for worker in self.workers if worker.pending]
            if self.ready or not waiting:
                break
            wait_s = 0.0
            if block:
                deadlines = [worker.deadline() for worker in waiting]
                bound = None if None in deadlines else min(deadlines)
                if until is not None:
                    bound = until if bound is None else min(bound, until)
                wait_s = None if bound is None else max(0.0, bound - time.monotonic())
            ready = self._arrived(waiting, wait_s)
            for worker in waiting:
                if worker in ready:
                    self._receive(worker)
                elif worker.deadline() is not None and time.monotonic() > worker.deadline():
                    if self._arrived([worker], 0.0):  # it answered while another worker was being replaced
                        self._receive(worker)
                        continue
                    self._replace(worker, f"EnvTimeout: no answer within env.step_timeout={self.step_timeout} s "
                                          f"(its {self.what} did not return to Python within {WORKER_GRACE} s "
                                          f"more, and was replaced)")
            if not block or (until is not None and time.monotonic() >= until):
                break
        out = list(self.ready)
        self.ready.clear()
        return out

    def _receive(self, worker: _Worker) -> None:
        try:
            index, kind, value, error = worker.receive()
        except WorkerLost as lost:
            if lost.blame:
                self._replace(worker, f"EnvWorkerDied: the {self.what} holding this environment ended ({lost.how}) "
                                      f"while it stepped; a new one took its place")
            else:
                self._replace(worker, f"ended from outside ({lost.how})", blame=False)
            return
        request = worker.pending.popleft()
        worker.started, worker.answered = time.monotonic(), True
        assert request[:2] == (index, kind), f"{request[:2]=} {(index, kind)=}"
        if kind == "rebuild":
            if error is not None:
                self.broken[index] = f"rebuild after a worker was replaced: {error}"
            return
        if kind == "step" and error is None:
            self.history[index][1].append(request[2])
        self.ready.append(Answer(index, kind, value, error))

    def _replace(self, worker: _Worker, error: str, blame: bool = True) -> None:
        """Fail the request `worker` was running with `error`, start a new worker in its place, rebuild
        its other environments there and send it the requests that were waiting. Without `blame` (the
        worker was ended from outside) the request it was running fails not: its environment is rebuilt
        too and the request sent again."""
        worker.stop()
        self.replaced += 1
        culprit, *waiting = worker.pending or [None]
        index, kind = culprit[:2] if culprit else (None, None)
        if not blame:
            index, waiting = None, [culprit, *waiting] if culprit else []
        elif kind == "rebuild":
            self.broken[index] = f"rebuild after a worker was replaced: {error}"
        else:
            self.ready.append(Answer(index, kind, error=error))
        # An environment whose reset is still waiting starts over anyway.
        resetting = {request[0] for request in waiting if request[1] == "reset"}
        slot = self.workers.index(worker)
        fresh = self._start(slot)
        self.workers[slot] = fresh
        rebuilt = []
        for other, (seed, texts) in self.history.items():
            if other != index and self.owner(other) is fresh and other not in self.broken and other not in resetting:
                fresh.send((other, "rebuild", (seed, list(texts))))
                rebuilt.append(other)
        for request in waiting:
            if request[1] == "rebuild":  # sent again above, from the same history
                continue
            if request[0] != index:
                fresh.send(request)
            else:  # the environment whose rebuild failed: its next request fails
                self.ready.append(Answer(index, request[1], error=self.broken.pop(index, error)))
        request = ("no request failed" if culprit is None else
                   f"environment {culprit[0]}'s {culprit[1]} " + ("failed" if blame else "runs again"))
        print(f"env workers: {self.what} {slot} replaced, {request} ({error}); environments {rebuilt} rebuilt by "
              f"replay", file=sys.stderr, flush=True)

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        if self.example_env is not None and hasattr(self.example_env, "close"):
            self.example_env.close()


class _Worker:
    """One worker, as the protocol sees it: `pending` the requests sent and not yet answered, in order,
    `started` when the one at the head began, `answered` whether it has answered (so has started) yet. A
    transport adds `post` (deliver a request), `receive` (the next answer, as `(index, kind, value, error)`,
    or `WorkerLost`) and `stop`."""

    def __init__(self, step_timeout: float | None):
        self.step_timeout = step_timeout
        self.pending: deque[tuple] = deque()
        self.started = time.monotonic()
        self.answered = False  # until its first answer, a worker may still be starting

    def send(self, request: tuple) -> None:
        if not self.pending:
            self.started = time.monotonic()
        self.pending.append(request)
        self.post(request)

    def deadline(self) -> float | None:
        """When the request at the head of the queue is overdue; None without a step timeout."""
        if not self.step_timeout:
            return None
        steps = len(self.pending[0][2][1]) + 1 if self.pending[0][1] == "rebuild" else 1
        return self.started + self.step_timeout * steps + WORKER_GRACE + (0.0 if self.answered else WORKER_START)

    def post(self, request: tuple) -> None:
        raise NotImplementedError

    def receive(self) -> tuple:
        raise NotImplementedError

    def gone(self) -> str | None:
        """How the worker ended (`signal 9`), if it is known to have ended without a round trip; None while it
        may be alive (a transport that cannot tell finds out at its next request, or in `check_idle`)."""
        return None

    def stop(self) -> None:
        raise NotImplementedError


class _ProcessWorker(_Worker):
    """A worker process (`serve`) and its two pipes."""

    def __init__(self, factory, step_timeout: float | None):
        import pickle

        super().__init__(step_timeout)
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from vagen.env_workers import serve; serve({to_child}, {from_child})"],
            pass_fds=(to_child, from_child), env=env, stdin=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self.requests = Connection(from_parent, readable=False)
        self.answers = Connection(to_parent, writable=False)
        self.requests.send_bytes(pickle.dumps((factory, step_timeout)))

    def post(self, request: tuple) -> None:
        try:
            self.requests.send(request)
        except OSError:  # the process is gone: `answers` finds out and replaces it
            pass

    def receive(self) -> tuple:
        try:
            return self.answers.recv()
        except (EOFError, OSError):
            code = self.process.wait()
            raise WorkerLost(f"signal {-code}" if code < 0 else f"exit code {code}") from None

    def gone(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"signal {-code}" if code < 0 else f"exit code {code}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.requests.close()
        self.answers.close()


def handle(envs: dict, factory, step_timeout: float | None, index: int, kind: str, arg) -> tuple:
    """A worker's answer to one request, `(index, kind, value, error)`: environment `index` of `envs` (made
    by `factory` on first use) reset, stepped, or rebuilt by replaying a reset and steps (`arg` is then
    `(seed, texts)`, and the answer carries only the error)."""
    try:
        env = envs[index] if index in envs else envs.setdefault(index, factory())
    except Exception as err:
        return index, kind, None, f"making the environment: {env_error_summary(err)}"
    if kind == "rebuild":
        seed, texts = arg
        answer = run_request(env, "reset", seed, step_timeout)
        for text in texts:
            if answer.error is None:
                answer = run_request(env, "step", text, step_timeout)
        return index, kind, None, answer.error
    answer = run_request(env, kind, arg, step_timeout)
    return index, kind, answer.value, answer.error


def serve(from_parent: int, to_parent: int) -> None:
    """A worker process's loop: environments made on first use, requests run in order, each answered."""
    requests = Connection(from_parent, writable=False)
    answers = Connection(to_parent, readable=False)
    factory, step_timeout = requests.recv()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which then closes the workers
    envs = {}
    while True:
        try:
            index, kind, arg = requests.recv()
        except EOFError:
            return
        answers.send(handle(envs, factory, step_timeout, index, kind, arg))
