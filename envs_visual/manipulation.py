"""Manipulation: tabletop tasks for a gripper commanded with primitive skills (MuJoCo).

A table holds two to four coloured objects: 40 mm cubes and, in the push task, a 60 mm block that
is wider than the gripper opens. White discs mark goals. The gripper hangs above the table; each
action is a primitive skill that a scripted controller carries out over simulated time (about a
second each): the hand is pulled along waypoints, a grasp holds by the fingers' contact and
friction, pushes shove by contact. Levels are a pure function of the seed (`generate_level`) and
every generated level is solved by the scripted expert (`plan`, `solve()`).

Tasks (`task=`; `any` draws one per seed):
- `place`: put the named cube on the goal (centre within 20 mm, resting on the table).
- `stack`: put one named cube on another (centres within 20 mm across, one cube height apart).
- `align`: line up three named cubes in a row (every centre within 10 mm of one straight line,
  at least 50 mm apart, all on the table).
- `push`: move the block onto the goal (centre within 20 mm); it cannot be picked up.

Coordinates are millimetres in the table's frame: the origin is the table top's centre, x grows to
the right in the image, y away from the camera, z up. A 40 mm cube resting on the table has its
centre at z = 20.

## Actions

Up to `max_actions_per_turn` (default 2) per turn, comma-separated, names case-insensitive,
numbers in millimetres (never `eval`'d; a strict pattern reads them):

- `pick(x, y, z)`: open the fingers, move above (x, y), lower the grasp point to z (stopping on
  whatever the fingers land on), close, lift to 150 mm. Picks up the object between the fingers.
- `place(x, y, z)`: carry the held object so that its centre goes to (x, y, z), lowering until it
  lands on something, then release and lift.
- `push(x1, y1, z1, x2, y2, z2)`: close the fingers, lower them at (x1, y1, z1) (they must not land
  on anything on the way down), sweep in a straight line to (x2, y2, z2), lift. The closed fingers
  are 20 mm across x and 40 mm across y.

Targets must lie in the workspace (x and y from -200 to 200, z from 0 to 250). A target outside it,
a pick with a full gripper or a place or push with the wrong one ends that primitive at once with a
message in the next observation; the action counts as taken but changes nothing.

## Observation

The instruction, the messages of the primitives just run, the gripper's position and what it holds,
and every object's centre and the goals in millimetres; in `render_mode="vision"` also one
`<image>`, a frame from a fixed camera in front of the table (`image_width` x `image_height`,
default 168 x 168: 6 x 6 image tokens). `state()` returns the same as plain data.
`info` adds `task`, `messages`, `holding`, `stage` (stages reached) and `sim_time` (simulated
seconds of the turn) to the shared keys. `info["state_key"]` (after `reset` and every `step`) is the
seed, what the gripper holds, the gripper's position, and each object's centre, yaw and tilt,
quantised: positions to 5 mm, angles to 5 degrees (yaw folded by the cube's 90-degree symmetry).
Objects settle by simulation, so an exact float key would match almost nothing but the start; 5 mm
is a quarter of the task tolerances (10-20 mm), well above the sub-millimetre jitter of a settled
object and well below the distance any primitive that moves an object moves it.

## Reward

`stage_reward` (default 1.0) once per stage reached: place and stack, first holding the cube to
move; align, first holding one of the three; push, the block half-way to the goal. `success_reward`
(default 10.0) on success, which ends the episode; an object knocked off the table ends it as
failed. Plus the shared format reward (0.5) for a well-formed response with valid actions. After
`max_steps` (default 12) primitives the episode is truncated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from envs_visual.base import TextActionEnv, check_choice
from envs_visual.manipulation_scene import BLOCK_SLOT, CUBE_SLOTS, TabletopScene
from envs_visual.navigation_scene import COLOURS as NAVIGATION_COLOURS

TASKS = ("place", "stack", "align", "push")
# Six colours of the navigation objects' palette (chosen to be far apart), one drawn per object.
COLOURS: dict[str, tuple[float, float, float]] = {
    name: NAVIGATION_COLOURS[name] for name in ("red", "green", "blue", "yellow", "purple", "orange")}
GOAL_RGBA = (0.97, 0.97, 0.97, 1.0)

CUBE, BLOCK = 40.0, 60.0  # object sides, mm
REACH_XY, REACH_Z = 200.0, (0.0, 250.0)  # the workspace, mm
PLACE_TOLERANCE = 20.0  # mm across, for place, stack and push
ALIGN_TOLERANCE = 10.0  # mm from the row's line
ALIGN_SPACING = 50.0  # mm between centres in a row at least
REST_TOLERANCE = 5.0  # mm: an object whose centre is this close to half its side above the table rests on it
FINGER_HALF_X, FINGER_HALF_Y = 10.0, 20.0  # the closed fingers' half extents, mm
PUSH_CLEARANCE = 15.0  # mm between the fingers and the block where a push starts
MOVED = 1.0  # mm: an object that moved less did not move
STATE_KEY_MM, STATE_KEY_DEGREES = 5.0, 5.0  # quanta of positions and angles in `state_key`

ARITY = {"pick": 3, "place": 3, "push": 6}
_NUMBER = r"[+-]?(?:\d{1,6}(?:\.\d{0,4})?|\.\d{1,4})"
_ACTION = re.compile(rf"\s*([A-Za-z]{{1,12}})\s*\(\s*({_NUMBER}(?:\s*,\s*{_NUMBER}){{0,9}})\s*\)\s*")
MAX_ANSWER_CHARS = 600


# -- level -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TableObject:
    name: str  # "red cube", "green block"
    colour: str
    kind: str  # cube | block
    slot: str  # the scene's body
    x: float  # mm, where it starts
    y: float

    @property
    def size(self) -> float:
        return BLOCK if self.kind == "block" else CUBE


@dataclass(frozen=True)
class Level:
    """One tabletop level as plain data (millimetres)."""

    seed: int
    task: str
    objects: tuple[TableObject, ...]
    goals: tuple[tuple[float, float], ...]
    roles: dict[str, Any] = field(hash=False)  # task-specific object names, e.g. {"top": ..., "base": ...}

    @property
    def instruction(self) -> str:
        r = self.roles
        if self.task == "place":
            return f"Put the {r['object']} on the goal."
        if self.task == "stack":
            return f"Stack the {r['top']} on the {r['base']}."
        if self.task == "align":
            a, b, c = r["row"]
            return f"Line up the {a}, the {b} and the {c} in a straight row."
        return f"Push the {r['object']} onto the goal."


def _far(p, others, distance: float) -> bool:
    return all(math.hypot(p[0] - q[0], p[1] - q[1]) >= distance for q in others)


def _band_clear(a, b, half_width: float, points) -> bool:
    """Whether no point lies within `half_width` of the segment a-b."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    d = b - a
    length2 = float(d @ d)
    for p in points:
        p = np.asarray(p, dtype=float)
        t = 0.0 if length2 == 0 else float(np.clip((p - a) @ d / length2, 0.0, 1.0))
        if np.linalg.norm(p - (a + t * d)) < half_width:
            return False
    return True


