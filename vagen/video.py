"""Episode videos that show what the agent saw, thought and did.

One video frame per executed action (not per turn): the environment frame after the action,
scaled up with nearest-neighbour by an integer factor so grid cells stay sharp, beside a
text panel with the turn number, the agent's ``<think>`` text (wrapped to the panel width
in pixels, truncated with "…"), its ``<answer>``, the action taken, the step reward and the
running return. The video opens on the initial observation and closes on a frame that states
success (green) or failure (red) in large text.

    frames = compose_episode_frames(initial_frame, steps, success, title="sokoban seed 7")
    paths = write_episode_video(initial_frame, steps, success, "runs/x/videos", "sokoban", 7)

Text uses Pillow's built-in scalable font (Pillow >= 10.1), so nothing is downloaded and no
font file is needed. Characters that font lacks (arrows, √, accents) are replaced by ASCII
stand-ins instead of being drawn as empty boxes.

Only PIL, numpy and imageio are imported (never torch): the evaluation entry point and a
laptop without a GPU stack can both render videos.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

TARGET_HEIGHT = 384
"""Env frames are scaled up by the largest integer factor that keeps them at most this tall."""
PANEL_WIDTH = 512
"""Width of the text panel in pixels (a multiple of 16, as H.264 in yuv420p wants)."""
MARGIN = 16
"""Border around the env frame and inside the text panel (a multiple of 16 keeps sizes aligned)."""

_BACKGROUND = (24, 24, 28)
_PANEL_BACKGROUND = (36, 36, 42)
_TEXT = (232, 232, 232)
_DIM = (150, 150, 160)
_LABEL = (120, 170, 255)
_ACTION = (255, 214, 90)
_GREEN = (60, 200, 90)
_RED = (235, 70, 60)

_SIZE_SMALL = 14
_SIZE_BODY = 15
_SIZE_HEADING = 20
_SIZE_BIG = 56

_ELLIPSIS = "…"

# Stand-ins for characters Pillow's built-in font has no glyph for. '*' for √ follows the
# classic Sokoban text format, where '*' is a box on a target.
_FALLBACKS = {
    "√": "*",
    "←": "<-",
    "→": "->",
    "↑": "^",
    "↓": "v",
    "—": "-",
    "–": "-",
    "×": "x",
    "≤": "<=",
    "≥": ">=",
    "≠": "!=",
    "✓": "v",
    "✔": "v",
    "✗": "x",
    "✘": "x",
}


@dataclass
class EpisodeStep:
    """One executed action of an episode, as the video shows it."""

    frame: Image.Image
    """Environment frame after the action."""
    turn: int
    """1-based turn in which the action was taken (a turn may execute several actions)."""
    think: str
    """The agent's <think> text of that turn ('' when absent)."""
    answer: str
    """The raw <answer> text of that turn."""
    action: str
    """The action executed in this step."""
    reward: float
    """Reward of this step."""
    episode_return: float
    """Running return after this step."""


