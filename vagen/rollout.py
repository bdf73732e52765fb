"""Multi-turn rollouts: groups of environments share a level seed; each turn the active episodes go to
a decoder (`vagen.decoding`) in one batch, and every episode keeps the exact token ids the policy saw
and produced, so that training sees the same sequence as sampling did (`vagen.episode` has the layout).
"""

from __future__ import annotations

import contextlib
import time

import envs_visual
from vagen.decoding import Decoder, sampling_from, turn_seed
from vagen.decoding_hf import HFDecoder
from vagen.episode import ChatEncoder, Episode, Segment, Turn, TurnContext


def make_env(cfg_env, seed_env_params: dict | None = None):
    params = dict(cfg_env.params)
    params.setdefault("prompt_format", cfg_env.prompt_format)
    params.setdefault("render_mode", cfg_env.render_mode)
    params.setdefault("max_actions_per_turn", cfg_env.max_actions_per_turn)
    params.setdefault("format_reward", cfg_env.format_reward)
    if seed_env_params:
        params.update(seed_env_params)
    return envs_visual.make(cfg_env.name, **params)


def make_decoder(cfg, model, encoder: ChatEncoder) -> Decoder:
    """The engine `rollout.backend` names, decoding `model`'s policy."""
    if cfg.rollout.backend == "hf":
        # A window drops its oldest turn as it slides, so a cache kept across turns would no longer hold a
        # prefix of the next prompt: with rollout.context=window each turn runs its whole window.
        keep_cache = cfg.rollout.reuse_cache and cfg.rollout.context == "full"
        return HFDecoder(model, encoder, keep_cache=keep_cache)
    if cfg.rollout.backend == "vllm":
        from vagen.decoding_vllm import VLLMDecoder  # vLLM is an optional dependency

        return VLLMDecoder.from_config(cfg, model, encoder)
    raise ValueError(f"unknown rollout.backend {cfg.rollout.backend!r}; choices: hf, vllm")


