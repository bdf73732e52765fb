"""Multi-turn rollouts: groups of environments share a level seed, each turn the active episodes'
histories are generated in one batch, and every episode keeps the exact token ids the policy saw and
produced, so that training sees the same sequence as sampling did.

An episode's token sequence is the Qwen chat markup built turn by turn:

    <|im_start|>system\\n{system prompt}<|im_end|>\\n
    <|im_start|>user\\n{observation, images as <|vision_start|><|image_pad|>*n<|vision_end|>}<|im_end|>\\n
    <|im_start|>assistant\\n{generated ids}<|im_end|>            <- loss_mask = 1 here
    \\n<|im_start|>user\\n{next observation}...

Generated ids are kept as sampled (never re-tokenised from text).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

import envs_visual
from envs_visual.base import IMAGE_PLACEHOLDER
from vagen.generation import Lockstep, TurnGenerator, idle_inputs
from vagen.models import VISION_TOKENS, tokenizer_of

# Seeds at or above this are reserved for evaluation, so training and evaluation levels never overlap.
EVAL_SEED_BASE = 1_000_000_000


def train_seeds(iteration: int, env_groups: int, base_seed: int = 0) -> list[int]:
    """Level seeds of training iteration `iteration`: distinct across iterations, below EVAL_SEED_BASE."""
    start = (base_seed * 1_000_003 + iteration * env_groups) % (EVAL_SEED_BASE - env_groups)
    return [start + i for i in range(env_groups)]


def eval_seeds(n: int, offset: int = 0) -> list[int]:
    return [EVAL_SEED_BASE + offset + i for i in range(n)]


@contextlib.contextmanager
def own_draws(seed: int):
    """Sampling inside draws from `seed` and leaves the caller's torch random state as it was, so a
    sampled evaluation plays the same episodes whatever ran before it, and perturbs nothing after."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


@dataclass
class Turn:
    """One turn of an episode: what the agent saw, what it answered, what the env returned."""

    observation: str
    images: list[Image.Image]
    response: str
    reward: float
    info: dict[str, Any]
    span: tuple[int, int]  # [start, end) of the generated ids (closing <|im_end|> included) in Episode.input_ids
    response_length: int  # generated tokens, the closing <|im_end|> included
    # Whether the policy sampled the closing <|im_end|> itself. When generation stopped at `</answer>`,
    # at rollout.max_new_tokens or on <|endoftext|>, the <|im_end|> was appended: it ends the turn for
    # rewards and values but was never drawn, so it gets no policy gradient, entropy or KL.
    end_sampled: bool = False


@dataclass
class Episode:
    env_name: str
    seed: int
    group_id: int
    system_prompt: str
    input_ids: list[int] = field(default_factory=list)
    pixel_values: list[torch.Tensor] = field(default_factory=list)  # one [n_patches, d] per image
    image_grid_thw: list[torch.Tensor] = field(default_factory=list)  # one [3] per image
    turns: list[Turn] = field(default_factory=list)
    done: bool = False
    success: bool = False
    truncated_by_length: bool = False
    initial_observation: Any = None
    error: str | None = None  # the environment raised: its exception in one line; the episode ended there

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))


class ChatEncoder:
    """Builds token ids of chat segments exactly as the checkpoint's chat template would, with image
    placeholders expanded to the processor's token count for each image."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = tokenizer_of(processor)
        self.is_vision = hasattr(processor, "image_processor")
        tok = self.tokenizer
        self.im_end_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
        self.stop_ids = {self.im_end_id, tok.convert_tokens_to_ids("<|endoftext|>")}
        self.image_pad_id = tok.convert_tokens_to_ids("<|image_pad|>") if self.is_vision else None
        if self.is_vision:
            self.merge = processor.image_processor.merge_size
        suppressed = ["<|im_start|>"] + list(VISION_TOKENS)
        vocab = tok.get_vocab()
        self.suppress_ids = sorted({vocab[t] for t in suppressed if t in vocab})

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def images_to_inputs(self, images: list[Image.Image]):
        if not images:
            return [], []
        out = self.processor.image_processor(images=images, return_tensors="pt")
        grids = list(out["image_grid_thw"])
        counts = [int(g.prod()) for g in grids]
        pixel_values = list(torch.split(out["pixel_values"], counts))
        return pixel_values, grids

    def user_segment(self, text: str, images: list[Image.Image], first: bool, system: str | None):
        """Token ids of a user turn followed by the assistant header, and its image inputs."""
        if images and not self.is_vision:
            raise ValueError("this model has no vision tower but the environment returned images; "
                             "set env.render_mode=text or use a vision-language checkpoint")
        pixel_values, grids = self.images_to_inputs(images)
        parts = text.split(IMAGE_PLACEHOLDER)
        assert len(parts) == len(images) + 1, f"{len(parts) - 1=} placeholders, {len(images)=} images"
        content = parts[0]
        for grid, part in zip(grids, parts[1:]):
            n = int(grid.prod()) // (self.merge**2)
            content += "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" + part
        prefix = f"<|im_start|>system\n{system}<|im_end|>\n" if first else "\n"
        segment = f"{prefix}<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
        return self.encode_text(segment), pixel_values, grids

    def finish_response(self, generated: list[int]) -> tuple[list[int], str]:
        """Cut generated ids at the first stop token and close the turn with <|im_end|>; return the
        ids and the response text up to and including the first `</answer>`."""
        ids = []
        for token in generated:
            if token in self.stop_ids:
                break
            ids.append(int(token))
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = text.find("</answer>")
        if cut >= 0:
            text = text[: cut + len("</answer>")]
        return ids + [self.im_end_id], text

    def sampled_end(self, generated: list[int]) -> bool:
        """Whether the first stop token of `generated` is <|im_end|>, i.e. the turn's closing token was
        sampled rather than appended by `finish_response`."""
        for token in generated:
            if token in self.stop_ids:
                return token == self.im_end_id
        return False


def batch_generation_inputs(encoder: ChatEncoder, episodes: list[Episode]) -> dict[str, torch.Tensor]:
    """Left-padded batch of the episodes' histories, with their images in order."""
    width = max(len(ep.input_ids) for ep in episodes)
    input_ids = torch.full((len(episodes), width), encoder.pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(episodes), width), dtype=torch.long)
    for row, ep in enumerate(episodes):
        input_ids[row, width - len(ep.input_ids):] = torch.tensor(ep.input_ids)
        attention_mask[row, width - len(ep.input_ids):] = 1
    batch = {"input_ids": input_ids, "attention_mask": attention_mask}
    pixel_values = [p for ep in episodes for p in ep.pixel_values]
    if pixel_values:
        batch["pixel_values"] = torch.cat(pixel_values)
        batch["image_grid_thw"] = torch.stack([g for ep in episodes for g in ep.image_grid_thw])
        batch["mm_token_type_ids"] = (input_ids == encoder.image_pad_id).long() * attention_mask
    return batch


