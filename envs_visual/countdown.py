"""Countdown: combine the given numbers with + - * / to reach the target (text only).

Each seed draws `num_numbers` numbers in `[1, max_number]` and builds a random expression tree
over all of them (integer intermediate results only); its value is the target, so every puzzle is
solvable by construction. Answers are read by a small tokenizer and recursive-descent parser with
exact fractions; the text is never `eval`'d.

## Actions
One arithmetic expression using each given number exactly once, with `+ - * /` (also `× ÷ −`) and
parentheses, e.g. `<answer>(7 - 3) * 5 + 2</answer>`. A trailing `= value` is ignored. An answer
that is not such an expression is invalid: no action, no format reward, the episode continues.

## Observation
`render_mode="text"` only: the numbers and the target. `state()`: `{"numbers": [int, ...],
"target": int, "answer": str or None, "value": str or None (exact, e.g. "7/2"), "correct": bool}`.
`info["state_key"]` (after `reset` and `step`) is that `state()` made hashable, exact.

## Reward
1.0 if the expression uses exactly the given numbers (each once) and equals the target; 0.1 if it
uses exactly the numbers but misses; 0 otherwise (including division by zero). The episode ends
after the first valid expression (`success` if correct). The format reward (0.5) is added when the
response parses and holds a valid expression.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import numpy as np

from envs_visual.base import TextActionEnv

_TOKEN = re.compile(r"\s*(?:([0-9]{1,9})|([-+*/()×÷−]))")
_CANONICAL = {"×": "*", "÷": "/", "−": "-"}
MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32


class ExpressionError(ValueError):
    """The text is not an arithmetic expression this parser accepts."""


def tokenize(text: str) -> list[str]:
    """Numbers and operator/parenthesis tokens; raises ExpressionError on anything else."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens, position, text = [], 0, text.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise ExpressionError(f"unexpected character {text[position:].lstrip()[:1]!r} at {position}")
        number, symbol = match.groups()
        tokens.append(number if number is not None else _CANONICAL.get(symbol, symbol))
        position = match.end()
    return tokens


def evaluate(text: str) -> tuple[Fraction | None, list[int]]:
    """Value (exact; None on division by zero) and the numbers used, in order of appearance.

    Grammar: expr := term (("+" | "-") term)*; term := factor (("*" | "/") factor)*;
    factor := NUMBER | "(" expr ")". Raises ExpressionError for anything else."""
    tokens = tokenize(text)
    if not tokens:
        raise ExpressionError("empty expression")
    numbers: list[int] = []
    position = 0
    division_by_zero = False

    def peek() -> str | None:
        return tokens[position] if position < len(tokens) else None

    def expr(depth: int) -> Fraction:
        nonlocal position
        value = term(depth)
        while peek() in ("+", "-"):
            op = tokens[position]
            position += 1
            right = term(depth)
            value = value + right if op == "+" else value - right
        return value

    def term(depth: int) -> Fraction:
        nonlocal position, division_by_zero
        value = factor(depth)
        while peek() in ("*", "/"):
            op = tokens[position]
            position += 1
            right = factor(depth)
            if op == "*":
                value = value * right
            elif right == 0:
                division_by_zero = True
                value = Fraction(0)
            else:
                value = value / right
        return value

    def factor(depth: int) -> Fraction:
        nonlocal position
        token = peek()
        if token is None:
            raise ExpressionError("expression ends early")
        position += 1
        if token.isdigit():
            numbers.append(int(token))
            return Fraction(int(token))
        if token == "(":
            if depth >= MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = expr(depth + 1)
            if peek() != ")":
                raise ExpressionError("missing ')'")
            position += 1
            return value
        raise ExpressionError(f"unexpected {token!r}")

    value = expr(0)
    if position != len(tokens):
        raise ExpressionError(f"unexpected {tokens[position]!r} after a complete expression")
    return (None if division_by_zero else value), numbers


def _check_params(num_numbers: int, max_number: int, max_target: int) -> None:
    if num_numbers < 2 or max_number < 1 or max_target < 1:
        raise ValueError(
            f"need num_numbers >= 2, max_number >= 1 and max_target >= 1; got num_numbers={num_numbers}, "
            f"max_number={max_number}, max_target={max_target}"
        )


