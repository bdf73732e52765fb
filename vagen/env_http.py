"""Environments over HTTP (`env.backend=http`), in the protocol VAGEN-Lite's environment servers speak, and
the wire format shared with vagen's own server (`python -m vagen.env_server`).

The protocol (VAGEN-Lite's `vagen/envs_remote/`; `docs/environments.md` has the whole of it):
- `GET /health` (no key) answers JSON `{"ok": true, ...}`;
- `POST /connect {"env_config", "seed"}` opens a session (one episode) and answers `{"session_id", "obs",
  "info"}` with the first observation's frames;
- `POST /call {"session_id", "method", "params"}`, `method` one of `system_prompt` (`{"obs"}`), `reset`
  (params `{"seed"}`), `step` (params `{"action_str"}`, answered `{"obs", "reward", "done", "info"}`) and
  `close`;
- bodies are multipart: requests `multipart/form-data`, answers `multipart/mixed`; the first part is the
  JSON object and carries its own `Content-Type: application/json`, the frames follow as `image/png` parts
  in the order of the `<image>` placeholders of `obs`; parts are told apart by their Content-Type;
- a key, when the server has one, goes in the `X-API-Key` header (or `?token=`); 503 means busy (the
  request did not run), 404 an unknown session, 500 the environment's error.

The client (`HttpEnvWorkers`) holds `count` environments as sessions on the servers of `env.urls`, new
sessions going to the server with the fewest of this client's, and answers as `vagen.env_workers.EnvWorkers`
does (`reset`, `step`, `answers(block)`, `busy`, `close`), so the rollout cannot tell it from worker
processes. Each request runs in a thread of its own while the trainer goes on. Failures:
- a request that certainly did not run (connection refused, 503) is sent again after a backoff;
- a step is never sent twice to a session: when its session is lost (404: reaped while the episode was
  carried over an update, or the server restarted), the server is gone, or the answer never came, a new
  session (on any server) is reset to the same seed, the episode's responses are replayed and each
  observation checked against the one recorded (text and pixels), then the step runs there. A replayed
  observation that differs ends the episode with `ReplayMismatch`; `env.replay=false` (for servers that are
  not deterministic) ends it at once;
- the environment's own error (500) ends its episode with the server's text, as a local environment's would.
Each replay is logged on stderr. Sessions close at episode end (`done`), when their slot starts a new
episode, and at `close()`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image

from vagen.env_workers import Answer

PROTOCOL = "vagen-lite-gym/1"
# Sends of a request that certainly did not run (connection refused, 503), and the first wait between them
# (doubled each time, with jitter): about 4 s in all before the server counts as gone.
RETRIES = 4
BACKOFF = 0.25
# Seconds a server that refused connections is left out of new sessions.
DOWN_FOR = 30.0
# Replays of one request before its episode fails (a second server lost during the first replay, ...).
MAX_RECOVERIES = 2
# Seconds a session's close may take (best effort: a lost server's sessions are not waited for).
CLOSE_TIMEOUT = 5.0


class MultipartError(ValueError):
    """A body that is not the protocol's multipart: no boundary, no JSON part, JSON that does not parse."""


class ReplayMismatch(RuntimeError):
    """A replayed episode's observation differs from the one recorded: the server is not deterministic."""


# --- the wire format -------------------------------------------------------------------------------------