@dataclass(frozen=True)
class Layout:
    """Geometry shared by every frame of one video (all frames of a video must be the same size).

    The canvas is ``[left region | text panel]``; each env frame is scaled by ``scale_for``
    and centred in the left region. Width and height are multiples of 16.
    """

    target_height: int
    left_width: int
    height: int
    panel_width: int = PANEL_WIDTH

    @property
    def size(self) -> tuple[int, int]:
        return (self.left_width + self.panel_width, self.height)

    def scale_for(self, frame_size: tuple[int, int]) -> int:
        """Integer nearest-neighbour factor for a frame of ``(width, height)``."""
        return max(1, self.target_height // max(1, frame_size[1]))

    def frame_box(self, frame_size: tuple[int, int]) -> tuple[int, int, int, int]:
        """``(left, top, right, bottom)`` of the scaled env frame on the canvas."""
        scale = self.scale_for(frame_size)
        width, height = frame_size[0] * scale, frame_size[1] * scale
        left = (self.left_width - width) // 2
        top = (self.height - height) // 2
        return (left, top, left + width, top + height)


def _round_up(value: int, multiple: int = 16) -> int:
    return -(-value // multiple) * multiple


def layout_for(frames: Sequence[Image.Image], target_height: int = TARGET_HEIGHT) -> Layout:
    """The layout that fits every frame in ``frames`` (they may differ in size)."""
    if not frames:
        raise ValueError("layout_for needs at least one frame (the initial observation)")
    probe = Layout(target_height=target_height, left_width=0, height=0)
    scaled = [(f.width * probe.scale_for(f.size), f.height * probe.scale_for(f.size)) for f in frames]
    width = _round_up(max(w for w, _ in scaled)) + 2 * MARGIN
    height = _round_up(max(target_height, max(h for _, h in scaled))) + 2 * MARGIN
    return Layout(target_height=target_height, left_width=width, height=height)


def upscale_nearest(frame: Image.Image, scale: int) -> Image.Image:
    """``frame`` in RGB, each pixel repeated ``scale`` times in both directions."""
    rgb = frame.convert("RGB")
    if scale == 1:
        return rgb
    return rgb.resize((rgb.width * scale, rgb.height * scale), Image.Resampling.NEAREST)


# ---------------------------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------------------------


@functools.cache
def get_font(size: int) -> ImageFont.FreeTypeFont:
    """Pillow's built-in scalable font at ``size`` pixels (cached: loading it parses the font)."""
    font = ImageFont.load_default(size=size)
    if not isinstance(font, ImageFont.FreeTypeFont):
        raise RuntimeError(
            "Pillow's built-in font is not scalable here (needs Pillow >= 10.1 built with FreeType); "
            "upgrade with `pip install -U pillow`"
        )
    return font


@functools.cache
def _missing_glyph_key(size: int) -> tuple:
    # A private-use code point renders as the font's "missing glyph" box.
    mask = get_font(size).getmask("\ue000")
    return (mask.size, bytes(mask))


@functools.lru_cache(maxsize=4096)
def _has_glyph(char: str, size: int) -> bool:
    mask = get_font(size).getmask(char)
    return (mask.size, bytes(mask)) != _missing_glyph_key(size)


@functools.lru_cache(maxsize=4096)
def _displayable_char(char: str, size: int) -> str:
    if char.isascii() or _has_glyph(char, size):
        return char
    if char in _FALLBACKS:
        return _FALLBACKS[char]
    folded = unicodedata.normalize("NFKD", char).encode("ascii", "ignore").decode("ascii")
    return folded if folded.isprintable() and folded else "?"


def displayable(text: str, size: int = _SIZE_BODY) -> str:
    """``text`` with every character the built-in font cannot draw replaced by an ASCII stand-in."""
    text = "".join(" " if ch.isspace() and ch != "\n" else ch for ch in text)
    return "".join(ch if ch == "\n" else _displayable_char(ch, size) for ch in text)


def _fit_with_ellipsis(line: str, font: ImageFont.FreeTypeFont, max_width: float) -> str:
    line = line.rstrip()
    while line and font.getlength(line + _ELLIPSIS) > max_width:
        line = line[:-1].rstrip()
    return line + _ELLIPSIS


def _split_long_word(word: str, font: ImageFont.FreeTypeFont, max_width: float) -> list[str]:
    pieces, current = [], ""
    for char in word:
        if current and font.getlength(current + char) > max_width:
            pieces.append(current)
            current = char
        else:
            current += char
    return [*pieces, current] if current else pieces


def wrap_text(
    text: str, font: ImageFont.FreeTypeFont, max_width: float, max_lines: int | None = None
) -> list[str]:
    """Greedy word wrap measured in pixels with ``font.getlength``.

    Newlines start a new line (blank lines are dropped); a word wider than ``max_width`` is
    broken between characters. With ``max_lines``, text that does not fit is cut and the last
    kept line ends with "…" (still within ``max_width``). Returns ``[]`` for blank text.
    """
    if max_lines is not None and max_lines < 1:
        raise ValueError(f"max_lines must be >= 1 or None, got {max_lines}")
    lines: list[str] = []
    truncated = False
    for paragraph in text.split("\n"):
        words = paragraph.split()
        current = ""
        for word in words:
            candidate = f"{current} {word}" if current else word
            if font.getlength(candidate) <= max_width:
                current = candidate
                continue
            if current:
                lines.append(current)
            pieces = _split_long_word(word, font, max_width) if font.getlength(word) > max_width else [word]
            lines.extend(pieces[:-1])
            current = pieces[-1]
            if max_lines is not None and len(lines) > max_lines:
                break
        if current:
            lines.append(current)
        if max_lines is not None and len(lines) > max_lines:
            truncated = True
            break
    if max_lines is not None and len(lines) > max_lines:
        truncated = True
    if truncated:
        lines = lines[:max_lines]
        lines[-1] = _fit_with_ellipsis(lines[-1], font, max_width)
    return lines


# ---------------------------------------------------------------------------------------------
# Frames
# ---------------------------------------------------------------------------------------------


class _Panel:
    """Draws lines of text top-down into the text panel of one canvas."""

    def __init__(self, image: Image.Image, layout: Layout, y: int = MARGIN):
        self.draw = ImageDraw.Draw(image)
        self.x = layout.left_width + MARGIN
        self.width = layout.panel_width - 2 * MARGIN
        self.bottom = layout.height - MARGIN
        self.y = y

    @staticmethod
    def line_height(size: int) -> int:
        ascent, descent = get_font(size).getmetrics()
        return ascent + descent + max(2, size // 5)

    def text(self, text: str, size: int, fill: tuple[int, int, int], max_lines: int | None = 1) -> None:
        font = get_font(size)
        for line in wrap_text(displayable(text, size), font, self.width, max_lines):
            self.draw.text((self.x, self.y), line, font=font, fill=fill)
            self.y += self.line_height(size)

    def lines_left(self, size: int, reserve: int) -> int:
        return max(1, (self.bottom - reserve - self.y) // self.line_height(size))

    def gap(self, pixels: int = 8) -> None:
        self.y += pixels


def _blank_canvas(layout: Layout) -> Image.Image:
    canvas = Image.new("RGB", layout.size, _BACKGROUND)
    ImageDraw.Draw(canvas).rectangle(
        (layout.left_width, 0, layout.size[0] - 1, layout.height - 1), fill=_PANEL_BACKGROUND
    )
    return canvas


def _paste_frame(canvas: Image.Image, frame: Image.Image, layout: Layout) -> tuple[int, int, int, int]:
    box = layout.frame_box(frame.size)
    canvas.paste(upscale_nearest(frame, layout.scale_for(frame.size)), box[:2])
    return box


def _format_number(value: float) -> str:
    return f"{value:+.2f}" if value else "0.00"


def _step_footer_height() -> int:
    """Height below the think/answer block of a step panel: separator, action line, reward line."""
    return 2 * _Panel.line_height(_SIZE_HEADING) + 12


def _turn_panel(layout: Layout, title: str, think: str, answer: str) -> Image.Image:
    """Canvas with the header, think and answer of one turn drawn; shared by the turn's steps."""
    canvas = _blank_canvas(layout)
    panel = _Panel(canvas, layout)
    if title:
        panel.text(title, _SIZE_SMALL, _DIM)
    panel.y += _Panel.line_height(_SIZE_HEADING)  # the "Turn t · action i/n" line, drawn per step
    panel.gap()
    answer_lines = 2
    answer_reserve = _Panel.line_height(_SIZE_SMALL) + answer_lines * _Panel.line_height(_SIZE_BODY) + 8
    panel.text("think", _SIZE_SMALL, _LABEL)
    think_lines = panel.lines_left(_SIZE_BODY, _step_footer_height() + answer_reserve)
    if think.strip():
        panel.text(think, _SIZE_BODY, _TEXT, max_lines=think_lines)
    else:
        panel.text("(no <think> text)", _SIZE_BODY, _DIM)
    panel.gap()
    panel.text("answer", _SIZE_SMALL, _LABEL)
    panel.text(answer.strip() or "(empty)", _SIZE_BODY, _TEXT, max_lines=answer_lines)
    return canvas


def _step_frame(
    turn_canvas: Image.Image, layout: Layout, title: str, step: EpisodeStep, index: int, total: int
) -> Image.Image:
    canvas = turn_canvas.copy()
    _paste_frame(canvas, step.frame, layout)
    header = _Panel(canvas, layout)
    if title:
        header.y += _Panel.line_height(_SIZE_SMALL)
    header.text(f"Turn {step.turn} · action {index}/{total}", _SIZE_HEADING, _TEXT)
    footer = _Panel(canvas, layout, y=layout.height - MARGIN - _step_footer_height() + 12)
    header.draw.line((footer.x, footer.y - 8, footer.x + footer.width, footer.y - 8), fill=_DIM, width=1)
    footer.text(f"action: {step.action}", _SIZE_HEADING, _ACTION)
    reward_colour = _GREEN if step.reward > 0 else _RED if step.reward < 0 else _TEXT
    footer.text(
        f"reward {_format_number(step.reward)}   return {_format_number(step.episode_return)}",
        _SIZE_HEADING,
        reward_colour,
    )
    return canvas


def _initial_frame(initial_frame: Image.Image, layout: Layout, title: str) -> Image.Image:
    canvas = _blank_canvas(layout)
    _paste_frame(canvas, initial_frame, layout)
    panel = _Panel(canvas, layout)
    if title:
        panel.text(title, _SIZE_SMALL, _DIM)
    panel.text("Initial observation", _SIZE_HEADING, _TEXT)
    panel.gap()
    panel.text("before the first action; return 0.00", _SIZE_BODY, _DIM)
    return canvas


def _final_frame(
    last_frame: Image.Image, layout: Layout, title: str, success: bool, steps: Sequence[EpisodeStep]
) -> Image.Image:
    canvas = _blank_canvas(layout)
    box = _paste_frame(canvas, last_frame, layout)
    colour = _GREEN if success else _RED
    border = 6
    ImageDraw.Draw(canvas).rectangle(
        (box[0] - border, box[1] - border, box[2] + border - 1, box[3] + border - 1),
        outline=colour,
        width=border,
    )
    panel = _Panel(canvas, layout)
    if title:
        panel.text(title, _SIZE_SMALL, _DIM)
    panel.y = layout.height // 2 - _Panel.line_height(_SIZE_BIG)
    panel.text("SUCCESS" if success else "FAILURE", _SIZE_BIG, colour)
    panel.gap()
    episode_return = steps[-1].episode_return if steps else 0.0
    turns = len({step.turn for step in steps})
    panel.text(f"return {_format_number(episode_return)}", _SIZE_HEADING, _TEXT)
    panel.text(f"{len(steps)} actions in {turns} turns", _SIZE_HEADING, _DIM)
    return canvas


def compose_episode_frames(
    initial_frame: Image.Image,
    steps: Sequence[EpisodeStep],
    success: bool,
    title: str = "",
    target_height: int = TARGET_HEIGHT,
) -> list[Image.Image]:
    """Video frames of one episode: ``[initial, one per step..., final]``, all one size.

    Sizes are multiples of 16. The text of a turn (think, answer) is rendered once and shared
    by all actions of that turn.
    """
    layout = layout_for([initial_frame, *(step.frame for step in steps)], target_height)
    frames = [_initial_frame(initial_frame, layout, title)]
    turn_panels: dict[tuple[int, str, str], Image.Image] = {}
    for index, step in enumerate(steps, start=1):
        key = (step.turn, step.think, step.answer)
        if key not in turn_panels:
            turn_panels[key] = _turn_panel(layout, title, step.think, step.answer)
        frames.append(_step_frame(turn_panels[key], layout, title, step, index, len(steps)))
    last = steps[-1].frame if steps else initial_frame
    frames.append(_final_frame(last, layout, title, success, steps))
    return frames


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

VIDEO_FORMATS = ("mp4", "gif")


def episode_video_stem(env_name: str, seed: int, success: bool) -> str:
    """File name without extension, e.g. ``sokoban_seed1000000007_success`` (or ``_fail``)."""
    safe_env = re.sub(r"[^A-Za-z0-9_.-]+", "_", env_name).strip("_") or "env"
    return f"{safe_env}_seed{seed}_{'success' if success else 'fail'}"


def _write_mp4(frames: Sequence[Image.Image], path: Path, fps: float) -> None:
    import imageio.v2 as imageio  # imported here: only writing mp4 needs the ffmpeg plugin

    writer = imageio.get_writer(
        str(path),
        format="FFMPEG",
        mode="I",
        fps=fps,
        codec="libx264",
        pixelformat="yuv420p",
        macro_block_size=16,
        ffmpeg_log_level="error",
    )
    try:
        for frame in frames:
            writer.append_data(np.asarray(frame.convert("RGB")))
    finally:
        writer.close()


def _write_gif(frames: Sequence[Image.Image], path: Path, fps: float) -> None:
    duration_ms = int(round(1000 / fps))
    # The outcome frame stays up longer so a looping GIF is readable.
    durations = [duration_ms] * (len(frames) - 1) + [3 * duration_ms]
    first, *rest = frames
    first.save(path, save_all=True, append_images=rest, duration=durations, loop=0, optimize=False)


def write_episode_video(
    initial_frame: Image.Image,
    steps: Sequence[EpisodeStep],
    success: bool,
    out_dir: str | Path,
    env_name: str,
    seed: int,
    fps: float = 2,
    formats: Sequence[str] = VIDEO_FORMATS,
) -> list[Path]:
    """Write one episode as ``<env>_seed<seed>_<success|fail>.<fmt>`` for each format in ``formats``.

    Frames are those of ``compose_episode_frames``: initial observation, one per executed
    action, outcome. Returns the paths written, in the order of ``formats``.
    """
    unknown = [fmt for fmt in formats if fmt not in VIDEO_FORMATS]
    if unknown:
        raise ValueError(f"unknown video format(s) {unknown}; choices: {list(VIDEO_FORMATS)}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    frames = compose_episode_frames(initial_frame, steps, success, title=f"{env_name} · seed {seed}")
    stem = episode_video_stem(env_name, seed, success)
    paths = []
    for fmt in formats:
        path = out_dir / f"{stem}.{fmt}"
        if fmt == "mp4":
            _write_mp4(frames, path, fps)
        else:
            _write_gif(frames, path, fps)
        paths.append(path)
    return paths