@torch.no_grad()
def generate(model, encoder: ChatEncoder, episodes: list[Episode], max_new_tokens: int,
             temperature: float, top_p: float, top_k: int, do_sample: bool | None = None) -> list[list[int]]:
    """One batched `generate` over the episodes' histories; returns the new ids of each row.

    Under ZeRO-3 over several ranks (`Lockstep`) every rank calls this in the same turn, with
    transformers' `synced_gpus`; a rank without episodes generates from a stand-in input and returns []."""
    lockstep = Lockstep(model)
    idle = not episodes
    if lockstep.on:
        images_here = any(ep.pixel_values for ep in episodes)
        images_anywhere = lockstep.any(images_here)[0]
        if images_anywhere and episodes and not images_here:
            raise RuntimeError("under ZeRO-3 every rank's turn runs the same modules, but this rank's episodes "
                               "have no frame while another rank's do; an environment in vision mode must "
                               "return a frame with every observation")
        if idle:
            stand_in = Episode("idle", 0, 0, "")
            stand_in.input_ids, stand_in.pixel_values, stand_in.image_grid_thw = idle_inputs(encoder, images_anywhere)
            episodes = [stand_in]
    if not episodes:
        return []
    batch = batch_generation_inputs(encoder, episodes)
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    sample = temperature > 0 if do_sample is None else do_sample
    options = dict(do_sample=sample, max_new_tokens=max_new_tokens, pad_token_id=encoder.pad_id,
                   eos_token_id=sorted(encoder.stop_ids), suppress_tokens=encoder.suppress_ids,
                   stop_strings=["</answer>"], tokenizer=encoder.tokenizer, use_cache=True,
                   synced_gpus=lockstep.on)
    if sample:
        # top_k=0 keeps the full distribution: transformers would otherwise cut it at 50 tokens.
        options.update(temperature=max(temperature, 1e-5), top_p=top_p, top_k=top_k)
    else:
        options.update(temperature=None, top_p=None, top_k=None)
    with neutral_generation_config(model):
        out = model.generate(**batch, **options)
    new = out[:, batch["input_ids"].shape[1]:].cpu().tolist()
    return [] if idle else new


@contextlib.contextmanager
def neutral_generation_config(model):
    """Inside, `model.generate` sees no generation settings of the checkpoint's own: transformers fills
    every option a call leaves unset from `model.generation_config`, and published checkpoints carry
    sampling settings there (Qwen-VL checkpoints: repetition_penalty 1.05) that the update's
    log-probabilities would not reproduce. Only the options `generate` is given apply."""
    from transformers import GenerationConfig

    if not hasattr(model, "generation_config"):  # a stand-in model with a generate of its own
        yield
        return
    own = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = own


def make_env(cfg_env, seed_env_params: dict | None = None):
    params = dict(cfg_env.params)
    params.setdefault("prompt_format", cfg_env.prompt_format)
    params.setdefault("render_mode", cfg_env.render_mode)
    params.setdefault("max_actions_per_turn", cfg_env.max_actions_per_turn)
    params.setdefault("format_reward", cfg_env.format_reward)
    if seed_env_params:
        params.update(seed_env_params)
    return envs_visual.make(cfg_env.name, **params)


