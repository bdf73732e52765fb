"""Sokoban: push every box onto a target.

The room is surrounded by walls; the player walks on floor and pushes one box at a time. Levels
are generated from the seed (`generate_level`): a random walk carves the room, boxes start on
their targets, and the player then plays the game *backwards* (walking and pulling boxes) for a
while; the most scrambled state seen becomes the level. Every pull is the reverse of a legal push,
so every level is solvable by construction; `generate_level` also confirms it with the BFS solver
(`solve_level`) under a node budget, and redraws from the same seeded generator if a level fails
that check or the optional solution-length filter.

## Actions
`Up`, `Down`, `Left`, `Right` (case-insensitive, up to `max_actions_per_turn` per response,
comma-separated). The player moves one cell; if a box is in the way it is pushed one cell when the
cell beyond is floor or an empty target (no wall, no other box); otherwise nothing moves.

## Observation
`render_mode="vision"`: the text holds one `<image>`, a `H*cell_size x W*cell_size` RGB frame
(default `cell_size=28`, so the default 6x6 room is 168x168 pixels, one Qwen2.5-VL image token per
cell). `render_mode="text"`: the grid as text, one row per line: `#` wall, `_` floor, `O` target,
`X` box, `√` box on target, `P` player, `S` player on target.
`state()` returns the same facts as plain data: `{"size": (H, W), "player": (row, col),
"boxes": [(row, col), ...], "targets": [...], "walls": [...]}` (lists sorted, rows from the top).
`info["state_key"]` (after `reset` and every `step`) is that `state()` made hashable: the exact
layout (walls, targets) and positions (boxes, player), equal exactly when the rooms are equal.
`state_relations()` gives each box and target relative to the player, e.g. `("box", "above",
"left")` (`envs_visual.state_grader`); `describe_state()` says them in words ("The box is above and
to the left of me."). The state grader weighs boxes and targets 0.5 each (`state_weights`).

## Reward
Per executed action (as in gym-sokoban): -0.1; +1 when a box lands on a target; -1 when a box
leaves one; +10 when all boxes are on targets, which ends the episode (`terminated`, `success`).
The episode is `truncated` after `max_steps` executed actions. The format reward (0.5) is added
once per turn when the response parses and all its actions are valid.

## Helpers
`SokobanEnv.solve()` gives an optimal action list from the current state (BFS over player and box
positions with a node budget). `teacher_action(state, rng)` is a cheap imperfect policy for
demonstrations: push a box straight toward a free target when standing behind it, else walk to a
pushing position, else a random valid move.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from envs_visual.base import TextActionEnv
from envs_visual.grid import DIRECTIONS, check_cell_size, load_sprites, tile_image
from envs_visual.state_grader import grid_relation, grid_vocabulary

ACTIONS = ("Up", "Down", "Left", "Right")
TILE_NAMES = ("wall", "floor", "target", "box", "box_on_target", "player", "player_on_target")
WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = range(len(TILE_NAMES))
SYMBOLS = "#_OX√PS"
_SYMBOL_ARRAY = np.array(list(SYMBOLS))

_VOCABULARY = grid_vocabulary({"box": "box", "crate": "box", "target": "target", "goal": "target",
                               "storage": "target", "dock": "target"})

# 3x3 stamps the room-carving walk leaves behind, all containing the centre so the room stays
# connected.
_STAMPS = np.array(
    [
        [[0, 0, 0], [0, 1, 0], [0, 0, 0]],
        [[0, 0, 0], [1, 1, 1], [0, 0, 0]],
        [[0, 1, 0], [0, 1, 0], [0, 1, 0]],
        [[0, 1, 0], [1, 1, 1], [0, 1, 0]],
        [[1, 1, 0], [1, 1, 0], [0, 0, 0]],
        [[0, 0, 0], [0, 1, 1], [0, 1, 0]],
    ],
    dtype=bool,
)
_STAMP_DR, _STAMP_DC = np.meshgrid(np.arange(-1, 2), np.arange(-1, 2), indexing="ij")


@dataclass(frozen=True)
class SokobanLevel:
    """A level as flat cell indices (`index = row * width + col`). `walls` has one bool per cell;
    the outermost ring is always wall so moves never leave the grid."""

    height: int
    width: int
    walls: tuple[bool, ...]
    targets: tuple[int, ...]
    boxes: tuple[int, ...]
    player: int

    @classmethod
    def from_text(cls, text: str) -> SokobanLevel:
        """Parse a level drawn with the text-render symbols (`#_OX√PS`, one row per line)."""
        rows = [row.strip() for row in text.strip().splitlines()]
        height, width = len(rows), len(rows[0]) if rows else 0
        if height < 3 or any(len(row) != width for row in rows):
            raise ValueError(f"level rows must all have the same length (>= 3 rows), got {rows!r}")
        cells = "".join(rows)
        unknown = set(cells) - set(SYMBOLS)
        if unknown:
            raise ValueError(f"unknown level symbols {sorted(unknown)}; use only {SYMBOLS!r}")
        border = rows[0] + rows[-1] + "".join(row[0] + row[-1] for row in rows)
        if set(border) != {"#"}:
            raise ValueError(f"the outermost ring of the level must be wall '#', got rows {rows!r}")
        players = [i for i, s in enumerate(cells) if s in "PS"]
        boxes = tuple(i for i, s in enumerate(cells) if s in "X√")
        targets = tuple(i for i, s in enumerate(cells) if s in "O√S")
        if len(players) != 1 or len(boxes) != len(targets) or not boxes:
            raise ValueError(
                f"a level needs exactly one player (got {len(players)}) and as many boxes as targets "
                f"(got {len(boxes)} boxes, {len(targets)} targets), at least one"
            )
        walls = tuple(s == "#" for s in cells)
        return cls(height, width, walls, targets, boxes, players[0])

    def to_text(self) -> str:
        return _text_grid(
            _tile_ids(self.height, self.width, self.walls, self.targets, self.boxes, self.player)
        )


def _tile_ids(height, width, walls, targets, boxes, player) -> np.ndarray:
    ids = np.where(np.array(walls, dtype=bool), WALL, FLOOR).astype(np.int64)
    ids[list(targets)] = TARGET
    for b in boxes:
        ids[b] = BOX_ON_TARGET if ids[b] == TARGET else BOX
    ids[player] = PLAYER_ON_TARGET if ids[player] == TARGET else PLAYER
    return ids.reshape(height, width)


def _text_grid(tile_ids: np.ndarray) -> str:
    return "\n".join("".join(row) for row in _SYMBOL_ARRAY[tile_ids].tolist())


# -- generation --------------------------------------------------------------------------------
def _carve_room(rng: np.random.Generator, height: int, width: int, num_gen_steps: int) -> np.ndarray:
    """Floor mask: a random walk over the interior stamping small shapes."""
    r = int(rng.integers(1, height - 1))
    c = int(rng.integers(1, width - 1))
    turns = rng.random(num_gen_steps) < 0.35
    directions = rng.integers(0, 4, size=num_gen_steps + 1)
    moves = ((-1, 0), (1, 0), (0, -1), (0, 1))
    dr, dc = moves[int(directions[-1])]
    centres = np.empty((num_gen_steps, 2), dtype=np.int64)
    for step, (turn, direction) in enumerate(zip(turns.tolist(), directions[:-1].tolist())):
        if turn:
            dr, dc = moves[direction]
        r = min(max(r + dr, 1), height - 2)
        c = min(max(c + dc, 1), width - 2)
        centres[step] = r, c
    stamps = _STAMPS[rng.integers(0, len(_STAMPS), size=num_gen_steps)]
    rows = centres[:, 0, None, None] + _STAMP_DR
    cols = centres[:, 1, None, None] + _STAMP_DC
    floor = np.zeros((height, width), dtype=bool)
    floor[rows[stamps], cols[stamps]] = True
    floor[0, :] = floor[-1, :] = floor[:, 0] = floor[:, -1] = False
    return floor


def _reverse_play(rng, walls, width, targets, player, reverse_steps, pull_probability=0.8):
    """Walk backwards from the solved state, pulling boxes; return the most scrambled state seen
    as (boxes, player, score), score 0 if no box ever left its target."""
    deltas = (-width, width, -1, 1)
    moves = rng.integers(0, 4, size=reverse_steps).tolist()
    pulls = (rng.random(reverse_steps) < pull_probability).tolist()
    boxes = list(targets)
    origin = list(targets)
    target_set = set(targets)
    best = (tuple(boxes), player, 0)
    for move, pull in zip(moves, pulls):
        d = deltas[move]
        nxt = player + d
        if walls[nxt] or nxt in boxes:
            continue
        behind = player - d
        if pull and behind in boxes:
            boxes[boxes.index(behind)] = player
            player = nxt
            off = sum(b not in target_set for b in boxes)
            if off:
                displacement = sum(
                    abs(b // width - o // width) + abs(b % width - o % width) for b, o in zip(boxes, origin)
                )
                score = off * displacement
                if score > best[2]:
                    best = (tuple(boxes), player, score)
        else:
            player = nxt
            if best[2] and tuple(boxes) == best[0]:
                # same boxes, later player position: keep the freshest one so the level's player
                # position is a random walk sample rather than the spot right after the pull.
                best = (best[0], player, best[2])
    return best


def _check_generation(dim_room, num_boxes) -> tuple[int, int]:
    height, width = (int(x) for x in dim_room)
    if height < 4 or width < 4:
        raise ValueError(f"dim_room must be at least (4, 4) (walls included), got {dim_room!r}")
    most = (height - 2) * (width - 2) // 3
    if not 1 <= num_boxes <= most:
        raise ValueError(
            f"num_boxes must be in [1, {most}] for dim_room {dim_room}, got {num_boxes}; "
            "use a larger room for more boxes"
        )
    return height, width


def generate_level(
    seed: int,
    dim_room: tuple[int, int] = (6, 6),
    num_boxes: int = 1,
    num_gen_steps: int | None = None,
    min_solution_length: int | None = None,
    max_solution_length: int | None = None,
    reverse_steps: int | None = None,
    max_attempts: int = 1000,
    verify_nodes: int = 20_000,
) -> SokobanLevel:
    """A solvable level, a pure function of the arguments.

    `num_gen_steps` (default `1.7 * (H + W)`) random-walk steps carve the room; `reverse_steps`
    (default `10 * H * W`) steps of backward play scramble the boxes. When `min_solution_length` or
    `max_solution_length` is given, the level's optimal solution (BFS) must have that many actions.
    Every level is checked with the BFS solver limited to `verify_nodes` states. A rejected attempt is followed by the next one drawn from the same seeded generator."""
    height, width = _check_generation(dim_room, num_boxes)
    num_gen_steps = int(1.7 * (height + width)) if num_gen_steps is None else int(num_gen_steps)
    reverse_steps = 10 * height * width if reverse_steps is None else int(reverse_steps)
    if num_gen_steps < 1 or reverse_steps < 1:
        raise ValueError(
            f"num_gen_steps and reverse_steps must be >= 1, got {num_gen_steps}, {reverse_steps}"
        )
    filtered = min_solution_length is not None or max_solution_length is not None
    rng = np.random.default_rng(seed)
    for _ in range(max_attempts):
        floor = _carve_room(rng, height, width, num_gen_steps)
        cells = np.flatnonzero(floor)
        if len(cells) < 2 * num_boxes + 2:
            continue
        chosen = rng.choice(cells, size=num_boxes + 1, replace=False).tolist()
        targets, player = tuple(sorted(chosen[:-1])), chosen[-1]
        walls = tuple((~floor).ravel().tolist())
        boxes, player, score = _reverse_play(rng, walls, width, targets, player, reverse_steps)
        if score == 0:
            continue
        level = SokobanLevel(height, width, walls, targets, tuple(sorted(boxes)), player)
        # Reverse play makes levels solvable by construction; a bounded search confirms it (tens
        # of microseconds for small rooms). Past the budget, construction is trusted unless a
        # difficulty filter needs the exact solution length.
        solution, exhausted = _search(level, verify_nodes if not filtered else 200_000)
        if solution is None and (exhausted or filtered):
            continue
        if filtered:
            if min_solution_length is not None and len(solution) < min_solution_length:
                continue
            if max_solution_length is not None and len(solution) > max_solution_length:
                continue
        return level
    raise RuntimeError(
        f"no Sokoban level for seed={seed}, dim_room={dim_room}, num_boxes={num_boxes} within "
        f"{max_attempts} attempts (solution length in [{min_solution_length}, {max_solution_length}]); "
        "widen the solution-length range, enlarge the room or raise num_gen_steps/reverse_steps"
    )


# -- solver ------------------------------------------------------------------------------------
def _live_cells(walls, width, targets) -> list[bool]:
    """Cells from which a lone box can still be pushed onto some target (others are dead ends)."""
    live = [False] * len(walls)
    queue = deque(targets)
    for t in targets:
        live[t] = True
    while queue:
        cell = queue.popleft()
        for d in (-width, width, -1, 1):
            # pull the box from `cell` to `cell + d`: the player needs `cell + d` and `cell + 2d`
            nxt = cell + d
            if 0 <= nxt + d < len(walls) and not walls[nxt] and not walls[nxt + d] and not live[nxt]:
                live[nxt] = True
                queue.append(nxt)
    return live


def solve_level(level: SokobanLevel, max_nodes: int = 200_000) -> list[str] | None:
    """Optimal (fewest actions) action list solving `level`, `[]` if it is already solved, or None
    if it is unsolvable or the search visits more than `max_nodes` states."""
    return _search(level, max_nodes)[0]


def _search(level: SokobanLevel, max_nodes: int) -> tuple[list[str] | None, bool]:
    """Breadth-first search over (player, sorted boxes). Returns (solution or None, exhausted):
    `exhausted` is True when the whole reachable space was searched, so None means unsolvable."""
    walls, width = level.walls, level.width
    targets = frozenset(level.targets)
    live = _live_cells(walls, width, level.targets)
    moves = [(name, dr * width + dc) for name, (dr, dc) in DIRECTIONS.items()]
    start = (level.player, tuple(sorted(level.boxes)))
    if targets.issuperset(start[1]):
        return [], False
    parent: dict[tuple[int, tuple[int, ...]], tuple[Any, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        player, boxes = state
        for name, d in moves:
            nxt = player + d
            if walls[nxt]:
                continue
            if nxt in boxes:
                beyond = nxt + d
                if walls[beyond] or beyond in boxes or not live[beyond]:
                    continue
                new_boxes = tuple(sorted(beyond if b == nxt else b for b in boxes))
                new = (nxt, new_boxes)
                if new in parent:
                    continue
                parent[new] = (state, name)
                if targets.issuperset(new_boxes):
                    path = []
                    node = new
                    while parent[node] is not None:
                        node, move = parent[node]
                        path.append(move)
                    return path[::-1], False
            else:
                new = (nxt, boxes)
                if new in parent:
                    continue
                parent[new] = (state, name)
            queue.append(new)
        if len(parent) > max_nodes:
            return None, False
    return None, True


# -- teacher -----------------------------------------------------------------------------------
def teacher_action(state: dict[str, Any], rng: np.random.Generator | None = None) -> str:
    """An imperfect demonstrator for `SokobanEnv.state()`: for the first box off target (row-major)
    and its nearest free target, push it one cell in a direction that brings it closer when the
    player stands behind it; otherwise take a step that brings the player closer (Manhattan) to such
    a pushing position, without planning a way around walls or boxes; otherwise a random move that
    changes the state. Gets stuck behind walls and can deadlock the box; that is the point (6x6,
    one box, 3 turns of 3 actions: 0.62 against the solver's 0.93)."""
    return teacher_decision(state, rng)[0]


def teacher_decision(state: dict[str, Any],
                     rng: np.random.Generator | None = None) -> tuple[str, str, tuple[int, int] | None]:
    """`teacher_action`'s move with its reason: `(action, "push", None)` standing behind a box,
    `(action, "approach", cell)` stepping toward the pushing position `cell`, or
    `(action, "random", None)` when no step brings it closer to one."""
    rng = np.random.default_rng(0) if rng is None else rng
    h, w = state["size"]
    free = np.ones((h, w), dtype=bool)
    for cell in state["walls"]:
        free[cell] = False
    boxes = set(state["boxes"])
    targets = set(state["targets"])
    player = tuple(state["player"])
    open_floor = free.copy()
    for cell in boxes:
        open_floor[cell] = False

    def empty(cell):
        return 0 <= cell[0] < h and 0 <= cell[1] < w and open_floor[cell]

    free_targets = sorted(targets - boxes)
    for box in sorted(boxes - targets):
        if not free_targets:
            break
        target = min(free_targets, key=lambda t: abs(t[0] - box[0]) + abs(t[1] - box[1]))
        options = []
        for name, (dr, dc) in DIRECTIONS.items():
            closer = (dr and dr * (target[0] - box[0]) > 0) or (dc and dc * (target[1] - box[1]) > 0)
            behind, beyond = (box[0] - dr, box[1] - dc), (box[0] + dr, box[1] + dc)
            if closer and empty(beyond) and (empty(behind) or behind == player):
                options.append((name, behind))
        for name, behind in options:
            if behind == player:
                return name, "push", None
        for _, behind in options:
            distance = abs(player[0] - behind[0]) + abs(player[1] - behind[1])
            for name, (dr, dc) in DIRECTIONS.items():
                step = (player[0] + dr, player[1] + dc)
                if empty(step) and abs(step[0] - behind[0]) + abs(step[1] - behind[1]) < distance:
                    return name, "approach", behind
    valid = []
    for name, (dr, dc) in DIRECTIONS.items():
        nxt = (player[0] + dr, player[1] + dc)
        if empty(nxt) or (nxt in boxes and empty((nxt[0] + dr, nxt[1] + dc))):
            valid.append(name)
    return (valid[int(rng.integers(len(valid)))] if valid else ACTIONS[int(rng.integers(4))]), "random", None


# -- environment -------------------------------------------------------------------------------
class SokobanEnv(TextActionEnv):
    """Sokoban with text actions; see the module docstring."""

    name = "sokoban"
    action_names = ACTIONS
    example_answer = "Left, Up"
    state_weights = {"box": 0.5, "target": 0.5}

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        max_steps: int = 100,
        num_gen_steps: int | None = None,
        reverse_steps: int | None = None,
        min_solution_length: int | None = None,
        max_solution_length: int | None = None,
        render_mode: str = "vision",
        cell_size: int = 28,
        **kwargs,
    ):
        super().__init__(render_mode=render_mode, max_steps=max_steps, **kwargs)
        dim_room = tuple(int(x) for x in dim_room)
        if len(dim_room) != 2:
            raise ValueError(f"dim_room must be (height, width), got {dim_room!r}")
        self.cell_size = check_cell_size(cell_size)
        self.generation = {
            "dim_room": dim_room,
            "num_boxes": int(num_boxes),
            "num_gen_steps": num_gen_steps,
            "min_solution_length": min_solution_length,
            "max_solution_length": max_solution_length,
            "reverse_steps": reverse_steps,
        }
        _check_generation(dim_room, int(num_boxes))
        self._sheet = load_sprites("sokoban", TILE_NAMES, self.cell_size) if render_mode == "vision" else None
        self.level: SokobanLevel | None = None
        self._relations: tuple = (None, [])  # ((level, player, boxes), their state_relations())

    # -- level ----------------------------------------------------------------------------------
    def _reset(self, seed: int) -> None:
        self._set_level(generate_level(seed, **self.generation))

    def load_level(self, level: SokobanLevel):
        """Start an episode on a given level (hand-made test cases, curated level sets) instead of a
        generated one; returns `(obs, info)` like `reset`, with `info["seed"] == -1`."""
        self.seed, self.steps, self.done = -1, 0, False
        self._set_level(level)
        return self.observation(self._initial_prompt()), {"seed": -1, "success": self._success(),
                                                          "state_key": self.state_key()}

    def _set_level(self, level: SokobanLevel) -> None:
        self.level = level
        self.width = level.width
        self.walls = level.walls
        self.is_target = [False] * len(level.walls)
        for t in level.targets:
            self.is_target[t] = True
        self.boxes = list(level.boxes)
        self.player = level.player
        self.on_target = sum(self.is_target[b] for b in self.boxes)
        self._deltas = {name: dr * level.width + dc for name, (dr, dc) in DIRECTIONS.items()}
        base = np.where(np.array(level.walls, dtype=bool), WALL, FLOOR)
        base[list(level.targets)] = TARGET
        self._base_ids = base
        # What of `hashable(self.state())` the level fixes, built once so that `state_key` on every step
        # builds only the player and the boxes.
        self._fixed_key = (
            ("size", (level.height, level.width)),
            ("targets", tuple(divmod(t, level.width) for t in level.targets)),
            ("walls", tuple(divmod(i, level.width) for i, wall in enumerate(level.walls) if wall)),
        )

    # -- dynamics -------------------------------------------------------------------------------
    def _apply(self, action: str) -> tuple[float, bool]:
        d = self._deltas[action]
        nxt = self.player + d
        reward = -0.1
        if self.walls[nxt]:
            return reward, False
        if nxt in self.boxes:
            beyond = nxt + d
            if self.walls[beyond] or beyond in self.boxes:
                return reward, False
            self.boxes[self.boxes.index(nxt)] = beyond
            if self.is_target[nxt]:
                reward -= 1.0
                self.on_target -= 1
            if self.is_target[beyond]:
                reward += 1.0
                self.on_target += 1
                if self.on_target == len(self.boxes):
                    reward += 10.0
        self.player = nxt
        return reward, True

    def _success(self) -> bool:
        return self.on_target == len(self.boxes)

    def place_player(self, cell: tuple[int, int]) -> None:
        """Stand the player on `cell` (row, column) without a move, e.g. to render a question's frame."""
        index = int(cell[0]) * self.width + int(cell[1])
        if self.walls[index] or index in self.boxes:
            raise ValueError(f"cell {tuple(cell)} holds a wall or a box; the player can stand only on floor or a target")
        self.player = index

    def _step_info(self) -> dict[str, Any]:
        return {"boxes_on_target": self.on_target, "num_boxes": len(self.boxes)}

    def solve(self, max_nodes: int = 200_000) -> list[str] | None:
        """Optimal action list from the current state (None if unsolvable or over budget)."""
        level = self.level
        current = SokobanLevel(
            level.height, level.width, level.walls, level.targets, tuple(self.boxes), self.player
        )
        return solve_level(current, max_nodes=max_nodes)

    def state(self) -> dict[str, Any]:
        """Plain-data state: `size`, `player`, `boxes`, `targets`, `walls` as (row, col) tuples."""
        w = self.width

        def rc(i):
            return (i // w, i % w)

        return {
            "size": (self.level.height, w),
            "player": rc(self.player),
            "boxes": sorted(rc(b) for b in self.boxes),
            "targets": [rc(t) for t in self.level.targets],
            "walls": [rc(i) for i, wall in enumerate(self.walls) if wall],
        }

    def state_key(self):
        """`hashable(self.state())`, equal value for value (the level's part is built once per level)."""
        if type(self).state is not SokobanEnv.state:
            return super().state_key()
        w = self.width
        moving = (("boxes", tuple(sorted(divmod(b, w) for b in self.boxes))), ("player", divmod(self.player, w)))
        return moving + self._fixed_key

    def state_relations(self) -> list[tuple[str, str, str]]:
        """Each box, then each target, relative to the player (a box on a target appears as both)."""
        if self.level is None:
            return []
        # `step` asks before and after the actions, so a turn's "before" is the last turn's "after"
        positions = (self.level, self.player, tuple(self.boxes))
        if self._relations[0] != positions:
            w, player = self.width, divmod(self.player, self.width)
            boxes = [grid_relation("box", player, divmod(b, w)) for b in sorted(self.boxes)]
            targets = [grid_relation("target", player, divmod(t, w)) for t in self.level.targets]
            self._relations = (positions, boxes + targets)
        return list(self._relations[1])

    def state_vocabulary(self):
        return _VOCABULARY

    # -- rendering ------------------------------------------------------------------------------
    def _ids(self) -> np.ndarray:
        ids = self._base_ids.copy()
        for b in self.boxes:
            ids[b] = BOX_ON_TARGET if self.is_target[b] else BOX
        ids[self.player] = PLAYER_ON_TARGET if self.is_target[self.player] else PLAYER
        return ids.reshape(self.level.height, self.width)

    def render_text(self) -> str:
        return _text_grid(self._ids())

    def render_image(self) -> Image.Image:
        if self._sheet is None:
            self._sheet = load_sprites("sokoban", TILE_NAMES, self.cell_size)
        return tile_image(self._sheet, self._ids())

    # -- prompts --------------------------------------------------------------------------------
    def _task_prompt(self) -> str:
        if self.render_mode == "vision":
            legend = (
                "You see the room as an image: brick walls, floor tiles, red ring targets, wooden "
                "crates (green when on a target) and the player figure."
            )
        else:
            legend = (
                "You see the room as text, one row per line: # wall, _ floor, O target, X box, "
                "√ box on target, P player, S player on target."
            )
        return (
            "You are a Sokoban solver. Push every box onto a target. You can push a box but never "
            "pull it, and you cannot push two boxes at once or push a box into a wall.\n"
            f"{legend}\n"
            "Actions: Up, Down, Left, Right (the player moves one cell, pushing a box in the way).\n"
            "Rewards: -0.1 per action, +1 for a box onto a target, -1 for a box off one, +10 when all "
            "boxes are on targets."
        )

    def _example_fields(self) -> dict[str, str]:
        return {
            "observation": "The box is on my left, in the same row. The target is above and to the left of me.",
            "reasoning": "Pushing the box left brings it under the target; then I go around to push it up.",
            "prediction": "The box is below and to the left of me. The target is on my left, in the same row.",
        }
