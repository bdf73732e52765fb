"""Two-armed bandit: one pull, a safe arm or a risky one (text only).

Each seed draws two arm names from a small list and decides which one is low-risk and in which
order they are shown. The prompt says which arm is low-risk and which is high-risk but not what
they pay: the agent has to learn that the risky arm is worth more on average.

## Actions
The name of one arm (case-insensitive), e.g. `<answer>Tiger</answer>`. Only the first valid name
of a response is pulled; the episode ends after it.

## Observation
`render_mode="text"` only: the two arm names, each labelled low-risk or high-risk, and after the
pull what was received. `state()`: `{"arms": [name, name] (display order), "low_risk": name,
"high_risk": name, "pulled": name or None, "payout": float or None}`. `info["state_key"]` (after
`reset` and `step`) is that `state()` made hashable, exact.

## Reward
Low-risk arm: 0.1. High-risk arm: 1.0 with probability 0.25, else 0 (drawn from a generator seeded
by `reset`, so an episode is reproducible). `success` means the high-risk arm was pulled (the
better arm in expectation, 0.25 > 0.1). The format reward (0.5) is added when the response parses
and names an arm.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from envs_visual.base import TextActionEnv

ARM_NAMES = (
    "Tiger", "Falcon", "Otter", "Wolf", "Heron", "Lynx", "Badger", "Panda",
    "Crimson", "Azure", "Amber", "Jade", "Violet", "Scarlet", "Cobalt", "Ivory",
)  # fmt: skip
LOW_RISK_PAYOUT = 0.1
HIGH_RISK_PAYOUT = 1.0
HIGH_RISK_PROBABILITY = 0.25


def generate_level(seed: int) -> dict[str, Any]:
    """`{"arms": [shown first, shown second], "low_risk": name, "high_risk": name}` from the seed."""
    rng = np.random.default_rng(seed)
    first, second = (ARM_NAMES[i] for i in rng.choice(len(ARM_NAMES), size=2, replace=False).tolist())
    low, high = (first, second) if rng.random() < 0.5 else (second, first)
    return {"arms": [first, second], "low_risk": low, "high_risk": high}


class BanditEnv(TextActionEnv):
    """Two-armed bandit with text actions; see the module docstring."""

    name = "bandit"
    example_answer = ARM_NAMES[0]
    render_modes = ("text",)

    def __init__(self, render_mode: str = "text", max_steps: int = 1, **kwargs):
        super().__init__(render_mode=render_mode, max_steps=max_steps, **kwargs)

    def _reset(self, seed: int) -> None:
        self.arms = generate_level(seed)
        self._set_action_names(self.arms["arms"])
        self.example_answer = self.arms["arms"][0]
        self._rng = np.random.default_rng([seed, 1])
        self.pulled: str | None = None
        self.payout: float | None = None

    def _apply(self, action: str) -> tuple[float, bool]:
        self.pulled = action
        if action == self.arms["low_risk"]:
            self.payout = LOW_RISK_PAYOUT
        else:
            self.payout = HIGH_RISK_PAYOUT if self._rng.random() < HIGH_RISK_PROBABILITY else 0.0
        return self.payout, True

    def _success(self) -> bool:
        return self.pulled == self.arms["high_risk"]

    def _failed(self) -> bool:
        return self.pulled == self.arms["low_risk"]

    def _step_info(self) -> dict[str, Any]:
        return {"pulled": self.pulled, "payout": self.payout}

    def state(self) -> dict[str, Any]:
        return {**self.arms, "arms": list(self.arms["arms"]), "pulled": self.pulled, "payout": self.payout}

    def _label(self, name: str) -> str:
        return "low-risk" if name == self.arms["low_risk"] else "high-risk"

    def render_text(self) -> str:
        lines = [f"Arm {name}: {self._label(name)}" for name in self.arms["arms"]]
        if self.pulled is not None:
            lines.append(f"You pulled {self.pulled} and received {self.payout:g}.")
        return "\n".join(lines)

    def render_image(self):
        raise NotImplementedError("bandit is text only; use render_mode='text'")

    def _actions_prompt(self) -> str:
        return ""

    def _task_prompt(self) -> str:
        if self.seed is None:  # before reset the arms are not drawn yet
            arms, names = "two arms, named in the observation", "the arm's name"
        else:
            first, second = self.arms["arms"]
            arms = f"two arms, {first} ({self._label(first)}) and {second} ({self._label(second)})"
            names = f"{first} or {second}"
        return (
            f"You are playing a slot machine with {arms}. The low-risk arm and the high-risk arm pay "
            "different rewards. Pull one arm to maximise your expected reward.\n"
            f"Actions: {names}."
        )

    def _example_fields(self) -> dict[str, str]:
        return {
            "observation": "There are two arms, one low-risk and one high-risk.",
            "reasoning": "I compare what each arm pays on average.",
            "prediction": "I receive the reward of the arm I pull.",
        }