def _push_corridors(block, goal) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """The two legs of an x-then-y push, each extended behind its start to where the fingers go down."""
    (bx, by), (gx, gy) = block, goal
    behind = BLOCK / 2 + 2 * FINGER_HALF_Y + PUSH_CLEARANCE
    sx, sy = math.copysign(1.0, gx - bx), math.copysign(1.0, gy - by)
    return [((bx - sx * behind, by), (gx, by)), ((gx, by - sy * behind), (gx, gy))]


def _try_level(rng: np.random.Generator, seed: int, task: str, num_objects: int) -> Level | None:
    colours = [str(c) for c in rng.permutation(list(COLOURS))]
    spots: list[tuple[float, float]] = []
    goals: list[tuple[float, float]] = []

    def draw(limit: float, away: list, distance: float) -> tuple[float, float] | None:
        for _ in range(100):
            p = (round(float(rng.uniform(-limit, limit)), 1), round(float(rng.uniform(-limit, limit)), 1))
            if _far(p, away, distance):
                return p
        return None

    objects: list[TableObject] = []
    if task == "push":
        block = draw(120.0, [], 0.0)
        goal = draw(120.0, [block], 90.0)
        if goal is None or abs(goal[0] - block[0]) < 15 or abs(goal[1] - block[1]) < 15:
            return None  # both legs of the push are real moves
        goals.append(goal)
        objects.append(TableObject(f"{colours[0]} block", colours[0], "block", BLOCK_SLOT, *block))
        spots.append(block)
        corridors = _push_corridors(block, goal)
        for k in range(num_objects - 1):
            p = draw(150.0, spots + goals, 90.0)
            if p is None or not all(_band_clear(a, b, BLOCK / 2 + CUBE / 2 + 25.0, [p]) for a, b in corridors):
                return None
            objects.append(TableObject(f"{colours[k + 1]} cube", colours[k + 1], "cube", CUBE_SLOTS[k], *p))
            spots.append(p)
    else:
        for k in range(num_objects):
            p = draw(150.0, spots, 85.0)
            if p is None:
                return None
            objects.append(TableObject(f"{colours[k]} cube", colours[k], "cube", CUBE_SLOTS[k], *p))
            spots.append(p)
        if task == "place":
            goal = draw(150.0, spots, 70.0)
            if goal is None or not _far(goal, spots[:1], 100.0):
                return None
            goals.append(goal)
    names = [o.name for o in objects]
    if task in ("place", "push"):
        roles = {"object": names[0]}
    elif task == "stack":
        roles = {"top": names[0], "base": names[1]}
    else:
        roles = {"row": names[:3]}
        if row_error(np.array(spots[:3])) < 3 * ALIGN_TOLERANCE:
            return None  # already nearly in a row
    return Level(seed, task, tuple(objects), tuple(goals), roles)


