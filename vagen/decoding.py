"""The decoding seam: what a rollout asks of a generation engine, and the rules every engine keeps.

A rollout asks a `Decoder` to play its episodes: turn by turn, the running episodes in one batch per call
of `generate` (hf), or in the decoder's own agent loop, `play` (vllm), where each episode's next turn joins
the running batch as soon as its environment answers. Each episode's `input_ids` hold the
whole history, ending with the assistant header of the new turn, and its `images` every frame so
far, already resized. The decoder returns, for each episode, the ids it generated (kept as sampled,
the stop token included when one was produced) and, where the engine reports them, the
log-probability of each under the distribution it was drawn from.

Engines:
- `hf` (`vagen.decoding_hf.HFDecoder`): the `transformers` model being trained, one key/value cache
  across turns, the draws of `draw` below. Greedy, sampled, evaluation and ZeRO-3 lock-step all go
  through it.
- `vllm` (`vagen.decoding_vllm.VLLMDecoder`): an in-process vLLM engine per rank, weights synced from
  the actor after each update.

The rules, the same for every engine: a turn ends at the first stop token (`<|im_end|>`,
`<|endoftext|>`), at the first `</answer>` (the token that completes it is kept), or after
`max_new_tokens`; tokens of `ChatEncoder.suppress_ids` (`<|im_start|>` and the vision tokens) are
never drawn, and the update's log-probabilities exclude them too (`vagen.update.head_logprobs`), so
that sampling and training see one distribution.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import torch

from vagen.episode import Episode

STOP_STRING = "</answer>"


@dataclass(frozen=True)
class Sampling:
    """How one turn is decoded. `seed` is the call's seed: engines that seed each request derive the
    request's seed from it and the episode's row, so that a run samples reproducibly."""

    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    seed: int = 0


@dataclass
class Generated:
    ids: list[int]  # new ids as sampled; the stop token included when one was produced
    logprobs: list[float] | None = None  # the engine's log-probability of each id, where it has them


class Decoder(Protocol):
    def start_rollout(self) -> None:
        """A new rollout begins: state kept for the previous one's episodes goes."""

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank whose decoding this one's must pair with (collective where
        forward passes are: ZeRO-3 over several ranks); `flag` itself elsewhere."""

    def generate(self, episodes: list[Episode], rows: list[int], sampling: Sampling) -> list[Generated]:
        """The new ids of each episode; `rows` are the episodes' indices in the rollout, a subset of the
        previous call's within one rollout."""

    # A decoder that batches continuously also has `play(*games)`: its agent loop over one or more
    # `vagen.rollout.Game`s (with rollout.tasks, every task's), each episode's next turn sent as soon as its
    # observation is ready. Without it, the rollout plays the
    # episodes turn by turn through `generate` (`vagen.rollout.play_in_turns`).


def sampling_from(rollout_cfg, do_sample: bool | None = None, seed: int = 0) -> Sampling:
    """`Sampling` of the `rollout` config section; `do_sample` None samples when the temperature is > 0."""
    sample = rollout_cfg.temperature > 0 if do_sample is None else do_sample
    return Sampling(rollout_cfg.max_new_tokens, rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k,
                    sample, seed)


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a rollout's turn `turn` from the rollout's seed."""
    return (seed * 1_000_003 + turn) % (2**63 - 1)


def request_seed(seed: int, row: int) -> int:
    """The seed of one episode's request (`row`: its index in the rollout) from the turn's seed:
    distinct rows, distinct seeds, within the 63 bits engines take."""
    return (seed * 1_009 + row) % (2**63 - 1)


@contextlib.contextmanager
def own_draws(seed: int, device: torch.device | None = None):
    """Sampling inside draws from `seed` and leaves the caller's torch random state as it was, so a
    sampled evaluation plays the same episodes whatever ran before it, and perturbs nothing after.
    Only the CPU's and `device`'s random states are forked and seeded: forking every visible GPU
    would start a CUDA context on each of them from every rank."""
    devices = rng_devices(device)
    with torch.random.fork_rng(devices=devices):
        torch.default_generator.manual_seed(seed)
        for index in devices:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def rng_devices(device: torch.device | None) -> list[int]:
    """The CUDA devices whose random state a rank's sampling touches: its own, or none on the CPU."""
    if device is None or device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def ends_turn(text: str, piece: str, token: int, stop_ids: set[int]) -> bool:
    """Whether the turn ends with `token`, whose text `piece` was just appended to `text`: a stop
    token, or the token that completes `STOP_STRING` (looked for only where `piece` could have
    completed it)."""
    return token in stop_ids or STOP_STRING in text[-len(STOP_STRING) - len(piece):]


def draw(logits: torch.Tensor, suppress: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Next token of every row of `logits` [R, V]: argmax, or a draw after temperature, top-k and top-p
    in that order, as transformers' `generate` draws (`torch.multinomial` on the logits' device, from
    its default generator). The `suppress` ids are never drawn."""
    logits = logits.index_fill(-1, suppress, float("-inf"))
    if not sampling.do_sample:
        return logits.argmax(-1)
    logits = logits / max(sampling.temperature, 1e-5)
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= sampling.top_p  # keep the smallest head whose mass reaches top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)
