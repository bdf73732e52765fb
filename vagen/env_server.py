"""Serve a vagen environment over HTTP, in the protocol VAGEN-Lite's environment servers speak
(`vagen.env_http` describes it), so that other trainers (VAGEN-Lite's `RemoteEnv`, vagen's own
`env.backend=http`) can play it:

    pip install -e ".[http]"
    python -m vagen.env_server --config sokoban_visual [env.params.dim_room=[8,8] ...] --host 127.0.0.1 --port 8000

`--config` (and its overrides) fixes the environment and its parameters; a session's `/connect` may change
the parameters of its own environment (`env_config`, checked against the environment's: 400 naming them).
Sessions are environments of `vagen.env_workers.EnvWorkers` (`--workers` processes), so a step past
`env.step_timeout` ends its episode with an error and a worker that dies is replaced, its other sessions
rebuilt by replay. Answers carry the observation's text in `obs`, its frames as PNG parts in `<image>`
order, and `info` as JSON (tuples as lists, numpy as numbers, `terminated` and `truncated` added).

Admission: `--api-key-env VAR` requires the key in that variable (`X-API-Key` header or `?token=`; 401
without one, 403 for a wrong one, before anything reaches an environment); `--max-sessions` open sessions
and `--max-inflight` requests at once (a request waits 5 s for its turn), 503 past them; sessions idle for
`--session-timeout` s are closed; bodies over `--max-request-mb` get 413, malformed ones 400. It binds
127.0.0.1 unless `--host` says otherwise.
"""

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import queue
import sys
import threading
import time
import uuid
from collections import deque

import envs_visual
from vagen.env_http import PROTOCOL, MultipartError, decode_multipart, encode_multipart, json_safe
from vagen.env_workers import EnvWorkers, env_params

ADMIT_TIMEOUT = 5.0  # seconds a request waits for one of --max-inflight before it gets 503
METHODS = ("system_prompt", "reset", "step", "close")


class EnvConfigError(ValueError):
    """A session's env_config that the environment does not take."""


class SessionEnv:
    """The environment of one session slot: reset with `(env_config as JSON, seed)`, it is made again when the
    session's parameters differ from those it was made with (kept across sessions otherwise)."""

    def __init__(self, name: str, base: dict):
        self.name, self.base, self.env, self.made_with = name, base, None, None

    def reset(self, seed):
        config, seed = seed
        if config != self.made_with:
            self.close()
            try:
                self.env = envs_visual.make(self.name, **{**self.base, **json.loads(config)})
            except Exception as err:
                raise EnvConfigError(f"env {self.name!r} cannot be made with env_config {config}: "
                                     f"{type(err).__name__}: {err}") from None
            self.made_with = config
        return self.env.reset(seed=seed)

    def step(self, text: str):
        return self.env.step(text)

    def system_prompt(self) -> str:
        return self.env.system_prompt()

    def close(self) -> None:
        if self.env is not None and hasattr(self.env, "close"):
            self.env.close()
        self.env, self.made_with = None, None


class SessionEnvFactory:
    """A picklable maker of `SessionEnv`s, for the worker processes."""

    def __init__(self, name: str, base: dict):
        self.name, self.base = name, base

    def __call__(self) -> SessionEnv:
        return SessionEnv(self.name, self.base)


class Dispatcher:
    """The one thread that talks to `EnvWorkers` (which is not thread-safe): requests from the event loop go
    in through a queue, answers come back to their futures, in order per slot."""

    def __init__(self, workers: EnvWorkers):
        self.workers, self.inbox = workers, queue.Queue()
        self.waiting: dict[int, deque] = {}
        self.thread = threading.Thread(target=self._loop, name="env-dispatcher", daemon=True)
        self.thread.start()

    def submit(self, index: int, kind: str, arg) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.inbox.put((index, kind, arg, future, loop))
        return future

    def stop(self) -> None:
        self.inbox.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            try:  # while environments step, look for their answers every millisecond
                item = self.inbox.get(timeout=0.001 if self.workers.busy() else 0.5)
            except queue.Empty:
                item = False
            while item is not False:
                if item is None:
                    return
                index, kind, arg, future, loop = item
                self.waiting.setdefault(index, deque()).append((future, loop))
                (self.workers.reset if kind == "reset" else self.workers.step)(index, arg)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = False
            for answer in self.workers.answers(block=False):
                future, loop = self.waiting[answer.index].popleft()
                loop.call_soon_threadsafe(_resolve, future, answer)


def _resolve(future: asyncio.Future, answer) -> None:
    if not future.done():
        future.set_result(answer)


class Session:
    def __init__(self, index: int, config: str):
        self.id, self.index, self.config = uuid.uuid4().hex, index, config
        self.created = self.last_access = time.time()
        self.system_prompt, self.in_flight = "", 0