def generate_level(seed: int, task: str = "any", num_objects: int | None = None) -> Level:
    """The level for `seed`: a pure function of its arguments (`np.random.default_rng(seed)`).

    `task="any"` draws the task from the seed; `num_objects` (2-4; align 3-4) is drawn when None.
    Objects start upright at least 85 mm apart, the goal of `place` at least 100 mm from its cube,
    and the path of the expert's push (along x, then along y) is clear of the other cubes.
    """
    check_choice("task", task, (*TASKS, "any"))
    rng = np.random.default_rng(seed)
    if task == "any":
        task = TASKS[int(rng.integers(len(TASKS)))]
    low = 3 if task == "align" else 2
    if num_objects is not None and not low <= int(num_objects) <= 4:
        raise ValueError(f"num_objects must be in {low}..4 for task {task!r} (the scene holds four cubes), "
                         f"got {num_objects}")
    for _ in range(500):
        n = int(num_objects) if num_objects is not None else int(rng.integers(low, 5))
        level = _try_level(rng, int(seed), task, n)
        if level is not None:
            return level
    raise RuntimeError(f"no {task} level for seed {seed} with num_objects={num_objects} after 500 tries; "
                       "use fewer objects")


# -- success checks ----------------------------------------------------------------------------
def row_error(points: np.ndarray) -> float:
    """Largest distance (mm) of the points [N, 2] from their best-fitting straight line."""
    centred = points - points.mean(0)
    _, _, vt = np.linalg.svd(centred)
    return float(np.abs(centred @ vt[1]).max())


def _rests(obj: dict) -> bool:
    return abs(obj["position"][2] - obj["size"] / 2) <= REST_TOLERANCE


def _across(a, b) -> float:
    return math.hypot(a[0] - b[0], a[1] - b[1])


def task_success(state: dict) -> bool:
    """Whether the state (`state()`) meets its task; nothing may be held."""
    if state["holding"] is not None:
        return False
    objects = {o["name"]: o for o in state["objects"]}
    roles, task = state["roles"], state["task"]
    if task in ("place", "push"):
        obj = objects[roles["object"]]
        return _rests(obj) and _across(obj["position"], state["goals"][0]) <= PLACE_TOLERANCE
    if task == "stack":
        top, base = objects[roles["top"]], objects[roles["base"]]
        height = top["position"][2] - base["position"][2]
        return (_rests(base) and _across(top["position"], base["position"]) <= PLACE_TOLERANCE
                and abs(height - CUBE) <= 2 * REST_TOLERANCE)
    row = [objects[name] for name in roles["row"]]
    points = np.array([o["position"][:2] for o in row])
    spread = min(_across(a, b) for i, a in enumerate(points) for b in points[i + 1:])
    return all(_rests(o) for o in row) and spread >= ALIGN_SPACING and row_error(points) <= ALIGN_TOLERANCE


# -- actions -----------------------------------------------------------------------------------
def _round(value: float) -> float:
    return round(float(value), 1) + 0.0  # + 0.0: no "-0.0" in the plain-data state


