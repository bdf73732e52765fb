"""A model behind an OpenAI-compatible chat API (vLLM's or sglang's server, an API provider) as the policy of an
evaluation: a decoder (`vagen.decoding`) whose turns are chat completion requests over HTTP (httpx, the `[http]`
extra). Environments, episodes, results, videos and the browser are those of a checkpoint's evaluation; only the
decoding differs.

Each turn's request holds the episode as a chat:
- the environment's system prompt as a system message;
- each observation as a user message whose content interleaves the text and the frames, in order: a
  `{"type": "text"}` part for each stretch of text between `<image>` placeholders (empty stretches left out) and an
  `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` part at each placeholder, the frame
  after vagen's own resize (`ChatEncoder.resize`), so an API model sees the pixels a checkpoint sees; an
  observation without frames is a plain string;
- each earlier reply as an assistant message, cut after its first `</answer>` as vagen's decoders stop there (the
  text the environment received);
- which turns: `rollout.context=full` all of them, `window` the last `rollout.window_turns` before the new one.

Sampling: greedy (temperature 0) unless `eval.do_sample`, then `rollout.temperature` and `rollout.top_p`;
`max_tokens` = `rollout.max_new_tokens`; each request carries the seed a checkpoint's request would
(`request_seed` of the turn's seed and the episode's row), which servers that take one use.

Failures: 429, 5xx, timeouts and lost connections are retried (`max_retries`) after exponential backoff with
jitter, or after the server's `Retry-After`; any other 4xx is an `APIError` at once, with the server's message.
An episode whose request runs out of retries ends there as a model error (`Episode.model_error`), counted apart
from the environment's errors and left out of the success rate. At most `max_concurrency` requests run at once.
"""

from __future__ import annotations

import base64
import email.utils
import io
import os
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from envs_visual.base import IMAGE_PLACEHOLDER
from vagen.decoding import STOP_STRING, Generated, Sampling, request_seed
from vagen.episode import ChatEncoder, Episode

TOKEN_PARAMS = ("max_tokens", "max_completion_tokens")
OMITTABLE = ("seed", "temperature", "top_p")


class APIError(RuntimeError):
    """A request the server refused in a way retrying cannot mend (a 4xx other than 429): the evaluation stops."""


class ModelError(RuntimeError):
    """A request that failed on every try (429, 5xx, timeouts, lost connections): its episode ends as a model error."""


@dataclass(frozen=True)
class APISettings:
    """Where the model is and how it is asked. `api_key_env` names the environment variable holding the key; the
    key itself is read from it when requests are sent and never stored in results or printed."""

    base_url: str
    model: str
    api_key_env: str | None = None
    max_concurrency: int = 8
    max_retries: int = 6
    min_backoff: float = 0.5
    max_backoff: float = 8.0
    max_retry_after: float = 120.0  # a longer Retry-After is waited this long at most
    timeout_s: float = 120.0
    token_param: str = "max_tokens"  # max_completion_tokens for OpenAI's reasoning models
    omit: tuple[str, ...] = ()  # request fields a server refuses, left out: of seed, temperature, top_p

    def describe(self) -> dict:
        """What results.json records of the policy: everything but the key."""
        return {"kind": "openai", "base_url": self.base_url, "model": self.model, "api_key_env": self.api_key_env,
                "max_concurrency": self.max_concurrency, "max_retries": self.max_retries,
                "token_param": self.token_param, "omit": list(self.omit)}


def check_settings(settings: APISettings) -> list[str]:
    """What is wrong with `settings`, each as a sentence saying how to fix it."""
    problems = []
    if not settings.base_url.startswith(("http://", "https://")):
        problems.append(f"--base-url {settings.base_url!r} is not an http(s) URL; pass the API's root, e.g. "
                        f"http://127.0.0.1:8000/v1 (vLLM's server) or https://api.openai.com/v1")
    if not settings.model:
        problems.append("--model is empty; pass the name the server knows the model by (vLLM's server: the --model "
                        "it was started with, or its --served-model-name; GET <base-url>/models lists them)")
    if settings.api_key_env and not os.environ.get(settings.api_key_env):
        problems.append(f"--api-key-env {settings.api_key_env}: the environment variable {settings.api_key_env} is "
                        f"not set or empty; export it with the key (keys never go in configs or on the command line)")
    if settings.token_param not in TOKEN_PARAMS:
        problems.append(f"--token-param {settings.token_param!r}; choices: {', '.join(TOKEN_PARAMS)}")
    unknown = sorted(set(settings.omit) - set(OMITTABLE))
    if unknown:
        problems.append(f"--omit {','.join(unknown)}: only {', '.join(OMITTABLE)} can be left out of a request")
    if settings.max_concurrency < 1 or settings.max_retries < 0:
        problems.append(f"--max-concurrency {settings.max_concurrency} and --max-retries {settings.max_retries}: "
                        f"expected at least 1 request at once and 0 or more retries")
    return problems


