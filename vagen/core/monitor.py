"""Collapse indicators (pure) and a small stateful monitor that turns them into warnings.

Multi-turn RL collapses in recognisable ways: in-group reward std goes to 0 (no learning
signal), token entropy collapses, gradient norms spike, and the "echo trap": the policy
writes the same reasoning whatever the level. `collapse_indicators` measures them for one
batch; `CollapseMonitor` compares them with their own history.
"""

import statistics
from collections import deque

import torch

from vagen.core._checks import check_same_shape
from vagen.core.selection import group_std

__all__ = ["collapse_indicators", "distinct_n", "echo_rate", "CollapseMonitor"]


def distinct_n(texts: list[str], n: int = 2) -> float:
    """Distinct-n over a batch: unique word n-grams / all word n-grams (whitespace split).

    0.0 when the texts hold no n-gram at all (empty reasoning is itself a collapse sign).
    """
    grams = [
        tuple(words[i : i + n]) for words in (t.split() for t in texts) for i in range(len(words) - n + 1)
    ]
    return len(set(grams)) / len(grams) if grams else 0.0


def echo_rate(texts: list[str], seeds: list[int]) -> float:
    """Fraction of trajectories whose reasoning text also appears under a different seed.

    Texts are compared after collapsing whitespace; an empty text (no reasoning at all) is never
    an echo; 0.0 for an empty batch.
    """
    if len(texts) != len(seeds):
        raise ValueError(f"echo_rate: got {len(texts)} texts but {len(seeds)} seeds; need one seed per text")
    seeds_by_text: dict[str, set] = {}
    normalised = [" ".join(text.split()) for text in texts]
    for text, seed in zip(normalised, seeds, strict=True):
        seeds_by_text.setdefault(text, set()).add(seed)
    echoed = sum(bool(text) and len(seeds_by_text[text]) > 1 for text in normalised)
    return echoed / len(texts) if texts else 0.0


def collapse_indicators(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    entropies: torch.Tensor,
    mask: torch.Tensor,
    response_lengths: torch.Tensor,
    reasoning_texts: list[str],
    seeds: list[int],
) -> dict[str, float]:
    """Collapse indicators for one batch of B trajectories.

    Args:
        scores: [B] float, trajectory scores; group_ids: [B] int, rollout groups.
        entropies: [B, L] float, per-token policy entropy; mask: [B, L] bool or 0/1 (loss_mask).
            Only their masked mean is used, so any equal shapes work (e.g. [1, N] concatenated).
        response_lengths: [B] int or float, generated tokens per trajectory.
        reasoning_texts: B strings, e.g. the <think> contents of each trajectory, joined.
        seeds: B level seeds (ints), the level each trajectory played.

    Returns:
        reward_std_in_group: mean unbiased in-group score std over groups of 2 or more (0 if none);
        entropy_mean: mean entropy over masked-in tokens (0 if none);
        response_length_mean: mean of response_lengths;
        echo_rate: fraction of trajectories whose reasoning text also appears under a different seed;
        distinct_2: unique / all word bigrams over reasoning_texts (0 if no bigram).
    """
    check_same_shape(
        "collapse_indicators", 1, scores=scores, group_ids=group_ids, response_lengths=response_lengths
    )
    check_same_shape("collapse_indicators", None, entropies=entropies, mask=mask)
    batch = scores.shape[0]
    if len(reasoning_texts) != batch or len(seeds) != batch:
        raise ValueError(
            f"collapse_indicators: batch sizes differ: scores {batch}, reasoning_texts {len(reasoning_texts)}, "
            f"seeds {len(seeds)}; need one text and one seed per trajectory"
        )
    std, inverse = group_std(scores, group_ids)
    multi = torch.bincount(inverse, minlength=std.numel()) > 1 if batch else torch.zeros(0, dtype=torch.bool)
    keep = mask != 0
    n_tokens = int(keep.sum())
    entropy_sum = float(torch.where(keep, entropies.double(), torch.zeros((), dtype=torch.float64)).sum())
    return {
        "reward_std_in_group": float(std[multi].mean()) if bool(multi.any()) else 0.0,
        "entropy_mean": entropy_sum / n_tokens if n_tokens else 0.0,
        "response_length_mean": float(response_lengths.double().mean()) if batch else 0.0,
        "echo_rate": echo_rate(reasoning_texts, [int(s) for s in seeds]),
        "distinct_2": distinct_n(reasoning_texts, 2),
    }


def _below_peak(step: int, what: str, key: str, value: float, frac: float, peak: float | None,
                note: str = "") -> list[str]:
    """[the warning] when `value` fell below `frac` x the highest value seen before, else []."""
    if peak is None or value >= frac * peak:
        return []
    return [f"step {step}: {what}: {key} {value:.4g} < {frac:g} x peak {peak:.4g}{note}"]


