"""`--policy openai`: the chat a served model is sent, and the request failures, against a small real HTTP server
started here on 127.0.0.1 (the standard library's, one thread per request)."""

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

import envs_visual
from vagen.api_policy import (
    APIError,
    APISettings,
    ChatClient,
    ModelError,
    chat_messages,
    cut_reply,
    load_encoder,
    request_body,
)
from vagen.config import load_config
from vagen.decoding import Sampling, request_seed, turn_seed
from vagen.eval import main, parse_seeds

REPLY = "<think>the box is right of me</think><answer>Right</answer>"


class Server:
    """A chat API on 127.0.0.1 whose answer to each request is `answer(body, number)` -> (status, headers, json
    or text); it records the requests and the most that ran at once."""

    def __init__(self, answer, delay: float = 0.0):
        self.answer, self.delay, self.requests, self.headers = answer, delay, [], []
        self.lock, self.running, self.most_at_once = threading.Lock(), 0, 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    number = len(server.requests)
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    server.running += 1
                    server.most_at_once = max(server.most_at_once, server.running)
                try:
                    time.sleep(server.delay)
                    status, headers, content = server.answer(body, number)
                finally:
                    with server.lock:
                        server.running -= 1
                data = (json.dumps(content) if isinstance(content, dict) else content).encode()
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Type", "application/json" if isinstance(content, dict) else "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(text: str) -> dict:
    return {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
                                                               "message": {"role": "assistant", "content": text}}]}


def settings(url: str, **kwargs) -> APISettings:
    return APISettings(url, "tiny", **{"min_backoff": 0.01, "max_backoff": 0.05, **kwargs})


def test_messages_interleave_text_and_the_frames_resized_as_a_checkpoint_sees_them():
    cfg = load_config("sokoban_visual")
    encoder = load_encoder(cfg)
    env = envs_visual.make("sokoban", **{**cfg.env.params, "cell_size": 30})  # 180x180: the processor resizes it
    obs, _ = env.reset(seed=3)
    frame = obs.images[0]
    wide = Image.new("RGB", (100, 50), (200, 10, 10))
    second = ("before <image> between <image>", [wide, frame])
    messages = chat_messages("SYSTEM", [(obs.text, obs.images), second], ["R1"], "full", 2, encoder.resize)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"] == "SYSTEM" and messages[2]["content"] == "R1"
    first_text, = obs.text.split("<image>")[:1]
    assert obs.text.endswith("<image>") and obs.text.count("<image>") == 1
    assert [part["type"] for part in messages[1]["content"]] == ["text", "image_url"]
    assert messages[1]["content"][0] == {"type": "text", "text": first_text}
    content = messages[3]["content"]
    assert [(p["type"], p.get("text")) for p in content] == [("text", "before "), ("image_url", None),
                                                            ("text", " between "), ("image_url", None)]
    for part, image in ((messages[1]["content"][1], frame), (content[1], wide), (content[3], frame)):
        url = part["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        sent = Image.open(io.BytesIO(base64.b64decode(url.removeprefix("data:image/png;base64,"))))
        resized = encoder.resize(image)
        assert sent.size == resized.size and sent.size[0] % 28 == 0 and sent.size[1] % 28 == 0
        assert np.array_equal(np.asarray(sent.convert("RGB")), np.asarray(resized))
    assert frame.size == (180, 180) and encoder.resize(frame).size != frame.size
    # a window of one earlier turn: the oldest observation and its reply drop out
    three = [("a", []), ("b", []), ("c", [])]
    assert chat_messages("S", three, ["r1", "r2"], "window", 1) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "b"},
        {"role": "assistant", "content": "r2"}, {"role": "user", "content": "c"}]
    assert chat_messages("S", three, ["r1", "r2"], "window", 0)[1:] == [{"role": "user", "content": "c"}]
    with pytest.raises(ValueError, match="2 <image> placeholders but 1 frames"):
        chat_messages("S", [("<image><image>", [wide])], [], "full", 2)
    assert cut_reply(REPLY + " and then Up") == REPLY and cut_reply("no answer") == "no answer"


def test_a_429_is_retried_after_the_servers_retry_after():
    answers = [(429, {"Retry-After": "0.6"}, "slow down"), (200, {}, completion(REPLY))]
    with Server(lambda body, n: answers[n]) as server:
        client = ChatClient(settings(server.url))
        start = time.perf_counter()
        answer = client.complete({"model": "tiny", "messages": []})
        waited = time.perf_counter() - start
    assert answer["choices"][0]["message"]["content"] == REPLY
    assert len(server.requests) == 2 and client.retries == 1
    assert waited >= 0.6  # Retry-After, not the 0.01 s backoff