def rollout(model, encoder: ChatEncoder, cfg, seeds: list[int], group_size: int, *, do_sample: bool | None = None,
            envs: list | None = None, on_step=None, progress=None, decoder: Decoder | None = None,
            sample_seed: int = 0) -> tuple[list[Episode], dict[str, float]]:
    """Play `len(seeds) * group_size` episodes (members of a group share a seed) for up to
    `cfg.rollout.max_turns` turns, decoding with `decoder` (default: `rollout.backend` over `model`).
    Returns the episodes and timing/length metrics. `progress` (a `vagen.console.progress_bar`) is
    advanced by one as each episode ends; `sample_seed` seeds engines that seed each request."""
    ro = cfg.rollout
    n = len(seeds) * group_size
    envs = envs if envs is not None else [make_env(cfg.env) for _ in range(n)]
    assert len(envs) == n, f"{len(envs)=} {n=}"
    episodes, observations = reset_envs(envs, cfg.env, seeds, group_size)
    decoder = decoder if decoder is not None else make_decoder(cfg, model, encoder)
    decoder.start_rollout()
    timing = {"timing/generate": 0.0, "timing/env": 0.0, "rollout/generated_tokens": 0.0}
    ended = Ended(episodes, progress)
    for turn in range(ro.max_turns):
        ended.count()
        active = open_turn(encoder, episodes, observations, turn, ro)
        # Under ZeRO-3 over several ranks, a rank whose episodes have ended keeps generating (idle) while
        # another rank's go on: forward passes are collective there.
        if not decoder.any_rank(bool(active)):
            break
        t0 = time.perf_counter()
        sampling = sampling_from(ro, do_sample, seed=turn_seed(sample_seed, turn))
        generated = decoder.generate([episodes[i] for i in active], active, sampling)
        timing["timing/generate"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        for i, new in zip(active, generated):
            timing["rollout/generated_tokens"] += close_turn(encoder, episodes[i], envs[i], observations, i, new,
                                                             cfg.env.step_timeout, on_step)
        timing["timing/env"] += time.perf_counter() - t0
    for ep in episodes:
        ep.done = True
    ended.count()
    return episodes, timing


def reset_envs(envs: list, env_cfg, seeds: list[int], group_size: int) -> tuple[list[Episode], list]:
    """A new episode per environment, reset to its group's level seed; an environment that raises
    ends its own episode there (failed), not the rollout."""
    episodes, observations = [], []
    for i, env in enumerate(envs):
        group = i // group_size
        try:
            with time_limit(env_cfg.step_timeout):
                obs, info = env.reset(seed=seeds[group])
            episodes.append(Episode(env_cfg.name, seeds[group], group, env.system_prompt(), initial_observation=obs,
                                    initial_state_key=info.get("state_key")))
        except Exception as err:
            episodes.append(Episode(env_cfg.name, seeds[group], group, "", done=True,
                                    error=f"reset: {env_error_summary(err)}"))
            obs = None
        observations.append(obs)
    return episodes, observations


class Ended:
    """Advances a progress bar by the episodes that ended since the last count."""

    def __init__(self, episodes: list[Episode], progress):
        self.episodes, self.progress, self.ended = episodes, progress, 0

    def count(self) -> None:
        now = sum(ep.done for ep in self.episodes)
        if self.progress is not None and now > self.ended:
            self.progress.update(now - self.ended)
        self.ended = now


def open_turn(encoder: ChatEncoder, episodes: list[Episode], observations: list, turn: int, ro) -> list[int]:
    """Append each running episode's observation (text and frames, resized once) to its history, or with
    `rollout.context=window` make its window the next prompt (`window_prompt`); returns the indices of the
    episodes that generate this turn. An episode whose next turn would not fit in
    `rollout.max_trajectory_length` ends before it: whole turns only, so an image is never cut and what
    was played stays trainable."""
    window = ro.context == "window"
    active = []
    for i, ep in enumerate(episodes):
        if ep.done:
            continue
        obs = observations[i]
        images = [encoder.resize(image) for image in obs.images] if encoder.is_vision else obs.images
        if window:
            _, pixel_values, grids = encoder.user_segment(obs.text, images, first=False, system=None)
            segment = Segment(obs.text, images, pixel_values, grids)
            prompt = window_prompt(encoder, ep.system_prompt, ep.segments + [segment], ro.window_turns)
            if len(prompt.input_ids) + ro.max_new_tokens + 1 > ro.max_trajectory_length:
                ep.done = True
                ep.truncated_by_length = True
                continue
            ep.segments.append(segment)
            ep.input_ids, ep.pixel_values, ep.image_grid_thw = prompt.input_ids, prompt.pixel_values, prompt.image_grid_thw
            ep.images = [image for seg in ep.segments[-ro.window_turns - 1:] for image in seg.images]
            active.append(i)
            continue
        ids, pixel_values, grids = encoder.user_segment(obs.text, images, first=turn == 0, system=ep.system_prompt)
        if len(ep.input_ids) + len(ids) + ro.max_new_tokens + 1 > ro.max_trajectory_length:
            ep.done = True
            ep.truncated_by_length = True
            continue
        ep.input_ids += ids
        ep.pixel_values += pixel_values
        ep.image_grid_thw += grids
        ep.images += images
        active.append(i)
    return active


def window_prompt(encoder: ChatEncoder, system: str, segments: list[Segment], window_turns: int) -> TurnContext:
    """The prompt of the turn that answers `segments[-1]` with `rollout.context=window`: the system prompt,
    the last `window_turns` earlier turns (each observation with its frames, then the response as sampled)
    and the new observation, as one chat. The oldest turn kept opens the chat, after the system prompt."""
    kept = segments[max(0, len(segments) - 1 - window_turns):]
    ids, pixel_values, grids = [], [], []
    for k, segment in enumerate(kept):
        ids += encoder.segment_ids(segment.text, segment.image_grid_thw, first=k == 0, system=system)
        if k < len(kept) - 1:
            ids += segment.response_ids
        pixel_values += segment.pixel_values
        grids += segment.image_grid_thw
    return TurnContext(ids, pixel_values, grids)


def close_turn(encoder: ChatEncoder, ep: Episode, env, observations: list, i: int, new, step_timeout, on_step) -> int:
    """Close the turn's response with <|im_end|>, step the environment with its text and record the
    turn; returns the turn's token count. An environment that raises ends the episode there, failed."""
    ids, text = encoder.finish_response(new.ids)
    start = len(ep.input_ids)
    ep.input_ids += ids
    obs = observations[i]
    state_key = ep.turns[-1].info.get("state_key") if ep.turns else ep.initial_state_key
    try:
        with time_limit(step_timeout):
            next_obs, reward, terminated, truncated, info = env.step(text)
    except Exception as err:
        ep.error = f"step {len(ep.turns)}: {env_error_summary(err)}"
        next_obs, reward, terminated, truncated = None, 0.0, True, False
        info = {"success": False, "format_ok": False, "action_is_valid": False, "action_is_effective": False,
                "actions": [], "env_error": ep.error}
    if on_step is not None and ep.error is None:
        on_step(i, env, info)
    end_sampled = encoder.sampled_end(new.ids)
    logprobs = None if new.logprobs is None else list(new.logprobs[: len(ids) - (not end_sampled)])
    context = None
    if ep.segments:  # rollout.context=window: the turn's own sequence is its window and its response
        ep.segments[-1].response_ids = ids
        context = TurnContext(list(ep.input_ids), list(ep.pixel_values), list(ep.image_grid_thw))
    ep.turns.append(Turn(obs.text, obs.images, text, reward, info, (start, len(ep.input_ids)), len(ids),
                         end_sampled=end_sampled, sampled_logprobs=logprobs, state_key=state_key, context=context))
    ep.success = bool(info.get("success", False))
    observations[i] = next_obs
    if terminated or truncated:
        ep.done = True
    return len(ids)


class EnvTimeout(TimeoutError):
    """An environment's reset or step ran past `env.step_timeout`."""


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise EnvTimeout in the code inside if it runs longer than `seconds` (None: no limit). An alarm
    signal, so only in the main thread of a Unix process, and only between Python bytecodes."""
    import signal
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


GRADED_SCORES = (("observation", "grounding_score"), ("prediction", "worldmodel_score"))


def graded_scores(env) -> tuple[str, ...]:
    """The info keys of the state scores `env` grades every turn in its prompt format: `grounding_score`
    where the format has an <observation>, `worldmodel_score` where it has a <prediction>, none for an
    env whose state is not graded."""
    from envs_visual.base import PROMPT_FORMATS

    fields = PROMPT_FORMATS[env.prompt_format] or ()
    return tuple(key for name, key in GRADED_SCORES if name in fields) if env.state_weights else ()


def rollout_metrics(episodes: list[Episode], graded: tuple[str, ...] = ()) -> dict[str, float]:
    """Means over episodes of success, return, turns, format and validity rates, response length, and the
    state scores of graded fields (after the state reward's repetition check, when it ran): for the
    `graded` keys (`graded_scores`) over every turn, a turn whose description did not parse counting 0,
    so the curve exists from the first iteration; for others over the turns that have them.

    Per turn (docs/environments.md, "Format ok and action valid"): `rollout/format_ok` is the share whose
    response parsed into the prompt format's fields, `rollout/action_valid` the share that also named at
    least one action and only legal ones (the turns the format reward pays), so action_valid <= format_ok."""
    def mean(values):
        values = list(values)
        return float(sum(values) / len(values)) if values else 0.0

    turns = [t for ep in episodes for t in ep.turns]
    scores = {key: [t.info[key] for t in turns if t.info.get(key) is not None] for _, key in GRADED_SCORES}
    for key in graded:
        scores[key] = [t.info.get(key) or 0.0 for t in turns]
    return {
        "rollout/success": mean(ep.success for ep in episodes),
        "rollout/reward_mean": mean(ep.total_reward for ep in episodes),
        "rollout/turns": mean(len(ep.turns) for ep in episodes),
        "rollout/actions": mean(sum(len(t.info.get("actions", [])) for t in ep.turns) for ep in episodes),
        "rollout/format_ok": mean(bool(t.info.get("format_ok")) for t in turns),
        "rollout/action_valid": mean(bool(t.info.get("action_is_valid")) for t in turns),
        "rollout/action_effective": mean(bool(t.info.get("action_is_effective")) for t in turns),
        "rollout/response_length": mean(t.response_length for t in turns),
        "rollout/truncated_trajectories": float(sum(ep.truncated_by_length for ep in episodes)),
        "rollout/env_errors": float(sum(ep.error is not None for ep in episodes)),
        # how well the graded fields match the true state, whether or not they are rewarded
        **{f"rollout/{key}": mean(values) for key, values in scores.items() if values},
    }
