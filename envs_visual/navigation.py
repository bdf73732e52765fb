"""Navigation: walk through one to a few connected rooms to a described piece of furniture.

A level is a rectangular floor split by internal walls with doorways into rooms, holding objects
of distinct shapes and colours (`assets/navigation/*.xml`). The agent is a camera at eye height.
The instruction names one object by colour and shape ("Navigate to the red table."); that pair is
unique in the level. Levels are a pure function of the seed (`generate_level`) and every level
is solvable within `max_steps` (checked by the planner when it is generated).

The world is MuJoCo, rendered offscreen with `mujoco.Renderer` (`MUJOCO_GL=egl` by default, set
before mujoco is imported; `osmesa` also works), so it runs on any CPU. Collisions use an
occupancy map derived from the same geometry the scene is built from: walls and object footprints
as rectangles, the agent as a disc of radius `AGENT_RADIUS`.

## Actions

Up to `max_actions_per_turn` (default 5) per turn, comma-separated, case-insensitive:

- `moveahead`, `moveback`, `moveleft`, `moveright`: step `step_length` (default 0.5 m) forward,
  backward, left or right without turning. A step that would touch a wall or an object is blocked:
  the pose stays, and the action is not effective.
- `rotateleft`, `rotateright`: turn `rotate_degrees` (default 90) in place (left = counter-clockwise).
- `lookup`, `lookdown`: tilt the camera `look_degrees` (default 30), at most `MAX_PITCH` (60) either
  way; tilting past the limit is not effective.

Headings: yaw 0 faces +x (east on the top-down map), 90 faces +y (north).

## Observation

Vision mode: the instruction and one first-person RGB frame (`image_width` x `image_height`,
default 128 x 128, vertical field of view `fov`, default 90 degrees). Text mode: the instruction and
a description of the view: heading, how many steps are free in each direction, and the objects in
the field of view (not behind a wall) with their distance and direction.
`render_topdown()` draws the map with the agent's path; `render_video_frame()` puts it beside the
first-person frame. `state()` returns the level and the pose as plain data.
`state_relations()` gives the target as `(description, a, b)` when it is in view (as the text
observation lists it, `visible_objects()`), else nothing: `a` is "ahead" when the text would say
"straight ahead" (|bearing| < 5 degrees), else "left" or "right"; `b` is "near" when the distance
the text prints (one decimal) is at most `NEAR_DISTANCE` (2.0 m), else "far". `describe_state()`
says it in the text observation's words ("The red table is 30 degrees to my left, far, 3.2 m
away."); the state grader weighs the target 1.0 (`state_weights`).
`info` adds `distance` (metres from the camera to the closest point of the target's footprint),
`pose`, `target` and `blocked` (blocked moves this turn) to the shared keys.
`info["state_key"]` (after `reset` and every `step`) is `(seed, x, y, yaw, pitch)` with x and y in
whole millimetres and yaw (mod 360) and pitch in tenths of a degree, rounded: the level is the
seed's and the pose is the whole state. Poses are sums of `step_length` moves and `rotate_degrees` /
`look_degrees` turns kept to 1e-9, so the same pose reached along different paths gets the same key,
while distinct reachable poses are at least a step (or a turn) apart, far more than the quantum.

## Reward

`success_reward` (default +10) when the agent gets within `success_distance` (default 1.0 m) of the
target's footprint, which ends the episode; plus the shared format reward for a well-formed
response. After `max_steps` (default 30) executed actions the episode is truncated.
`solve()` returns a shortest action list to the target (breadth-first search on the grid of
positions `step_length` apart, moving only along the room's axes). `teacher_action(state, rng)` is
a cheap imperfect policy for demonstrations: it follows the fewest axis moves to the target but only
ever steps ahead, turning first to face the next cell, and one time in `TEACHER_SLIP` moves or turns
at random.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from envs_visual.base import TextActionEnv
from envs_visual.navigation_level import (  # noqa: F401  (re-exported: the level is part of this module's API)
    AGENT_RADIUS,
    DOOR_WIDTH,
    MIN_ROOM_WIDTH,
    SAMPLE_SPACING,
    WALL_THICKNESS,
    Lattice,
    Level,
    NavObject,
    _goal_cells,
    build_lattice,
    generate_level,
    grid_distances,
    level_from_state,
    points_free,
    rect_distance,
    segments_free,
    target_distance,
)
from envs_visual.navigation_scene import (
    COLOURS,
    FLOOR_RGB,
    OBJECT_KINDS,
    WALL_HEIGHT,
    WALL_RGB,
    NavigationScene,
)
from envs_visual.state_grader import NEAR_DISTANCE, egocentric_vocabulary

STATE_KEY_METRES = 0.001  # quantum of x and y in `state_key`
STATE_KEY_DEGREES = 0.1  # quantum of yaw and pitch in `state_key`
MAX_PITCH = 60.0  # degrees up or down
ROUND_OBJECTS = ("lamp", "ball", "barrel")  # drawn as discs on the top-down map

MOVES = {"moveahead": 0.0, "moveleft": 90.0, "moveback": 180.0, "moveright": 270.0}
ROTATIONS = {"rotateleft": 1.0, "rotateright": -1.0}
LOOKS = {"lookup": 1.0, "lookdown": -1.0}


# -- environment ---------------------------------------------------------------------------------
def _compass(yaw: float) -> str:
    names = ["east", "north-east", "north", "north-west", "west", "south-west", "south", "south-east"]
    k = yaw / 45.0
    return names[round(k) % 8] if abs(k - round(k)) < 1e-6 else f"{yaw:g} degrees counter-clockwise from east"


def _positive(name: str, value, upper: float | None = None) -> float:
    value = float(value)
    if not value > 0 or (upper is not None and value > upper):
        bound = f" and at most {upper:g}" if upper is not None else ""
        raise ValueError(f"{name} must be > 0{bound}, got {value}")
    return value


class NavigationEnv(TextActionEnv):
    """Navigate to a described object in rooms rendered by MuJoCo. See the module docstring."""

    name = "navigation"
    action_names = ("moveahead", "moveback", "moveleft", "moveright", "rotateleft", "rotateright", "lookup",
                    "lookdown")
    example_answer = "moveahead, moveahead, rotateleft"

    def __init__(
        self,
        prompt_format: str = "free_think",
        render_mode: str = "vision",
        max_actions_per_turn: int = 5,
        max_steps: int = 30,
        format_reward: float = 0.5,
        format_penalty: float = 0.0,
        ineffective_penalty: float = 0.0,
        step_length: float = 0.5,
        rotate_degrees: float = 90.0,
        look_degrees: float = 30.0,
        success_distance: float = 1.0,
        success_reward: float = 10.0,
        num_objects: int = 6,
        max_rooms: int = 2,
        image_width: int = 128,
        image_height: int = 128,
        fov: float = 90.0,
        eye_height: float = 1.5,
    ):
        super().__init__(prompt_format, render_mode, max_actions_per_turn, max_steps, format_reward, format_penalty,
                         ineffective_penalty)
        self.step_length = _positive("step_length", step_length, 1.0)
        self.rotate_degrees = _positive("rotate_degrees", rotate_degrees, 180.0)
        self.look_degrees = _positive("look_degrees", look_degrees, MAX_PITCH)
        self.success_distance = _positive("success_distance", success_distance)
        self.success_reward = float(success_reward)
        self.num_objects, self.max_rooms = int(num_objects), int(max_rooms)
        self.fov = _positive("fov", fov, 170.0)
        self.eye_height = _positive("eye_height", eye_height, WALL_HEIGHT - 0.05)
        self.image_width, self.image_height = int(image_width), int(image_height)
        if not (16 <= self.image_width <= 2048 and 16 <= self.image_height <= 2048):
            raise ValueError(f"image size must be 16..2048 pixels a side, got {image_width}x{image_height}")
        generate_level(0, self.num_objects, self.max_rooms, self.step_length, self.success_distance,
                       self.max_steps)  # fail at construction, not at the first reset, on bad parameters
        self.level: Level | None = None
        self.x = self.y = self.yaw = self.pitch = 0.0
        self.path: list[tuple[float, float]] = []
        self._turn_log: list[tuple[str, bool]] = []
        self._scene: NavigationScene | None = None
        self._scene_level: Level | None = None
        self._frame: tuple[tuple, np.ndarray] | None = None
        self._obstacles = np.zeros((0, 4))
        self._lattices: dict[tuple, Lattice] = {}

    # -- hooks of TextActionEnv -------------------------------------------------------------------
    def reset(self, seed: int | None = None):
        obs, info = super().reset(seed)
        info.update(self._step_info())
        return obs, info

    def _reset(self, seed: int) -> None:
        self.level = generate_level(seed, self.num_objects, self.max_rooms, self.step_length,
                                    self.success_distance, self.max_steps)
        self._obstacles = self.level.obstacles()
        self._lattices = {}
        self.x, self.y, self.yaw = self.level.start
        self.pitch = 0.0
        self.path = [(self.x, self.y)]
        self._turn_log = []

    def _apply(self, action: str) -> tuple[float, bool]:
        effective = True
        if action in MOVES:
            angle = math.radians(self.yaw + MOVES[action])
            dx, dy = round(math.cos(angle), 12) * self.step_length, round(math.sin(angle), 12) * self.step_length
            nx, ny = round(self.x + dx, 9), round(self.y + dy, 9)
            if segments_free(self.level, np.array([[self.x, self.y]]), np.array([[nx, ny]]), self._obstacles)[0]:
                self.x, self.y = nx, ny
                self.path.append((nx, ny))
            else:
                effective = False
        elif action in ROTATIONS:
            self.yaw = round((self.yaw + ROTATIONS[action] * self.rotate_degrees) % 360.0, 9) % 360.0
        else:
            pitch = round(self.pitch + LOOKS[action] * self.look_degrees, 9)
            effective = abs(pitch) <= MAX_PITCH + 1e-9
            self.pitch = pitch if effective else self.pitch
        self._turn_log.append((action, effective))
        return (self.success_reward if effective and self._success() else 0.0), effective

    def _success(self) -> bool:
        return self.level is not None and self.distance() <= self.success_distance + 1e-9

    def _step_info(self) -> dict[str, Any]:
        return {
            "distance": round(self.distance(), 4),
            "pose": self.pose(),
            "target": self.level.objects[self.level.target].description,
            "blocked": sum(1 for a, ok in self._turn_log if a in MOVES and not ok),
        }

    def _initial_prompt(self) -> str:
        return f"{self.level.instruction}\nCurrent observation:"

    def _turn_prompt(self, info: dict[str, Any]) -> str:
        done = ", ".join(f"{a} (blocked)" if a in MOVES and not ok else a for a, ok in self._turn_log) or "none"
        self._turn_log = []
        warning = ("" if info["action_is_valid"] else
                   "Your response did not follow the required format or named an invalid action. ")
        return f"{warning}Executed actions: {done}.\n{self.level.instruction}\nCurrent observation:"

    def _example_fields(self) -> dict[str, str]:
        return {
            "observation": "A red table is ahead on the left, about 2 m away; a wall is close on my right.",
            "reasoning": "The red table is ahead-left, so I move ahead twice and turn left to face it.",
            "prediction": "The red table will be in the middle of my view, about 1 m away.",
        }

    def _task_prompt(self) -> str:
        view = ("Each observation is the picture from your camera." if self.render_mode == "vision" else
                "Each observation describes your heading, the free steps around you and the objects in view "
                "with distance and direction (degrees to your left or right).")
        return "\n".join([
            "You are a robot in a home with one or more rooms joined by doorways. Your task looks like "
            f"'Navigate to the red table.': move until you are within {self.success_distance:g} m of that "
            "object. " + view,
            f"Objects are {', '.join(OBJECT_KINDS)}; colours are {', '.join(COLOURS)}.",
            "Actions:",
            f"- moveahead, moveback, moveleft, moveright: step {self.step_length:g} m forward, backward, left "
            "or right without turning; walls and furniture block a step.",
            f"- rotateleft, rotateright: turn {self.rotate_degrees:g} degrees left or right in place.",
            f"- lookup, lookdown: tilt the camera {self.look_degrees:g} degrees (at most {MAX_PITCH:g} either "
            "way).",
            f"Reward: {self.success_reward:g} for reaching the object. The episode ends after {self.max_steps} "
            "actions.",
        ])

    # -- plain-data views -----------------------------------------------------------------------
    def distance(self) -> float:
        """Metres from the camera to the closest point of the target's footprint."""
        return target_distance(self.level, self.x, self.y)

    def pose(self) -> dict[str, float]:
        return {"x": self.x, "y": self.y, "yaw": self.yaw, "pitch": self.pitch}

    def state(self) -> dict[str, Any]:
        """The level and the agent as plain data (JSON-serialisable)."""
        self._require_reset("state")
        level = self.level.to_dict()
        return {
            "seed": self.seed,
            "instruction": level["instruction"],
            "room": {"width": level["width"], "depth": level["depth"], "wall_height": WALL_HEIGHT},
            "walls": [list(w) for w in level["walls"]],
            "doors": [list(d) for d in level["doors"]],
            "objects": [{**o, "footprint": list(o["footprint"])} for o in level["objects"]],
            "target": level["target"],
            "agent": self.pose(),
            "start": list(level["start"]),
            "distance": self.distance(),
            "path": [list(p) for p in self.path],
            "steps": self.steps,
            "done": self.done,
        }

    def state_key(self) -> tuple[int, int, int, int, int]:
        """`(seed, x, y, yaw, pitch)` quantised (module docstring): equal for equal poses in a level."""
        self._require_reset("state_key")
        yaw_steps = round(360.0 / STATE_KEY_DEGREES)
        return (self.seed, round(self.x / STATE_KEY_METRES), round(self.y / STATE_KEY_METRES),
                round(self.yaw / STATE_KEY_DEGREES) % yaw_steps, round(self.pitch / STATE_KEY_DEGREES))

    def set_pose(self, x: float, y: float, yaw: float | None = None, pitch: float | None = None) -> None:
        """Put the agent at (x, y) (for tests and scripted views); raises if the pose collides."""
        self._require_reset("set_pose")
        x, y = round(float(x), 9), round(float(y), 9)
        if not points_free(self.level, x, y, self._obstacles):
            raise ValueError(f"pose ({x}, {y}) touches a wall or an object (agent radius {AGENT_RADIUS} m); "
                             "pick a free point, e.g. from state()['start']")
        self.x, self.y = x, y
        self.yaw = self.yaw if yaw is None else float(yaw) % 360.0
        self.pitch = self.pitch if pitch is None else float(np.clip(pitch, -MAX_PITCH, MAX_PITCH))
        self.path.append((x, y))

    def _require_reset(self, what: str) -> None:
        if self.level is None:
            raise RuntimeError(f"{self.name}: call reset(seed=...) before {what}()")

    # -- state description ----------------------------------------------------------------------
    @property
    def state_weights(self) -> dict[str, float]:
        """The state grader's weights: the target (by its description) only; {} before `reset`."""
        return {self.level.objects[self.level.target].description: 1.0} if self.level is not None else {}

    def _target_in_view(self) -> dict[str, Any] | None:
        target = self.level.objects[self.level.target].description
        return next((o for o in self.visible_objects() if o["description"] == target), None)

    def state_relations(self) -> list[tuple[str, str, str]]:
        """[(target description, left | right | ahead, near | far)] when the target is in view, else []."""
        if self.level is None:
            return []
        seen = self._target_in_view()
        if seen is None:
            return []
        b = seen["bearing"]
        side = "ahead" if abs(b) < 5 else "left" if b > 0 else "right"
        near = float(f"{seen['distance']:.1f}") <= NEAR_DISTANCE
        return [(seen["description"], side, "near" if near else "far")]

    def state_vocabulary(self):
        """The target's description, its shape alone and "target"; other objects' descriptions are
        recognised so that what is said about them is not taken for the target."""
        target = self.level.objects[self.level.target]
        names: dict[str, str | None] = {f"{c} {k}": None for k in OBJECT_KINDS for c in COLOURS}
        names.update({target.description: target.description, target.kind: target.description,
                      "target": target.description, "target object": target.description})
        return egocentric_vocabulary(names)

    def describe_state(self, relations=None) -> str:
        """The target in the text observation's words, or that it is not in view. `relations` (from
        `state_relations`, default the current ones) give the words; the degrees and metres are read
        from the current pose when its relations are those given, else left out."""
        self._require_reset("describe_state")
        target = self.level.objects[self.level.target].description
        current = self.state_relations()
        relations = current if relations is None else [tuple(r) for r in relations]
        if not relations:
            return f"The {target} is not in view."
        _, side, dist = relations[0]
        seen = self._target_in_view() if relations == current else None
        if side == "ahead":
            where = "straight ahead"
        elif seen is not None:
            where = f"{abs(seen['bearing']):.0f} degrees to my {side}"
        else:
            where = f"on my {side}"
        metres = f", {seen['distance']:.1f} m away" if seen is not None else ""
        return f"The {target} is {where}, {dist}{metres}."

    # -- planner --------------------------------------------------------------------------------
    def solve(self) -> list[str]:
        """A shortest list of actions from the current pose to success ([] when already there or done).

        Breadth-first search over (grid position, heading): positions `step_length` apart anchored at
        the agent, moves only along the room's axes, rotations as actions. Shortest overall when
        `rotate_degrees` is a multiple of 90."""
        self._require_reset("solve")
        if self.done or self._success():
            return []
        s = self.step_length
        key = (round(self.x % s, 6), round(self.y % s, 6))
        if key not in self._lattices:
            self._lattices[key] = build_lattice(self.level, (self.x, self.y), s)
        lattice = self._lattices[key]
        goal = _goal_cells(self.level, lattice, self.success_distance)
        start = lattice.index(self.x, self.y)
        if start is None:
            raise RuntimeError(f"agent at ({self.x}, {self.y}) is not on its own lattice; this is a bug")
        start_state = (*start, round(self.yaw % 360.0, 6))
        parents: dict[tuple, tuple | None] = {start_state: None}
        queue = deque([start_state])
        while queue:
            state = queue.popleft()
            i, j, yaw = state
            if goal[i, j]:
                actions = []
                while parents[state] is not None:
                    state, action = parents[state]
                    actions.append(action)
                return actions[::-1]
            for action in self.action_names[:6]:
                if action in ROTATIONS:
                    nxt = (i, j, round((yaw + ROTATIONS[action] * self.rotate_degrees) % 360.0, 6) % 360.0)
                else:
                    angle = math.radians(yaw + MOVES[action])
                    di, dj = round(math.cos(angle), 12), round(math.sin(angle), 12)
                    if (abs(di), abs(dj)) not in ((1.0, 0.0), (0.0, 1.0)) or not lattice.moves[(int(di), int(dj))][i, j]:
                        continue
                    nxt = (i + int(di), j + int(dj), yaw)
                if nxt not in parents:
                    parents[nxt] = (state, action)
                    queue.append(nxt)
        raise RuntimeError(f"no path to the target from ({self.x}, {self.y}) in level {self.seed}; "
                           "generate_level guarantees one from the start, so the agent has walled itself "
                           "off (impossible with the built-in actions) or this is a bug")

    # -- renders --------------------------------------------------------------------------------
    def render_frame(self) -> np.ndarray:
        """First-person RGB frame [image_height, image_width, 3] uint8 (cached per pose)."""
        self._require_reset("render_frame")
        key = (self.level.seed, id(self.level), self.x, self.y, self.yaw, self.pitch)
        if self._frame is not None and self._frame[0] == key:
            return self._frame[1]
        if self._scene is None:
            num_walls = 4 + 2 * (self.max_rooms - 1)
            self._scene = NavigationScene(num_walls, self.image_width, self.image_height, self.fov, self.eye_height)
        if self._scene_level is not self.level:
            objects = [{"kind": o.kind, "colour": o.colour, "x": o.x, "y": o.y, "yaw": o.yaw}
                       for o in self.level.objects]
            self._scene.load(self.level.width, self.level.depth, self.level.walls, objects)
            self._scene_level = self.level
        frame = self._scene.render(self.x, self.y, self.yaw, self.pitch)
        self._frame = (key, frame)
        return frame

    def render_image(self) -> Image.Image:
        return Image.fromarray(self.render_frame())

    def visible_objects(self) -> list[dict[str, Any]]:
        """Objects whose centre lies in the horizontal field of view and not behind a wall, nearest
        first: description, distance (m, to the footprint), bearing (degrees, positive = left)."""
        self._require_reset("visible_objects")
        half_fov = math.degrees(math.atan(math.tan(math.radians(self.fov) / 2) * self.image_width
                                          / self.image_height))
        walls = np.array(self.level.walls[4:] or np.zeros((0, 4)))  # inner walls (the first 4 are outer)
        out = []
        for obj in self.level.objects:
            cx, cy = (obj.footprint[0] + obj.footprint[2]) / 2, (obj.footprint[1] + obj.footprint[3]) / 2
            bearing = (math.degrees(math.atan2(cy - self.y, cx - self.x)) - self.yaw + 180.0) % 360.0 - 180.0
            if abs(bearing) > half_fov or _segment_hits_rects(self.x, self.y, cx, cy, walls):
                continue
            dist = float(rect_distance(self.x, self.y, np.array([obj.footprint]))[0])
            out.append({"description": obj.description, "distance": round(dist, 2), "bearing": round(bearing, 1)})
        return sorted(out, key=lambda o: o["distance"])

    def free_steps(self, limit: int = 20) -> dict[str, int]:
        """How many steps each move could take in a row from here (up to `limit`)."""
        self._require_reset("free_steps")
        out = {}
        n = max(1, round(self.step_length / SAMPLE_SPACING))
        t = np.arange(1, limit * n + 1) * (self.step_length / n)
        for action, offset in MOVES.items():
            angle = math.radians(self.yaw + offset)
            ok = points_free(self.level, self.x + t * math.cos(angle), self.y + t * math.sin(angle),
                             self._obstacles)
            blocked = np.flatnonzero(~ok)
            free = blocked[0] if len(blocked) else len(t)
            out[action.removeprefix("move")] = int(free // n)
        return out

    def render_text(self) -> str:
        self._require_reset("render_text")
        look = ("level" if abs(self.pitch) < 1e-9 else
                f"{abs(self.pitch):g} degrees {'up' if self.pitch > 0 else 'down'}")
        steps = self.free_steps()
        lines = [
            f"You face {_compass(self.yaw)}, camera tilted {look}.",
            "Free steps: " + ", ".join(f"{k} {v}" for k, v in steps.items()) + ".",
        ]
        seen = self.visible_objects()
        if not seen:
            lines.append("No objects in view.")
        else:
            lines.append("Objects in view:")
            for obj in seen:
                b = obj["bearing"]
                where = "straight ahead" if abs(b) < 5 else f"{abs(b):.0f} degrees to your {'left' if b > 0 else 'right'}"
                lines.append(f"- the {obj['description']}: {obj['distance']:.1f} m away, {where}")
        return "\n".join(lines)

    def render_topdown(self, size: int = 256) -> Image.Image:
        """Map of the level seen from above (north up): walls, objects in their colours, the target
        ringed in black, the start as a small square, the path and the agent with its heading."""
        self._require_reset("render_topdown")
        level, margin = self.level, 0.3
        scale = size / (max(level.width, level.depth) + 2 * margin)
        w, h = round((level.width + 2 * margin) * scale), round((level.depth + 2 * margin) * scale)

        def px(x: float, y: float) -> tuple[float, float]:
            return ((x + margin) * scale, h - (y + margin) * scale)

        def box(rect) -> list[float]:
            (x0, y1), (x1, y0) = px(rect[0], rect[1]), px(rect[2], rect[3])
            return [x0, y0, x1, y1]

        rgb = lambda c: tuple(int(255 * v) for v in c)  # noqa: E731
        img = Image.new("RGB", (w, h), (40, 40, 40))
        draw = ImageDraw.Draw(img)
        draw.rectangle(box((0, 0, level.width, level.depth)), fill=rgb(FLOOR_RGB))
        for wall in level.walls:
            draw.rectangle(box(wall), fill=rgb(WALL_RGB))
        for k, obj in enumerate(level.objects):
            shape = draw.ellipse if obj.kind in ROUND_OBJECTS else draw.rectangle
            outline, width = ((0, 0, 0), max(2, size // 100)) if k == level.target else (None, 1)
            shape(box(obj.footprint), fill=rgb(COLOURS[obj.colour]), outline=outline, width=width)
        sx, sy = px(*level.start[:2])
        draw.rectangle([sx - 3, sy - 3, sx + 3, sy + 3], outline=(255, 255, 255))
        if len(self.path) > 1:
            draw.line([px(*p) for p in self.path], fill=(255, 255, 255), width=max(1, size // 128))
        ax, ay = px(self.x, self.y)
        r = AGENT_RADIUS * scale
        draw.ellipse([ax - r, ay - r, ax + r, ay + r], fill=(20, 20, 20))
        yaw = math.radians(self.yaw)
        draw.line([(ax, ay), (ax + 2 * r * math.cos(yaw), ay - 2 * r * math.sin(yaw))], fill=(255, 255, 255),
                  width=max(1, size // 128))
        return img

    def render_video_frame(self, with_topdown: bool = True, size: int = 256) -> Image.Image:
        """The first-person frame scaled to `size` pixels high, with the top-down map beside it."""
        frame = self.render_image()
        frame = frame.resize((round(size * frame.width / frame.height), size), Image.NEAREST)
        if not with_topdown:
            return frame
        topdown = self.render_topdown(size)
        out = Image.new("RGB", (frame.width + topdown.width, max(size, topdown.height)), (0, 0, 0))
        out.paste(frame, (0, 0))
        out.paste(topdown, (frame.width, 0))
        return out

    def close(self) -> None:
        """Free the renderer (its GL context); the env can render again after, at the cost of a new one."""
        if self._scene is not None:
            self._scene.close()
        self._scene = self._scene_level = self._frame = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: nothing left to free)
            pass


def _segment_hits_rects(x0: float, y0: float, x1: float, y1: float, rects: np.ndarray) -> bool:
    """Whether the segment (x0, y0)-(x1, y1) passes through any rectangle (slab test)."""
    if len(rects) == 0:
        return False
    d = np.array([x1 - x0, y1 - y0])
    lo, hi = np.zeros(len(rects)), np.ones(len(rects))
    for axis, origin in ((0, x0), (1, y0)):
        rmin, rmax = rects[:, axis], rects[:, axis + 2]
        if abs(d[axis]) < 1e-12:
            outside = (origin < rmin) | (origin > rmax)
            hi = np.where(outside, -1.0, hi)
            continue
        t0, t1 = (rmin - origin) / d[axis], (rmax - origin) / d[axis]
        lo, hi = np.maximum(lo, np.minimum(t0, t1)), np.minimum(hi, np.maximum(t0, t1))
    return bool(np.any(lo <= hi))


# the teacher lives in its own module; imported last, as it builds on this one's level geometry
from envs_visual.navigation_teacher import TEACHER_SLIP, teacher_action  # noqa: E402, F401