def generate_level(
    seed: int, num_numbers: int = 4, max_number: int = 25, max_target: int = 100, max_attempts: int = 1000
) -> dict[str, Any]:
    """`{"numbers": [...], "target": int, "solution": str}`: a random expression tree over all the
    drawn numbers with positive integer intermediate results and a target in `[1, max_target]`."""
    _check_params(num_numbers, max_number, max_target)
    rng = np.random.default_rng(seed)
    for _ in range(max_attempts):
        numbers = rng.integers(1, max_number + 1, size=num_numbers).tolist()
        pool = [(n, str(n)) for n in numbers]
        while len(pool) > 1:
            i, j = rng.choice(len(pool), size=2, replace=False).tolist()
            (a, ta), (b, tb) = pool[i], pool[j]
            op = "+-*/"[int(rng.integers(4))]
            if op == "-" and a < b:
                (a, ta), (b, tb) = (b, tb), (a, ta)
            if op == "-" and a == b or op == "/" and (b == 1 or a % b):
                op = "+"
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
            pool = [item for k, item in enumerate(pool) if k not in (i, j)] + [(value, f"({ta} {op} {tb})")]
        target, solution = pool[0]
        if 1 <= target <= max_target:
            return {"numbers": numbers, "target": target, "solution": solution[1:-1]}
    raise RuntimeError(
        f"no countdown puzzle with target <= {max_target} for seed={seed} in {max_attempts} attempts; "
        "raise max_target or lower max_number"
    )


class CountdownEnv(TextActionEnv):
    """Countdown with a text answer; see the module docstring."""

    name = "countdown"
    example_answer = "(7 - 3) * 5 + 2"
    render_modes = ("text",)

    def __init__(
        self,
        num_numbers: int = 4,
        max_number: int = 25,
        max_target: int = 100,
        render_mode: str = "text",
        max_steps: int = 1,
        **kwargs,
    ):
        super().__init__(render_mode=render_mode, max_steps=max_steps, **kwargs)
        self.puzzle_params = {
            "num_numbers": int(num_numbers),
            "max_number": int(max_number),
            "max_target": int(max_target),
        }
        _check_params(**self.puzzle_params)

    def _reset(self, seed: int) -> None:
        self.puzzle = generate_level(seed, **self.puzzle_params)
        self.answer: str | None = None
        self.value: Fraction | None = None
        self.correct = False

    def _parse_actions(self, answer: str) -> tuple[list[str], bool]:
        expression = answer.split("=", 1)[0].strip()
        try:
            evaluate(expression)
        except ExpressionError:
            return [], False
        return [expression], True

    def _apply(self, action: str) -> tuple[float, bool]:
        value, used = evaluate(action)
        self.answer, self.value = action, value
        if sorted(used) != sorted(self.puzzle["numbers"]):
            return 0.0, True
        self.correct = value is not None and value == self.puzzle["target"]
        return (1.0 if self.correct else 0.1), True

    def _success(self) -> bool:
        return self.correct

    def _failed(self) -> bool:
        return self.answer is not None and not self.correct

    def _step_info(self) -> dict[str, Any]:
        return {"value": None if self.value is None else str(self.value), "target": self.puzzle["target"]}

    def state(self) -> dict[str, Any]:
        return {
            "numbers": list(self.puzzle["numbers"]),
            "target": self.puzzle["target"],
            "answer": self.answer,
            "value": None if self.value is None else str(self.value),
            "correct": self.correct,
        }

    def render_text(self) -> str:
        text = f"Numbers: {', '.join(map(str, self.puzzle['numbers']))}\nTarget: {self.puzzle['target']}"
        if self.answer is not None:
            value = "undefined (division by zero)" if self.value is None else str(self.value)
            text += f"\nYour expression {self.answer} = {value}."
        return text

    def render_image(self):
        raise NotImplementedError("countdown is text only; use render_mode='text'")

    def _actions_prompt(self) -> str:
        return ""

    def _task_prompt(self) -> str:
        return (
            "You are playing Countdown. Combine all the given numbers, each exactly once, with +, -, *, "
            "/ and parentheses so that the expression equals the target.\n"
            "Answer with the expression only, for example (7 - 3) * 5 + 2."
        )

    def _example_fields(self) -> dict[str, str]:
        return {
            "observation": "The numbers are 2, 3, 5, 7 and the target is 22.",
            "reasoning": "7 - 3 = 4, 4 * 5 = 20, 20 + 2 = 22.",
            "prediction": "The expression equals 22.",
        }
