"""Manipulation's teacher for demonstrations: the scripted expert's next action (`envs_visual.manipulation.plan`)
with its millimetres jittered, or, with `slip=0` (`sft.teacher_slip`), copied exactly from the observation's
listing of centres in the listing's own spelling (`copy_action`), so that a student's labels show a copy.
"""

from __future__ import annotations

import numpy as np


def copy_action(name: str, values) -> str:
    """An action in whole millimetres spelled as the observation spells a centre, a space before the
    bracket: `pick (-29, -6, 20)` holds the tokens of the listing's `orange cube (-29, -6, 20)`, while
    `pick(-29` splits its first number differently. The env reads both spellings."""
    return f"{name} {man._point(values)}"


def teacher_action(state: dict, rng: np.random.Generator, slip: float = 1.0) -> str:
    """A deliberately imperfect teacher: the expert's next action with its millimetres jittered
    (sd 8 mm, and one time in four a coordinate off by 40 mm), so some of its grasps, placements and
    pushes miss and it has to recover on later turns. It writes whole millimetres, as the observation
    lists the centres: tenths would be noise for a student to imitate. `slip` is the share of its
    actions jittered (the default, 1, jitters all); the others copy the expert's action exactly, in the
    listing's whole millimetres and spelling (`copy_action`): a picked cube's listed centre, a listed goal."""
    wanted = man.plan(state)
    if not wanted:
        return man.format_action("pick", 0, 0, man.CUBE / 2)
    name, values = man._split(wanted[0])
    if slip < 1.0 and (slip <= 0.0 or rng.random() >= slip):
        return copy_action(name, values)
    noisy = [v + float(rng.normal(0.0, 8.0)) for v in values]
    if rng.random() < 1 / 4:
        k = int(rng.integers(len(noisy)))
        if k % 3 != 2:  # a coordinate across the table, not a height
            noisy[k] += float(rng.choice([-40.0, 40.0]))
    for k in range(2, len(noisy), 3):
        noisy[k] = values[k]  # heights: the teacher reads those right
    return man.format_action(name, *(round(v) for v in noisy))


# manipulation.py re-exports this module's names at its end: imported last, the cycle resolves either way
from envs_visual import manipulation as man  # noqa: E402