def test_5xx_are_retried_with_backoff_and_a_400_fails_at_once_with_the_servers_message(tmp_path, capsys):
    answers = [(500, {}, "boom"), (502, {}, "bad gateway"), (200, {}, completion(REPLY))]
    with Server(lambda body, n: answers[n]) as server:
        client = ChatClient(settings(server.url))
        assert client.complete({"model": "tiny"})["choices"][0]["message"]["content"] == REPLY
        assert len(server.requests) == 3 and client.retries == 2
    with Server(lambda body, n: (400, {}, {"error": {"message": "model 'tiny' does not exist"}})) as server:
        client = ChatClient(settings(server.url))
        with pytest.raises(APIError, match="answered .* with 400: .*model 'tiny' does not exist"):
            client.complete({"model": "tiny"})
        assert len(server.requests) == 1 and client.retries == 0
        # in an evaluation: it stops at the first such answer, exit 2 with the server's message
        assert main(["--config", "sokoban_text", "--policy", "openai", "--base-url", server.url, "--model", "tiny",
                     "--episodes", "2", "--out", str(tmp_path), "rollout.max_turns=1"]) == 2
        assert "with 400: " in capsys.readouterr().err and not (tmp_path / "results.json").exists()
    with Server(lambda body, n: (503, {}, "overloaded")) as server:
        client = ChatClient(settings(server.url, max_retries=3))
        with pytest.raises(ModelError, match="4 tries .* failed; the last: 503: overloaded"):
            client.complete({"model": "tiny"})
        assert len(server.requests) == 4
    client = ChatClient(settings(server.url, max_retries=1, timeout_s=1.0))  # the server is gone: connection refused
    with pytest.raises(ModelError, match="2 tries .* ConnectError"):
        client.complete({"model": "tiny"})


def _evaluate(server, out, *extra):
    args = ["--config", "sokoban_visual", "--policy", "openai", "--base-url", server.url, "--model", "tiny",
            "--out", str(out), "--videos", "0", "--max-retries", "1", *extra]
    assert main(args) == 0
    return json.loads((out / "results.json").read_text())


def test_an_episode_whose_requests_never_succeed_is_a_model_error_not_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("TINY_KEY", "sk-not-to-be-written")
    # the request of episode row 1's first turn (its seed: the checkpoint's request seed of that row and turn)
    failing = request_seed(turn_seed(0, 0), 1)
    with Server(lambda body, n: (500, {}, "down") if body["seed"] == failing else (200, {}, completion(REPLY))) as server:
        result = _evaluate(server, tmp_path / "eval", "--seeds", "5,6,7", "--api-key-env", "TINY_KEY",
                           "rollout.max_turns=1")
    assert {h["Authorization"] for h in server.headers} == {"Bearer sk-not-to-be-written"}
    assert [r["seed"] for r in result["episodes"]] == [5, 6, 7] and result["seed_list"] == [5, 6, 7]
    errors = [r for r in result["episodes"] if r["model_error"]]
    assert [r["seed"] for r in errors] == [6] and "2 tries" in errors[0]["model_error"]
    assert all(r["env_error"] is None for r in result["episodes"])
    assert result["model"]["episodes"] == 2 and result["model"]["model_errors"] == 1
    assert sum(body["seed"] == failing for body in server.requests) == 2  # one retry
    assert "1 more episode(s) ended as model errors" in (tmp_path / "eval" / "results.md").read_text()
    assert result["policy"] == {"kind": "openai", "base_url": server.url, "model": "tiny", "api_key_env": "TINY_KEY",
                                "max_concurrency": 8, "max_retries": 1, "token_param": "max_tokens", "omit": []}
    assert "sk-not-to-be-written" not in "".join(p.read_text() for p in (tmp_path / "eval").rglob("*.*")
                                                  if p.suffix in (".json", ".md", ".html", ".jsonl"))


def _moves(body, n):
    """A deterministic model: the move depends on the last frame's bytes and the turn."""
    user = body["messages"][-1]["content"]
    url = next(p["image_url"]["url"] for p in user if p["type"] == "image_url")
    move = ["Up", "Down", "Left", "Right"][(sum(url.encode()) + len(body["messages"])) % 4]
    return 200, {}, completion(f"<think>go</think><answer>{move}</answer> and more words")