def png_data_url(image) -> str:
    """`image` as a `data:image/png;base64,...` URL."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def user_content(text: str, images: list) -> str | list[dict]:
    """An observation as a user message's content: `text` alone when it has no frames, else its text and frames
    interleaved in placeholder order (frames as they are given: the caller resizes them)."""
    parts = text.split(IMAGE_PLACEHOLDER)
    if len(parts) != len(images) + 1:
        raise ValueError(f"an observation has {len(parts) - 1} {IMAGE_PLACEHOLDER} placeholders but {len(images)} "
                         f"frames; the environment must give one frame per placeholder")
    if not images:
        return text
    content = [{"type": "text", "text": parts[0]}] if parts[0] else []
    for image, part in zip(images, parts[1:]):
        content.append({"type": "image_url", "image_url": {"url": png_data_url(image)}})
        if part:
            content.append({"type": "text", "text": part})
    return content


def cut_reply(reply: str) -> str:
    """`reply` up to and including its first `</answer>`, where vagen's decoders stop a turn."""
    cut = reply.find(STOP_STRING)
    return reply if cut < 0 else reply[: cut + len(STOP_STRING)]


def chat_messages(system: str, observations: list[tuple[str, list]], replies: list[str], context: str,
                  window_turns: int, resize=None) -> list[dict]:
    """The messages of the turn that answers `observations[-1]`: the system prompt, the earlier turns
    `rollout.context` keeps (each observation, then its reply) and the new observation. `resize`: applied to each
    frame (`ChatEncoder.resize`)."""
    assert len(observations) == len(replies) + 1, f"{len(observations)=} {len(replies)=}"
    first = 0 if context == "full" else max(0, len(observations) - 1 - window_turns)
    messages = [{"role": "system", "content": system}]
    for k in range(first, len(observations)):
        text, images = observations[k]
        images = [resize(image) for image in images] if resize is not None else list(images)
        messages.append({"role": "user", "content": user_content(text, images)})
        if k < len(replies):
            messages.append({"role": "assistant", "content": replies[k]})
    return messages


def retry_after(headers) -> float | None:
    """The server's `Retry-After` in seconds (a number or an HTTP date), None without one."""
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class ChatClient:
    """Chat completion requests to `settings.base_url` with the retries of the module docstring. Thread-safe: one
    httpx client shared by the decoder's workers."""

    def __init__(self, settings: APISettings, rng_seed: int = 0):
        import httpx

        self.settings, self.httpx = settings, httpx
        self.rng, self.lock = random.Random(rng_seed), threading.Lock()
        self.client = httpx.Client(base_url=settings.base_url.rstrip("/") + "/", timeout=settings.timeout_s)
        self.retries = 0  # requests sent again, over the client's life

    def close(self) -> None:
        self.client.close()

    def backoff(self, attempt: int) -> float:
        """Exponential backoff before retry `attempt` (0-based), with up to 25% jitter."""
        with self.lock:
            jitter = 1 + 0.25 * self.rng.random()
        return min(self.settings.max_backoff, self.settings.min_backoff * 2**attempt) * jitter

    def complete(self, body: dict) -> dict:
        """The server's answer (its JSON) to `POST chat/completions` with `body`; raises `APIError` at once on a
        4xx other than 429, `ModelError` once every try has failed."""
        s = self.settings
        headers = {}
        if s.api_key_env:
            headers["Authorization"] = f"Bearer {os.environ.get(s.api_key_env, '')}"
        failures = []
        for attempt in range(s.max_retries + 1):
            wait_s = None
            try:
                response = self.client.post("chat/completions", json=body, headers=headers)
            except (self.httpx.TimeoutException, self.httpx.TransportError) as err:
                failures.append(f"{type(err).__name__}: {err}")
            else:
                if response.status_code == 200:
                    try:
                        return response.json()
                    except ValueError:
                        failures.append(f"200 with a body that is not JSON: {response.text[:200]!r}")
                elif response.status_code == 429 or response.status_code >= 500:
                    failures.append(f"{response.status_code}: {response.text[:300]}")
                    wait_s = retry_after(response.headers)
                else:
                    raise APIError(f"{s.base_url} answered POST chat/completions (model {s.model!r}) with "
                                   f"{response.status_code}: {response.text[:1000]}; a 4xx other than 429 is not "
                                   f"retried: check --base-url, --model, the key in --api-key-env and the request")
            if attempt == s.max_retries:
                break
            with self.lock:
                self.retries += 1
            time.sleep(min(wait_s, s.max_retry_after) if wait_s is not None else self.backoff(attempt))
        raise ModelError(f"{len(failures)} tries of POST {s.base_url}/chat/completions failed; the last: {failures[-1]}")


def request_body(settings: APISettings, messages: list[dict], sampling: Sampling, seed: int) -> dict:
    """The chat completion request of one turn: greedy is temperature 0; `settings.omit` fields left out."""
    body = {"model": settings.model, "messages": messages, settings.token_param: sampling.max_new_tokens,
            "seed": seed}
    if sampling.do_sample:
        body.update(temperature=sampling.temperature, top_p=sampling.top_p)
    else:
        body.update(temperature=0.0)
    return {key: value for key, value in body.items() if key not in settings.omit}


