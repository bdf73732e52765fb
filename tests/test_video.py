"""Episode videos: frame counts and sizes of the written files, text wrapping, frame placement."""

import imageio.v2 as imageio
import numpy as np
import pytest
from PIL import Image

from vagen.video import (
    EpisodeStep,
    compose_episode_frames,
    displayable,
    episode_video_stem,
    get_font,
    layout_for,
    wrap_text,
    write_episode_video,
)


def checkerboard(width: int, height: int, cell: int = 4) -> Image.Image:
    ys, xs = np.mgrid[0:height, 0:width]
    dark = ((xs // cell + ys // cell) % 2).astype(bool)
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[dark] = (250, 30, 30)
    pixels[~dark] = (20, 200, 60)
    pixels[0, 0] = (0, 0, 255)  # marks the top-left corner, so a flipped or shifted paste fails
    return Image.fromarray(pixels)


def make_steps(frame_size=(168, 168), n_steps=5, actions_per_turn=2) -> list[EpisodeStep]:
    steps, episode_return = [], 0.0
    for i in range(n_steps):
        reward = 1.0 if i == n_steps - 1 else -0.1
        episode_return += reward
        steps.append(
            EpisodeStep(
                frame=checkerboard(*frame_size, cell=2 + i),
                turn=1 + i // actions_per_turn,
                think=f"turn {1 + i // actions_per_turn}: the box is left of the target, push right.",
                answer="Right, Up",
                action=["Right", "Up"][i % 2],
                reward=reward,
                episode_return=episode_return,
            )
        )
    return steps


def test_wrap_text_fits_width_and_truncates_with_ellipsis():
    font = get_font(15)
    text = "Pushing the box right puts it on the target, then I go up. " * 40
    lines = wrap_text(text, font, max_width=300, max_lines=4)
    assert len(lines) == 4
    assert all(font.getlength(line) <= 300 for line in lines), [font.getlength(line) for line in lines]
    assert lines[-1].endswith("…")
    assert not any(line.endswith("…") for line in lines[:-1])
    # Greedy: every full line but the last is too short to take the next word.
    assert font.getlength(lines[0] + " " + lines[1].split()[0]) > 300


def test_wrap_text_short_text_untouched_and_long_word_broken():
    font = get_font(15)
    assert wrap_text("Left, Up", font, 300, max_lines=3) == ["Left, Up"]
    assert wrap_text("   ", font, 300) == []
    assert wrap_text("first\n\nsecond", font, 300) == ["first", "second"]
    long_word = "x" * 200
    lines = wrap_text(long_word, font, 100)
    assert "".join(lines) == long_word
    assert len(lines) > 1 and all(font.getlength(line) <= 100 for line in lines)


def test_unicode_is_mapped_to_drawable_characters():
    assert displayable("box √ target ← é 中") == "box * target <- e ?"
    assert displayable("tab\there") == "tab here"


def test_env_frame_region_equals_nearest_neighbour_upscale():
    initial = checkerboard(112, 112, cell=3)
    steps = make_steps(frame_size=(112, 112), n_steps=2)
    frames = compose_episode_frames(initial, steps, success=True, title="grid")
    layout = layout_for([initial, *(s.frame for s in steps)])
    assert layout.scale_for((112, 112)) == 3  # 384 // 112
    for frame, source in [(frames[0], initial), (frames[1], steps[0].frame), (frames[2], steps[1].frame)]:
        box = layout.frame_box(source.size)
        assert (box[2] - box[0], box[3] - box[1]) == (336, 336)
        region = np.asarray(frame.crop(box))
        expected = np.repeat(np.repeat(np.asarray(source), 3, axis=0), 3, axis=1)
        np.testing.assert_array_equal(region, expected)


def test_frames_one_per_action_plus_initial_and_final_all_same_size():
    steps = make_steps(n_steps=5)
    frames = compose_episode_frames(checkerboard(168, 168), steps, success=False)
    assert len(frames) == 1 + 5 + 1
    sizes = {frame.size for frame in frames}
    assert len(sizes) == 1
    width, height = sizes.pop()
    assert width % 16 == 0 and height % 16 == 0
    assert height >= 384


def test_final_frame_colour_states_outcome():
    def count(frame, colour):
        return int(np.all(np.asarray(frame) == colour, axis=-1).sum())

    green, red = (60, 200, 90), (235, 70, 60)
    won = compose_episode_frames(checkerboard(128, 128), make_steps((128, 128), 2), success=True)[-1]
    lost = compose_episode_frames(checkerboard(128, 128), make_steps((128, 128), 2), success=False)[-1]
    assert count(won, green) > 1000 and count(won, red) == 0
    assert count(lost, red) > 1000 and count(lost, green) == 0


def test_mixed_frame_sizes_share_one_canvas():
    # grid 112 px, navigation 128 px, a wide frame with a top-down view beside it, and a tall one
    initial = checkerboard(112, 112)
    frames_in = [checkerboard(128, 128), checkerboard(256, 128), checkerboard(100, 500)]
    steps = [
        EpisodeStep(f, turn=1, think="", answer="", action="moveahead", reward=0.0, episode_return=0.0)
        for f in frames_in
    ]
    frames = compose_episode_frames(initial, steps, success=True)
    layout = layout_for([initial, *frames_in])
    assert {f.size for f in frames} == {layout.size}
    assert layout.frame_box((256, 128))[2:] != layout.frame_box((128, 128))[2:]
    box = layout.frame_box((100, 500))  # taller than the target: kept at scale 1, still inside
    assert box[0] >= 0 and box[1] >= 0 and box[2] <= layout.left_width and box[3] <= layout.height


def test_episode_video_stem_names_env_seed_outcome():
    assert episode_video_stem("sokoban", 1000000007, True) == "sokoban_seed1000000007_success"
    assert episode_video_stem("primitive_skill/place", 3, False) == "primitive_skill_place_seed3_fail"


def test_write_episode_video_mp4_and_gif(tmp_path):
    steps = make_steps(frame_size=(168, 168), n_steps=4)
    paths = write_episode_video(checkerboard(168, 168), steps, True, tmp_path, "sokoban", 1000000007, fps=2)
    assert [p.name for p in paths] == [
        "sokoban_seed1000000007_success.mp4",
        "sokoban_seed1000000007_success.gif",
    ]
    expected_frames = 1 + 4 + 1
    expected_size = compose_episode_frames(checkerboard(168, 168), steps, True)[0].size

    reader = imageio.get_reader(paths[0], format="FFMPEG")
    try:
        decoded = [frame for frame in reader]
        fps = reader.get_meta_data()["fps"]
    finally:
        reader.close()
    assert len(decoded) == expected_frames
    assert decoded[0].shape == (expected_size[1], expected_size[0], 3)
    assert fps == pytest.approx(2)

    with Image.open(paths[1]) as gif:
        assert gif.n_frames == expected_frames
        assert gif.size == expected_size
        assert gif.info["loop"] == 0


def test_write_episode_video_failure_name_and_single_format(tmp_path):
    paths = write_episode_video(
        checkerboard(128, 128),
        make_steps((128, 128), 1),
        False,
        tmp_path / "videos",
        "navigation",
        5,
        formats=("gif",),
    )
    assert [p.name for p in paths] == ["navigation_seed5_fail.gif"]
    assert paths[0].is_file()
    with pytest.raises(ValueError, match="unknown video format.*'webm'.*choices"):
        write_episode_video(checkerboard(8, 8), [], False, tmp_path, "x", 0, formats=("webm",))
