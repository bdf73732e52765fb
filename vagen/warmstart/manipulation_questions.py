"""A copy question about manipulation's observations, answered with the action that does it: "Which
action picks up the yellow cube?" after the observation's listing of centres, answered
`pick (94, 124, 20)`, the listed centre in its own spelling (`envs_visual.manipulation.copy_action`).

The observation lists every centre in whole millimetres, so a policy needs no vision to place a cube:
it needs to copy the named cube's line. The shipped teacher's labels never did (their first pick
equals the listed centre 0.5% of the time), and the built-in model learned the digits' marginal
distribution instead. This question asks for the copy alone; `benchmarks/vision_probe.py --env
manipulation` trains it as a probe.

    probes = copy_probes(env, 2000)
    sample = question_sample(encoder, model, probes[0].frame, probes[0].question, probes[0].answer)
"""

from __future__ import annotations

import itertools

import numpy as np

from vagen.warmstart.perception import Probe


def copy_question(listing: str, name: str) -> str:
    return f"{listing}\nWhich action picks up the {name}?\n<image>"


def copy_probes(env, n: int, exclude: set[str] = frozenset(), start_seed: int = 0,
                named: bool = False) -> list[Probe]:
    """`n` copy questions on distinct manipulation levels from seeds `start_seed, …` (skipping `exclude`),
    one per level, about one of its objects drawn from the seed, with the level's start frame. The
    answer is text: the pick action at the object's listed centre; `named`, the object's listing line
    first (`purple cube (-60, -23, 20), pick (-60, -23, 20)`), so that its centre follows its name as in
    the listing."""
    from envs_visual.manipulation import copy_action
    from vagen.warmstart.demos import distinct_levels

    probes = []
    for seed in distinct_levels(env, n, itertools.count(start_seed), exclude, None, "ask fewer questions"):
        state = env.state()
        obj = state["objects"][int(np.random.default_rng([seed, 37]).integers(len(state["objects"])))]
        answer = copy_action("pick", obj["position"])
        if named:
            answer = f"{copy_action(obj['name'], obj['position'])}, {answer}"
        probes.append(Probe(seed, env.render_image(), copy_question(env._describe(), obj["name"]), answer))
    return probes


def stage_probes(cfg, n: int, exclude: set[str] = frozenset()) -> list[Probe]:
    """The perception stage's questions (`vagen.warmstart.perception.stage_probes`, `sft.perception_steps`): copy
    questions on start frames of `cfg.env`'s task and size, answered with the object's listing line first when the
    demonstrations write it too (`sft.reasoning=lookup`)."""
    from vagen.rollout import make_env

    return copy_probes(make_env(cfg.env, {"render_mode": "vision"}), n, exclude, named=cfg.sft.reasoning == "lookup")
