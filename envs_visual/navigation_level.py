"""Navigation levels: the floor plan, rooms, doorways and objects of a seed (`generate_level`), the
collision geometry, and the lattice of poses `step_length` apart that the planner and the teacher search.
A pure function of the seed; `envs_visual.navigation` re-exports every name and renders and steps the level.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from envs_visual.navigation_scene import COLOURS, MAX_PER_KIND, OBJECT_KINDS, footprint

AGENT_RADIUS = 0.18  # metres; the agent is a disc this wide for collisions
WALL_THICKNESS = 0.1
DOOR_WIDTH = 1.0
MIN_ROOM_WIDTH = 2.5
SAMPLE_SPACING = 0.05  # metres between collision samples along a move


# -- level -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NavObject:
    kind: str
    colour: str
    x: float
    y: float
    yaw: float  # degrees, a multiple of 90
    footprint: tuple[float, float, float, float]  # xmin, ymin, xmax, ymax on the floor

    @property
    def description(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass(frozen=True)
class Level:
    """One navigation level as plain data (metres, degrees)."""

    seed: int
    width: float  # interior x extent; the floor is [0, width] x [0, depth]
    depth: float
    walls: tuple[tuple[float, float, float, float], ...]  # rectangles, outer walls included
    doors: tuple[tuple[float, float], ...]  # doorway centres
    objects: tuple[NavObject, ...]
    target: int  # index into objects
    start: tuple[float, float, float]  # x, y, yaw

    @property
    def instruction(self) -> str:
        return f"Navigate to the {self.objects[self.target].description}."

    def obstacles(self) -> np.ndarray:
        """[N, 4] rectangles (xmin, ymin, xmax, ymax) the agent may not touch."""
        return np.array(list(self.walls) + [o.footprint for o in self.objects], dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for obj, d in zip(self.objects, out["objects"]):
            d["description"] = obj.description
        out["instruction"] = self.instruction
        return out


def rect_distance(px, py, rects: np.ndarray) -> np.ndarray:
    """Distance from points (px, py) [...] to each rectangle [N, 4] -> [..., N]; 0 inside."""
    px, py = np.asarray(px, dtype=np.float64)[..., None], np.asarray(py, dtype=np.float64)[..., None]
    dx = np.maximum(np.maximum(rects[:, 0] - px, px - rects[:, 2]), 0.0)
    dy = np.maximum(np.maximum(rects[:, 1] - py, py - rects[:, 3]), 0.0)
    return np.hypot(dx, dy)


def points_free(level: Level, px, py, obstacles: np.ndarray, radius: float = AGENT_RADIUS) -> np.ndarray:
    """Whether a disc of `radius` at each point stays inside the floor and touches nothing."""
    px, py = np.asarray(px, dtype=np.float64), np.asarray(py, dtype=np.float64)
    inside = (px >= radius - 1e-9) & (px <= level.width - radius + 1e-9)
    inside &= (py >= radius - 1e-9) & (py <= level.depth - radius + 1e-9)
    return inside & (rect_distance(px, py, obstacles) >= radius - 1e-9).all(-1)


def segments_free(level: Level, starts: np.ndarray, ends: np.ndarray, obstacles: np.ndarray) -> np.ndarray:
    """Whether the agent can move straight from each start [E, 2] to each end [E, 2]: both ends and
    samples every SAMPLE_SPACING metres in between are free."""
    starts, ends = np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)
    length = float(np.max(np.hypot(*(ends - starts).T), initial=0.0))
    t = np.linspace(0.0, 1.0, max(1, math.ceil(length / SAMPLE_SPACING - 1e-9)) + 1)
    pts = starts[:, None, :] + t[None, :, None] * (ends - starts)[:, None, :]
    return points_free(level, pts[..., 0], pts[..., 1], obstacles).all(-1)


def target_distance(level: Level, x: float, y: float) -> float:
    return float(rect_distance(x, y, np.array([level.objects[level.target].footprint]))[0])


@dataclass
class Lattice:
    """Positions `step` apart anchored at `origin`, with free cells and free moves along the axes."""

    xs: np.ndarray  # [nx] x coordinates
    ys: np.ndarray  # [ny]
    free: np.ndarray  # [nx, ny] bool
    moves: dict[tuple[int, int], np.ndarray]  # (di, dj) -> [nx, ny] bool: the move from (i, j) is free

    def index(self, x: float, y: float) -> tuple[int, int] | None:
        i, j = np.flatnonzero(np.isclose(self.xs, x, atol=1e-6)), np.flatnonzero(np.isclose(self.ys, y, atol=1e-6))
        return (int(i[0]), int(j[0])) if len(i) and len(j) else None


def build_lattice(level: Level, origin: tuple[float, float], step: float) -> Lattice:
    obstacles = level.obstacles()

    def axis(o: float, extent: float) -> np.ndarray:
        lo = math.ceil((AGENT_RADIUS - o) / step - 1e-9)
        hi = math.floor((extent - AGENT_RADIUS - o) / step + 1e-9)
        return np.round(o + step * np.arange(lo, hi + 1), 9)

    xs, ys = axis(origin[0], level.width), axis(origin[1], level.depth)
    gx, gy = np.meshgrid(xs, ys, indexing="ij")
    free = points_free(level, gx, gy, obstacles)
    moves = {}
    for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        ok = np.zeros_like(free)
        src = (slice(max(0, -di), len(xs) - max(0, di)), slice(max(0, -dj), len(ys) - max(0, dj)))
        dst = (slice(max(0, di), len(xs) - max(0, -di)), slice(max(0, dj), len(ys) - max(0, -dj)))
        both = free[src] & free[dst]
        starts = np.stack([gx[src][both], gy[src][both]], -1)
        # ends computed the way the dynamics compute them, so planner and env agree to the bit
        ends = np.round(starts + step * np.array([di, dj], dtype=np.float64), 9)
        sub = ok[src]
        sub[both] = segments_free(level, starts, ends, obstacles)
        ok[src] = sub
        moves[(di, dj)] = ok
    return Lattice(xs, ys, free, moves)


def grid_distances(lattice: Lattice, goal: np.ndarray) -> np.ndarray:
    """Fewest axis moves from every cell to a goal cell ([nx, ny] bool); -1 where unreachable."""
    dist = np.full(lattice.free.shape, -1, dtype=np.int64)
    queue = deque()
    for i, j in zip(*np.nonzero(goal & lattice.free)):
        dist[i, j] = 0
        queue.append((int(i), int(j)))
    while queue:
        i, j = queue.popleft()
        for (di, dj), ok in lattice.moves.items():
            ni, nj = i - di, j - dj  # a move (di, dj) from (ni, nj) arrives here
            if 0 <= ni < dist.shape[0] and 0 <= nj < dist.shape[1] and dist[ni, nj] < 0 and ok[ni, nj]:
                dist[ni, nj] = dist[i, j] + 1
                queue.append((ni, nj))
    return dist


def _goal_cells(level: Level, lattice: Lattice, success_distance: float) -> np.ndarray:
    gx, gy = np.meshgrid(lattice.xs, lattice.ys, indexing="ij")
    target = np.array([level.objects[level.target].footprint])
    return rect_distance(gx, gy, target)[..., 0] <= success_distance + 1e-9


def _rect_gap(a, b) -> float:
    dx = max(b[0] - a[2], a[0] - b[2], 0.0)
    dy = max(b[1] - a[3], a[1] - b[3], 0.0)
    return math.hypot(dx, dy)


def _try_level(rng: np.random.Generator, seed: int, num_objects: int, max_rooms: int, step: float,
               success_distance: float, max_steps: int) -> Level | None:
    nx = max(4, round(int(rng.integers(4, 9)) / step))
    ny = max(4, round(int(rng.integers(4, 7)) / step))
    width, depth = round(nx * step, 9), round(ny * step, 9)
    t = WALL_THICKNESS
    walls = [(-t, -t, width + t, 0.0), (-t, depth, width + t, depth + t), (-t, 0.0, 0.0, depth),
             (width, 0.0, width + t, depth)]
    # internal walls sit on cell boundaries, doorways are centred on a row of positions
    num_rooms = int(rng.integers(1, max_rooms + 1))
    splits: list[float] = []
    for _ in range(20):
        if num_rooms == 1:
            break
        cand = sorted(round(float(k) * step, 9) for k in rng.choice(np.arange(1, nx), num_rooms - 1, replace=False))
        bounds = [0.0, *cand, width]
        if min(b - a for a, b in zip(bounds, bounds[1:])) >= MIN_ROOM_WIDTH:
            splits = cand
            break
    rows = [round((j + 0.5) * step, 9) for j in range(ny)]
    rows = [y for y in rows if DOOR_WIDTH <= y <= depth - DOOR_WIDTH]
    doors = []
    for x in splits:
        if not rows:
            return None
        y = float(rng.choice(rows))
        doors.append((x, y))
        walls.append((x - t / 2, 0.0, x + t / 2, round(y - DOOR_WIDTH / 2, 9)))
        walls.append((x - t / 2, round(y + DOOR_WIDTH / 2, 9), x + t / 2, depth))
    rooms = list(zip([0.0, *splits], [*splits, width]))

    pairs = [(k, c) for k in OBJECT_KINDS for c in COLOURS]
    chosen: list[tuple[str, str]] = []
    while len(chosen) < num_objects:
        kind, colour = pairs[int(rng.integers(len(pairs)))]
        if (kind, colour) not in chosen and sum(k == kind for k, _ in chosen) < MAX_PER_KIND:
            chosen.append((kind, colour))
    objects: list[NavObject] = []
    for kind, colour in chosen:
        for _ in range(60):
            x0, x1 = rooms[int(rng.integers(len(rooms)))]
            yaw = 90.0 * int(rng.integers(4))
            x = round(float(rng.uniform(x0, x1)), 3)
            y = round(float(rng.uniform(0.0, depth)), 3)
            rect = footprint(kind, x, y, yaw)
            inside = rect[0] >= x0 + 0.1 and rect[2] <= x1 - 0.1 and rect[1] >= 0.05 and rect[3] <= depth - 0.05
            if not inside or any(_rect_gap(rect, o.footprint) < 0.45 for o in objects):
                continue
            if any(_rect_gap(rect, (dx, dy, dx, dy)) < 1.0 for dx, dy in doors):
                continue
            objects.append(NavObject(kind, colour, x, y, yaw, rect))
            break
        else:
            return None
    target = int(rng.integers(len(objects)))
    level = Level(seed, width, depth, tuple(walls), tuple(doors), tuple(objects), target, (0.0, 0.0, 0.0))
    lattice = build_lattice(level, (step / 2, step / 2), step)
    dist = grid_distances(lattice, _goal_cells(level, lattice, success_distance))
    starts = np.argwhere((dist >= 3) & (dist <= max_steps))
    if len(starts) == 0:
        return None
    i, j = starts[int(rng.integers(len(starts)))]
    # face a direction with at least two free steps, so that the first view is not a wall up close
    headings = [h for h, (di, dj) in enumerate(((1, 0), (0, 1), (-1, 0), (0, -1)))
                if lattice.moves[(di, dj)][i, j] and 0 <= i + di < len(lattice.xs) and 0 <= j + dj < len(lattice.ys)
                and lattice.moves[(di, dj)][i + di, j + dj]]
    heading = headings[int(rng.integers(len(headings)))] if headings else int(rng.integers(4))
    start = (float(lattice.xs[i]), float(lattice.ys[j]), 90.0 * heading)
    return Level(seed, width, depth, tuple(walls), tuple(doors), tuple(objects), target, start)


def generate_level(seed: int, num_objects: int = 6, max_rooms: int = 2, step_length: float = 0.5,
                   success_distance: float = 1.0, max_steps: int = 30) -> Level:
    """The level for `seed`: a pure function of its arguments (`np.random.default_rng(seed)`).

    The floor is 4-8 m by 4-6 m, split into 1 to `max_rooms` rooms (each at least 2.5 m wide)
    joined by 1 m doorways; `num_objects` objects with unique (colour, shape) pairs, at most two
    of one shape; the start is at least 3 moves and at most `max_steps` moves from the target and
    faces a direction with two free steps when there is one.
    """
    if not 1 <= num_objects <= len(OBJECT_KINDS) * MAX_PER_KIND:
        raise ValueError(f"num_objects must be in 1..{len(OBJECT_KINDS) * MAX_PER_KIND}, got {num_objects}")
    if not 1 <= max_rooms <= 3:
        raise ValueError(f"max_rooms must be 1, 2 or 3 (rooms are at least {MIN_ROOM_WIDTH} m wide on a "
                         f"floor at most 8 m wide), got {max_rooms}")
    if not 2 * AGENT_RADIUS < step_length <= 1.0:
        raise ValueError(f"step_length must be in ({2 * AGENT_RADIUS}, 1.0] metres, got {step_length}")
    rng = np.random.default_rng(seed)
    for _ in range(500):
        level = _try_level(rng, int(seed), int(num_objects), int(max_rooms), float(step_length),
                           float(success_distance), int(max_steps))
        if level is not None:
            return level
    raise RuntimeError(
        f"no solvable level for seed {seed} with num_objects={num_objects}, max_steps={max_steps}, "
        f"success_distance={success_distance} after 500 tries; use fewer objects or more steps"
    )


def level_from_state(state: dict[str, Any]) -> Level:
    """The `Level` of a `NavigationEnv.state()` (the inverse of its level fields)."""
    objects = tuple(NavObject(o["kind"], o["colour"], o["x"], o["y"], o["yaw"], tuple(o["footprint"]))
                    for o in state["objects"])
    return Level(state["seed"], state["room"]["width"], state["room"]["depth"], tuple(map(tuple, state["walls"])),
                 tuple(map(tuple, state["doors"])), objects, state["target"], tuple(state["start"]))