def _mm(value: float) -> str:
    """Millimetres to 0.1 mm without exponents or a trailing ".0": 20, -4.5, 1234567."""
    text = f"{float(value):.1f}".removesuffix(".0")
    return "0" if text == "-0" else text


def _point(values) -> str:
    """A position for the observation text: whole millimetres."""
    return "(" + ", ".join(str(round(float(v)) + 0) for v in values) + ")"


def format_action(name: str, *values: float) -> str:
    """The canonical spelling of an action, e.g. `pick(50, -20.5, 20)`."""
    return f"{name}({', '.join(_mm(v) for v in values)})"


def parse_actions(answer: str, limit: int) -> tuple[list[str], bool]:
    """Read up to `limit` comma-separated primitives from `answer` into their canonical spelling.
    Returns (actions, all_read_were_valid); reading stops at the first malformed one. Never raises."""
    if not isinstance(answer, str) or len(answer) > MAX_ANSWER_CHARS:
        return [], False
    actions: list[str] = []
    position = 0
    while len(actions) < limit:
        match = _ACTION.match(answer, position)
        if match is None:
            return actions, False
        name = match.group(1).lower()
        values = [float(v) for v in match.group(2).split(",")]
        if name not in ARITY or len(values) != ARITY[name]:
            return actions, False
        actions.append(format_action(name, *values))
        position = match.end()
        if position == len(answer):
            break
        if answer[position] != ",":
            return actions, False
        position += 1
    return actions, len(actions) > 0


def _split(action: str) -> tuple[str, list[float]]:
    name, args = action[:-1].split("(")
    return name, [float(v) for v in args.split(",")]


def out_of_reach(values: list[float]) -> str | None:
    """Why one of the targets (x, y, z triples) is outside the workspace, or None."""
    for k in range(0, len(values), 3):
        x, y, z = values[k:k + 3]
        if abs(x) > REACH_XY or abs(y) > REACH_XY or not REACH_Z[0] <= z <= REACH_Z[1]:
            return (f"({_mm(x)}, {_mm(y)}, {_mm(z)}) is outside the workspace (x and y from {-REACH_XY:g} to "
                    f"{REACH_XY:g}, z from {REACH_Z[0]:g} to {REACH_Z[1]:g} mm)")
    return None


# -- the scripted expert -------------------------------------------------------------------------
def _position(state: dict, name: str) -> list[float]:
    return next(o["position"] for o in state["objects"] if o["name"] == name)


def _free_spot(state: dict, mover: str, prefer, taken=()) -> tuple[float, float]:
    """A table spot at least 75 mm from every other object, the goals and `taken`, nearest `prefer`."""
    others = [o["position"][:2] for o in state["objects"] if o["name"] != mover]
    others += [g[:2] for g in state["goals"]] + [t[:2] for t in taken]
    grid = np.arange(-160.0, 161.0, 10.0)
    candidates = sorted(((x, y) for x in grid for y in grid), key=lambda p: _across(p, prefer))
    for p in candidates:
        if _far(p, others, 75.0):
            return p
    raise RuntimeError(f"no free spot on the table for the {mover}; this is a bug in the level generator")


def _put_down(state: dict) -> list[str]:
    """Place whatever is held on a free spot near where it is."""
    held = state["holding"]
    x, y = _free_spot(state, held, _position(state, held))
    return [format_action("place", x, y, CUBE / 2)]


def _move(state: dict, name: str, x: float, y: float, z: float) -> list[str]:
    pick = [] if state["holding"] == name else [format_action("pick", *_position(state, name))]
    return pick + [format_action("place", x, y, z)]


def _clear_above(state: dict, name: str) -> list[str]:
    """Move anything resting on `name` to a free spot (one object; the expert re-plans)."""
    here = _position(state, name)
    for o in state["objects"]:
        if o["name"] != name and _across(o["position"], here) < CUBE and o["position"][2] > here[2] + CUBE / 2:
            x, y = _free_spot(state, o["name"], o["position"])
            return _move(state, o["name"], x, y, CUBE / 2)
    return []


