"""Demonstrations for a supervised warm start: multi-turn episodes played by a scripted policy (the
env's imperfect `teacher_action` or its optimal `solve()`), written in the env's own response format
with short reasoning derived from the state.

    demos = collect_demos(cfg.env, "teacher", n=2000, max_turns=3, exclude=eval_level_keys(cfg.env, 1024))
    episodes = [demo_episode(d, make_env(cfg.env), encoder) for d in demos]   # token layout of `rollout`

A `Demo` holds text only (responses, rewards, success); `demo_episode` replays it through a fresh
env and builds the `Episode` exactly as `vagen.rollout.rollout` does, so SFT trains on the token
sequence RL later samples. Levels are identified by the env's `state()` at reset (not the seed):
duplicates are dropped and levels of evaluation seeds are never demonstrated.
"""

from __future__ import annotations

import copy
import functools
import importlib
import itertools
import json
from dataclasses import dataclass, field

import numpy as np

from envs_visual.base import format_response
from envs_visual.frozenlake import STYLE_ORDER
from envs_visual.grid import DIRECTIONS
from envs_visual.sokoban import teacher_decision
from vagen.episode import ChatEncoder, Episode, Turn, eval_seeds
from vagen.rollout import make_env

POLICIES = ("teacher", "solver", "random")  # random: a baseline, not for warm starts


@dataclass
class Demo:
    """One demonstrated episode: the responses given and what the env returned for them."""

    seed: int
    level: str  # level identity (the env's state at reset, as JSON)
    responses: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    success: bool = False

    @property
    def total_reward(self) -> float:
        return float(sum(self.rewards))


def level_key(env) -> str:
    """Identity of the current level: the env's plain-data state as canonical JSON."""
    return json.dumps(env.state(), sort_keys=True, default=list)


def eval_level_keys(cfg_env, n: int) -> set[str]:
    """Level identities of the first `n` evaluation seeds (`vagen.rollout.eval_seeds`)."""
    env = make_env(cfg_env, {"render_mode": "text"})
    keys = set()
    for seed in eval_seeds(n):
        env.reset(seed=seed)
        keys.add(level_key(env))
    return keys


def distinct_levels(env, n: int, seeds, exclude: set[str] = frozenset(), max_draws: int | None = None,
                    fix: str = "ask for fewer levels or use larger ones"):
    """Yield the first `n` of `seeds` (an iterable of ints) whose levels differ from each other and
    from `exclude` (level keys), with `env` reset to each one as it is yielded. Gives up after
    `max_draws` seeds (default 50·n) with an error that ends with `fix`."""
    seen, found = set(exclude), 0
    max_draws = max_draws or 50 * n
    for draws, seed in enumerate(seeds):
        if found == n:
            return
        if draws == max_draws:
            raise RuntimeError(f"only {found} new distinct {env.name} levels in {max_draws} seeds, {n} requested; {fix}")
        env.reset(seed=seed)
        key = level_key(env)
        if key not in seen:
            seen.add(key)
            found += 1
            yield seed


def distinct_eval_seeds(cfg_env, n: int, max_draws: int | None = None) -> list[int]:
    """The first `n` evaluation seeds whose levels differ from each other (small maps repeat)."""
    env = make_env(cfg_env, {"render_mode": "text"})
    return list(distinct_levels(env, n, (eval_seeds(1, offset)[0] for offset in itertools.count()),
                                max_draws=max_draws or 20 * n))


# -- reasoning ----------------------------------------------------------------------------------------

def _relative(dr: int, dc: int, rng: np.random.Generator) -> str:
    """`2 rows down and 1 column right` (or the terser `2 down and 1 right`)."""
    terse = bool(rng.integers(2))
    parts = []
    if dr:
        unit = "" if terse else (" row" if abs(dr) == 1 else " rows")
        parts.append(f"{abs(dr)}{unit} {'down' if dr > 0 else 'up'}")
    if dc:
        unit = "" if terse else (" column" if abs(dc) == 1 else " columns")
        parts.append(f"{abs(dc)}{unit} {'right' if dc > 0 else 'left'}")
    return (" and " if not terse else ", ").join(parts) if parts else "here"


_SIDES = {(-1, 0): ("above", "above me"), (1, 0): ("below", "below me"), (0, -1): ("left", "to my left"),
          (0, 1): ("right", "to my right")}


