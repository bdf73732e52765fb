"""Helpers shared by the grid worlds: sprite sheets, frame tiling, directions and BFS.

Frames are composed without per-pixel Python: the sprites of one world are stacked once per cell
size into a `[n_tile_types, cell, cell, 3]` uint8 array, a frame is `sheet[tile_ids]` (shape
`[H, W, cell, cell, 3]`) transposed and reshaped to `[H * cell, W * cell, 3]`.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from PIL import Image

from envs_visual.assets import asset_path

# (d_row, d_col) for the four moves, by canonical action name.
DIRECTIONS: dict[str, tuple[int, int]] = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}

_SHEETS: dict[tuple[str, tuple[str, ...], int], np.ndarray] = {}


def load_sprites(world: str, names: tuple[str, ...], cell_size: int) -> np.ndarray:
    """`[len(names), cell_size, cell_size, 3]` uint8 sprites from `assets/<world>/<name>.png`,
    resized once per cell size and cached for the life of the process."""
    key = (world, names, int(cell_size))
    sheet = _SHEETS.get(key)
    if sheet is None:
        tiles = []
        for name in names:
            with Image.open(asset_path(world, f"{name}.png")) as image:
                image = image.convert("RGB")
                if image.size != (cell_size, cell_size):
                    image = image.resize((cell_size, cell_size), Image.Resampling.LANCZOS)
                tiles.append(np.asarray(image, dtype=np.uint8))
        sheet = np.ascontiguousarray(np.stack(tiles))
        sheet.setflags(write=False)
        _SHEETS[key] = sheet
    return sheet


def check_cell_size(cell_size: int) -> int:
    if not isinstance(cell_size, (int, np.integer)) or not 4 <= cell_size <= 256:
        raise ValueError(
            f"cell_size must be an int in [4, 256] pixels, got {cell_size!r}; use 28 (or 14) so cells "
            "line up with Qwen2.5-VL's 28-pixel image tokens"
        )
    return int(cell_size)


def tile(sheet: np.ndarray, tile_ids: np.ndarray) -> np.ndarray:
    """`[H * cell, W * cell, 3]` frame from `[H, W]` integer tile ids."""
    h, w = tile_ids.shape
    cell = sheet.shape[1]
    return sheet[tile_ids].transpose(0, 2, 1, 3, 4).reshape(h * cell, w * cell, 3)


def tile_image(sheet: np.ndarray, tile_ids: np.ndarray) -> Image.Image:
    return Image.fromarray(tile(sheet, tile_ids), "RGB")


def bfs_path(free: np.ndarray, start: tuple[int, int], goal: tuple[int, int]) -> list[str] | None:
    """Shortest list of move names from `start` to `goal` over cells where `free` is True (moves off
    the grid are not allowed), or None if `goal` is unreachable. `start` need not be free."""
    h, w = free.shape
    if start == goal:
        return []
    parent: dict[tuple[int, int], tuple[tuple[int, int], str]] = {start: (start, "")}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        for name, (dr, dc) in DIRECTIONS.items():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < h and 0 <= nxt[1] < w and free[nxt] and nxt not in parent:
                parent[nxt] = ((r, c), name)
                if nxt == goal:
                    path = []
                    while nxt != start:
                        nxt, move = parent[nxt]
                        path.append(move)
                    return path[::-1]
                queue.append(nxt)
    return None
