"""FrozenLake: walk across a frozen lake to the goal without falling into a hole.

The map comes from the seed (`generate_level`): the player starts in the top-left cell and the
goal is the bottom-right one (Gymnasium's random-map layout; `random_start_goal=True` draws two
distinct random cells instead), every other cell is frozen with probability `p` and a hole
otherwise, and maps without a path from start to goal are redrawn from the same seeded generator.

## Actions
`Left`, `Down`, `Right`, `Up` (case-insensitive, up to `max_actions_per_turn` per response,
comma-separated). Walking off the map leaves the player in place. With `is_slippery=True` the
player moves in the intended direction or in one of the two perpendicular ones, 1/3 each (the
classical FrozenLake semantics), drawn from the environment's own generator seeded by `reset`.

## Observation
`render_mode="vision"`: the text holds one `<image>`, a `size*cell_size` square RGB frame (default
`cell_size=28`, so 4x4 is 112x112 pixels, one Qwen2.5-VL image token per cell).
`render_mode="text"`: the grid as text, one row per line: `_` frozen, `O` hole, `G` goal,
`P` player, `X` player in a hole, `√` player on the goal.
`state()` returns the same facts as plain data: `{"size": (n, n), "player": (row, col),
"start": (row, col), "goal": (row, col), "holes": [(row, col), ...]}` (rows from the top).
`info["state_key"]` (after `reset` and every `step`) is that `state()` made hashable: the exact map
and the player's cell (the slipping generator's draws are not state: they decide the next move).
`state_relations()` gives the goal and each hole relative to the player, e.g. `("goal", "below",
"right")` (`envs_visual.state_grader`); `describe_state()` says them in words. The state grader
weighs the goal 0.7 and the holes 0.3 (`state_weights`).

## Reward
1.0 on reaching the goal, 0 otherwise. The episode is `terminated` on the goal (`success`) or in a
hole, and `truncated` after `max_steps` executed actions. The format reward (0.5) is added once per
turn when the response parses and all its actions are valid.

## Helpers
`FrozenLakeEnv.solve()` gives a shortest action list from the current position avoiding holes
(BFS; it ignores slipping). `teacher_action(state, rng, style)` is a cheap imperfect policy: step toward
the goal along the preferred axis (`TEACHER_STYLES`: rows or columns first), never into an
adjacent hole, else any safe step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from envs_visual.base import TextActionEnv, hashable
from envs_visual.grid import DIRECTIONS, bfs_path, check_cell_size, load_sprites, tile_image
from envs_visual.state_grader import grid_relation, grid_vocabulary

# Classical order (0 Left, 1 Down, 2 Right, 3 Up): perpendicular moves are (a - 1) % 4, (a + 1) % 4.
ACTIONS = ("Left", "Down", "Right", "Up")
TILE_NAMES = ("frozen", "hole", "goal", "player", "player_in_hole", "player_on_goal")
FROZEN, HOLE, GOAL, PLAYER, PLAYER_IN_HOLE, PLAYER_ON_GOAL = range(len(TILE_NAMES))
SYMBOLS = "_OGPX√"
_SYMBOL_ARRAY = np.array(list(SYMBOLS))
_VOCABULARY = grid_vocabulary({"goal": "goal", "flag": "goal", "hole": "hole", "pit": "hole"})


@dataclass(frozen=True)
class FrozenLakeLevel:
    """`holes` is a `[size, size]` bool array (read-only); `start` and `goal` are (row, col)."""

    holes: np.ndarray
    start: tuple[int, int]
    goal: tuple[int, int]

    @property
    def size(self) -> int:
        return self.holes.shape[0]

    @classmethod
    def from_text(cls, text: str) -> FrozenLakeLevel:
        """Parse a map drawn with the text-render symbols; the player cell (`P`) is the start."""
        rows = [row.strip() for row in text.strip().splitlines()]
        n = len(rows)
        if n < 2 or any(len(row) != n for row in rows):
            raise ValueError(f"a FrozenLake map is a square of >= 2 rows, got {rows!r}")
        cells = "".join(rows)
        if set(cells) - set("_OGP") or cells.count("P") != 1 or cells.count("G") != 1:
            raise ValueError(f"map rows use '_OGP' with exactly one P and one G, got {rows!r}")
        holes = np.array([s == "O" for s in cells], dtype=bool).reshape(n, n)
        holes.setflags(write=False)
        return cls(holes, divmod(cells.index("P"), n), divmod(cells.index("G"), n))


def generate_level(seed: int, size: int = 4, p: float = 0.8, max_attempts: int = 1000,
                   random_start_goal: bool = False) -> FrozenLakeLevel:
    """A map with a hole-free path from start to goal, a pure function of the arguments. The start
    is the top-left cell and the goal the bottom-right one, as in Gymnasium's random maps; with
    `random_start_goal` they are two distinct random cells (shorter, easier episodes on average)."""
    size = int(size)
    if size < 2:
        raise ValueError(f"size must be >= 2, got {size}")
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p (probability that a cell is frozen) must be in (0, 1], got {p}")
    rng = np.random.default_rng(seed)
    for _ in range(max_attempts):
        if random_start_goal:
            start_index, goal_index = rng.choice(size * size, size=2, replace=False).tolist()
        else:
            start_index, goal_index = 0, size * size - 1
        holes = rng.random((size, size)) >= p
        start, goal = divmod(start_index, size), divmod(goal_index, size)
        holes[start] = holes[goal] = False
        if bfs_path(~holes, start, goal) is not None:
            holes.setflags(write=False)
            return FrozenLakeLevel(holes, start, goal)
    raise RuntimeError(
        f"no FrozenLake map with a path for seed={seed}, size={size}, p={p} in {max_attempts} "
        "attempts; raise p (the frozen probability)"
    )


# Axis preferences of the teacher (see `teacher_action`); `sft.teacher_styles` draws one per episode.
TEACHER_STYLES = ("rows", "columns")
# The order in which each style tries the moves (path reasoning in vagen.demos names the ones it rejects).
STYLE_ORDER = {"rows": ("Down", "Up", "Right", "Left"), "columns": ("Right", "Left", "Down", "Up")}


def teacher_action(state: dict[str, Any], rng: np.random.Generator | None = None, style: str = "rows") -> str:
    """An imperfect demonstrator for `FrozenLakeEnv.state()`: among the moves that bring the player
    closer to the goal, take one whose cell is not a hole, rows before columns (`style="rows"`) or
    columns before rows (`style="columns"`); if there is none, any move onto the map that is not a
    hole; `rng` only breaks the last-resort choice. It does not plan, so it can walk into dead ends
    and oscillate. On 4x4 maps with the corner layout either style alone solves about 68% of the
    levels and the better of the two 93%: which axis to prefer depends on the map."""
    if style not in TEACHER_STYLES:
        raise ValueError(f"unknown FrozenLake teacher style {style!r}; choices: {', '.join(TEACHER_STYLES)}")
    n = state["size"][0]
    (r, c), (gr, gc) = state["player"], state["goal"]
    holes = {tuple(h) for h in state["holes"]}
    closer, safe = [], []
    for name in STYLE_ORDER[style]:
        dr, dc = DIRECTIONS[name]
        nxt = (r + dr, c + dc)
        if not (0 <= nxt[0] < n and 0 <= nxt[1] < n) or nxt in holes:
            continue
        safe.append(name)
        if abs(nxt[0] - gr) + abs(nxt[1] - gc) < abs(r - gr) + abs(c - gc):
            closer.append(name)
    if closer:
        return closer[0]
    if safe:
        rng = np.random.default_rng(0) if rng is None else rng
        return safe[int(rng.integers(len(safe)))]
    return "Down"


class FrozenLakeEnv(TextActionEnv):
    """FrozenLake with text actions; see the module docstring."""

    name = "frozenlake"
    action_names = ACTIONS
    example_answer = "Down, Right"
    state_weights = {"goal": 0.7, "hole": 0.3}

    def __init__(
        self,
        size: int = 4,
        p: float = 0.8,
        is_slippery: bool = False,
        max_steps: int = 100,
        render_mode: str = "vision",
        cell_size: int = 28,
        random_start_goal: bool = False,
        **kwargs,
    ):
        super().__init__(render_mode=render_mode, max_steps=max_steps, **kwargs)
        if int(size) < 2 or not 0.0 < float(p) <= 1.0:
            raise ValueError(f"need size >= 2 and p in (0, 1], got size={size}, p={p}")
        self.size, self.p, self.is_slippery = int(size), float(p), bool(is_slippery)
        self.random_start_goal = bool(random_start_goal)
        self.cell_size = check_cell_size(cell_size)
        self._sheet = (
            load_sprites("frozenlake", TILE_NAMES, self.cell_size) if render_mode == "vision" else None
        )
        self.level: FrozenLakeLevel | None = None

    def _reset(self, seed: int) -> None:
        self._set_level(generate_level(seed, self.size, self.p, random_start_goal=self.random_start_goal))
        # a stream separate from the level's, so slipping never changes which map a seed gives
        self._rng = np.random.default_rng([seed, 1])

    def load_level(self, level: FrozenLakeLevel, seed: int = 0):
        """Start an episode on a given map (tests, curated maps); `seed` seeds slipping. Returns
        `(obs, info)` like `reset`, with `info["seed"] == -1`."""
        self.seed, self.steps, self.done = -1, 0, False
        self._set_level(level)
        self._rng = np.random.default_rng([seed, 1])
        return self.observation(self._initial_prompt()), {"seed": -1, "success": False, "state_key": self.state_key()}

    def _set_level(self, level: FrozenLakeLevel) -> None:
        self.level = level
        self.player = level.start
        self._base_ids = np.where(level.holes, HOLE, FROZEN)
        self._base_ids[level.goal] = GOAL
        # What of `hashable(self.state())` the level fixes (the keys before and after "player"), built once
        # so that `state_key` on every step adds only the player.
        self._fixed_key = (
            (("goal", hashable(level.goal)), ("holes", hashable([tuple(x) for x in np.argwhere(level.holes).tolist()]))),
            (("size", (level.size, level.size)), ("start", hashable(level.start))),
        )

    # -- dynamics -------------------------------------------------------------------------------
    def _apply(self, action: str) -> tuple[float, bool]:
        if self.is_slippery:
            index = (ACTIONS.index(action) + int(self._rng.integers(-1, 2))) % 4
            action = ACTIONS[index]
        dr, dc = DIRECTIONS[action]
        r, c = self.player[0] + dr, self.player[1] + dc
        if not (0 <= r < self.level.size and 0 <= c < self.level.size):
            return 0.0, False
        self.player = (r, c)
        return (1.0 if self.player == self.level.goal else 0.0), True

    def _success(self) -> bool:
        return self.player == self.level.goal

    def place_player(self, cell: tuple[int, int]) -> None:
        """Stand the player on `cell` (row, column) without a move, e.g. to render a question's frame."""
        if not all(0 <= int(x) < self.level.size for x in cell):
            raise ValueError(f"cell {tuple(cell)} is off the {self.level.size}x{self.level.size} map")
        self.player = (int(cell[0]), int(cell[1]))

    def _failed(self) -> bool:
        return bool(self.level.holes[self.player])

    def _step_info(self) -> dict[str, Any]:
        return {"fell_in_hole": self._failed(), "position": self.player}

    def solve(self) -> list[str] | None:
        """Shortest action list from the current position to the goal avoiding holes (ignores
        slipping); None when no path exists or the player is in a hole."""
        if self._failed():
            return None
        return bfs_path(~self.level.holes, self.player, self.level.goal)

    def state(self) -> dict[str, Any]:
        """Plain-data state: `size`, `player`, `start`, `goal`, `holes` as (row, col) tuples."""
        level = self.level
        return {
            "size": (level.size, level.size),
            "player": self.player,
            "start": level.start,
            "goal": level.goal,
            "holes": [tuple(x) for x in np.argwhere(level.holes).tolist()],
        }

    def state_key(self):
        """`hashable(self.state())`, equal value for value (the level's part is built once per level)."""
        if type(self).state is not FrozenLakeEnv.state:
            return super().state_key()
        before, after = self._fixed_key
        return before + (("player", hashable(self.player)),) + after

    def state_relations(self) -> list[tuple[str, str, str]]:
        """The goal, then each hole (row-major), relative to the player."""
        if self.level is None:
            return []
        holes = [grid_relation("hole", self.player, h) for h in np.argwhere(self.level.holes).tolist()]
        return [grid_relation("goal", self.player, self.level.goal)] + holes

    def state_vocabulary(self):
        return _VOCABULARY

    # -- rendering ------------------------------------------------------------------------------
    def _ids(self) -> np.ndarray:
        ids = self._base_ids.copy()
        ids[self.player] = {FROZEN: PLAYER, HOLE: PLAYER_IN_HOLE, GOAL: PLAYER_ON_GOAL}[int(ids[self.player])]
        return ids

    def render_text(self) -> str:
        return "\n".join("".join(row) for row in _SYMBOL_ARRAY[self._ids()].tolist())

    def render_image(self) -> Image.Image:
        if self._sheet is None:
            self._sheet = load_sprites("frozenlake", TILE_NAMES, self.cell_size)
        return tile_image(self._sheet, self._ids())

    # -- prompts --------------------------------------------------------------------------------
    def _task_prompt(self) -> str:
        if self.render_mode == "vision":
            legend = "You see the lake as an image: ice, dark holes, the red goal flag and the player figure."
        else:
            legend = (
                "You see the lake as text, one row per line: _ frozen ice, O hole, G goal, P player, "
                "X player in a hole, √ player on the goal."
            )
        slip = (
            " The ice is slippery: you may move perpendicular to the direction you chose."
            if self.is_slippery
            else ""
        )
        return (
            "You are a FrozenLake solver. Walk to the goal without stepping into a hole; a hole ends "
            f"the game.{slip}\n{legend}\n"
            "Actions: Left, Down, Right, Up (walking off the lake leaves you in place).\n"
            "Reward: 1 for reaching the goal."
        )

    def _example_fields(self) -> dict[str, str]:
        return {
            "observation": "The goal is below and to the right of me. The hole is on my right, in the same row.",
            "reasoning": "Going right first would fall into the hole, so I go down, then right.",
            "prediction": "The goal is at my position. The hole is directly above me, in the same column.",
        }