def _decision(actions: list[str], verb: str, rng: np.random.Generator) -> str:
    """The first move only: the answer lists them all, and responses must stay short."""
    first = actions[0].lower()
    return [f"I {verb} {first}.", f"So I {verb} {first}.", f"{actions[0]} first."][int(rng.integers(3))]


_STYLE_SENTENCES = {"rows": "Rows first.", "columns": "Columns first."}


def frozenlake_reasoning(state: dict, actions: list[str], rng: np.random.Generator,
                         style: str | None = None) -> dict[str, str]:
    """The teacher's axis preference (`style`, first, in the same words every turn), where the goal is
    relative to the player, which neighbours are holes, the next move."""
    (r, c), (gr, gc) = state["player"], state["goal"]
    holes = {tuple(h) for h in state["holes"]}
    near = [sides for (dr, dc), sides in _SIDES.items() if (r + dr, c + dc) in holes]
    goal = f"The goal is {_relative(gr - r, gc - c, rng)}." if rng.integers(2) else \
        f"Goal {_relative(gr - r, gc - c, rng)}."
    if len(near) == 1:
        danger = f"Hole {near[0][1]}." if rng.integers(2) else f"A hole is {near[0][1]}."
    elif near:
        danger = f"Holes {' and '.join(side for side, _ in near)}."
    else:
        danger = "No hole near." if rng.integers(2) else ""
    observation = f"I am at row {r}, column {c}; the goal is at row {gr}, column {gc}."
    reasoning = " ".join(p for p in (_STYLE_SENTENCES.get(style, ""), goal, danger, _decision(actions, "go", rng)) if p)
    return {"observation": observation, "reasoning": reasoning}


def sokoban_reasoning(state: dict, actions: list[str], rng: np.random.Generator,
                      style: str | None = None) -> dict[str, str]:
    """Where the nearest box off target is relative to the player and its target relative to the box."""
    r, c = state["player"]
    targets = set(map(tuple, state["targets"]))
    loose = [tuple(b) for b in state["boxes"] if tuple(b) not in targets] or [tuple(b) for b in state["boxes"]]
    box = min(loose, key=lambda b: abs(b[0] - r) + abs(b[1] - c))
    free = [t for t in targets if t not in set(map(tuple, state["boxes"]))] or sorted(targets)
    target = min(free, key=lambda t: abs(t[0] - box[0]) + abs(t[1] - box[1]))
    where_box = _relative(box[0] - r, box[1] - c, rng)
    where_target = _relative(target[0] - box[0], target[1] - box[1], rng)
    if rng.integers(2):
        text = f"The box is {where_box}; the target is {where_target} of it."
    else:
        text = f"Box {where_box}, target {where_target} of it."
    verb = "push" if _pushes(state, actions[0]) else "go"
    observation = f"I am at row {r}, column {c}; the box is at row {box[0]}, column {box[1]}."
    return {"observation": observation, "reasoning": f"{text} {_decision(actions, verb, rng)}"}


def _pushes(state: dict, action: str) -> bool:
    dr, dc = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}[action]
    r, c = state["player"]
    return (r + dr, c + dc) in set(map(tuple, state["boxes"]))


_BESIDE = {"Up": "above", "Down": "below", "Left": "left", "Right": "right"}


def frozenlake_path(states: list[dict], actions: list[str], style: str | None = None) -> dict[str, str]:
    """One clause per move of the turn, read along the path: the cell the move starts from, the
    moves toward the goal that the teacher (in `style`'s order) had to reject there because they
    enter a hole, and the move. `states[i]` is the state before `actions[i]`:
    `row 0, column 0: hole below, so right. row 0, column 1: down.` (lower case: `Ġrow` is one token
    of the built-in tokenizer, `Row` three)."""
    order = STYLE_ORDER[style or "rows"]
    gr, gc = states[0]["goal"]
    clauses = []
    for state, action in zip(states, actions):
        (r, c), holes = state["player"], {tuple(h) for h in state["holes"]}
        cell = {name: (r + dr, c + dc) for name, (dr, dc) in DIRECTIONS.items()}
        closer = [name for name in order
                  if abs(cell[name][0] - gr) + abs(cell[name][1] - gc) < abs(r - gr) + abs(c - gc)]
        considered = closer[: closer.index(action)] if action in closer else closer  # all of them before a fallback
        rejected = [_BESIDE[name] for name in considered if cell[name] in holes]
        why = f"{'holes' if len(rejected) > 1 else 'hole'} {' and '.join(rejected)}, so " if rejected else ""
        clauses.append(f"row {r}, column {c}: {why}{action.lower()}.")
    return {"observation": clauses[0], "reasoning": " ".join(clauses)}