def _push_plan(state: dict, name: str) -> list[str]:
    obj = next(o for o in state["objects"] if o["name"] == name)
    (bx, by, _), (gx, gy) = obj["position"], state["goals"][0][:2]
    half = obj["size"] / 2 * (abs(math.cos(math.radians(obj["yaw"]))) + abs(math.sin(math.radians(obj["yaw"]))))
    z = CUBE / 2
    plan = []
    if abs(gx - bx) > 3.0:
        s = math.copysign(1.0, gx - bx)
        plan.append(format_action("push", bx - s * (half + FINGER_HALF_X + PUSH_CLEARANCE), by, z,
                                  gx - s * (half + FINGER_HALF_X), by, z))
    if abs(gy - by) > 3.0:
        s = math.copysign(1.0, gy - by)
        plan.append(format_action("push", gx, by - s * (half + FINGER_HALF_Y + PUSH_CLEARANCE), z,
                                  gx, gy - s * (half + FINGER_HALF_Y), z))
    return plan


def _align_plan(state: dict) -> list[str]:
    row = state["roles"]["row"]
    best: list[str] | None = None
    for anchor in [name for name in row if name != state["holding"]]:  # the anchor stays where it rests
        ax, ay, _ = _position(state, anchor)
        plan: list[str] = []
        taken = [(ax, ay)]
        others = [o["position"][:2] for o in state["objects"] if o["name"] not in row]
        for name in row:
            if name == anchor:
                continue
            x, y, z = _position(state, name)
            if abs(y - ay) <= 2.0 and _far((x, y), taken, ALIGN_SPACING + 15) and abs(z - CUBE / 2) <= REST_TOLERANCE:
                taken.append((x, y))
                continue
            # the nearest free slot on the row: clear of the row so far, of every object still where it
            # is (but the mover) and of the workspace's edge
            blockers = taken + others + [_position(state, n)[:2] for n in row if n not in (name, anchor)]
            slots = sorted(np.arange(-160.0, 161.0, 5.0), key=lambda sx: abs(sx - x))
            slot = next((sx for sx in slots if _far((sx, ay), blockers, 75.0)), None)
            if slot is None:
                plan = None
                break
            plan += _move(state, name, float(slot), ay, CUBE / 2)
            taken.append((float(slot), ay))
        if plan is not None and (best is None or len(plan) < len(best)):
            best = plan
    if best is None:
        raise RuntimeError("no free slots for a row; this is a bug in the level generator")
    return best


def plan(state: dict) -> list[str]:
    """The scripted expert: actions that solve the task from `state` (`ManipulationEnv.state()`),
    computed from the true poses; [] once solved. Re-planned every turn, it also recovers from
    grasps and pushes that landed off target."""
    if task_success(state):
        return []
    roles, task, held = state["roles"], state["task"], state["holding"]
    if task in ("place", "stack"):
        mover = roles["object"] if task == "place" else roles["top"]
        if held is not None and held != mover:
            return _put_down(state)
        cleared = _clear_above(state, mover) if held is None else []
        if cleared:
            return cleared
        if task == "place":
            gx, gy = state["goals"][0][:2]
            return _move(state, mover, gx, gy, CUBE / 2)
        base = roles["base"]
        cleared = _clear_above(state, base) if held is None else []
        if cleared:
            return cleared
        bx, by, bz = _position(state, base)
        if abs(bz - CUBE / 2) > REST_TOLERANCE and held is None:  # the base is not on the table
            x, y = _free_spot(state, base, (bx, by))
            return _move(state, base, x, y, CUBE / 2)
        return _move(state, mover, bx, by, bz + CUBE)
    if held is not None and (task == "push" or held not in roles["row"]):
        return _put_down(state)
    if task == "push":
        return _push_plan(state, roles["object"])
    return _align_plan(state)


