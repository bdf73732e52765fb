"""Environments over HTTP: vagen's server (`vagen.env_server`) answers VAGEN-Lite's protocol byte for byte,
vagen's client (`env.backend=http`, `vagen.env_http.HttpEnvWorkers`) plays a VAGEN-Lite-like server whose
answers are built by hand, and the faults (a lost answer, a restarted server, a reaped session, a busy or
missing server, a server that is not deterministic, a wrong key, malformed bodies) end or recover as documented.
Every server listens on loopback."""

import io
import json
import random
import re
import time

import httpx
import pytest
from http_servers import SYSTEM_PROMPT, LiteLikeServer, ServerThread, free_port
from PIL import Image

from vagen.config import load_config
from vagen.env_http import HttpEnvWorkers, decode_multipart, encode_multipart
from vagen.env_server import build_app
from vagen.env_workers import EnvFactory, EnvWorkers, env_params

SCRIPT = ["<think>go</think><answer>Left, Up</answer>", "<think>go</think><answer>Down</answer>",
          "<think>go</think><answer>Right, Right</answer>", "no answer tags"]


def sokoban():
    return load_config("sokoban_visual", ["env.backend=http", "env.urls=[http://127.0.0.1:1]"])


@pytest.fixture(scope="module")
def shared():
    """One server for the tests that need no setting of their own (its start, a worker process, costs seconds):
    64 sessions and 64 requests at once at most, bodies up to 64 KiB."""
    app = build_app(sokoban(), workers=2, max_sessions=64, max_inflight=64, max_request_bytes=1 << 16)
    with ServerThread(app) as server:
        server.state = app.state.vagen
        warm = client([server.url], 2)  # a session in each worker: both processes started and imported
        try:
            warm.reset(0, 1)
            warm.reset(1, 2)
            assert all(answer.error is None for answer in collect(warm, 2))
        finally:
            warm.close()
        yield server


def served(cfg=None, port=None, **kwargs):
    kwargs.setdefault("workers", 1)
    return ServerThread(build_app(cfg or sokoban(), **kwargs), port)


def client(urls, count, cfg=None, log=None, **kwargs):
    cfg = cfg or sokoban()
    return HttpEnvWorkers(urls, count, env_params(cfg.env), env_name=cfg.env.name, log=log, **kwargs)


def collect(pool, n):
    answers = []
    while len(answers) < n:
        answers += pool.answers(block=True)
    return sorted(answers, key=lambda a: a.index)


def record(answer):
    """An answer as plain data: the error, or the observation's text and pixels, reward, flags and info."""
    if answer.error is not None:
        return answer.error
    obs, *rest = answer.value
    return obs.text, [(image.mode, image.size, image.tobytes()) for image in obs.images], rest


def play(pool, seeds, script=SCRIPT, between=None):
    """Each environment reset to its seed, then stepped with `script` turn by turn; `between(turn)` runs after
    each turn's steps are sent. Returns each environment's answers."""
    played = {i: [] for i in range(len(seeds))}
    for i, seed in enumerate(seeds):
        pool.reset(i, seed)
    for answer in collect(pool, len(seeds)):
        played[answer.index].append(record(answer))
    active = list(range(len(seeds)))
    for turn, text in enumerate(script):
        for i in active:
            pool.step(i, text)
        if between is not None:
            between(turn)
        for answer in collect(pool, len(active)):
            played[answer.index].append(record(answer))
            if answer.error is not None or answer.value[2] or answer.value[3]:
                active.remove(answer.index)
    return played


def parts(body: bytes, content_type: str) -> list[tuple[str, bytes]]:
    """A multipart body split by hand: (the part's headers, its payload), in order."""
    boundary = re.search(r'boundary="?([^";]+)"?', content_type).group(1).encode()
    assert body.endswith(b"--" + boundary + b"--\r\n"), body[-80:]
    out = []
    for chunk in body.split(b"--" + boundary)[1:-1]:
        head, _, payload = chunk[2:].partition(b"\r\n\r\n")
        out.append((head.decode(), payload[:-2]))
    return out