def sokoban_path(states: list[dict], actions: list[str], style: str | None = None,
                 aims: bool = False) -> dict[str, str]:
    """Where the boxes and targets are, then one clause per move of the turn from the cell it starts
    on, pushing or going: `box at row 3, column 2; target at row 1, column 2. row 4, column 2: push
    up. row 3, column 2: go left.` With `aims` (sft.reasoning=plan), a move by which the teacher
    walks toward the cell it wants to push from also names that cell: `row 2, column 3: to row 4,
    column 2, go down.` (below the box, to push it up)."""
    def cells(key, one):
        where = sorted(tuple(x) for x in states[0][key])
        return f"{one if len(where) == 1 else key} at " + " and ".join(f"row {r}, column {c}" for r, c in where)

    clauses = [f"{cells('boxes', 'box')}; {cells('targets', 'target')}."]
    for state, action in zip(states, actions):
        r, c = state["player"]
        aim = ""
        if aims:
            wanted, mode, cell = teacher_decision(state)
            if mode == "approach" and wanted == action:
                aim = f"to row {cell[0]}, column {cell[1]}, "
        clauses.append(f"row {r}, column {c}: {aim}{'push' if _pushes(state, action) else 'go'} {action.lower()}.")
    return {"observation": clauses[0], "reasoning": " ".join(clauses)}


def navigation_reasoning(state: dict, actions: list[str], rng: np.random.Generator,
                         style: str | None = None) -> dict[str, str]:
    """How far the target is and the first move (the observation field comes from `describe_state`)."""
    return {"reasoning": f"The target is {state['distance']:.1f} m away. {_decision(actions, 'take', rng)}"}


def _gripper(holding: str | None, future: bool = False) -> str:
    if holding:
        return f"I {'will hold' if future else 'hold'} the {holding}."
    return "My gripper will be empty." if future else "My gripper is empty."


def manipulation_reasoning(state: dict, actions: list[str], rng: np.random.Generator,
                           style: str | None = None) -> dict[str, str]:
    """The task, what the gripper holds, and the first primitive (with its millimetres)."""
    now = _gripper(state["holding"])
    return {"observation": now, "reasoning": f"{state['instruction']} {now} {_decision(actions, 'do', rng)}"}


def manipulation_lookup(state: dict, actions: list[str], rng: np.random.Generator,
                        style: str | None = None) -> dict[str, str]:
    """`near`, with the listing's line of each object or goal the turn's actions go to (matched by its
    x and y) written before the first primitive: "purple cube (-60, -23, 20), goal (-142, -113, 0)." Its
    centre then follows its name as in the listing, and the answer repeats the reasoning's numbers."""
    from envs_visual.manipulation import _split
    from envs_visual.manipulation_teacher import copy_action

    listed = [(o["name"], o["position"]) for o in state["objects"]] + [("goal", g) for g in state["goals"]]
    lines: list[str] = []
    for action in actions:
        values = _split(action)[1]
        for name, position in listed:
            line = copy_action(name, position)
            if len(values) >= 2 and round(values[0]) == round(position[0]) and round(values[1]) == round(position[1]) \
                    and line not in lines:
                lines.append(line)
                break
    fields = manipulation_reasoning(state, actions, rng, style)
    if lines:
        now = _gripper(state["holding"])
        fields["reasoning"] = f"{state['instruction']} {now} {', '.join(lines)}. {_decision(actions, 'do', rng)}"
    return fields


REASONING = {"frozenlake": frozenlake_reasoning, "sokoban": sokoban_reasoning, "navigation": navigation_reasoning,
             "manipulation": manipulation_reasoning}
PATH_REASONING = {"frozenlake": frozenlake_path, "sokoban": sokoban_path}
PLAN_REASONING = {"sokoban": functools.partial(sokoban_path, aims=True)}
REASONING_KINDS = ("near", "path", "plan", "view", "lookup")
LOOKUP_REASONING = {"manipulation": manipulation_lookup}


def view_reasoning(env, actions: list[str], rng: np.random.Generator) -> dict[str, str]:
    """`view` reasoning: what the env's frame shows from its current pose, in the words of the env's
    question module (navigation: `vagen.warmstart.navigation_questions.view_words`), then the first move."""
    if env.name != "navigation":
        raise ValueError(f"no view reasoning for env {env.name!r}: it is written for navigation; use another "
                         f"sft.reasoning, or add a view_words function for it")
    from envs_visual.navigation_teacher import view_words

    return {"reasoning": f"{view_words(env)} {_decision(actions, 'take', rng)}"}