class CollapseMonitor:
    """Turns per-step metrics into human-readable collapse warnings.

    `update(metrics)` reads (each optional) "grad_norm", "entropy_mean", "reward_std_in_group"
    and "format_ok" and returns a list of warning strings (empty when all is well):
      - gradient-norm spike: grad_norm > k x the median of the previous `window` values
        (needs `min_history` earlier values);
      - entropy collapse: entropy_mean < entropy_frac x the highest entropy seen so far;
      - in-group std drop: reward_std_in_group <= std_floor, or < std_frac x the median of
        the previous `window` values (needs `min_history` earlier values);
      - format collapse: format_ok (the share of turns whose answer parses) < format_frac x the
        highest seen so far: the policy has unlearned the answer format (GRPO on Sokoban did, with
        and without a penalty for malformed turns; README, "Learning on a laptop", run K);
      - a policy that does not look: "frame_gap" (nats per turn by which its responses are likelier
        with their own frames than with another level group's, `vagen.frame_check`) < frame_gap_floor
        while format_ok >= format_high: it answers in the format without reading its frames. Warned
        when the gap falls below the floor (the first check included), not again until it has risen
        above it. The floor is calibrated on the shipped warm starts (docs/algorithms.md, "Does the
        policy look?").
    """

    def __init__(
        self,
        window: int = 20,
        k: float = 3.0,
        entropy_frac: float = 0.25,
        std_frac: float = 0.25,
        std_floor: float = 1e-6,
        min_history: int = 3,
        format_frac: float = 0.5,
        frame_gap_floor: float = 3.0,
        format_high: float = 0.8,
    ):
        if window < 1 or k <= 0:
            raise ValueError(f"CollapseMonitor: need window >= 1 and k > 0, got window={window!r}, k={k!r}")
        self.window, self.k = window, k
        self.entropy_frac, self.std_frac, self.std_floor = entropy_frac, std_frac, std_floor
        self.min_history = min_history
        self.format_frac = format_frac
        self.format_peak: float | None = None
        self.frame_gap_floor, self.format_high = frame_gap_floor, format_high
        self.not_looking = False  # the last frame gap checked was below the floor (while the format held)
        self.grad_norms: deque[float] = deque(maxlen=window)
        self.stds: deque[float] = deque(maxlen=window)
        self.entropy_peak: float | None = None
        self.step = 0

    def state_dict(self) -> dict:
        """Plain-data history, for checkpoints: a resumed run warns exactly as an uninterrupted one."""
        return {"grad_norms": list(self.grad_norms), "stds": list(self.stds), "entropy_peak": self.entropy_peak,
                "step": self.step, "format_peak": self.format_peak, "not_looking": self.not_looking}

    def load_state_dict(self, state: dict) -> None:
        self.grad_norms = deque(state["grad_norms"], maxlen=self.window)
        self.stds = deque(state["stds"], maxlen=self.window)
        self.entropy_peak, self.step = state["entropy_peak"], int(state["step"])
        self.format_peak = state.get("format_peak")  # absent from checkpoints older than the indicator
        self.not_looking = bool(state.get("not_looking", False))

    def update(self, metrics: dict) -> list[str]:
        """Check one step's metrics against the history, then add them to it."""
        warnings = []
        step = self.step
        self.step += 1
        if "grad_norm" in metrics:
            g = float(metrics["grad_norm"])
            if len(self.grad_norms) >= self.min_history:
                median = statistics.median(self.grad_norms)
                if g > self.k * median:
                    warnings.append(
                        f"step {step}: gradient-norm spike: grad_norm {g:.4g} > {self.k:g} x running median "
                        f"{median:.4g} (last {len(self.grad_norms)} steps)"
                    )
            self.grad_norms.append(g)
        if "entropy_mean" in metrics:
            h = float(metrics["entropy_mean"])
            warnings += _below_peak(step, "entropy collapse", "entropy_mean", h, self.entropy_frac, self.entropy_peak)
            self.entropy_peak = h if self.entropy_peak is None else max(self.entropy_peak, h)
        if "reward_std_in_group" in metrics:
            s = float(metrics["reward_std_in_group"])
            if s <= self.std_floor:
                warnings.append(
                    f"step {step}: in-group reward std collapsed: reward_std_in_group {s:.4g} <= floor "
                    f"{self.std_floor:g} (no learning signal)"
                )
            elif len(self.stds) >= self.min_history:
                median = statistics.median(self.stds)
                if s < self.std_frac * median:
                    warnings.append(
                        f"step {step}: in-group reward std drop: reward_std_in_group {s:.4g} < {self.std_frac:g} x "
                        f"running median {median:.4g} (last {len(self.stds)} steps)"
                    )
            self.stds.append(s)
        if "format_ok" in metrics:
            f = float(metrics["format_ok"])
            warnings += _below_peak(step, "format collapse", "format_ok", f, self.format_frac, self.format_peak,
                                    " (answers stop parsing)")
            self.format_peak = f if self.format_peak is None else max(self.format_peak, f)
        if "frame_gap" in metrics:
            warnings += self._frame_gap(step, float(metrics["frame_gap"]), metrics.get("format_ok"))
        return warnings

    def _frame_gap(self, step: int, gap: float, format_ok) -> list[str]:
        """[the warning] when the frame gap enters the range below the floor while the format holds."""
        if format_ok is None or float(format_ok) < self.format_high:
            return []  # answers that do not parse: the format collapse says more than the frames can
        below = gap < self.frame_gap_floor
        entered, self.not_looking = below and not self.not_looking, below
        if not entered:
            return []
        return [f"step {step}: the policy does not look at its frames: frame_gap {gap:.3g} nats/turn < floor "
                f"{self.frame_gap_floor:g} while format_ok {float(format_ok):.3g} >= {self.format_high:g} (its "
                f"responses are about as likely with another level's frames; docs/algorithms.md, \"Does the "
                f"policy look?\")"]