def test_a_connect_and_a_step_sent_as_hand_built_multipart_are_answered_with_png_parts_per_image(shared):
    boundary = b"gym_env_5a5a5a5a"

    def body(data: bytes) -> bytes:
        return (b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"data\"\r\n"
                b"Content-Type: application/json; charset=utf-8\r\n\r\n" + data + b"\r\n--" + boundary + b"--\r\n")

    headers = {"Content-Type": "multipart/form-data; boundary=\"gym_env_5a5a5a5a\""}
    server = shared
    connected = httpx.post(f"{server.url}/connect", headers=headers,
                           content=body(b'{"env_config": {"dim_room": [6, 6]}, "seed": 7}'))
    assert connected.status_code == 200, connected.text
    assert connected.headers["content-type"].startswith("multipart/mixed; boundary=")
    (head, payload), *images = parts(connected.content, connected.headers["content-type"])
    assert "Content-Type: application/json" in head
    first = json.loads(payload)
    assert first["obs"].count("<image>") == len(images) == 1 and first["info"]["success"] is False
    session = first["session_id"]
    stepped = httpx.post(f"{server.url}/call", headers=headers, content=body(json.dumps(
        {"session_id": session, "method": "step", "params": {"action_str": SCRIPT[0]}}).encode()))
    assert stepped.status_code == 200, stepped.text
    (head, payload), *images = parts(stepped.content, stepped.headers["content-type"])
    data = json.loads(payload)
    assert head.index("Content-Type: application/json") >= 0 and data["obs"].count("<image>") == len(images) == 1
    for image_head, png in images:
        assert "Content-Type: image/png" in image_head and png.startswith(b"\x89PNG\r\n\x1a\n")
        assert Image.open(io.BytesIO(png)).size == (168, 168)  # 6x6 cells of 28 pixels
    assert set(data) == {"obs", "reward", "done", "info"} and data["done"] is False
    assert data["info"]["terminated"] is False and data["info"]["truncated"] is False
    assert data["info"]["actions"] == ["Left", "Up"] and isinstance(data["info"]["state_key"], list)
    # the answer is the local environment's, step for step
    cfg = sokoban()
    local = EnvFactory(cfg.env)()
    obs, _ = local.reset(seed=7)
    obs, reward, *_ = local.step(SCRIPT[0])
    assert data["obs"] == obs.text and data["reward"] == reward
    assert Image.open(io.BytesIO(images[0][1])).tobytes() == obs.images[0].tobytes()
    prompt = httpx.post(f"{server.url}/call", headers=headers, content=body(json.dumps(
        {"session_id": session, "method": "system_prompt", "params": {}}).encode()))
    assert json.loads(parts(prompt.content, prompt.headers["content-type"])[0][1])["obs"] == local.system_prompt()
    again = httpx.post(f"{server.url}/call", headers=headers, content=body(json.dumps(
        {"session_id": session, "method": "reset", "params": {"seed": 7}}).encode()))
    (head, payload), *images = parts(again.content, again.headers["content-type"])
    assert json.loads(payload)["obs"] == first["obs"] and len(images) == 1  # the level of /connect's seed again
    closed = httpx.post(f"{server.url}/call", headers=headers, content=body(json.dumps(
        {"session_id": session, "method": "close", "params": {}}).encode()))
    assert json.loads(parts(closed.content, closed.headers["content-type"])[0][1]) == {"closed": True}
    assert httpx.get(f"{server.url}/sessions").json()["num_sessions"] == 0