def reasoning(env_name: str, states: list[dict], actions: list[str], rng: np.random.Generator,
              style: str | None = None, kind: str = "near") -> dict[str, str]:
    """Fields of the <think> block for `actions` taken by a teacher of `style` (None: no style, e.g.
    the solver) in grid env `env_name`, `states[i]` being the state before `actions[i]`. `kind`:
    near (where the goal is from the turn's first cell, what is next to it, the first move), path
    (a clause per move, from the cell it starts on) or plan (path, with the cell the teacher heads
    for; Sokoban)."""
    if kind not in REASONING_KINDS:
        raise ValueError(f"unknown demonstration reasoning {kind!r}; choices: {', '.join(REASONING_KINDS)}")
    if kind == "view":
        raise ValueError("view reasoning is read from the env's pose, not from states: use demo_response")
    table = {"near": REASONING, "path": PATH_REASONING, "plan": PLAN_REASONING, "lookup": LOOKUP_REASONING}[kind]
    if env_name not in table:
        raise ValueError(f"no {kind} reasoning for env {env_name!r}: it is written for {', '.join(table)}; use "
                         f"one of them, another sft.reasoning, or add a function for it to vagen/warmstart/demos.py")
    if kind in ("path", "plan"):
        return table[env_name](states, actions, style)
    return table[env_name](states[0], actions, rng, style)


def _prediction(env_name: str, after: dict, success: bool) -> str:
    """The prediction of an env without state relations (`state_weights`)."""
    if env_name == "manipulation":
        return "The task will be done." if success else _gripper(after["holding"], future=True)
    if success:
        return "I am on the goal." if env_name == "frozenlake" else "The box is on the target."
    r, c = after["player"]
    return f"I am at row {r}, column {c}."


# -- playing ------------------------------------------------------------------------------------------

def _shadow(env):
    """A copy of `env` that only tracks the state: no sprites, text render, answer-only format."""
    sim = copy.copy(env)
    sim.__dict__ = {k: (None if k == "_sheet" else copy.deepcopy(v)) for k, v in env.__dict__.items()}
    sim.render_mode, sim.prompt_format = "text", "no_think"
    return sim


def teacher_styles(env) -> tuple:
    """The styles the env's teacher can be played in (its module's `TEACHER_STYLES`), or `(None,)`."""
    return getattr(importlib.import_module(type(env).__module__), "TEACHER_STYLES", (None,))


def _plan(env, policy: str, rng: np.random.Generator, style: str | None = None,
          slip: float | None = None) -> tuple[list[str], list[dict], dict, bool, str]:
    """Up to `max_actions_per_turn` actions from the env's current state, simulated on a shadow copy
    (the teacher with its share `slip` of random actions, None: its own); returns (actions, the state before each of them, state after them, success after them, the
    state after them in the env's words: `describe_state`, "" for an env without state relations)."""
    sim = _shadow(env)
    if policy == "solver":
        # no path (e.g. a slip into a dead end): one action keeps the response well-formed
        wanted = (env.solve() or [env.action_names[0]])[: env.max_actions_per_turn]
    elif policy == "random":
        count = int(rng.integers(1, env.max_actions_per_turn + 1))
        if env.action_names:
            wanted = [env.action_names[int(i)] for i in rng.integers(len(env.action_names), size=count)]
        else:  # actions with numbers (manipulation): the env draws them
            wanted = env.random_actions(rng, count)
    else:
        teach = importlib.import_module(type(env).__module__).teacher_action
        teacher = teach if style is None else functools.partial(teach, style=style)
        if slip is not None:
            teacher = functools.partial(teacher, slip=slip)
    actions, states, success = [], [], False
    for i in range(env.max_actions_per_turn):
        if policy != "teacher":
            if i == len(wanted):
                break
            action = wanted[i]
        else:
            action = teacher(sim.state(), rng)
        actions.append(action)
        states.append(sim.state())
        _, _, terminated, truncated, info = sim.step(f"<answer>{action}</answer>")
        success = bool(info["success"])
        if terminated or truncated:
            break
    return actions, states, sim.state(), success, sim.describe_state() if sim.state_weights else ""