# -- environment ---------------------------------------------------------------------------------
class ManipulationEnv(TextActionEnv):
    """Tabletop manipulation with primitive skills on MuJoCo. See the module docstring."""

    name = "manipulation"
    action_names = ()  # actions carry numbers: `_parse_actions` reads them
    example_answer = "pick(50, -30, 20), place(-80, 40, 20)"

    def __init__(
        self,
        prompt_format: str = "free_think",
        render_mode: str = "vision",
        max_actions_per_turn: int = 2,
        max_steps: int = 12,
        format_reward: float = 0.5,
        format_penalty: float = 0.0,
        ineffective_penalty: float = 0.0,
        task: str = "any",
        num_objects: int | None = None,
        stage_reward: float = 1.0,
        success_reward: float = 10.0,
        image_width: int = 168,
        image_height: int = 168,
    ):
        super().__init__(prompt_format, render_mode, max_actions_per_turn, max_steps, format_reward, format_penalty,
                         ineffective_penalty)
        self.task = task
        self.num_objects = num_objects
        self.stage_reward, self.success_reward = float(stage_reward), float(success_reward)
        self.image_width, self.image_height = int(image_width), int(image_height)
        if not (16 <= self.image_width <= 1024 and 16 <= self.image_height <= 1024):
            raise ValueError(f"image size must be 16..1024 pixels a side, got {image_width}x{image_height}")
        generate_level(0, task, num_objects)  # fail at construction, not at the first reset, on bad parameters
        self.level: Level | None = None
        self.scene = TabletopScene(self.image_width, self.image_height)
        self.holding: str | None = None  # the slot in the gripper
        self.messages: list[str] = []
        self.stages: set[str] = set()
        self.turn_time = 0.0
        self._start_distance = 0.0
        self._frame: tuple[tuple, np.ndarray] | None = None
        self._names: dict[str, TableObject] = {}

    # -- hooks of TextActionEnv -------------------------------------------------------------------
    def reset(self, seed: int | None = None):
        obs, info = super().reset(seed)
        info.update(self._step_info())
        return obs, info

    def _reset(self, seed: int) -> None:
        self.level = generate_level(seed, self.task, self.num_objects)
        self._names = {o.name: o for o in self.level.objects}
        self.scene.load([(o.slot, (*COLOURS[o.colour], 1.0), o.x / 1000, o.y / 1000) for o in self.level.objects],
                        [(x / 1000, y / 1000, GOAL_RGBA) for x, y in self.level.goals])
        self.holding = None
        self.messages = []
        self.stages = set()
        self.turn_time = 0.0
        self._frame = None
        if self.level.task == "push":
            obj = self._names[self.level.roles["object"]]
            self._start_distance = _across((obj.x, obj.y), self.level.goals[0])

    def _apply(self, action: str) -> tuple[float, bool]:
        name, values = _split(action)
        before = {o.name: self.scene.position(o.slot) for o in self.level.objects}
        held_before = self.holding
        t0 = self.scene.sim_time
        self.messages.append(f"{action}: {self._run(name, values)}")
        self.turn_time += self.scene.sim_time - t0
        self._frame = None
        moved = any(np.linalg.norm(self.scene.position(self._names[n].slot) - p) * 1000 > MOVED
                    for n, p in before.items())
        state = self.state()
        reward = 0.0
        for stage in self._stages_reached(state):
            if stage not in self.stages:
                self.stages.add(stage)
                reward += self.success_reward if stage == "success" else self.stage_reward
        return reward, moved or self.holding != held_before

    def _run(self, name: str, values: list[float]) -> str:
        """Carry out one primitive; returns what happened, for the next observation."""
        scene = self.scene
        unreachable = out_of_reach(values)
        if unreachable:
            return f"not done: {unreachable}."
        target = [v / 1000 for v in values]
        if name == "pick":
            if self.holding is not None:
                return f"not done: the gripper already holds the {self._label(self.holding)}; place it first."
            outcome = scene.pick(*target)
            if outcome.grasped is not None:
                self.holding = outcome.grasped
                return f"picked up the {self._label(outcome.grasped)}."
            landed = "" if outcome.landed_at is None else (
                f"the fingers landed on something at z = {_mm(outcome.landed_at * 1000)} and ")
            return f"{landed}the gripper closed on nothing."
        if name == "place":
            if self.holding is None:
                return "not done: the gripper holds nothing; pick an object first."
            slot, self.holding = self.holding, None
            scene.place(slot, *target)
            x, y, z = (scene.position(slot) * 1000).tolist()
            return f"released the {self._label(slot)}; it rests at ({_mm(x)}, {_mm(y)}, {_mm(z)})."
        if self.holding is not None:
            return f"not done: the gripper holds the {self._label(self.holding)}; place it before pushing."
        before = {o.slot: scene.position(o.slot) for o in self.level.objects}
        outcome = scene.push(target[:3], target[3:])
        if not outcome.ok:
            return (f"stopped: the fingers landed on something at z = {_mm(outcome.landed_at * 1000)} before "
                    "reaching the start; start a push beside the object, not over it.")
        moved = [f"the {self._label(slot)} to ({', '.join(_mm(v * 1000) for v in scene.position(slot))})"
                 for slot, p in before.items() if np.linalg.norm(scene.position(slot) - p) * 1000 > MOVED]
        return f"pushed {' and '.join(moved)}." if moved else "the sweep touched nothing."

    def _label(self, slot: str) -> str:
        return next(o.name for o in self.level.objects if o.slot == slot)

    def _stages_reached(self, state: dict) -> list[str]:
        roles, task = self.level.roles, self.level.task
        reached = []
        held = state["holding"]
        if task == "place" and held == roles["object"] or task == "stack" and held == roles["top"]:
            reached.append("holding")
        if task == "align" and held in roles["row"]:
            reached.append("holding")
        if task == "push":
            position = _position(state, roles["object"])
            if _across(position, self.level.goals[0]) <= self._start_distance / 2:
                reached.append("half-way")
        if task_success(state):
            reached.append("success")
        return reached

    def _success(self) -> bool:
        return self.level is not None and task_success(self.state())

    def _failed(self) -> bool:
        return self.level is not None and any(self.scene.position(o.slot)[2] < -0.01 for o in self.level.objects)

    def _step_info(self) -> dict[str, Any]:
        return {
            "task": self.level.task,
            "messages": list(self.messages),
            "holding": None if self.holding is None else self._label(self.holding),
            "stage": len(self.stages),
            "sim_time": round(self.turn_time, 3),
        }

    def _describe(self) -> str:
        """The gripper, the objects and the goals in millimetres."""
        state = self.state()
        holding = f"holding the {state['holding']}" if state["holding"] else "empty"
        lines = [f"Gripper {_point(state['gripper'])}, {holding}. Centres in mm:"]
        lines += [f"{o['name']} {_point(o['position'])}" for o in state["objects"]]
        lines += [f"goal {_point(g)}" for g in state["goals"]]
        return "\n".join(lines)

    def _initial_prompt(self) -> str:
        listing = f"\n{self._describe()}" if self.render_mode == "vision" else ""
        return f"{self.level.instruction}{listing}\nCurrent observation:"

    def _turn_prompt(self, info: dict[str, Any]) -> str:
        done = "\n".join(self.messages) or "No actions executed."
        self.messages, self.turn_time = [], 0.0
        warning = ("" if info["action_is_valid"] else
                   "Your response did not follow the required format or held an invalid action. ")
        listing = f"\n{self._describe()}" if self.render_mode == "vision" else ""
        return f"{warning}{done}\n{self.level.instruction}{listing}\nCurrent observation:"

    def _parse_actions(self, answer: str) -> tuple[list[str], bool]:
        return parse_actions(answer, self.max_actions_per_turn)

    def _actions_prompt(self) -> str:
        return f"You may take up to {self.max_actions_per_turn} actions per turn, separated by ','."

    def _example_fields(self) -> dict[str, str]:
        return {
            "observation": "The red cube is at (50, -30, 20) and the goal at (-80, 40, 0); the gripper is empty.",
            "reasoning": "I pick the red cube where it is and place it on the goal, its centre 20 mm up.",
            "prediction": "The red cube will rest on the goal at about (-80, 40, 20).",
            "think": "I pick the red cube at (50, -30, 20) and place it on the goal at (-80, 40).",
        }

    def _task_prompt(self) -> str:
        view = "a picture of the table from the front and " if self.render_mode == "vision" else ""
        return "\n".join([
            "You control a robot gripper above a table with coloured cubes (40 mm) and maybe a block (60 mm, "
            "too wide to pick up). Goals are white discs. Tasks: put a cube on the goal, stack one cube on "
            f"another, line up three cubes in a straight row, push the block onto the goal. You see {view}the "
            "positions in mm: x to the right, y away from you, z up; a cube on the table has z = 20.",
            "Actions (mm; x, y from -200 to 200, z from 0 to 250):",
            "- pick(x, y, z): lower the open fingers to (x, y, z), close, lift.",
            "- place(x, y, z): move the held object's centre to (x, y, z), lower until it lands, release.",
            "- push(x1, y1, z1, x2, y2, z2): lower the closed fingers (20 mm across x, 40 mm across y) at "
            "(x1, y1, z1) beside an object, sweep straight to (x2, y2, z2).",
            f"Reward: {self.stage_reward:g} per stage reached, {self.success_reward:g} on success; at most "
            f"{self.max_steps} actions.",
        ])

    # -- plain-data views -----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The level and the poses as plain data (millimetres, degrees; JSON-serialisable)."""
        self._require_reset("state")
        objects = []
        for o in self.level.objects:
            position = self.scene.position(o.slot) * 1000
            objects.append({
                "name": o.name, "colour": o.colour, "kind": o.kind, "size": o.size,
                "position": [_round(v) for v in position],
                "yaw": _round(self.scene.yaw(o.slot)),
                "tilt": _round(self.scene.tilt(o.slot)),
            })
        return {
            "seed": self.seed,
            "task": self.level.task,
            "instruction": self.level.instruction,
            "roles": dict(self.level.roles),
            "objects": objects,
            "goals": [[x, y, 0.0] for x, y in self.level.goals],
            "holding": None if self.holding is None else self._label(self.holding),
            "gripper": [_round(v) for v in self.scene.hand() * 1000],
            "steps": self.steps,
            "done": self.done,
        }

    def state_key(self) -> tuple:
        """The quantised state (module docstring): `(seed, holding, gripper, objects)` with each object
        as `(name, x, y, z, yaw, tilt)` in quanta of 5 mm and 5 degrees."""
        self._require_reset("state_key")
        scene = self.scene

        def mm(values) -> tuple[int, ...]:
            return tuple(round(float(v) * 1000 / STATE_KEY_MM) for v in values)

        folds = round(90.0 / STATE_KEY_DEGREES)
        objects = tuple((o.name, *mm(scene.position(o.slot)),
                         round(scene.yaw(o.slot) / STATE_KEY_DEGREES) % folds,
                         round(scene.tilt(o.slot) / STATE_KEY_DEGREES)) for o in self.level.objects)
        holding = None if self.holding is None else self._label(self.holding)
        return (self.seed, holding, mm(scene.hand()), objects)

    def set_object(self, name: str, x: float, y: float, z: float | None = None) -> None:
        """Put object `name` upright at (x, y, z) mm, at rest (z: resting on the table); for tests and
        hand-made scenes."""
        self._require_reset("set_object")
        if name not in self._names:
            raise ValueError(f"no object {name!r} in this level; objects: {', '.join(self._names)}")
        self.scene.set_object(self._names[name].slot, x / 1000, y / 1000, None if z is None else z / 1000)
        self._frame = None

    def _require_reset(self, what: str) -> None:
        if self.level is None:
            raise RuntimeError(f"{self.name}: call reset(seed=...) before {what}()")

    def random_actions(self, rng: np.random.Generator, count: int) -> list[str]:
        """`count` primitives, each kind equally likely, with every coordinate uniform over the workspace."""
        actions = []
        for _ in range(count):
            name = list(ARITY)[int(rng.integers(len(ARITY)))]
            points = [(rng.uniform(-REACH_XY, REACH_XY), rng.uniform(-REACH_XY, REACH_XY), rng.uniform(*REACH_Z))
                      for _ in range(ARITY[name] // 3)]
            actions.append(format_action(name, *(round(float(v)) for point in points for v in point)))
        return actions

    def solve(self) -> list[str]:
        """The scripted expert's actions from the current state (`plan`); [] once solved or done."""
        self._require_reset("solve")
        if self.done:
            return []
        return plan(self.state())

    # -- renders --------------------------------------------------------------------------------
    def render_frame(self) -> np.ndarray:
        """RGB frame [image_height, image_width, 3] uint8 from the front camera (cached per state)."""
        self._require_reset("render_frame")
        key = (self.seed, self.scene.sim_time, self.scene.data.qpos.tobytes())
        if self._frame is None or self._frame[0] != key:
            self._frame = (key, self.scene.render())
        return self._frame[1]

    def render_image(self) -> Image.Image:
        return Image.fromarray(self.render_frame())

    def render_text(self) -> str:
        self._require_reset("render_text")
        return self._describe()

    def close(self) -> None:
        """Free the renderer (its GL context); the env can render again after, at the cost of a new one."""
        self.scene.close()
        self._frame = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: nothing left to free)
            pass


# the teacher lives in its own module; imported last, as it builds on this one's expert
from envs_visual.manipulation_teacher import copy_action, teacher_action  # noqa: E402, F401