def rollout(model, encoder: ChatEncoder, cfg, seeds: list[int], group_size: int, *, do_sample: bool | None = None,
            envs: list | None = None, on_step=None, progress=None) -> tuple[list[Episode], dict[str, float]]:
    """Play `len(seeds) * group_size` episodes (members of a group share a seed) for up to
    `cfg.rollout.max_turns` turns. Returns the episodes and timing/length metrics. `progress` (a
    `vagen.run.progress_bar`) is advanced by one as each episode ends."""
    ro = cfg.rollout
    n = len(seeds) * group_size
    envs = envs if envs is not None else [make_env(cfg.env) for _ in range(n)]
    assert len(envs) == n, f"{len(envs)=} {n=}"
    episodes: list[Episode] = []
    observations = []
    for i, env in enumerate(envs):
        group = i // group_size
        try:
            with time_limit(cfg.env.step_timeout):
                obs, _ = env.reset(seed=seeds[group])
            episodes.append(Episode(cfg.env.name, seeds[group], group, env.system_prompt(), initial_observation=obs))
        except Exception as err:  # one environment's fault ends its episode, not the rollout
            episodes.append(Episode(cfg.env.name, seeds[group], group, "", done=True,
                                    error=f"reset: {env_error_summary(err)}"))
            obs = None
        observations.append(obs)
    gen_time = env_time = 0.0
    gen_tokens = 0
    turn_generator = TurnGenerator(model, encoder) if ro.reuse_cache else None
    # Under ZeRO-3 over several ranks, a rank whose episodes have ended keeps generating (idle) while
    # another rank's go on: forward passes are collective there.
    lockstep = Lockstep(model)
    ended = 0

    def count_ended():
        nonlocal ended
        now = sum(ep.done for ep in episodes)
        if progress is not None and now > ended:
            progress.update(now - ended)
        ended = now

    for turn in range(ro.max_turns):
        count_ended()
        active = []
        for i, ep in enumerate(episodes):
            if ep.done:
                continue
            obs = observations[i]
            ids, pixel_values, grids = encoder.user_segment(obs.text, obs.images, first=turn == 0,
                                                            system=ep.system_prompt)
            if len(ep.input_ids) + len(ids) + ro.max_new_tokens + 1 > ro.max_trajectory_length:
                # Whole turns only: an image is never cut, and what was played stays trainable.
                ep.done = True
                ep.truncated_by_length = True
                continue
            ep.input_ids += ids
            ep.pixel_values += pixel_values
            ep.image_grid_thw += grids
            active.append(i)
        if not lockstep.any(bool(active))[0]:
            break
        t0 = time.perf_counter()
        if turn_generator is not None:
            generated = turn_generator.generate([episodes[i] for i in active], active, ro.max_new_tokens,
                                                ro.temperature, ro.top_p, ro.top_k, do_sample=do_sample)
        else:
            generated = generate(model, encoder, [episodes[i] for i in active], ro.max_new_tokens,
                                 ro.temperature, ro.top_p, ro.top_k, do_sample=do_sample)
        gen_time += time.perf_counter() - t0
        t0 = time.perf_counter()
        for i, new_ids in zip(active, generated):
            ep, env = episodes[i], envs[i]
            ids, text = encoder.finish_response(new_ids)
            gen_tokens += len(ids)
            start = len(ep.input_ids)
            ep.input_ids += ids
            obs = observations[i]
            try:
                with time_limit(cfg.env.step_timeout):
                    next_obs, reward, terminated, truncated, info = env.step(text)
            except Exception as err:  # the episode ends here, failed; the rollout goes on
                ep.error = f"step {len(ep.turns)}: {env_error_summary(err)}"
                next_obs, reward, terminated, truncated = None, 0.0, True, False
                info = {"success": False, "format_ok": False, "action_is_valid": False, "action_is_effective": False,
                        "actions": [], "env_error": ep.error}
            if on_step is not None and ep.error is None:
                on_step(i, env, info)
            ep.turns.append(Turn(obs.text, obs.images, text, reward, info, (start, len(ep.input_ids)), len(ids),
                                 end_sampled=encoder.sampled_end(new_ids)))
            ep.success = bool(info.get("success", False))
            observations[i] = next_obs
            if terminated or truncated:
                ep.done = True
        env_time += time.perf_counter() - t0
    for ep in episodes:
        ep.done = True
    count_ended()
    metrics = {"timing/generate": gen_time, "timing/env": env_time, "rollout/generated_tokens": float(gen_tokens)}
    return episodes, metrics


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


def rollout_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Means over episodes of success, return, turns, format and validity rates, response length, and
    over the turns that have them, the state scores of their graded fields (after the state reward's
    repetition check, when it ran)."""
    def mean(values):
        values = list(values)
        return float(sum(values) / len(values)) if values else 0.0

    turns = [t for ep in episodes for t in ep.turns]
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
        # how well the graded fields match the true state (turns that have them), whether or not they are rewarded
        **{f"rollout/{key}": mean(scores) for key in ("grounding_score", "worldmodel_score")
           if (scores := [t.info[key] for t in turns if t.info.get(key) is not None])},
    }


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