def demo_response(env, policy: str, rng: np.random.Generator, style: str | None = None, kind: str = "near",
                  slip: float | None = None) -> str:
    """`policy`'s response to the env's current state, in `env.prompt_format` (the env is left as it
    is), the teacher with its share `slip` of random actions (None: its own). Envs with state relations
    observe and predict with `describe_state` (the state before and after the turn's actions), as the
    state grader wants."""
    actions, states, after, success, predicted = _plan(env, policy, rng, style, slip)
    if kind == "view":
        fields = view_reasoning(env, actions, rng)
    else:
        fields = reasoning(env.name, states, actions, rng, style, kind)
    if env.state_weights:  # graded fields: the true state before and after the turn, in the env's words
        fields["observation"], fields["prediction"] = env.describe_state(), predicted
    else:
        fields["prediction"] = _prediction(env.name, after, success)
    return format_response(env.prompt_format, ", ".join(actions), fields)


def play_demo(env, seed: int, policy: str, max_turns: int, style: str | None = None,
              draw_style: bool = False, kind: str = "near", slip: float | None = None) -> Demo:
    """Play one episode of `policy` (teacher | solver | random) on `env` from `seed`. A teacher with
    styles (`teacher_styles`) plays the given `style`, or with `draw_style` one drawn from the seed
    for the whole episode, and then says which in its reasoning; else its default style, unsaid.
    `kind`: what the reasoning says (`reasoning`); each turn's response is `demo_response`'s (with the
    teacher's share `slip` of random actions, None: its own)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown demonstration policy {policy!r}; choices: {', '.join(POLICIES)}")
    env.reset(seed=seed)
    demo = Demo(seed, level_key(env))
    rng = np.random.default_rng([seed, 7])
    if policy != "teacher":
        style = None
    elif style is None and draw_style:  # own generator: a drawn style's episode is the one played given it
        styles = teacher_styles(env)
        style = styles[int(np.random.default_rng([seed, 11]).integers(len(styles)))]
    for _ in range(max_turns):
        response = demo_response(env, policy, rng, style, kind, slip)
        _, reward, terminated, truncated, info = env.step(response)
        assert info["format_ok"], f"demonstration response does not parse: {response!r}"
        demo.responses.append(response)
        demo.rewards.append(float(reward))
        demo.success = bool(info["success"])
        if terminated or truncated:
            break
    return demo


def collect_demos(cfg_env, policy: str, n: int, max_turns: int, exclude: set[str] = frozenset(),
                  start_seed: int = 0, max_draws: int | None = None, draw_style: bool = False,
                  kind: str = "near", slip: float | None = None) -> list[Demo]:
    """`n` demonstrations on distinct levels from training seeds `start_seed, start_seed + 1, …`,
    skipping levels in `exclude` (e.g. `eval_level_keys`). Played in text render mode (same levels,
    same dynamics, no frames drawn)."""
    env = make_env(cfg_env, {"render_mode": "text"})
    return [play_demo(env, seed, policy, max_turns, draw_style=draw_style, kind=kind, slip=slip)
            for seed in distinct_levels(env, n, itertools.count(start_seed), exclude, max_draws,
                                        "ask for fewer demonstrations or use larger levels")]


def scripted_success(cfg_env, policy: str, seeds: list[int], max_turns: int,
                     draw_style: bool = False, slip: float | None = None) -> dict[str, float]:
    """Success rate and mean return of a scripted policy on `seeds` (one episode each); the teacher with
    its share `slip` of slips (None: its own)."""
    env = make_env(cfg_env, {"render_mode": "text"})
    return _rates([play_demo(env, seed, policy, max_turns, draw_style=draw_style, slip=slip) for seed in seeds])


def _rates(demos: list[Demo]) -> dict[str, float]:
    successes = sum(d.success for d in demos)
    return {"success": successes / len(demos), "return": sum(d.total_reward for d in demos) / len(demos),
            "successes": successes, "n": len(demos)}


def best_style_success(cfg_env, seeds: list[int], max_turns: int) -> dict[str, float] | None:
    """Success rate and mean return of the teacher when each level is played in whichever of its
    styles succeeds there (the first that does, else the first style): what a policy that has
    learned only to choose the style per level can reach. None for a teacher without styles."""
    env = make_env(cfg_env, {"render_mode": "text"})
    styles = teacher_styles(env)
    if len(styles) < 2:
        return None
    demos = []
    for seed in seeds:
        tries = [play_demo(env, seed, "teacher", max_turns, style=style) for style in styles]
        demos.append(next((d for d in tries if d.success), tries[0]))
    return _rates(demos)


def scripted_baselines(cfg, seeds: list[int]) -> dict[str, dict]:
    """The rows printed next to a learned policy on the same levels: random valid moves, the teacher
    (drawing its style per episode when `sft.teacher_styles`, slipping as `sft.teacher_slip` says: the
    demonstrations' teacher), the solver, the best blind plan and, for a teacher with styles, its best
    style per level."""
    turns = cfg.rollout.max_turns
    rows = {p: scripted_success(cfg.env, p, seeds, turns, cfg.sft.teacher_styles, cfg.sft.teacher_slip)
            for p in ("random", "teacher", "solver")}
    rows["blind"] = blind_success(cfg.env, seeds, turns)
    best_style = best_style_success(cfg.env, seeds, turns)
    if best_style:  # the teacher's styles differ by level: the ceiling of choosing the style
        rows["teacher, best style"] = best_style
    return rows


def blind_success(cfg_env, seeds: list[int], max_turns: int, candidates: int = 64) -> dict:
    """The best policy that never looks: each distinct solver solution of up to `candidates` training
    levels (evaluation levels excluded) is played open-loop on every level of `seeds` (chunks of
    `max_actions_per_turn` per turn); returns the best plan's success rate, mean return and the plan.
    A warm start near this rate has learned the common moves, not to read the observation."""
    env = make_env(cfg_env, {"render_mode": "text"})
    env.prompt_format = "no_think"
    plans, excluded, seed = [], set(), 0
    for eval_seed in seeds:
        env.reset(seed=eval_seed)
        excluded.add(level_key(env))
    while len(plans) < candidates and seed < 50 * candidates:
        env.reset(seed=seed)
        plan = env.solve() if level_key(env) not in excluded else None
        if plan and plan not in plans:
            plans.append(plan)
        seed += 1
    if not plans:
        raise RuntimeError(f"the {cfg_env.name} solver found no plan on {seed} training levels, so there is no "
                           f"blind baseline; check the env's solve()")
    per_turn = env.max_actions_per_turn
    best: dict = {}
    for plan in plans:
        successes, total = 0, 0.0
        for eval_seed in seeds:
            env.reset(seed=eval_seed)
            info = {"success": False}
            for start in range(0, min(len(plan), per_turn * max_turns), per_turn):
                _, reward, terminated, truncated, info = env.step(
                    f"<answer>{', '.join(plan[start:start + per_turn])}</answer>")
                total += reward
                if terminated or truncated:
                    break
            successes += bool(info["success"])
        if not best or successes / len(seeds) > best["success"]:
            best = {"success": successes / len(seeds), "return": total / len(seeds), "successes": successes,
                    "n": len(seeds), "plan": plan}
    return best


def demo_episode(demo: Demo, env, encoder: ChatEncoder, group_id: int = 0) -> Episode:
    """Replay `demo` through `env` (fresh, same params in any render mode) into an `Episode` built
    exactly as `rollout` builds one; raises if the env returns different rewards than recorded (a
    reward recorded as None is not checked)."""
    obs, _ = env.reset(seed=demo.seed)
    episode = Episode(env.name, demo.seed, group_id, env.system_prompt(), initial_observation=obs)
    for turn, (response, recorded) in enumerate(zip(demo.responses, demo.rewards)):
        ids, pixel_values, grids = encoder.user_segment(obs.text, obs.images, first=turn == 0,
                                                        system=episode.system_prompt)
        episode.input_ids += ids
        episode.pixel_values += pixel_values
        episode.image_grid_thw += grids
        generated, text = encoder.finish_response(encoder.encode_text(response))
        assert text == response, f"response does not survive tokenisation: {response!r} -> {text!r}"
        start = len(episode.input_ids)
        episode.input_ids += generated
        next_obs, reward, terminated, truncated, info = env.step(text)
        if recorded is not None and reward != recorded:
            raise RuntimeError(f"replaying seed {demo.seed} turn {turn}: reward {reward} but the demonstration "
                               f"recorded {recorded}; the env params differ from those the demos were made with")
        episode.turns.append(Turn(obs.text, obs.images, text, reward, info, (start, len(episode.input_ids)),
                                  len(generated)))
        episode.success = bool(info.get("success", False))
        obs = next_obs
        if terminated or truncated:
            break
    episode.done = True
    return episode