def test_the_client_plays_a_vagen_lite_server_from_its_hand_built_answers():
    with LiteLikeServer(api_key="k3y") as lite:
        pool = HttpEnvWorkers([lite.url], 2, {"eval_set": "base"}, api_key="k3y")
        try:
            pool.reset(0, 3)
            pool.reset(1, 5)
            first = collect(pool, 2)
            obs, info, system_prompt = first[0].value
            assert obs.text == "[Initial Observation]:\n<image>\nYou are at 3." and info == {}
            assert system_prompt == SYSTEM_PROMPT  # asked for with /call system_prompt, as Lite's server needs
            (image,) = obs.images
            assert image.mode == "RGB" and image.size == (8, 8) and image.getpixel((0, 0)) == (120, 10, 20)
            ours, other = pool.sessions[0].session_id, pool.sessions[1].session_id
            rewards = []
            for _ in range(3):
                pool.step(0, "<answer>Right</answer>")
                (answer,) = collect(pool, 1)
                obs, reward, terminated, truncated, info = answer.value
                rewards.append((reward, terminated, truncated, info["success"]))
            assert rewards == [(1.0, False, False, False)] * 2 + [(1.0, True, False, True)]
            assert obs.text == "You are at 6.\n<image>" and obs.images[0].getpixel((0, 0)) == (240, 10, 20)
            assert ours not in lite.sessions and other in lite.sessions  # closed at its episode's end, not before
        finally:
            pool.close()
        assert lite.sessions == {}  # and the rest at close()
        for _path, headers, body in lite.requests:
            assert headers["X-API-Key"] == "k3y" and headers["Content-Type"].startswith("multipart/form-data")
            assert LiteLikeServer.json_part(headers, body) is not None  # found by its own Content-Type
        connect = LiteLikeServer.json_part(lite.requests[0][1], lite.requests[0][2])
        assert connect["env_config"] == {"eval_set": "base"} and connect["seed"] in (3, 5)
        assert [step[1] for step in lite.steps] == ["<answer>Right</answer>"] * 3  # each step sent once


def test_a_step_whose_answer_was_lost_is_never_sent_again_but_replayed_in_a_new_session():
    lines = []
    with LiteLikeServer() as lite:
        lite.drop_step = 2  # applied, and its answer lost: the server has stepped, the client does not know
        pool = HttpEnvWorkers([lite.url], 1, {}, log=lines.append)
        try:
            pool.reset(0, 0)
            collect(pool, 1)
            positions = []
            for text in ("<answer>Right</answer>", "<answer>Right</answer>"):
                pool.step(0, text)
                (answer,) = collect(pool, 1)
                positions.append(answer.value[0].text)
        finally:
            pool.close()
    assert positions == ["You are at 1.\n<image>", "You are at 2.\n<image>"]  # not 3: the step ran once
    # session s1 got the lost step once; s2 replayed the first step and ran the pending one
    assert lite.steps == [("s1", "<answer>Right</answer>")] * 2 + [("s2", "<answer>Right</answer>")] * 2
    assert pool.replayed == 1 and len(lines) == 1
    assert re.match(r"env http: environment 0's session on http://127.0.0.1:\d+ was lost \(HttpNoAnswer: .* gave "
                    r"no answer .*\); its episode \(seed 0, 1 steps\) was replayed in a new session", lines[0]), lines


def test_busy_servers_are_retried_and_lost_sessions_of_a_restarted_server_replayed():
    lines = []
    with LiteLikeServer() as lite:
        pool = HttpEnvWorkers([lite.url], 1, {}, log=lines.append)
        try:
            lite.busy = 2  # 503 twice: the connect did not run, and is sent again
            pool.reset(0, 4)
            assert collect(pool, 1)[0].error is None
            pool.step(0, "<answer>Right</answer>")
            collect(pool, 1)
            lite.sessions.clear()  # a restart: every session is unknown (404) from now on
            pool.step(0, "<answer>Right</answer>")
            (answer,) = collect(pool, 1)
        finally:
            pool.close()
    assert answer.error is None and answer.value[0].text == "You are at 6.\n<image>"
    assert pool.replayed == 1 and "(HttpSessionLost: " in lines[0] and "404: reaped" in lines[0]


