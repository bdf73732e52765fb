"""Environments for multi-turn agents: grid worlds, 3D navigation and tabletop manipulation worlds,
and text-only tasks.

    env = envs_visual.make("sokoban", render_mode="vision")
    obs, info = env.reset(seed=7)
    obs, reward, terminated, truncated, info = env.step("<think>...</think><answer>Left</answer>")

Modules are imported on first use so that `import envs_visual` stays light (MuJoCo loads only
for navigation and manipulation).
"""

from __future__ import annotations

import importlib

from envs_visual.base import PROMPT_FORMATS, Observation, closest_choice_error, parse_response

# name -> "module:Class"
ENVS = {
    "sokoban": "envs_visual.sokoban:SokobanEnv",
    "frozenlake": "envs_visual.frozenlake:FrozenLakeEnv",
    "bandit": "envs_visual.bandit:BanditEnv",
    "countdown": "envs_visual.countdown:CountdownEnv",
    "navigation": "envs_visual.navigation:NavigationEnv",
    "manipulation": "envs_visual.manipulation:ManipulationEnv",
}


def env_class(name: str):
    if name not in ENVS:
        raise closest_choice_error("env", name, ENVS)
    module, cls = ENVS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def parameters(name: str) -> set[str]:
    """The keyword parameters environment `name` accepts (its constructors' along the class hierarchy)."""
    import inspect

    return {
        p.name
        for klass in env_class(name).__mro__
        if "__init__" in vars(klass)
        for p in inspect.signature(klass.__init__).parameters.values()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
    }


def make(name: str, **params):
    """Build environment `name` with `params`; unknown names or parameters raise ValueError naming
    the valid choices."""
    accepted = parameters(name)
    for key in params:
        if key not in accepted:
            raise closest_choice_error(f"parameter of env '{name}'", key, accepted)
    return env_class(name)(**params)


__all__ = ["ENVS", "PROMPT_FORMATS", "Observation", "env_class", "make", "parameters", "parse_response"]
