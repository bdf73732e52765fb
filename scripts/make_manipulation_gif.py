"""Regenerate docs/figures/manipulation_stack.gif: the scripted expert stacking two cubes.

    python scripts/make_manipulation_gif.py [--seed 1] [--size 224] [--every 0.1] [--out PATH]

Plays `envs_visual.make("manipulation", task="stack")` from `--seed` with the expert's actions
(`env.solve()`), two primitives per turn as in training, and keeps a frame of the front camera every
`--every` simulated seconds while the controllers run, with the running primitive written under it.
The GIF plays in real time.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MUJOCO_GL", "egl")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--size", type=int, default=224, help="frame width and height in pixels")
    parser.add_argument("--every", type=float, default=0.1, help="simulated seconds between frames")
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures" / "manipulation_stack.gif"))
    args = parser.parse_args(argv)
    from PIL import Image, ImageDraw, ImageFont

    import envs_visual
    from envs_visual.base import format_response

    env = envs_visual.make("manipulation", task="stack", image_width=args.size, image_height=args.size)
    obs, _ = env.reset(seed=args.seed)
    font = ImageFont.load_default(size=max(10, args.size // 18))
    strip = max(16, args.size // 9)

    def caption(frame, text: str) -> Image.Image:
        out = Image.new("RGB", (args.size, args.size + strip), (20, 20, 20))
        out.paste(Image.fromarray(frame) if not isinstance(frame, Image.Image) else frame, (0, 0))
        ImageDraw.Draw(out).text((4, args.size + strip // 6), text, fill=(235, 235, 235), font=font)
        return out

    frames = [caption(obs.images[0], env.state()["instruction"])] * 5
    env.scene.record_every = args.every
    info = {"success": False}
    for _ in range(4):
        for action in env.solve()[: env.max_actions_per_turn]:
            env.scene.recorded = []
            _, _, terminated, truncated, info = env.step(format_response(env.prompt_format, action))
            frames += [caption(f, action) for f in env.scene.recorded]
            if terminated or truncated:
                break
        if info["success"] or env.done:
            break
    if not info["success"]:
        raise RuntimeError(f"the expert did not stack the cubes of seed {args.seed}: {info.get('messages')}")
    frames += [caption(env.render_image(), "stacked: success")] * 10
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(out, save_all=True, append_images=frames[1:], duration=round(1000 * args.every), loop=0,
                   optimize=True)
    env.close()
    print(f"wrote {out} ({len(frames)} frames, {out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