def test_the_same_seeds_play_the_same_episodes_with_at_most_max_concurrency_requests_at_once(tmp_path):
    with Server(_moves, delay=0.15) as server:
        first = _evaluate(server, tmp_path / "a", "--episodes", "5", "--max-concurrency", "2", "rollout.max_turns=2")
        assert server.most_at_once == 2
        sent = sorted(json.dumps(b, sort_keys=True) for b in server.requests)
    with Server(_moves) as server:
        second = _evaluate(server, tmp_path / "b", "--episodes", "5", "--max-concurrency", "5", "rollout.max_turns=2")
        assert sorted(json.dumps(b, sort_keys=True) for b in server.requests) == sent
    assert first["episodes"] == second["episodes"] and first["model"] == second["model"]
    assert first["model"]["episodes"] == 5 and first["model"]["model_errors"] == 0
    assert [r["seed"] for r in first["episodes"]] == list(range(1_000_000_000, 1_000_000_005))
    # results.json keeps each reply uncut, as the server gave it
    assert all(reply["text"].endswith("</answer> and more words") and reply["finish_reason"] == "stop"
               for r in first["episodes"] for reply in r["replies"])
    assert [len(r["replies"]) for r in first["episodes"]] == [r["turns"] for r in first["episodes"]]
    bodies = [json.loads(b) for b in sent]
    assert {(b["temperature"], b["max_tokens"], b["model"]) for b in bodies} == {(0.0, 64, "tiny")}
    # a second turn carries the first reply cut after </answer>, as the environment received it
    later = [b for b in bodies if len(b["messages"]) == 4]
    assert later and all(b["messages"][2]["role"] == "assistant" and b["messages"][2]["content"].endswith("</answer>")
                         for b in later)
    browsed = [json.loads(line) for line in (tmp_path / "a" / "episodes.jsonl").read_text().splitlines()]
    assert all(t["response"].endswith("</answer>") for ep in browsed for t in ep["turns"])


def test_seed_lists_and_refused_arguments(tmp_path, capsys):
    listed = tmp_path / "seeds.txt"
    listed.write_text("[3, 1,\n2]\n")
    assert parse_seeds("0,1,2") == [0, 1, 2] and parse_seeds(str(listed)) == [3, 1, 2]
    with pytest.raises(ValueError, match="'x' is not an integer seed"):
        parse_seeds("1,x")
    with pytest.raises(ValueError, match=r"lists \[1\] more than once"):
        parse_seeds("1,2,1")
    assert main(["--config", "sokoban_visual", "--policy", "openai", "--base-url", "127.0.0.1:8000",
                 "--model", "m", "--api-key-env", "VAGEN_TEST_UNSET_KEY"]) == 2
    err = capsys.readouterr().err
    assert "is not an http(s) URL" in err and "VAGEN_TEST_UNSET_KEY is not set" in err
    assert main(["--config", "sokoban_visual", "--policy", "openai", "--model", "m"]) == 2
    assert "--policy openai needs --config NAME" in capsys.readouterr().err
    assert main(["--config", "sokoban_visual"]) == 2
    assert "--checkpoint is required" in capsys.readouterr().err
    assert main(["--config", "sokoban_visual", "--policy", "openai", "--base-url", "http://127.0.0.1:1/v1",
                 "--model", "m", "--omit", "seed,stop", "--token-param", "max_new"]) == 2
    err = capsys.readouterr().err
    assert "--omit stop: only seed, temperature, top_p" in err and "--token-param 'max_new'; choices" in err


def test_requests_carry_the_checkpoints_sampling_and_leave_out_what_the_server_refuses():
    messages = [{"role": "user", "content": "hi"}]
    greedy = Sampling(64, 0.7, 0.9, 0, do_sample=False, seed=5)
    sampled = Sampling(64, 0.7, 0.9, 0, do_sample=True, seed=5)
    assert request_body(settings("http://x"), messages, greedy, 11) == {
        "model": "tiny", "messages": messages, "max_tokens": 64, "seed": 11, "temperature": 0.0}
    reasoning = settings("http://x", token_param="max_completion_tokens", omit=("seed", "temperature", "top_p"))
    assert request_body(reasoning, messages, sampled, 11) == {"model": "tiny", "messages": messages,
                                                              "max_completion_tokens": 64}
    assert request_body(settings("http://x", omit=("seed",)), messages, sampled, 11) == {
        "model": "tiny", "messages": messages, "max_tokens": 64, "temperature": 0.7, "top_p": 0.9}