def png_bytes(image: Image.Image) -> bytes:
    """A frame as PNG. zlib level 1: on a 168x168 Sokoban frame 40 % faster to write than PIL's default level 6
    (about 3 ms less per step on the 2-core machine), for 6.5 KiB instead of 4.7 (benchmarks.md)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def encode_multipart(data: dict, images: list = (), boundary: str | None = None,
                     subtype: str = "form-data") -> tuple[bytes, str]:
    """`(body, content_type)`: the JSON part (with its own `Content-Type: application/json`), then one
    `image/png` part per image (PIL images, or PNG bytes as they are), in order."""
    boundary = boundary or f"gym_env_{uuid.uuid4().hex}"
    parts = [b"Content-Disposition: form-data; name=\"data\"\r\nContent-Type: application/json; charset=utf-8\r\n\r\n"
             + json.dumps(data, ensure_ascii=False).encode()]
    for i, image in enumerate(images):
        payload = image if isinstance(image, bytes) else png_bytes(image)
        parts.append(f"Content-Disposition: form-data; name=\"images\"; filename=\"{i}.png\"\r\n"
                     f"Content-Type: image/png\r\n\r\n".encode() + payload)
    dash = b"--" + boundary.encode()
    body = b"".join(dash + b"\r\n" + part + b"\r\n" for part in parts) + dash + b"--\r\n"
    return body, f"multipart/{subtype}; boundary=\"{boundary}\""


def boundary_of(content_type: str) -> str:
    """The boundary parameter of a multipart Content-Type header, or MultipartError."""
    kind, _, params = (content_type or "").partition(";")
    if not kind.strip().lower().startswith("multipart/"):
        raise MultipartError(f"Content-Type {content_type!r} is not multipart; the protocol sends "
                             f"multipart/form-data with a JSON part and image/png parts")
    for param in params.split(";"):
        name, _, value = param.strip().partition("=")
        if name.strip().lower() == "boundary" and value.strip().strip('"'):
            return value.strip().strip('"')
    raise MultipartError(f"Content-Type {content_type!r} has no boundary parameter")


def decode_multipart(body: bytes, content_type: str) -> tuple[dict, list[bytes]]:
    """`(data, pngs)` of a protocol body: the JSON object of the `application/json` part and the bytes of the
    `image/*` parts, in order; parts are classified by their Content-Type only, as VAGEN-Lite does (a part
    named `data` without one is read as JSON too). MultipartError for anything else."""
    dash = b"--" + boundary_of(content_type).encode()
    chunks = body.split(dash)
    if len(chunks) < 3 or not chunks[-1].startswith(b"--"):
        raise MultipartError(f"the body ({len(body)} bytes) has no closing boundary {dash.decode()}--")
    data, images = None, []
    for chunk in chunks[1:-1]:
        chunk = chunk[2:] if chunk.startswith(b"\r\n") else chunk
        head, sep, payload = chunk.partition(b"\r\n\r\n")
        if not sep:
            raise MultipartError("a part has no blank line between its headers and its body")
        payload = payload[:-2] if payload.endswith(b"\r\n") else payload
        headers = {}
        for line in head.decode("latin-1").split("\r\n"):
            name, colon, value = line.partition(":")
            if colon:
                headers[name.strip().lower()] = value.strip()
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        named_data = 'name="data"' in headers.get("content-disposition", "")
        if kind == "application/json" or (not kind and named_data and data is None):
            try:
                data = json.loads(payload.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise MultipartError(f"the JSON part does not parse: {err}") from None
            if not isinstance(data, dict):
                raise MultipartError(f"the JSON part is a {type(data).__name__}, not an object")
        elif kind.startswith("image/"):
            images.append(payload)
    if data is None:
        raise MultipartError("no part has Content-Type: application/json (the protocol's JSON part carries "
                             "its own Content-Type header)")
    return data, images


def decode_image(payload: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(payload))
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def image_digest(image: Image.Image) -> str:
    """The pixels of a frame, hashed: what a replayed observation is checked against."""
    return hashlib.sha256(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()[:16]


def json_safe(value):
    """`value` as JSON can carry it: tuples as lists, numpy as Python, keys as strings; PIL images (an info's
    recorded `frames`) and other objects dropped to their repr."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items() if k != "frames"}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return json_safe(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, bytes):
        return value.decode("latin-1")
    return repr(value)


def tuples(value):
    """Lists back to tuples, all the way down (a state key, hashable again after JSON)."""
    return tuple(tuples(v) for v in value) if isinstance(value, list) else value


def restore_info(info: dict) -> dict:
    info = dict(info)
    if isinstance(info.get("state_key"), list):
        info["state_key"] = tuples(info["state_key"])
    return info


# --- the client ------------------------------------------------------------------------------------------


class HttpError(Exception):
    """A request that failed. `ran`: False where it certainly did not run (connection refused, 503), True
    where it ran (an answer came), None where nobody knows (no answer). `status`: the HTTP status, if any."""

    def __init__(self, message: str, ran: bool | None, status: int | None = None):
        super().__init__(message)
        self.ran, self.status = ran, status


class _Session:
    """One episode on one server: its session, its seed, and what the server answered so far, to check a
    replay against (the observation's text and frame digests, per step)."""

    def __init__(self, url: str, session_id: str, seed: int):
        self.url, self.session_id, self.seed = url, session_id, seed
        self.observations: list[tuple[str, list[str]]] = []  # the reset's, then each step's
        self.texts: list[str] = []  # the responses stepped


