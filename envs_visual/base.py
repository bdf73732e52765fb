"""What every environment shares: the observation type, the response formats and their strict
parser, and the turn loop that turns one response into executed actions and a reward.

An environment subclasses `TextActionEnv` and supplies the level, the dynamics and the renders;
the base class owns everything about the agent's text so that all environments grade responses
the same way.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from envs_visual.state_grader import Vocabulary, describe_grid, grade, grid_vocabulary, plural

IMAGE_PLACEHOLDER = "<image>"

# Each format is the ordered list of fields inside <think>; "" means no <think> block at all and
# None means a free-form <think>.
PROMPT_FORMATS: dict[str, tuple[str, ...] | None] = {
    "no_think": (),
    "free_think": None,
    "grounding": ("observation", "reasoning"),
    "worldmodeling": ("reasoning", "prediction"),
    "grounding_worldmodeling": ("observation", "reasoning", "prediction"),
}

_FIELD_HINTS = {
    "observation": "what you see now",
    "reasoning": "how you decide",
    "prediction": "what you expect to see after your actions",
}

_TAGS = ("think", "answer", "observation", "reasoning", "prediction")
_ANY_TAG = re.compile(r"</?(?:{})>".format("|".join(_TAGS)))


def closest_choice_error(kind: str, received: str, choices) -> ValueError:
    """A ValueError naming what was received, the closest valid names and all choices."""
    choices = sorted(choices)
    close = difflib.get_close_matches(str(received), choices, n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown {kind} {received!r}{hint} choices: {', '.join(choices)}")


def check_prompt_format(prompt_format: str) -> None:
    if prompt_format not in PROMPT_FORMATS:
        raise closest_choice_error("prompt_format", prompt_format, PROMPT_FORMATS)


def _format_regex(prompt_format: str) -> re.Pattern:
    inner = PROMPT_FORMATS[prompt_format]
    if inner is None:
        think = r"<think>(?P<think>.*?)</think>\s*"
    elif inner == ():
        think = ""
    else:
        parts = r"\s*".join(rf"<{name}>(?P<{name}>.*?)</{name}>" for name in inner)
        think = rf"<think>\s*{parts}\s*</think>\s*"
    return re.compile(rf"\A\s*{think}<answer>(?P<answer>.*?)</answer>\s*\Z", re.DOTALL)


_REGEXES = {name: _format_regex(name) for name in PROMPT_FORMATS}


@dataclass
class ParsedResponse:
    """The fields of one response. `ok` is False when the text does not match the format."""

    ok: bool
    answer: str = ""
    think: str = ""
    observation: str = ""
    reasoning: str = ""
    prediction: str = ""

    def fields(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in ("think", "observation", "reasoning", "prediction", "answer")}


def parse_response(text: str, prompt_format: str) -> ParsedResponse:
    """Strictly parse `text` in `prompt_format`. The whole text must match (surrounding whitespace
    and whitespace between tags allowed); a field may not contain another tag. Never raises on
    any string."""
    check_prompt_format(prompt_format)
    if not isinstance(text, str):
        return ParsedResponse(ok=False)
    match = _REGEXES[prompt_format].match(text)
    if match is None:
        return ParsedResponse(ok=False)
    groups = {k: v.strip() for k, v in match.groupdict().items()}
    if any(_ANY_TAG.search(v) for v in groups.values()):
        return ParsedResponse(ok=False)
    parsed = ParsedResponse(ok=True, **groups)
    if PROMPT_FORMATS[prompt_format]:
        parsed.think = " ".join(groups[name] for name in PROMPT_FORMATS[prompt_format])
    return parsed


def format_instructions(prompt_format: str, example_answer: str, example_fields: dict[str, str]) -> str:
    """The paragraph of the system prompt that states the response format, with an example."""
    check_prompt_format(prompt_format)
    inner = PROMPT_FORMATS[prompt_format]
    if inner is None:
        shape = "<think>...</think><answer>...</answer>"
    elif inner == ():
        shape = "<answer>...</answer>"
    else:
        shape = "<think>" + "".join(f"<{n}>...</{n}>" for n in inner) + "</think><answer>...</answer>"
    fields = dict(example_fields) if inner is None else {**_FIELD_HINTS, **example_fields}
    lines = [f"Respond exactly in this format: {shape}"]
    if inner:
        lines.append("Inside <think>: " + "; ".join(f"<{n}> {_FIELD_HINTS[n]}" for n in inner) + ".")
    lines.append(f"Example: {format_response(prompt_format, example_answer, fields)}")
    return "\n".join(lines)


def format_response(prompt_format: str, answer: str, fields: dict[str, str] | None = None) -> str:
    """A well-formed response in `prompt_format` (for scripted policies and demonstrations)."""
    check_prompt_format(prompt_format)
    fields = fields or {}
    inner = PROMPT_FORMATS[prompt_format]
    if inner is None:
        think = f"<think>{fields.get('think', fields.get('reasoning', ''))}</think>"
    elif inner == ():
        think = ""
    else:
        think = "<think>" + "".join(f"<{n}>{fields.get(n, '')}</{n}>" for n in inner) + "</think>"
    return f"{think}<answer>{answer}</answer>"


@dataclass
class Observation:
    """What the agent sees: text with one `<image>` placeholder per image in `images`."""

    text: str
    images: list[Image.Image] = field(default_factory=list)

    def __post_init__(self):
        n = self.text.count(IMAGE_PLACEHOLDER)
        assert n == len(self.images), f"{n=} placeholders but {len(self.images)=} images"


_ATOMS = frozenset({int, float, str, bool, bytes, type(None)})


def hashable(value) -> Hashable:
    """Plain data as an equal-for-equal hashable value: dicts become tuples of (key, value) pairs
    sorted by key, lists, tuples and numpy arrays tuples, sets sorted tuples, numpy scalars Python
    numbers; everything else is kept as it is (and must be hashable)."""
    if type(value) in _ATOMS:  # the common case, ahead of the isinstance chain (a state key per step)
        return value
    if isinstance(value, dict):
        return tuple(sorted((str(k), hashable(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(hashable(v) for v in value)
    if isinstance(value, np.ndarray):
        return tuple(hashable(v) for v in value.tolist())
    if isinstance(value, set | frozenset):
        return tuple(sorted(hashable(v) for v in value))
    if isinstance(value, np.generic):
        return value.item()
    hash(value)  # a TypeError here names the unhashable type
    return value


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise closest_choice_error(name, value, choices)


class TextActionEnv:
    """Base class: Gymnasium-style `reset`/`step` over text responses.

    Subclasses set `name`, `action_names` (canonical spellings) and implement `_reset(seed)`,
    `_apply(action) -> (reward, effective)`, `_success()`, `render_text()`, `render_image()`,
    `_task_prompt()`, `_turn_prompt()` and `state()`; `state_key()` (an exact hashable key of the
    state, in every `info` as `info["state_key"]`) comes from `state()` unless overridden.
    Environments whose answer is not a list of named actions (e.g. an arithmetic expression)
    override `_parse_actions`.

    Environments whose state can be described set `state_weights` ({kind: weight}) and implement
    `state_relations()`; `step` then grades the response's `<observation>` and `<prediction>`
    (`envs_visual.state_grader`) into `info["grounding_score"]` and `info["worldmodel_score"]`.
    """

    name = "base"
    action_names: tuple[str, ...] = ()
    example_answer = ""
    render_modes = ("vision", "text")
    # {kind: weight} of the state grader; empty: the env's state is not graded
    state_weights: dict[str, float] = {}

    def __init__(
        self,
        prompt_format: str = "free_think",
        render_mode: str = "vision",
        max_actions_per_turn: int = 3,
        max_steps: int = 100,
        format_reward: float = 0.5,
        format_penalty: float = 0.0,
        ineffective_penalty: float = 0.0,
    ):
        check_prompt_format(prompt_format)
        check_choice("render_mode", render_mode, self.render_modes)
        if int(max_actions_per_turn) < 1:
            raise ValueError(f"max_actions_per_turn must be >= 1, got {max_actions_per_turn}")
        if int(max_steps) < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        self.prompt_format = prompt_format
        self.render_mode = render_mode
        self.max_actions_per_turn = int(max_actions_per_turn)
        self.max_steps = int(max_steps)
        self.format_reward = float(format_reward)
        self.format_penalty = float(format_penalty)
        if float(ineffective_penalty) < 0:
            raise ValueError(f"ineffective_penalty must be >= 0 (it is subtracted), got {ineffective_penalty}")
        self.ineffective_penalty = float(ineffective_penalty)
        self._set_action_names(self.action_names)
        self.seed: int | None = None
        self.steps = 0
        self.done = False
        # When True, `step` adds info["frames"]: one (action, reward, frame) per executed action.
        self.record_frames = False

    # -- Gymnasium API -------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        if seed is None:
            seed = int(np.random.SeedSequence().generate_state(1)[0])
        self.seed = int(seed)
        self.steps = 0
        self.done = False
        self._reset(self.seed)
        return self.observation(self._initial_prompt()), {"seed": self.seed, "success": False,
                                                          "state_key": self.state_key()}

    def step(self, response: str):
        """Parse `response`, execute its actions, return (obs, reward, terminated, truncated, info)."""
        if self.seed is None:
            raise RuntimeError(f"{self.name}: call reset(seed=...) before step()")
        parsed = parse_response(response, self.prompt_format)
        state_before = self.state_relations() if self.state_weights else []
        actions, all_valid = self._parse_actions(parsed.answer) if parsed.ok else ([], False)
        reward, executed, effective = 0.0, [], False
        terminated = truncated = False
        frames = []
        was_done = self.done
        if not was_done:
            for action in actions:
                r, changed = self._apply(action)
                if not changed:
                    r -= self.ineffective_penalty
                reward += r
                effective |= changed
                executed.append(action)
                self.steps += 1
                if self.record_frames:
                    frames.append((action, float(r), self.render_video_frame()))
                terminated = self._success() or self._failed()
                truncated = not terminated and self.steps >= self.max_steps
                if terminated or truncated:
                    break
        self.done = self.done or terminated or truncated
        # format ok: the response parsed into the prompt format's fields; action valid: besides, its answer
        # named at least one action and every considered action was legal. The format reward pays the second.
        action_is_valid = parsed.ok and all_valid and len(actions) > 0
        if was_done:
            pass  # an ended episode pays nothing, whatever the response
        elif action_is_valid:
            reward += self.format_reward
        elif not parsed.ok:
            reward -= self.format_penalty
        info = {
            "success": self._success(),
            "format_ok": parsed.ok,
            "action_is_valid": action_is_valid,
            "action_is_effective": effective,
            "actions": executed,
            "parsed": parsed.fields(),
            "steps": self.steps,
        }
        info.update(self._state_scores(parsed, state_before))
        if self.record_frames:
            info["frames"] = frames  # (action, reward, frame) per executed action, for episode videos
        info.update(self._step_info())
        info["state_key"] = self.state_key()
        return self.observation(self._turn_prompt(info)), float(reward), terminated, truncated, info

    def _state_scores(self, parsed: ParsedResponse, state_before: list[tuple[str, str, str]]) -> dict[str, Any]:
        """`grounding_score` (the observation against the state before the actions) and
        `worldmodel_score` (the prediction against the state after them), each None when the format
        has no such field, the response did not parse or the env is not graded; `state_before` and
        `state_after`: the true relations as lists of lists."""
        state_after = self.state_relations() if self.state_weights else []
        fields = PROMPT_FORMATS[self.prompt_format] or ()
        graded = parsed.ok and bool(self.state_weights) and any(name in fields for name in ("observation", "prediction"))
        vocabulary = self.state_vocabulary() if graded else None

        def score(name: str, relations) -> float | None:
            if not graded or name not in fields:
                return None
            return grade(getattr(parsed, name), relations, self.state_weights, vocabulary)

        return {
            "grounding_score": score("observation", state_before),
            "worldmodel_score": score("prediction", state_after),
            "state_before": [list(r) for r in state_before],
            "state_after": [list(r) for r in state_after],
        }

    # -- state description ---------------------------------------------------------------------
    def state_relations(self) -> list[tuple[str, str, str]]:
        """The true (object, a, b) relations of the current state (`envs_visual.state_grader`);
        [] for an env whose state is not graded."""
        return []

    def state_vocabulary(self) -> Vocabulary:
        """The phrases the grader recognises: by default each kind of `state_weights`."""
        if not self.state_weights:
            raise ValueError(f"{self.name}: this env has no state_weights, so there is nothing to grade; "
                             "set state_weights and implement state_relations() to grade descriptions")
        return grid_vocabulary(list(self.state_weights))

    def describe_state(self, relations=None) -> str:
        """`relations` (default: the current ones) in the env's own words, one sentence per object;
        `grade(describe_state(r), r, ...)` is 1.0."""
        relations = self.state_relations() if relations is None else relations
        names = {kind: (f"The {kind}", f"A {kind}") for kind in self.state_weights}
        return describe_grid(relations, names, {kind: f"There are no {plural(kind)}." for kind in self.state_weights})

    def system_prompt(self) -> str:
        parts = [
            self._task_prompt(),
            self._actions_prompt(),
            format_instructions(self.prompt_format, self.example_answer, self._example_fields()),
        ]
        return "\n\n".join(part for part in parts if part)

    def observation(self, text: str) -> Observation:
        """The observation for the current state, preceded by `text`."""
        if self.render_mode == "vision":
            return Observation(f"{text}\n{IMAGE_PLACEHOLDER}".strip(), [self.render_image()])
        return Observation(f"{text}\n{self.render_text()}".strip(), [])

    def _set_action_names(self, names) -> None:
        """Replace the accepted action names (for environments whose actions change per episode)."""
        self.action_names = tuple(names)
        self._lookup = {a.lower(): a for a in self.action_names}

    def render_video_frame(self) -> Image.Image:
        """The frame shown in episode videos (the observation frame unless an env adds more)."""
        return self.render_image()

    # -- hooks ---------------------------------------------------------------------------------
    def _parse_actions(self, answer: str) -> tuple[list[str], bool]:
        """Comma-separated, case-insensitive names; at most `max_actions_per_turn` are considered
        and the list stops at the first unknown one. Returns (actions, all_considered_valid)."""
        words = [w.strip() for w in answer.split(",")][: self.max_actions_per_turn]
        actions = []
        for word in words:
            action = self._lookup.get(word.lower())
            if action is None:
                return actions, False
            actions.append(action)
        return actions, len(actions) > 0

    def _failed(self) -> bool:
        return False

    def random_actions(self, rng: np.random.Generator, count: int) -> list[str] | None:
        """`count` actions drawn uniformly from the valid ones (the evaluation's random policy); None for an
        env whose actions cannot be drawn that way. Environments whose actions carry numbers override it."""
        if not self.action_names:
            return None
        return [str(a) for a in rng.choice(self.action_names, size=count)]

    def _actions_prompt(self) -> str:
        """The system-prompt line about several actions per turn ("" to leave it out)."""
        return f"You may take up to {self.max_actions_per_turn} actions per turn, separated by ','."

    def _step_info(self) -> dict[str, Any]:
        return {}

    def _example_fields(self) -> dict[str, str]:
        return {}

    def _initial_prompt(self) -> str:
        return "Current observation:"

    def _turn_prompt(self, info: dict[str, Any]) -> str:
        executed = ", ".join(info["actions"]) or "none"
        if not info["action_is_valid"]:
            return (
                "Your response did not follow the required format or named an invalid action. "
                f"Executed actions: {executed}. Current observation:"
            )
        return f"Executed actions: {executed}. Current observation:"

    def _reset(self, seed: int) -> None:
        raise NotImplementedError

    def _apply(self, action: str) -> tuple[float, bool]:
        raise NotImplementedError

    def _success(self) -> bool:
        raise NotImplementedError

    def render_text(self) -> str:
        raise NotImplementedError

    def render_image(self) -> Image.Image:
        raise NotImplementedError

    def _task_prompt(self) -> str:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def state_key(self) -> Hashable:
        """An exact, hashable key of the true state the next turn starts from: equal keys mean equal
        states (GiGPO's anchor states group turns by it). `reset` and `step` put it in
        `info["state_key"]`. By default `state()` made hashable (`hashable`), exact when `state()` holds
        the whole state and nothing of the history; environments whose `state()` carries history
        (a path, a step count) or continuous poses override this."""
        try:
            state = self.state()
        except NotImplementedError:
            raise NotImplementedError(
                f"{self.name}: state_key() needs state() (the state as plain data) or an override of "
                "state_key() returning an exact hashable key of the state") from None
        return hashable(state)
