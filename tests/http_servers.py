"""Environment servers for the HTTP tests, on loopback: vagen's own (`vagen.env_server`) in a thread of the test
process or in a process of its own (to be killed), and a small VAGEN-Lite-like server written here with the
standard library, whose answers are multipart bytes built by hand (so vagen's client is tested against the
protocol, not against vagen's own encoder)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import uvicorn
from PIL import Image


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, seconds: float = 60.0, process=None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer /health within {seconds} s")


class ServerThread:
    """An ASGI app under uvicorn in a thread of this process, on `port` (a free one by default)."""

    def __init__(self, app, port: int | None = None):
        self.app, self.port = app, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server thread did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def server_process(config: str, port: int, *args: str, env: dict | None = None):
    """`python -m vagen.env_server --config CONFIG --port PORT ARGS` until the block ends (or it is killed)."""
    process = subprocess.Popen([sys.executable, "-m", "vagen.env_server", "--config", config, "--port", str(port),
                                *args], env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process=process)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# --- a VAGEN-Lite-like server -----------------------------------------------------------------------------

SYSTEM_PROMPT = "You walk along a line. Answer <answer>Right</answer> to step right."


def frame(position: int) -> bytes:
    """The counter world's frame: an 8x8 RGBA square whose red channel says where the agent is (Lite's
    frames reach clients as PNG, decoded RGBA there)."""
    buffer = io.BytesIO()
    Image.new("RGBA", (8, 8), (position * 40 % 256, 10, 20, 255)).save(buffer, format="PNG")
    return buffer.getvalue()


def lite_multipart(data: dict, pngs: list[bytes], boundary: str = "gym_env_0f1e2d3c") -> tuple[bytes, str]:
    """The bytes VAGEN-Lite's encoder writes, spelled out here: the JSON part with its own Content-Type, then
    one image/png part per frame."""
    body = (b"--" + boundary.encode() + b"\r\n"
            b"Content-Disposition: form-data; name=\"data\"\r\n"
            b"Content-Type: application/json; charset=utf-8\r\n\r\n" + json.dumps(data).encode() + b"\r\n")
    for i, png in enumerate(pngs):
        body += (b"--" + boundary.encode() + b"\r\n"
                 + f"Content-Disposition: form-data; name=\"images\"; filename=\"{i}.png\"\r\n".encode()
                 + b"Content-Type: image/png\r\n\r\n" + png + b"\r\n")
    return body + b"--" + boundary.encode() + b"--\r\n", f"multipart/mixed; boundary=\"{boundary}\""


class LiteLikeServer:
    """A counter world behind VAGEN-Lite's routes: reset(seed) puts the agent at `seed`, `Right` moves it one
    step (reward 1), the episode is done after 3 steps. `requests` records (path, headers, raw body) of each
    request; `steps` the (session, action) of each step applied. Faults, set by the test: `forget` (every
    session unknown from now on: a restart), `drop_step` (the step number, counted over the server's life, whose
    answer is never sent: it is applied, then the connection closes), `busy` (503s still to answer),
    `wobble` (replayed observations differ: a server that is not deterministic), `fail_step` (the step number
    whose environment raises: 500 with its error)."""

    def __init__(self, api_key: str | None = None):
        self.api_key, self.sessions, self.requests, self.steps = api_key, {}, [], []
        self.forget, self.drop_step, self.busy, self.wobble, self.connects = False, None, 0, False, 0
        self.fail_step = None
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    self._json(200, {"ok": True, "service": "gym-env-service", "max_inflight": "unlimited"})
                else:
                    self._json(200, {"num_sessions": len(owner.sessions), "sessions": []})

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with owner.lock:
                    owner.requests.append((self.path, dict(self.headers), body))
                    answer = owner.answer(self.path, self.headers, body)
                if answer is None:  # the answer is lost on the way
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, data, pngs = answer
                if status != 200:
                    self._json(status, data)
                    return
                payload, content_type = lite_multipart(data, pngs)
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _json(self, status, data):
                payload = json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> LiteLikeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def json_part(headers, body: bytes) -> dict | None:
        """The JSON part of a request, found the way VAGEN-Lite's decoder finds it: by its Content-Type."""
        boundary = headers["Content-Type"].split("boundary=")[1].strip('"')
        for part in body.split(b"--" + boundary.encode())[1:-1]:
            head, _, payload = part.partition(b"\r\n\r\n")
            if b"Content-Type: application/json" in head:
                return json.loads(payload[:-2])
        return None

    def answer(self, path: str, headers, body: bytes):
        if self.api_key is not None and headers.get("X-API-Key") != self.api_key:
            return 401, {"detail": "invalid token"}, []
        if self.busy:
            self.busy -= 1
            return 503, {"detail": "server busy"}, []
        data = self.json_part(headers, body)
        if data is None:
            return 400, {"detail": "session_id required"}, []
        if path == "/connect":
            self.connects += 1
            session = f"s{self.connects}"
            position = int(data["seed"]) + (1000 * self.connects if self.wobble and self.connects > 1 else 0)
            self.sessions[session] = {"position": position, "steps": 0}
            return 200, {"session_id": session, "obs": f"[Initial Observation]:\n<image>\nYou are at {position}.",
                         "info": {}}, [frame(position)]
        state = None if self.forget else self.sessions.get(data.get("session_id"))
        if state is None:
            return 404, {"detail": "Session not found"}, []
        if data["method"] == "system_prompt":
            return 200, {"obs": SYSTEM_PROMPT}, []
        if data["method"] == "close":
            self.sessions.pop(data["session_id"])
            return 200, {"closed": True}, []
        action = data["params"]["action_str"]
        self.steps.append((data["session_id"], action))
        if self.fail_step is not None and len(self.steps) == self.fail_step:
            return 500, {"detail": "ValueError: the agent fell off the line"}, []
        state["steps"] += 1
        state["position"] += "Right" in action
        done = state["steps"] >= 3
        if self.drop_step is not None and len(self.steps) == self.drop_step:
            return None
        return 200, {"obs": f"You are at {state['position']}.\n<image>", "reward": 1.0, "done": done,
                     "info": {"success": done, "distance": 7 - state["position"]}}, [frame(state["position"])]