class HttpEnvWorkers:
    """`env.backend=http`: `count` environments as sessions on the servers `urls` (VAGEN-Lite's protocol),
    `env_config` sent to each `/connect`. `api_key`: sent as `X-API-Key`; `replay`: whether a lost session is
    rebuilt by replay; `timeout`: seconds a request may wait for its answer. `example_factory`: makes the
    local environment `example()` returns (never stepped); None for servers of other projects, whose
    `prompt_format` (env.prompt_format) is all the run knows of them. Raises
    RuntimeError naming each server that does not answer `GET /health`."""

    what = "HTTP session"

    def __init__(self, urls: list[str], count: int, env_config: dict, *, api_key: str | None = None,
                 replay: bool = True, timeout: float = 120.0, env_name: str | None = None, example_factory=None,
                 prompt_format: str = "free_think", log=None):
        import httpx

        if not urls:
            raise ValueError("env.backend=http needs at least one server in env.urls, e.g. "
                             "env.urls=[http://127.0.0.1:8000]")
        self.urls = [url.rstrip("/") for url in urls]
        self.count, self.env_config, self.replay, self.timeout = count, dict(env_config), replay, timeout
        self.example_factory, self.example_env, self.prompt_format = example_factory, None, prompt_format
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        headers = {"X-API-Key": api_key} if api_key else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(timeout, connect=10.0),
                                   limits=httpx.Limits(max_connections=max(8, min(count, 256))))
        self.sessions: dict[int, _Session | None] = dict.fromkeys(range(count))
        self.down: dict[str, float] = {}
        self.connecting = dict.fromkeys(self.urls, 0)  # sessions being opened, per server
        self.replayed = 0  # episodes rebuilt in a new session
        self.lock = threading.Lock()
        self.ready: queue.Queue[Answer] = queue.Queue()
        self.in_flight = 0
        self.queued: dict[int, list] = {}  # requests of an environment waiting for its running one
        self.running: set[int] = set()
        try:
            for url in self.urls:
                self._check_health(url, env_name)
        except BaseException:
            self.client.close()
            raise
        self.pool = ThreadPoolExecutor(max_workers=max(1, min(count, 64)), thread_name_prefix="env-http")

    @classmethod
    def from_config(cls, cfg_env, count: int) -> HttpEnvWorkers:
        from vagen.env_workers import EnvFactory, env_params

        api_key = None
        if cfg_env.api_key_env:
            api_key = os.environ.get(cfg_env.api_key_env)
            if not api_key:
                raise RuntimeError(f"env.api_key_env={cfg_env.api_key_env}: that environment variable is not set "
                                   f"(or empty); export it with the server's key, or set env.api_key_env=null for a "
                                   f"server without one")
        env_config = dict(cfg_env.remote_config) if cfg_env.remote_config else env_params(cfg_env)
        foreign = bool(cfg_env.remote_config)  # a server of another project: env.name is only a label then
        return cls(list(cfg_env.urls), count, env_config, api_key=api_key, replay=cfg_env.replay,
                   timeout=cfg_env.http_timeout, env_name=None if foreign else cfg_env.name,
                   example_factory=None if foreign else EnvFactory(cfg_env), prompt_format=cfg_env.prompt_format)

    def _check_health(self, url: str, env_name: str | None) -> None:
        try:
            response = self.client.get(f"{url}/health", timeout=10.0)
            health = response.json()
        except Exception as err:
            raise RuntimeError(f"env.urls: {url} does not answer GET /health ({type(err).__name__}: {err}); start "
                               f"the server (python -m vagen.env_server --config NAME --port P) or fix the "
                               f"address") from None
        if response.status_code != 200 or not isinstance(health, dict) or health.get("ok") is not True:
            raise RuntimeError(f"env.urls: {url}/health answered {response.status_code} {str(health)[:200]}, "
                               f"not {{\"ok\": true}}: is it an environment server?")
        served = health.get("env")
        if env_name is not None and served is not None and served != env_name:
            raise RuntimeError(f"env.urls: {url} serves env {served!r}, but env.name={env_name!r}; point env.urls "
                               f"at a server of {env_name} (python -m vagen.env_server --config ...)")

    # -- the worker protocol ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.count

    def example(self):
        """An environment of the kind the servers hold, built here once (its prompt format and graded
        fields; never stepped); for a server of another project a stand-in whose states are not graded (its
        `info` carries no state scores)."""
        if self.example_env is None:
            if self.example_factory is None:
                from types import SimpleNamespace

                self.example_env = SimpleNamespace(prompt_format=self.prompt_format, state_weights=None)
            else:
                self.example_env = self.example_factory()
        return self.example_env

    def reset(self, index: int, seed: int) -> None:
        self._submit(index, "reset", seed)

    def step(self, index: int, text: str) -> None:
        self._submit(index, "step", text)

    def check_idle(self) -> None:
        """Nothing to replace before a rollout: a session its server lost while idle (reaped, or the server
        restarted) answers its next request with 404 or not at all, and is replayed in a new session then."""

    def busy(self) -> bool:
        with self.lock:
            return self.in_flight > 0 or not self.ready.empty()

    def answers(self, block: bool = False, timeout: float | None = None) -> list[Answer]:
        """The answers that arrived; with `block`, at least one when any request is still running, or none
        once `timeout` seconds have passed (None: until one comes; each request has its own env.http_timeout)."""
        out = []
        if block and self.busy():
            try:
                out.append(self.ready.get(timeout=timeout))
            except queue.Empty:
                return out
        while True:
            try:
                out.append(self.ready.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        for index, session in self.sessions.items():
            if session is not None:
                self._close_session(session)
                self.sessions[index] = None
        self.client.close()
        if self.example_env is not None and hasattr(self.example_env, "close"):
            self.example_env.close()

    # -- requests in threads, one at a time per environment -------------------------------------------------

    def _submit(self, index: int, kind: str, arg) -> None:
        with self.lock:
            self.in_flight += 1
            if index in self.running:
                self.queued.setdefault(index, []).append((kind, arg))
                return
            self.running.add(index)
        self.pool.submit(self._run, index, kind, arg)

    def _run(self, index: int, kind: str, arg) -> None:
        try:
            answer = self._reset(index, arg) if kind == "reset" else self._step(index, arg)
        except Exception as err:  # a bug here must still answer, or the rollout would wait forever
            answer = Answer(index, kind, error=f"{type(err).__name__}: {err}")
        with self.lock:
            self.in_flight -= 1
            self.ready.put(answer)
            waiting = self.queued.get(index)
            if waiting:
                self.pool.submit(self._run, index, *waiting.pop(0))
            else:
                self.running.discard(index)

    def _reset(self, index: int, seed: int) -> Answer:
        old = self.sessions[index]
        if old is not None:
            self.sessions[index] = None
            self._close_session(old)
        try:
            session, (obs, info, system_prompt) = self._connect(seed)
        except HttpError as err:
            return Answer(index, "reset", error=str(err))
        self.sessions[index] = session
        self._opened(session.url)
        return Answer(index, "reset", (obs, info, system_prompt))

    def _step(self, index: int, text: str) -> Answer:
        session = self.sessions[index]
        if session is None:
            return Answer(index, "step", error="HttpSessionClosed: step sent to an environment whose session has "
                                               "closed (its episode ended); reset it first")
        for attempt in range(MAX_RECOVERIES + 1):
            try:
                value = self._call_step(session, text)
                break
            except HttpError as err:
                if err.ran or attempt == MAX_RECOVERIES:  # the episode ends here: so does its session
                    self.sessions[index] = None
                    self._close_session(session)
                    return Answer(index, "step", error=str(err))
                lost = str(err)
            if not self.replay:
                self.sessions[index] = None
                return Answer(index, "step", error=f"HttpSessionLost: {lost}; env.replay=false, so the episode "
                                                   f"ends (set env.replay=true for a deterministic server)")
            try:
                session = self._rebuild(index, session, lost)
            except (HttpError, ReplayMismatch) as err:
                self.sessions[index] = None
                return Answer(index, "step", error=f"{type(err).__name__}: {err}")
        obs, reward, terminated, truncated, info = value
        session.texts.append(text)
        session.observations.append((obs.text, [image_digest(image) for image in obs.images]))
        if terminated or truncated:
            self.sessions[index] = None
            self._close_session(session)
        return Answer(index, "step", value)

    def _rebuild(self, index: int, lost: _Session, why: str) -> _Session:
        """A new session for `lost`'s episode: reset to its seed and its responses replayed, each observation
        checked against the recorded one. Raises ReplayMismatch or HttpError."""
        t0 = time.perf_counter()
        self._close_session(lost)
        session, (obs, _, _) = self._connect(lost.seed, avoid=lost.url)
        try:
            self._replay(index, lost, session, obs)
        finally:
            self._opened(session.url)
        self.log(f"env http: environment {index}'s session on {lost.url} was lost ({why}); its episode (seed "
                 f"{lost.seed}, {len(lost.texts)} steps) was replayed in a new session on {session.url} in "
                 f"{time.perf_counter() - t0:.2f} s")
        return session

    def _replay(self, index: int, lost: _Session, session: _Session, obs) -> None:
        observed = [(obs.text, [image_digest(image) for image in obs.images])]
        if observed[0] != lost.observations[0]:
            self._close_session(session)
            raise ReplayMismatch(_mismatch(0, lost.observations[0], observed[0], lost.seed))
        for text in lost.texts:
            obs = self._call_step(session, text)[0]
            observed.append((obs.text, [image_digest(image) for image in obs.images]))
            step = len(observed) - 1
            if observed[-1] != lost.observations[step]:
                self._close_session(session)
                raise ReplayMismatch(_mismatch(step, lost.observations[step], observed[-1], lost.seed))
        session.texts, session.observations = list(lost.texts), observed
        self.sessions[index] = session
        with self.lock:
            self.replayed += 1

    # -- the protocol's requests --------------------------------------------------------------------------

    def _pick(self, avoid: str | None = None) -> str:
        """The server for a new session, counted as being opened there until `_opened`: of those not refusing
        connections, the one holding (or opening) the fewest of this client's sessions (the first in env.urls on
        a tie); `avoid` only when it is the only one."""
        now = time.monotonic()
        with self.lock:
            held = dict(self.connecting)
            for session in self.sessions.values():
                if session is not None and session.url in held:
                    held[session.url] += 1
            up = [url for url in self.urls if self.down.get(url, 0.0) <= now]
            candidates = [url for url in up if url != avoid] or up or [url for url in self.urls if url != avoid] \
                or self.urls
            url = min(candidates, key=lambda url: (held[url], self.urls.index(url)))
            self.connecting[url] += 1
        return url

    def _opened(self, url: str) -> None:
        with self.lock:
            self.connecting[url] -= 1

    def _connect(self, seed: int, avoid: str | None = None) -> tuple[_Session, tuple]:
        """A new session reset to `seed` on a server `_pick` chooses (another one where that one is gone):
        `(session, (obs, info, system_prompt))`."""
        tried = []
        for _ in range(len(self.urls) + 1):
            url = self._pick(avoid)
            try:
                data, images = self._post(url, "/connect", {"env_config": self.env_config, "seed": int(seed),
                                                            "client_request_id": uuid.uuid4().hex})
            except HttpError as err:
                self._opened(url)
                tried.append(f"{url}: {err}")
                if err.ran:
                    raise
                avoid = url
                continue
            try:
                return self._opening(url, seed, data, images)
            except BaseException:
                self._opened(url)
                raise
        raise HttpError("HttpServersGone: no server of env.urls opened a session: " + "; ".join(tried), ran=None)

    def _opening(self, url: str, seed: int, data: dict, images: list[bytes]) -> tuple[_Session, tuple]:
        """`_connect`'s session from the server's answer (and its system prompt, where the answer has none)."""
        if "session_id" not in data:
            raise HttpError(f"HttpProtocolError: {url}/connect answered without a session_id: {str(data)[:200]}",
                            ran=True)
        session = _Session(url, str(data["session_id"]), int(seed))
        obs = _observation(data, images, f"{url}/connect")
        system_prompt = data.get("system_prompt")
        if system_prompt is None:  # a VAGEN-Lite server: its own request
            prompt, prompt_images = self._post(url, "/call", {"session_id": session.session_id,
                                                              "method": "system_prompt", "params": {}})
            if prompt_images:
                raise HttpError(f"HttpProtocolError: {url}'s system prompt has {len(prompt_images)} images; vagen "
                                f"takes a text-only system prompt", ran=True)
            system_prompt = prompt.get("obs", "")
        session.observations.append((obs.text, [image_digest(image) for image in obs.images]))
        return session, (obs, restore_info(data.get("info") or {}), str(system_prompt))

    def _call_step(self, session: _Session, text: str) -> tuple:
        data, images = self._post(session.url, "/call", {"session_id": session.session_id, "method": "step",
                                                         "params": {"action_str": text}}, step=True)
        obs = _observation(data, images, f"{session.url}/call step")
        info = restore_info(data.get("info") or {})
        done = bool(data.get("done", False))
        terminated = bool(info.pop("terminated", done))
        truncated = bool(info.pop("truncated", False))
        return obs, float(data.get("reward", 0.0)), terminated, truncated, info

    def _close_session(self, session: _Session) -> None:
        """Best effort: a session that is gone already (reaped, its server lost) needs no closing."""
        try:
            self._post(session.url, "/call", {"session_id": session.session_id, "method": "close", "params": {}},
                       retries=0, timeout=CLOSE_TIMEOUT)
        except HttpError:
            pass

    def _post(self, url: str, path: str, data: dict, step: bool = False, retries: int = RETRIES,
              timeout: float | None = None) -> tuple:
        """`(data, pngs)` of one request, sent again (after a backoff) only while it certainly did not run.
        HttpError otherwise: `ran` False (not run: refused, 503 to the end, or 404 for a step, whose session
        is gone), True (the server ran it and answered an error), None (no answer: it may have run)."""
        import httpx

        body, content_type = encode_multipart(data)
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(BACKOFF * 2 ** (attempt - 1) * random.uniform(0.8, 1.2))
            try:
                response = self.client.post(f"{url}{path}", content=body, headers={"Content-Type": content_type},
                                            **({"timeout": timeout} if timeout else {}))
            except httpx.ConnectError as err:
                problem = HttpError(f"HttpServerGone: {url} refused the connection ({err})", ran=False)
                self.down[url] = time.monotonic() + DOWN_FOR
                continue
            except httpx.TransportError as err:  # sent, and no answer: it may have run
                raise HttpError(f"HttpNoAnswer: {url}{path} gave no answer ({type(err).__name__}: {err})",
                                ran=None) from None
            self.down.pop(url, None)
            if response.status_code == 503:
                problem = HttpError(f"HttpBusy: {url}{path} answered 503 ({_detail(response)}) {attempt + 1} times",
                                    ran=False, status=503)
                continue
            if response.status_code == 404 and step:
                raise HttpError(f"HttpSessionLost: {url} no longer knows session {data.get('session_id')} (404: "
                                f"reaped after its idle timeout, or the server restarted)", ran=False, status=404)
            if response.status_code in (502, 504):  # a proxy's: the server may have run it
                raise HttpError(f"HttpNoAnswer: {url}{path} answered {response.status_code} ({_detail(response)})",
                                ran=None, status=response.status_code)
            if response.status_code != 200:
                raise HttpError(f"HttpEnvError: {url}{path} answered {response.status_code}: {_detail(response)}",
                                ran=True, status=response.status_code)
            try:
                return decode_multipart(response.content, response.headers.get("content-type", ""))
            except MultipartError as err:
                raise HttpError(f"HttpProtocolError: {url}{path}'s answer: {err}", ran=True) from None
        raise problem


def _detail(response) -> str:
    try:
        detail = response.json().get("detail", response.text)
    except Exception:
        detail = response.text
    return str(detail)[:500]


def _observation(data: dict, images: list[bytes], where: str):
    from envs_visual import Observation

    text = data.get("obs")
    if not isinstance(text, str):
        raise HttpError(f"HttpProtocolError: {where} answered no obs text: {str(data)[:200]}", ran=True)
    frames = [decode_image(payload) for payload in images]
    if text.count("<image>") != len(frames):
        raise HttpError(f"HttpProtocolError: {where}'s obs has {text.count('<image>')} <image> placeholders and "
                        f"{len(frames)} image parts; they must match", ran=True)
    return Observation(text, frames)


def _mismatch(step: int, recorded: tuple, replayed: tuple, seed: int) -> str:
    what = "text" if recorded[0] != replayed[0] else "frames"
    where = "the reset" if step == 0 else f"step {step}"
    return (f"replaying the episode of seed {seed} in a new session, the observation after {where} differs from the "
            f"one recorded ({what}: {str(recorded[0] if what == 'text' else recorded[1])[:120]!r} recorded, "
            f"{str(replayed[0] if what == 'text' else replayed[1])[:120]!r} replayed); the server is not "
            f"deterministic given the seed and the responses: set env.replay=false to end such episodes instead")
