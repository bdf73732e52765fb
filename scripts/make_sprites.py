"""Draw the grid-world sprites procedurally and write them as PNGs under `assets/`.

    python scripts/make_sprites.py

Sprites are drawn at `SIZE` pixels (a multiple of 28 and 14) with 2x supersampling, and the
environments resize them once per cell size (`envs_visual.grid.load_sprites`). Every sprite is a
full opaque tile, so a frame is composed by plain tiling with no alpha blending.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 112
SS = 2  # supersampling factor: draw at SIZE * SS, downsample with a box filter
ASSETS = Path(__file__).resolve().parent.parent / "assets"

# palette
FLOOR = (196, 178, 150)
FLOOR_LINE = (178, 160, 132)
BRICK = (150, 62, 42)
MORTAR = (92, 84, 80)
TARGET = (214, 40, 40)
CRATE = (186, 122, 52)
CRATE_DARK = (120, 72, 28)
CRATE_DONE = (70, 160, 70)
CRATE_DONE_DARK = (36, 96, 36)
SKIN = (242, 200, 160)
SHIRT = (40, 90, 200)
TROUSERS = (40, 40, 60)
ICE = (208, 236, 250)
ICE_LINE = (170, 210, 236)
HOLE = (18, 44, 90)
HOLE_RIM = (90, 140, 190)
FLAG = (230, 30, 30)
POLE = (80, 60, 40)


def canvas(color) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image = Image.new("RGB", (SIZE * SS, SIZE * SS), color)
    return image, ImageDraw.Draw(image)


def s(*values: float) -> list[int]:
    """Coordinates given on a 0..1 square, scaled to the drawing canvas."""
    return [round(v * SIZE * SS) for v in values]


def finish(image: Image.Image) -> Image.Image:
    return image.resize((SIZE, SIZE), Image.Resampling.BOX)


# -- Sokoban -----------------------------------------------------------------------------------
def floor() -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image, draw = canvas(FLOOR)
    for t in (0.0, 0.5):  # four square tiles per cell
        draw.line(s(t, 0, t, 1), fill=FLOOR_LINE, width=3 * SS)
        draw.line(s(0, t, 1, t), fill=FLOOR_LINE, width=3 * SS)
    return image, draw


def wall() -> Image.Image:
    image, draw = canvas(MORTAR)
    rows = 4
    for row in range(rows):
        y0, y1 = row / rows + 0.02, (row + 1) / rows - 0.02
        offset = 0.25 if row % 2 else 0.0
        for k in range(-1, 3):
            x0, x1 = max(k * 0.5 + offset + 0.02, 0.0), min(k * 0.5 + offset + 0.48, 1.0)
            if x1 > x0:
                draw.rectangle(s(x0, y0, x1, y1), fill=BRICK)
    return finish(image)


def target_marker(draw: ImageDraw.ImageDraw) -> None:
    draw.ellipse(s(0.2, 0.2, 0.8, 0.8), outline=TARGET, width=6 * SS)
    draw.ellipse(s(0.4, 0.4, 0.6, 0.6), fill=TARGET)


def crate(draw: ImageDraw.ImageDraw, face, dark) -> None:
    draw.rectangle(s(0.08, 0.08, 0.92, 0.92), fill=face, outline=dark, width=6 * SS)
    draw.line(s(0.12, 0.12, 0.88, 0.88), fill=dark, width=6 * SS)
    draw.line(s(0.88, 0.12, 0.12, 0.88), fill=dark, width=6 * SS)
    draw.rectangle(s(0.08, 0.44, 0.92, 0.56), fill=dark)


def figure(draw: ImageDraw.ImageDraw) -> None:
    draw.ellipse(s(0.36, 0.08, 0.64, 0.36), fill=SKIN, outline=(0, 0, 0), width=2 * SS)  # head
    draw.rectangle(s(0.32, 0.38, 0.68, 0.66), fill=SHIRT)  # body
    draw.rectangle(s(0.18, 0.40, 0.30, 0.62), fill=SHIRT)  # arms
    draw.rectangle(s(0.70, 0.40, 0.82, 0.62), fill=SHIRT)
    draw.rectangle(s(0.34, 0.66, 0.48, 0.92), fill=TROUSERS)  # legs
    draw.rectangle(s(0.52, 0.66, 0.66, 0.92), fill=TROUSERS)


def sokoban_sprites() -> dict[str, Image.Image]:
    sprites = {"wall": wall()}
    image, _ = floor()
    sprites["floor"] = finish(image)
    image, draw = floor()
    target_marker(draw)
    sprites["target"] = finish(image)
    image, draw = floor()
    crate(draw, CRATE, CRATE_DARK)
    sprites["box"] = finish(image)
    image, draw = floor()
    crate(draw, CRATE_DONE, CRATE_DONE_DARK)
    draw.ellipse(s(0.38, 0.38, 0.62, 0.62), fill=TARGET)
    sprites["box_on_target"] = finish(image)
    image, draw = floor()
    figure(draw)
    sprites["player"] = finish(image)
    image, draw = floor()
    target_marker(draw)
    figure(draw)
    sprites["player_on_target"] = finish(image)
    return sprites


# -- FrozenLake --------------------------------------------------------------------------------
def ice() -> tuple[Image.Image, ImageDraw.ImageDraw]:
    image, draw = canvas(ICE)
    draw.line(s(0.1, 0.3, 0.35, 0.18), fill=ICE_LINE, width=3 * SS)
    draw.line(s(0.6, 0.85, 0.9, 0.7), fill=ICE_LINE, width=3 * SS)
    draw.line(s(0.55, 0.25, 0.75, 0.4), fill=ICE_LINE, width=3 * SS)
    return image, draw


def hole(draw: ImageDraw.ImageDraw) -> None:
    draw.ellipse(s(0.1, 0.2, 0.9, 0.85), fill=HOLE_RIM)
    draw.ellipse(s(0.16, 0.27, 0.84, 0.8), fill=HOLE)


def flag(draw: ImageDraw.ImageDraw) -> None:
    draw.rectangle(s(0.3, 0.1, 0.36, 0.9), fill=POLE)
    draw.polygon(s(0.36, 0.1, 0.85, 0.25, 0.36, 0.42), fill=FLAG)
    draw.ellipse(s(0.2, 0.84, 0.5, 0.94), fill=(120, 170, 120))


def frozenlake_sprites() -> dict[str, Image.Image]:
    sprites = {}
    image, _ = ice()
    sprites["frozen"] = finish(image)
    image, draw = ice()
    hole(draw)
    sprites["hole"] = finish(image)
    image, draw = ice()
    flag(draw)
    sprites["goal"] = finish(image)
    image, draw = ice()
    figure(draw)
    sprites["player"] = finish(image)
    image, draw = ice()
    hole(draw)
    # only head and raised arms stick out of the hole
    draw.ellipse(s(0.36, 0.3, 0.64, 0.58), fill=SKIN, outline=(0, 0, 0), width=2 * SS)
    draw.rectangle(s(0.2, 0.2, 0.3, 0.5), fill=SHIRT)
    draw.rectangle(s(0.7, 0.2, 0.8, 0.5), fill=SHIRT)
    sprites["player_in_hole"] = finish(image)
    image, draw = ice()
    flag(draw)
    draw.ellipse(s(0.52, 0.4, 0.72, 0.6), fill=SKIN, outline=(0, 0, 0), width=2 * SS)
    draw.rectangle(s(0.5, 0.62, 0.74, 0.92), fill=SHIRT)
    sprites["player_on_goal"] = finish(image)
    return sprites


def main() -> None:
    for folder, sprites in (("sokoban", sokoban_sprites()), ("frozenlake", frozenlake_sprites())):
        out = ASSETS / folder
        out.mkdir(parents=True, exist_ok=True)
        for name, image in sprites.items():
            image.save(out / f"{name}.png", optimize=True)
            print(f"wrote {out / name}.png")


if __name__ == "__main__":
    main()
