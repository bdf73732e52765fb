"""Navigation's teacher for demonstrations: the map teacher (`teacher_action`) that plans over the whole
level, with a share `slip` of its actions random.

Its actions come from the map, not the frame: the target is in view at only about 40% of its turn
starts. A warm start that should read its frames learns from the slip-free teacher (`slip=0`, the
`sft.teacher_slip` setting) with a `<think>` that states what the frame shows
(`vagen.warmstart.navigation_questions.view_words`); slips cap whole 5-action answers at about half
and weaken the link between the frame and the answer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

TEACHER_SLIP = 0.15  # share of the teacher's actions drawn at random (a move or a turn)


def teacher_action(state: dict[str, Any], rng: np.random.Generator | None = None, step_length: float = 0.5,
                   success_distance: float = 1.0, slip: float = TEACHER_SLIP) -> str:
    """A deliberately imperfect teacher (for demonstrations): the step toward the target that `solve`
    counts fewest axis moves from, but only ever `moveahead`, turning first to face that cell (where
    the shortest plan would step sideways or back), and a share `slip` of the time (with `rng`; default
    `TEACHER_SLIP`) a random move or turn. `step_length` and `success_distance` are the env's (defaults
    here)."""
    moves = [*nav.MOVES, *nav.ROTATIONS]
    if rng is not None and slip > 0 and rng.random() < slip:
        return moves[int(rng.integers(len(moves)))]
    level, agent = nav.level_from_state(state), state["agent"]
    lattice = nav.build_lattice(level, (agent["x"], agent["y"]), step_length)
    dist = nav.grid_distances(lattice, nav._goal_cells(level, lattice, success_distance))
    cell = lattice.index(agent["x"], agent["y"])
    if cell is None or dist[cell] <= 0:
        return "rotateleft"
    i, j = cell
    closer = {(di, dj) for (di, dj), ok in lattice.moves.items()
              if ok[i, j] and dist[i + di, j + dj] == dist[i, j] - 1}
    for action, turn in (("moveahead", 0.0), ("rotateleft", 90.0), ("rotateright", -90.0), ("rotateleft", 180.0)):
        angle = math.radians(agent["yaw"] + turn)
        if (round(math.cos(angle)), round(math.sin(angle))) in closer:
            return action
    return "rotateleft"  # facing off the axes: turn until a step ahead leads closer


# navigation.py re-exports this module's names at its end: imported last, the cycle resolves either way
from envs_visual import navigation as nav  # noqa: E402

# What the frame shows, in the words of the teacher's <think> (sft.reasoning=view) and of the perception
# questions (vagen/warmstart/navigation_questions.py).
SIDES = ("not in view", "on my left", "ahead", "on my right")
STEP_WORDS = ("no steps", "1 step", "2 steps", "3 or more steps")
TOKEN_PIXELS = 28  # one image token of the built-in model and Qwen2-VL: 14-px patches merged 2x2


def ahead_degrees(env) -> float:
    """Half the width of "ahead" in degrees: one token column of the frame on either side of its centre
    (the horizontal field of view split into `image_width / 28` columns; one column when narrower)."""
    half_fov = math.degrees(math.atan(math.tan(math.radians(env.fov) / 2) * env.image_width / env.image_height))
    columns = max(2, env.image_width // TOKEN_PIXELS)
    return 2 * half_fov / columns


def target_side(env) -> int:
    """SIDES index of the target seen from the env's pose: 0 when it is not in view."""
    seen = env._target_in_view()
    if seen is None:
        return 0
    bearing, width = seen["bearing"], ahead_degrees(env)
    return 2 if abs(bearing) <= width else 1 if bearing > 0 else 3


def steps_ahead(env) -> int:
    """Free `moveahead` steps from the env's pose, 3 meaning three or more."""
    return min(env.free_steps(limit=3)["ahead"], 3)


def view_words(env) -> str:
    """What the frame shows, as a demonstration's `<think>` states it: where the target is and how far
    the agent can walk ahead, e.g. "The red table is on my left. 2 steps free ahead." No distances: the
    frame's 16-36 tokens cannot give them."""
    target = env.level.objects[env.level.target].description
    side = target_side(env)
    where = f"The {target} is not in view." if side == 0 else f"The {target} is {SIDES[side]}."
    steps = steps_ahead(env)
    return f"{where} {'Wall ahead' if steps == 0 else STEP_WORDS[steps].capitalize() + ' free ahead'}."