def test_the_environment_s_own_error_ends_its_episode_without_a_replay():
    lines = []
    with LiteLikeServer() as lite:
        lite.fail_step = 2
        pool = HttpEnvWorkers([lite.url], 2, {}, log=lines.append)
        try:
            pool.reset(0, 0)
            pool.reset(1, 1)
            collect(pool, 2)
            pool.step(0, "<answer>Right</answer>")
            pool.step(1, "<answer>Right</answer>")
            first, second = collect(pool, 2)
        finally:
            pool.close()
    failed, fine = (first, second) if first.error else (second, first)
    assert re.fullmatch(r"HttpEnvError: http://127.0.0.1:\d+/call answered 500: ValueError: the agent fell off the "
                        r"line", failed.error), failed.error
    assert fine.error is None and lines == [] and lite.connects == 2 and len(lite.steps) == 2


def test_a_server_that_is_not_deterministic_ends_the_episode_with_a_named_error():
    for replay in (True, False):
        with LiteLikeServer() as lite:
            pool = HttpEnvWorkers([lite.url], 1, {}, replay=replay, log=lambda line: None)
            try:
                pool.reset(0, 2)
                collect(pool, 1)
                lite.wobble = True  # a new session starts elsewhere than the seed says
                lite.sessions.clear()
                pool.step(0, "<answer>Right</answer>")
                (answer,) = collect(pool, 1)
            finally:
                pool.close()
        if replay:
            assert answer.error.startswith("ReplayMismatch: replaying the episode of seed 2 in a new session, the "
                                           "observation after the reset differs from the one recorded (text: ")
            assert "set env.replay=false" in answer.error
        else:
            assert answer.error.startswith("HttpSessionLost: ") and "env.replay=false, so the episode ends" in answer.error
            assert lite.connects == 1  # no new session was opened


def test_a_server_that_does_not_answer_health_is_refused_by_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match=rf"env.urls: {url} does not answer GET /health \(ConnectError"):
        HttpEnvWorkers([url], 1, {})
    with served() as server, pytest.raises(RuntimeError, match=r"serves env 'sokoban', but env.name='frozenlake'"):
        client([server.url], 1, load_config("frozenlake_visual", []))


def test_vagen_server_answers_as_worker_processes_do_and_replays_a_reaped_session():
    """The same answers as EnvWorkers, error text of a response that does not parse included; sessions reaped
    after --session-timeout come back by replay, with the same answers."""
    cfg = sokoban()
    seeds = [3, 4, 5]
    local = EnvWorkers(EnvFactory(cfg.env), len(seeds), 1, None)
    try:
        expected = play(local, seeds)
    finally:
        local.close()
    lines = []
    with served(session_timeout=0.3) as server:
        pool = client([server.url], len(seeds), log=lines.append)
        try:
            assert play(pool, seeds) == expected
            reaped = play(pool, seeds, between=lambda turn: time.sleep(0.7) if turn == 1 else None)
            assert reaped == expected
        finally:
            pool.close()
        assert httpx.get(f"{server.url}/sessions").json()["num_sessions"] == 0
    assert pool.replayed == len(seeds) and all("(HttpSessionLost: " in line for line in lines), lines


def test_a_vagen_server_restarted_under_the_client_is_replayed_on_with_the_same_answers():
    seeds = [3, 4]
    lines = []
    first = served()
    port = first.port
    restarted = []

    def restart(turn):
        if turn == 1:  # every session unknown to the new server (404)
            first.__exit__(None, None, None)
            restarted.append(served(port=port).__enter__())

    with first:
        pool = client([first.url], len(seeds), log=lines.append)
        try:
            expected = play(pool, seeds)
            assert play(pool, seeds, between=restart) == expected
        finally:
            pool.close()
            for server in restarted:
                server.__exit__(None, None, None)
    assert pool.replayed == len(lines) >= 1 and all("(HttpSessionLost: " in line for line in lines), lines


