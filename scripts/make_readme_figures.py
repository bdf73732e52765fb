"""Regenerate the figures of the README and docs/evaluation.md from a real CPU run:

    python scripts/make_readme_figures.py [--config frozenlake_visual] [--iterations 12] [override ...]

Trains the config on this machine (the built-in tiny model, minutes on a laptop CPU), plots its
curves with `vagen.plot`, evaluates the final checkpoint with videos, and writes three small PNGs into
docs/figures/: `training_curves.png` (the plot), `episode_frame.png` (one frame of an episode
video, the first one in which the agent executed an action) and `episode_browser.png` (the
evaluation's episode browser in headless Chromium, open at that episode).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="frozenlake_visual")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from PIL import Image

    from vagen.browse import screenshot
    from vagen.eval import main as evaluate_main
    from vagen.plot import plot_runs
    from vagen.train import main as train_main

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        runs = Path(tmp) / "runs"
        overrides = [f"train.iterations={args.iterations}", f"train.run_dir={runs}", "train.run_name=readme",
                     "log.progress=false", *args.overrides]
        if train_main(["--config", args.config, *overrides]) != 0:
            return 1
        run = runs / "readme"
        summary = [p for p in plot_runs([run], Path(tmp) / "plots") if p.name == "summary.png"][0]
        image = Image.open(summary).convert("RGB")
        image.thumbnail((1200, 800))
        image.save(out / "training_curves.png", optimize=True)
        eval_dir = Path(tmp) / "eval"
        if evaluate_main(["--config", args.config, "--checkpoint", str(run), "--episodes", "8", "--videos", "8",
                          "--out", str(eval_dir), *args.overrides]) != 0:
            return 1
        results = json.loads((eval_dir / "results.json").read_text())
        acted = [r for r in results["episodes"] if r["actions"] > 0] or results["episodes"]
        # prefer a successful episode that acted, then any that acted
        chosen = sorted(acted, key=lambda r: (not r["success"], r["seed"]))[0]
        gif = next((eval_dir / "videos").glob(f"*_seed{chosen['seed']}_*.gif"))
        frames = Image.open(gif)
        frames.seek(min(2, frames.n_frames - 1))  # an action frame, not the opening one
        frames.convert("RGB").save(out / "episode_frame.png", optimize=True)
        screenshot(eval_dir / "index.html", out / "episode_browser.png", f"seed={chosen['seed']}&turn=1")
        (out / "source.json").write_text(json.dumps({"config": args.config, "iterations": args.iterations,
                                                     "overrides": args.overrides, "video": gif.name,
                                                     "eval": results["model"]}, indent=2))
    for name in ("training_curves.png", "episode_frame.png", "episode_browser.png"):
        print(out / name, os.path.getsize(out / name), "bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