def reply_text(answer: dict) -> tuple[str, str | None]:
    """The text of the first choice of a chat completion (empty where the server gave none) and its
    `finish_reason` (`length`: cut at the token budget)."""
    try:
        choice = answer["choices"][0]
        return choice["message"].get("content") or "", choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        raise ModelError(f"the server's answer has no choices[0].message ({err!r}): {str(answer)[:300]}") from None


class APIDecoder:
    """A `vagen.decoding.Decoder` whose turns are requests to a chat API. The episode's token ids are still kept
    (the encoder's tokenizer counts them against `rollout.max_trajectory_length`, as for the config's checkpoint),
    but the server is sent the chat of the module docstring, never ids; a reply comes back as the ids of its text
    up to its first `</answer>`."""

    def __init__(self, settings: APISettings, encoder: ChatEncoder, context: str = "full", window_turns: int = 2,
                 client: ChatClient | None = None):
        self.settings, self.encoder, self.context, self.window_turns = settings, encoder, context, window_turns
        self.client = client or ChatClient(settings)
        self.model_errors = 0
        self.replies: dict[int, list[dict]] = {}  # id of an episode -> each turn's reply as the server gave it

    def close(self) -> None:
        self.client.close()

    def start_rollout(self) -> None:
        """Nothing is kept between rollouts: each request carries the whole chat."""

    def any_rank(self, flag: bool) -> bool:
        return flag

    def messages(self, episode: Episode, observation) -> list[dict]:
        """The chat of `episode`'s next turn, whose observation is `observation`."""
        observations = [(t.observation, t.images) for t in episode.turns] + [(observation.text, observation.images)]
        resize = self.encoder.resize if self.encoder.is_vision else None
        return chat_messages(episode.system_prompt, observations, [t.response for t in episode.turns], self.context,
                             self.window_turns, resize)

    def ask(self, messages: list[dict], sampling: Sampling, row: int) -> tuple[Generated, dict]:
        """The reply's ids (its text cut after `</answer>`) and the reply as the server gave it."""
        answer = self.client.complete(request_body(self.settings, messages, sampling, request_seed(sampling.seed, row)))
        text, finish_reason = reply_text(answer)
        return Generated(self.encoder.encode_text(cut_reply(text))), {"text": text, "finish_reason": finish_reason}

    def replies_of(self, episode: Episode) -> list[dict]:
        """`episode`'s replies as the server gave them (uncut), with each one's `finish_reason`."""
        return self.replies.get(id(episode), [])

    def generate(self, episodes: list[Episode], rows: list[int], sampling: Sampling) -> list[Generated]:
        raise NotImplementedError("APIDecoder plays whole games (play); it has no per-turn generate, as it needs "
                                  "each episode's current observation")

    def play(self, game) -> None:
        """The agent loop over a `vagen.rollout.Game`: each ready episode's request goes to a pool of
        `max_concurrency` workers, and each reply goes to its environment as soon as it arrives. An episode whose
        request failed on every try ends there (`Episode.model_error`); an `APIError` stops the loop (requests
        not yet sent are dropped)."""
        pending: dict[Future, int] = {}
        pool = ThreadPoolExecutor(self.settings.max_concurrency, thread_name_prefix="api")
        try:
            while True:
                # with requests out, environment answers are taken as they come; else they are all there is
                game.take_answers(block=not pending)
                game.ended.count()
                for row in game.ready:
                    sampling, seed_row = game.request(row)
                    messages = self.messages(game.episodes[row], game.observations[row])
                    pending[pool.submit(self.ask, messages, sampling, seed_row)] = row
                game.ready.clear()
                if not pending:
                    if game.finished():
                        game.ended.count()
                        return
                    continue
                done, _ = wait(list(pending), timeout=0.05 if game.pool.busy() else None, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: pending[f]):
                    row = pending.pop(future)
                    try:
                        generated, reply = future.result()
                    except ModelError as err:
                        episode = game.episodes[row]
                        episode.model_error = f"turn {len(episode.turns)}: {err}"
                        episode.done = True
                        self.model_errors += 1
                        continue
                    self.replies.setdefault(id(game.episodes[row]), []).append(reply)
                    game.respond(row, generated)
        finally:
            # after an APIError the requests not yet sent are dropped, and those running are not waited for (the
            # caller closes the client under them)
            pool.shutdown(wait=False, cancel_futures=True)


def load_encoder(cfg) -> ChatEncoder:
    """The `ChatEncoder` of the config's checkpoint (`model.path`, its processor only, under `model.min_pixels` /
    `model.max_pixels`): frames are resized and turns counted as that checkpoint's evaluation would."""
    from vagen.models import base_checkpoint
    from vagen.models.families import family_of
    from vagen.models.loading import set_pixel_bounds

    path = base_checkpoint(cfg.model)
    from transformers import AutoProcessor, AutoTokenizer

    if family_of(path).vision:
        processor = AutoProcessor.from_pretrained(path)
        set_pixel_bounds(processor, cfg.model.min_pixels, cfg.model.max_pixels)
    else:
        processor = AutoTokenizer.from_pretrained(path)
    return ChatEncoder(processor)