def test_env_config_keys_are_checked_against_the_environment(shared):
    server = shared
    body, content_type = encode_multipart({"env_config": {"dim_rom": [6, 6]}, "seed": 1})
    answer = httpx.post(f"{server.url}/connect", content=body, headers={"Content-Type": content_type})
    assert answer.status_code == 400
    assert "dim_rom" in answer.json()["detail"] and "dim_room" in answer.json()["detail"]
    body, content_type = encode_multipart({"env_config": {"dim_room": "big"}, "seed": 1})
    answer = httpx.post(f"{server.url}/connect", content=body, headers={"Content-Type": content_type})
    assert answer.status_code == 400 and answer.json()["detail"].startswith("EnvConfigError: env 'sokoban' "
                                                                            "cannot be made with env_config")
    assert httpx.get(f"{server.url}/sessions").json()["num_sessions"] == 0


def test_a_wrong_or_missing_key_gets_401_or_403_and_never_reaches_an_environment(monkeypatch):
    app = build_app(sokoban(), api_key="s3cret", workers=1)
    body, content_type = encode_multipart({"env_config": {}, "seed": 1})
    with ServerThread(app) as server:
        assert httpx.get(f"{server.url}/health").json()["ok"] is True  # open
        for headers, status in (({}, 401), ({"X-API-Key": "wrong"}, 403)):
            for path in ("/connect", "/call"):
                answer = httpx.post(f"{server.url}{path}", content=body, headers={"Content-Type": content_type,
                                                                                  **headers})
                assert answer.status_code == status, (path, answer.text)
            assert httpx.get(f"{server.url}/sessions", headers=headers).status_code == status
        assert httpx.post(f"{server.url}/connect?token=wrong", content=body,
                          headers={"Content-Type": content_type}).status_code == 403
        assert app.state.vagen["envs_reached"] == 0
        with pytest.raises(RuntimeError, match="answered 401"):
            pool = client([server.url], 1)
            pool.reset(0, 1)
            raise RuntimeError(collect(pool, 1)[0].error)
        pool.close()
        monkeypatch.setenv("VAGEN_TEST_KEY", "s3cret")
        cfg = load_config("sokoban_visual", ["env.backend=http", f"env.urls=[{server.url}]",
                                             "env.api_key_env=VAGEN_TEST_KEY"])
        pool = HttpEnvWorkers.from_config(cfg.env, 1)
        try:
            pool.reset(0, 1)
            assert collect(pool, 1)[0].error is None and app.state.vagen["envs_reached"] == 1
        finally:
            pool.close()