def build_app(cfg, *, api_key: str | None = None, max_sessions: int = 128, max_inflight: int = 0,
              session_timeout: float = 3600.0, workers: int = 2, max_request_bytes: int = 16 << 20):
    """The FastAPI application serving `cfg.env`'s environment (its worker processes start with the app)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import JSONResponse, Response

    name, base = cfg.env.name, env_params(cfg.env)
    accepted = sorted(envs_visual.parameters(name))
    gate = asyncio.Semaphore(max_inflight) if max_inflight > 0 else None
    state = {"sessions": {}, "free": list(range(max_sessions)), "envs_reached": 0, "gate": gate}
    sessions: dict[str, Session] = state["sessions"]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        pool = EnvWorkers(SessionEnvFactory(name, base), max_sessions, workers, cfg.env.step_timeout)
        state["dispatcher"], state["loop"] = Dispatcher(pool), asyncio.get_running_loop()
        reaper = asyncio.create_task(reap())
        try:
            yield
        finally:
            reaper.cancel()
            state["dispatcher"].stop()
            pool.close()

    app = FastAPI(title=f"vagen environment server: {name}", lifespan=lifespan)
    app.state.vagen = state

    async def reap() -> None:
        while True:
            await asyncio.sleep(max(0.05, min(60.0, session_timeout / 4)))
            now = time.time()
            for session in list(sessions.values()):
                if session.in_flight == 0 and now - session.last_access > session_timeout:
                    close(session)

    def close(session: Session) -> None:
        if sessions.pop(session.id, None) is not None:
            state["free"].append(session.index)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("x-api-key") or request.query_params.get("token")
        if not given:
            raise HTTPException(401, "this server needs a key: send it in the X-API-Key header or as ?token=")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise HTTPException(403, "wrong key")

    async def read(request: Request) -> dict:
        """The JSON part of a request's multipart body (its image parts are not used by any method)."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_request_bytes:
            raise HTTPException(413, f"the body has {length} bytes; this server takes at most {max_request_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_request_bytes:
                raise HTTPException(413, f"the body has more than {max_request_bytes} bytes, the most this server "
                                         f"takes")
        try:
            data, _ = decode_multipart(bytes(body), request.headers.get("content-type", ""))
        except MultipartError as err:
            raise HTTPException(400, f"malformed request: {err}") from None
        return data

    @contextlib.asynccontextmanager
    async def admitted():
        if gate is None:
            yield
            return
        try:
            await asyncio.wait_for(gate.acquire(), ADMIT_TIMEOUT)
        except asyncio.TimeoutError:
            raise HTTPException(503, f"server busy: {max_inflight} requests running (--max-inflight) for "
                                     f"{ADMIT_TIMEOUT} s") from None
        try:
            yield
        finally:
            gate.release()

    async def run(session: Session, kind: str, arg):
        session.in_flight += 1
        state["envs_reached"] += 1
        try:
            return await state["dispatcher"].submit(session.index, kind, arg)
        finally:
            session.in_flight -= 1
            session.last_access = time.time()

    def answer(data: dict, images=()) -> Response:
        body, content_type = encode_multipart(data, list(images), subtype="mixed")
        return Response(content=body, media_type=content_type)

    async def observation(data: dict, obs) -> Response:
        # PNG encoding in a thread: the event loop goes on reading other sessions' requests meanwhile
        return await asyncio.to_thread(answer, {"obs": obs.text, **data}, obs.images)

    async def reset(session: Session, seed: int):
        result = await run(session, "reset", (session.config, seed))
        if result.error is not None:
            status = 400 if result.error.startswith("EnvConfigError") else 500
            raise HTTPException(status, result.error)
        obs, info, session.system_prompt = result.value
        return obs, json_safe(info)

    @app.get("/health")
    async def health():
        return {"ok": True, "service": "gym-env-service", "protocol": PROTOCOL, "env": name,
                "max_inflight": max_inflight or "unlimited", "max_sessions": max_sessions,
                "session_timeout": session_timeout}

    @app.get("/sessions")
    async def list_sessions(request: Request):
        check_key(request)
        now = time.time()
        return {"num_sessions": len(sessions), "max_sessions": max_sessions, "session_timeout": session_timeout,
                "sessions": [{"session_id": s.id, "created_at": s.created, "last_access": s.last_access,
                              "idle_seconds": now - s.last_access,
                              "will_timeout_in": session_timeout - (now - s.last_access)} for s in sessions.values()]}

    @app.post("/connect")
    async def connect(request: Request):
        check_key(request)
        data = await read(request)
        env_config, seed = data.get("env_config") or {}, data.get("seed")
        if not isinstance(env_config, dict):
            raise HTTPException(400, f"env_config must be an object of {name}'s parameters, got {env_config!r}")
        for key in env_config:
            if key not in accepted:
                raise HTTPException(400, str(envs_visual.closest_choice_error(f"parameter of env '{name}'", key,
                                                                             accepted)))
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise HTTPException(400, f"seed must be an integer, got {seed!r}")
        async with admitted():
            if not state["free"]:
                raise HTTPException(503, f"server busy: {max_sessions} sessions open (--max-sessions); close one "
                                         f"or wait for idle ones to time out")
            session = Session(state["free"].pop(), json.dumps(env_config, sort_keys=True))
            sessions[session.id] = session
            try:
                obs, info = await reset(session, 0 if seed is None else seed)
            except BaseException:
                close(session)
                raise
        if seed is None:
            return answer({"session_id": session.id})
        return await observation({"session_id": session.id, "info": info, "system_prompt": session.system_prompt}, obs)

    @app.post("/call")
    async def call(request: Request):
        check_key(request)
        data = await read(request)
        session_id, method, params = data.get("session_id"), data.get("method"), data.get("params") or {}
        if not isinstance(session_id, str) or not session_id:
            raise HTTPException(400, "session_id required (from POST /connect)")
        if method not in METHODS:
            raise HTTPException(400, f"method {method!r} is not one of {', '.join(METHODS)}")
        if not isinstance(params, dict):
            raise HTTPException(400, f"params must be an object, got {params!r}")
        session = sessions.get(session_id)
        if session is None:
            raise HTTPException(404, f"unknown session {session_id[:64]!r} (closed, timed out after "
                                     f"{session_timeout} s idle, or opened before this server started)")
        session.last_access = time.time()
        if method == "close":
            close(session)
            return answer({"closed": True})
        if method == "system_prompt":
            return answer({"obs": session.system_prompt})
        async with admitted():
            if method == "reset":
                seed = params.get("seed", 0)
                if isinstance(seed, bool) or not isinstance(seed, int):
                    raise HTTPException(400, f"params.seed must be an integer, got {seed!r}")
                obs, info = await reset(session, seed)
                return await observation({"info": info}, obs)
            text = params.get("action_str")
            if not isinstance(text, str):
                raise HTTPException(400, f"params.action_str must be the response text, got {text!r}")
            result = await run(session, "step", text)
        if result.error is not None:
            return JSONResponse({"detail": result.error}, status_code=500)
        obs, reward, terminated, truncated, info = result.value
        info = {**json_safe(info), "terminated": bool(terminated), "truncated": bool(truncated)}
        return await observation({"reward": float(reward), "done": bool(terminated or truncated), "info": info}, obs)

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vagen.env_server", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the environment config (a name in configs/ or a path)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides of the config (env.params...)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key-env", default=None,
                        help="name of the environment variable holding the key clients must send (X-API-Key)")
    parser.add_argument("--max-sessions", type=int, default=128, help="open sessions at most (503 past them)")
    parser.add_argument("--max-inflight", type=int, default=0,
                        help="requests running at once at most (503 after a 5 s wait); 0 = unlimited")
    parser.add_argument("--session-timeout", type=float, default=3600.0,
                        help="seconds a session may stay idle before it is closed")
    parser.add_argument("--workers", type=int, default=None,
                        help="environment worker processes (default: env.workers of the config, at least 1)")
    parser.add_argument("--max-request-mb", type=float, default=16.0, help="largest request body (413 past it)")
    args = parser.parse_args(argv)

    from vagen.config import load_config_or_exit

    cfg = load_config_or_exit(args.config, args.overrides)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            print(f"vagen.env_server: --api-key-env {args.api_key_env}: that environment variable is not set (or "
                  f"empty); export the key there", file=sys.stderr)
            return 2
    for flag, value in (("--max-sessions", args.max_sessions), ("--max-request-mb", args.max_request_mb),
                        ("--session-timeout", args.session_timeout)):
        if not value > 0:
            print(f"vagen.env_server: {flag}={value} must be > 0", file=sys.stderr)
            return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        print(f"vagen.env_server: warning: binding {args.host} without --api-key-env: anyone who reaches this port "
              f"can step the environments", file=sys.stderr)
    import uvicorn

    workers = args.workers if args.workers is not None else max(1, cfg.env.workers)
    app = build_app(cfg, api_key=api_key, max_sessions=args.max_sessions, max_inflight=args.max_inflight,
                    session_timeout=args.session_timeout, workers=workers,
                    max_request_bytes=int(args.max_request_mb * (1 << 20)))
    print(f"vagen.env_server: serving {cfg.env.name} ({args.config}) on http://{args.host}:{args.port} "
          f"({workers} worker processes)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    # the module's own copy, not __main__'s: the worker processes unpickle SessionEnvFactory from vagen.env_server
    from vagen.env_server import main as serve_main

    sys.exit(serve_main())
