"""Perception questions about navigation frames, answered with one digit, and the same facts in the
words a demonstration's `<think>` uses.

Two questions, each answerable from the frame alone:

- "Where is the red table? 0 = not in view, 1 = on my left, 2 = ahead, 3 = on my right." Left and right
  are set by the image's token columns (`ahead_degrees`): "ahead" is the middle two columns, so at
  112x112 (4 columns over the 90-degree field of view) a bearing within 22.5 degrees, at 168x168
  (6 columns) within 15.
- "How many steps can you move ahead? 0, 1, 2, or 3 = three or more."

Frames are the poses a slip-free map teacher passes on a training level, turned to a random multiple of
the env's rotation so that the target is in view about half the time (at the teacher's turn starts it
is in view 40% of the time, at episode starts 22%).

    probes = navigation_probes(env, 3000, exclude=eval_level_keys(cfg.env, 1024))
    sample = question_sample(encoder, model, probes[0].frame, probes[0].question, probes[0].answer)
"""

from __future__ import annotations

import itertools

import numpy as np

from envs_visual.navigation_teacher import (  # noqa: F401 (what the frame shows, in the teacher's words)
    SIDES,
    STEP_WORDS,
    TOKEN_PIXELS,
    ahead_degrees,
    steps_ahead,
    target_side,
    view_words,
)
from vagen.warmstart.perception import Probe


def side_question(target: str) -> str:
    answers = ", ".join(f"{digit} = {words}" for digit, words in enumerate(SIDES))
    return f"Where is the {target}? {answers}.\n<image>"


def steps_question() -> str:
    return "How many steps can you move ahead? 0, 1, 2, or 3 = three or more.\n<image>"


def teacher_pose(env, rng: np.random.Generator, max_actions: int = 15) -> None:
    """Play the slip-free map teacher from the level's start for 0 to `max_actions` actions (stopping
    before success), then turn to a random multiple of the env's rotation, preferring with even odds a
    heading that shows the target or one that does not."""
    from envs_visual.navigation_teacher import teacher_action

    for _ in range(int(rng.integers(max_actions + 1))):
        action = teacher_action(env.state(), None, env.step_length, env.success_distance)
        _, _, terminated, truncated, _ = env.step(f"<answer>{action}</answer>")
        if terminated or truncated:
            break
    turns = max(1, round(360.0 / env.rotate_degrees))
    headings = [(env.yaw + k * env.rotate_degrees) % 360.0 for k in range(turns)]
    shows = []
    for yaw in headings:
        env.yaw = yaw
        shows.append(env._target_in_view() is not None)
    want = bool(rng.random() < 0.5)
    pool = [h for h, s in zip(headings, shows) if s == want] or headings
    env.yaw = pool[int(rng.integers(len(pool)))]


def navigation_probes(env, n: int, exclude: set[str] = frozenset(), start_seed: int = 0,
                      questions=("side", "steps"), max_actions: int = 15) -> list[Probe]:
    """`n` questions on distinct navigation levels from seeds `start_seed, …` (skipping `exclude`,
    `state_key`-style level keys as `vagen.warmstart.demos.level_key` gives), one per level, at a
    `teacher_pose`; the question (among `questions`: side, steps) is drawn from the seed. `env` is a
    `NavigationEnv` at the frame size the model will see."""
    from vagen.warmstart.demos import distinct_levels

    unknown = [q for q in questions if q not in ("side", "steps")]
    if unknown or not questions:
        raise ValueError(f"navigation questions {list(questions)}: choose among side, steps")
    probes = []
    for seed in distinct_levels(env, n, itertools.count(start_seed), exclude, None, "ask fewer questions"):
        rng = np.random.default_rng([seed, 31])
        teacher_pose(env, rng, max_actions)
        kind = questions[int(rng.integers(len(questions)))]
        if kind == "side":
            target = env.level.objects[env.level.target].description
            probes.append(Probe(seed, env.render_image(), side_question(target), target_side(env)))
        else:
            probes.append(Probe(seed, env.render_image(), steps_question(), steps_ahead(env)))
    return probes


def stage_probes(cfg, n: int, exclude: set[str] = frozenset()) -> list[Probe]:
    """The perception stage's questions (`vagen.warmstart.perception.stage_probes`): both questions,
    on frames of `cfg.env`'s size."""
    from vagen.rollout import make_env

    return navigation_probes(make_env(cfg.env, {"render_mode": "vision"}), n, exclude)