def test_malformed_requests_get_400_and_the_server_stays_up_without_leaking_a_session(shared):
    good, content_type = encode_multipart({"env_config": {}, "seed": 1})
    boundary = content_type.split('"')[1]
    cases = [
        (b'{"env_config": {}, "seed": 1}', "application/json"),  # not multipart
        (good, "multipart/form-data"),  # no boundary
        (good, 'multipart/form-data; boundary="other"'),
        (good[: len(good) // 2], content_type),  # cut short
        (good.replace(b"application/json", b"text/plain"), content_type),  # no JSON part
        (good.replace(b'"seed": 1}', b'"seed": 1'), content_type),  # JSON that does not parse
        (encode_multipart({"env_config": [1], "seed": 1}, boundary=boundary)[0], content_type),
        (encode_multipart({"env_config": {}, "seed": "one"}, boundary=boundary)[0], content_type),
        (encode_multipart({"env_config": {}, "seed": True}, boundary=boundary)[0], content_type),
        (b"\x00" * 10, content_type),
        (b"", content_type),
    ]
    calls = [{"method": "step"}, {"session_id": 5, "method": "step"}, {"session_id": "x", "method": "dance"},
             {"session_id": "x", "method": "step", "params": [1]}]
    rng = random.Random(0)
    server = shared
    with httpx.Client() as http:
        statuses = []
        for body, kind in cases:
            statuses.append(http.post(f"{server.url}/connect", content=body, headers={"Content-Type": kind}).status_code)
        for data in calls:
            body, kind = encode_multipart(data)
            statuses.append(http.post(f"{server.url}/call", content=body, headers={"Content-Type": kind}).status_code)
        for _ in range(40):  # bytes of a good body flipped, dropped or repeated at random
            body = bytearray(good)
            for _ in range(rng.randint(1, 4)):
                at = rng.randrange(len(body))
                choice = rng.random()
                if choice < 0.4:
                    body[at] = rng.randrange(256)
                elif choice < 0.7:
                    del body[at: at + rng.randint(1, 20)]
                else:
                    body[at:at] = body[at: at + rng.randint(1, 20)]
            status = http.post(f"{server.url}/connect", content=bytes(body), headers={"Content-Type": content_type})
            if status.status_code == 200:  # a flip the parser tolerates (in a header's name, say): a real session
                session = decode_multipart(status.content, status.headers["content-type"])[0]["session_id"]
                close, kind = encode_multipart({"session_id": session, "method": "close"})
                http.post(f"{server.url}/call", content=close, headers={"Content-Type": kind})
            statuses.append(status.status_code)
        huge = http.post(f"{server.url}/connect", content=b"x" * (1 << 17), headers={"Content-Type": content_type})
        assert huge.status_code == 413
        assert statuses[: len(cases)] == [400] * len(cases)
        assert statuses[len(cases): len(cases) + len(calls)] == [400] * len(calls)
        assert all(status in (200, 400) for status in statuses), statuses
        assert http.get(f"{server.url}/health").json()["ok"] is True
        assert http.get(f"{server.url}/sessions").json()["num_sessions"] == 0
        assert sorted(server.state["free"]) == list(range(64))  # every slot free again
        # and it still serves
        answer = http.post(f"{server.url}/connect", content=good, headers={"Content-Type": content_type})
        assert answer.status_code == 200
        session = decode_multipart(answer.content, answer.headers["content-type"])[0]["session_id"]
        close, kind = encode_multipart({"session_id": session, "method": "close"})
        assert http.post(f"{server.url}/call", content=close, headers={"Content-Type": kind}).status_code == 200


def test_64_concurrent_sessions_on_one_server_and_503_past_max_sessions(shared):
    server = shared
    pool = client([server.url], 64)
    try:
        played = play(pool, list(range(64)), script=SCRIPT[:1])
        going = sum(not answers[-1][2][1] and not answers[-1][2][2] for answers in played.values())
        assert 32 < going <= 64  # a session closes at its episode's end (a level solved in a turn)
        assert httpx.get(f"{server.url}/sessions").json()["num_sessions"] == going
        body, content_type = encode_multipart({"env_config": {}, "seed": 1})
        extra = [httpx.post(f"{server.url}/connect", content=body, headers={"Content-Type": content_type})
                 for _ in range(64 - going + 1)]
        assert [answer.status_code for answer in extra] == [200] * (64 - going) + [503]
        assert "--max-sessions" in extra[-1].json()["detail"]
    finally:
        pool.close()
    assert httpx.get(f"{server.url}/sessions").json()["num_sessions"] == 64 - going  # those opened by hand
    for answer in extra[:-1]:
        session = decode_multipart(answer.content, answer.headers["content-type"])[0]["session_id"]
        close, kind = encode_multipart({"session_id": session, "method": "close"})
        httpx.post(f"{server.url}/call", content=close, headers={"Content-Type": kind})
    assert httpx.get(f"{server.url}/sessions").json()["num_sessions"] == 0
    assert all(len(answers) == 2 and all(not isinstance(a, str) for a in answers) for answers in played.values())
    assert len({answers[0][1][0][2] for answers in played.values()}) > 10  # 64 levels, many of them different


class KillsAServer:
    """The pool a rollout steps, as it is, but right after the first step of turn 1 sent to a session on
    `doomed`'s server, that server's process is killed (SIGKILL: its sessions and in-flight answers gone)."""

    def __init__(self, pool: HttpEnvWorkers, doomed, url: str):
        self.pool, self.doomed, self.url, self.killed = pool, doomed, url, False

    def __getattr__(self, name):
        return getattr(self.pool, name)

    def __len__(self):
        return len(self.pool)

    def step(self, index, text):
        session = self.pool.sessions[index]
        self.pool.step(index, text)
        if not self.killed and session is not None and session.url == self.url and len(session.texts) == 1:
            self.doomed.kill()
            self.killed = True


@pytest.mark.slow  # two server processes and the tiny model's processor: 30 s on the 2-core machine beside other jobs
def test_killing_one_of_two_servers_mid_rollout_gives_the_uninterrupted_run_with_the_replays_logged(tiny_vl):
    from http_servers import server_process
    from scripted import ScriptedDecoder

    from vagen.episode import ChatEncoder
    from vagen.rollout import rollout, rollout_metrics

    seeds = [3, 4, 5, 6, 7, 8]
    cfg = load_config("sokoban_visual", ["rollout.max_turns=3"])
    encoder = ChatEncoder(tiny_vl[2])
    script = {row: [SCRIPT[(row + turn) % 3] for turn in range(3)] for row in range(len(seeds))}
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    lines, played, metrics = [], [], []
    with server_process("sokoban_visual", ports[0], "--workers", "1"), \
            server_process("sokoban_visual", ports[1], "--workers", "1") as doomed:
        for disturbed in (False, True):
            pool = client(urls, len(seeds), log=lines.append)
            envs = KillsAServer(pool, doomed, urls[1]) if disturbed else pool
            try:
                episodes, _ = rollout(None, encoder, cfg, seeds, 1, envs=envs, decoder=ScriptedDecoder(encoder, script))
            finally:
                pool.close()
            assert not disturbed or envs.killed
            played.append([(ep.seed, [t.observation for t in ep.turns], [t.response for t in ep.turns],
                            [t.reward for t in ep.turns], [[i.tobytes() for i in t.images] for t in ep.turns],
                            ep.done, ep.success, ep.error) for ep in episodes])
            metrics.append(rollout_metrics(episodes))
    assert played[1] == played[0] and metrics[1] == metrics[0]
    assert all(ep[-1] is None for ep in played[1]) and sum(len(ep[1]) for ep in played[1]) >= 12
    # the sessions the kill took were replayed on the other server, each logged
    assert pool.replayed == len(lines) >= 1, lines
    assert all(f"on {urls[1]} was lost" in line and f"replayed in a new session on {urls[0]}" in line
               for line in lines), lines


def test_the_config_names_what_env_backend_http_needs(monkeypatch):
    from vagen.config import ConfigError

    with pytest.raises(ConfigError, match=r"env.backend=http steps sessions on environment servers, but "
                                          r"env.urls=\[\]; give their addresses"):
        load_config("sokoban_visual", ["env.backend=http"])
    with pytest.raises(ConfigError, match=r"env.api_key_env='sk-123' names an environment variable .*, never the "
                                          r"key itself"):
        load_config("sokoban_visual", ["env.backend=http", "env.urls=[http://127.0.0.1:1]", "env.api_key_env=sk-123"])
    with pytest.raises(ConfigError, match=r"env.backend='htp'; did you mean 'http'\?"):
        load_config("sokoban_visual", ["env.backend=htp"])
    monkeypatch.delenv("VAGEN_UNSET_KEY", raising=False)
    cfg = load_config("sokoban_visual", ["env.backend=http", "env.urls=[http://127.0.0.1:1]",
                                         "env.api_key_env=VAGEN_UNSET_KEY"])
    with pytest.raises(RuntimeError, match=r"env.api_key_env=VAGEN_UNSET_KEY: that environment variable is not set"):
        HttpEnvWorkers.from_config(cfg.env, 1)


def test_requests_past_max_inflight_wait_then_get_503_without_reaching_an_environment(shared, monkeypatch):
    import asyncio

    from vagen import env_server

    monkeypatch.setattr(env_server, "ADMIT_TIMEOUT", 0.3)
    gate, loop = shared.state["gate"], shared.state["loop"]
    for _ in range(64):  # every one of --max-inflight taken, as by 64 slow requests
        asyncio.run_coroutine_threadsafe(gate.acquire(), loop).result(timeout=5)
    body, content_type = encode_multipart({"env_config": {}, "seed": 1})
    reached = shared.state["envs_reached"]
    try:
        t0 = time.perf_counter()
        busy = httpx.post(f"{shared.url}/connect", content=body, headers={"Content-Type": content_type})
        assert busy.status_code == 503 and time.perf_counter() - t0 >= 0.3
        assert busy.json()["detail"] == "server busy: 64 requests running (--max-inflight) for 0.3 s"
    finally:
        for _ in range(64):
            loop.call_soon_threadsafe(gate.release)
    assert shared.state["envs_reached"] == reached and shared.state["sessions"] == {}
    served_now = httpx.post(f"{shared.url}/connect", content=body, headers={"Content-Type": content_type}, timeout=30)
    assert served_now.status_code == 200
    session = decode_multipart(served_now.content, served_now.headers["content-type"])[0]["session_id"]
    close, kind = encode_multipart({"session_id": session, "method": "close"})
    assert httpx.post(f"{shared.url}/call", content=close, headers={"Content-Type": kind}).status_code == 200


def test_the_server_command_refuses_a_key_variable_that_is_not_set(monkeypatch, capsys):
    from vagen.env_server import main

    monkeypatch.delenv("VAGEN_UNSET_KEY", raising=False)
    assert main(["--config", "sokoban_visual", "--api-key-env", "VAGEN_UNSET_KEY"]) == 2
    assert "--api-key-env VAGEN_UNSET_KEY: that environment variable is not set" in capsys.readouterr().err
    assert main(["--config", "sokoban_visual", "--max-sessions", "0"]) == 2


def test_a_foreign_server_gets_env_remote_config_and_no_vagen_environment_is_built():
    from vagen.rollout import graded_scores

    with LiteLikeServer() as lite:
        cfg = load_config("navigation_visual", ["env.backend=http", f"env.urls=[{lite.url}]",
                                                "env.remote_config={eval_set: base, max_actions_per_step: 5}",
                                                "env.prompt_format=grounding_worldmodeling"])
        pool = HttpEnvWorkers.from_config(cfg.env, 1)
        try:
            pool.reset(0, 11)
            assert collect(pool, 1)[0].value[0].text.endswith("You are at 11.")
            assert graded_scores(pool.example()) == ()  # a stand-in: its info carries no state scores
        finally:
            pool.close()
    connect = LiteLikeServer.json_part(lite.requests[0][1], lite.requests[0][2])
    assert connect["env_config"] == {"eval_set": "base", "max_actions_per_step": 5} and connect["seed"] == 11


def test_evaluation_over_http_plays_the_episodes_of_a_local_evaluation(shared, tmp_path, capsys):
    """`python -m vagen.eval ... env.backend=http env.urls=[...]` plays its levels in sessions on the server: the
    same episodes, success and baselines as with environments built in the evaluating process, no video."""
    import json

    from vagen.eval import main as evaluate_main

    common = ["--config", "sokoban_visual", "--checkpoint", "assets:sokoban_visual", "--episodes", "3"]
    short = ["rollout.max_turns=2", "log.progress=false"]
    assert evaluate_main([*common, "--videos", "0", "--out", str(tmp_path / "local"), *short]) == 0
    assert evaluate_main([*common, "--videos", "1", "--out", str(tmp_path / "http"), *short, "env.backend=http",
                          f"env.urls=[{shared.url}]"]) == 0
    assert "env.backend=http: no videos" in capsys.readouterr().out
    local, remote = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("local", "http"))
    assert remote["episodes"] == local["episodes"] and remote["model"] == local["model"]
    assert remote["reference"] == local["reference"] and len(remote["episodes"]) == 3
    assert not (tmp_path / "http" / "videos").exists()
    assert httpx.get(f"{shared.url}/sessions").json()["num_sessions"] == 0  # every session closed
