"""Add frame dependence to a shipped warm start's card (assets/checkpoints/NAME/card.json, key "frames"): greedy
success on the card's first N evaluation levels with each level's own frames and with decoy frames (every
observation showing another of those levels' frames, `vagen.frame_check.DecoyFrames`), each with its 95% Wilson
interval, and the frame gap of the greedy episodes (`vagen.frame_check.eval_frame_gap`). A warm start of several
tasks gets them per task. Run it again after rebuilding a warm start (python -m vagen.sft writes a new card).

    python scripts/card_frames.py frozenlake_visual sokoban_visual --levels 64
    python scripts/card_frames.py navigation_visual --levels 64 --dry-run    (print it, leave the card)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def success_row(records: list[dict]) -> dict:
    from vagen.eval import wilson_interval

    successes = sum(bool(r["success"]) for r in records)
    low, high = wilson_interval(successes, len(records))
    return {"success": successes / len(records), "interval_95": [round(low, 4), round(high, 4)],
            "successes": successes, "n": len(records)}


def frame_rows(model, encoder, cfg, levels: int) -> dict:
    """The card's "frames" entry of one environment config."""
    from vagen.eval import episode_record, play_with_decoys
    from vagen.frame_check import eval_frame_gap
    from vagen.rollout import rollout
    from vagen.warmstart.demos import distinct_eval_seeds

    seeds = distinct_eval_seeds(cfg.env, levels)
    played, _ = rollout(model, encoder, cfg, seeds, group_size=1, do_sample=False)
    own = [episode_record(ep.seed, [{"reward": t.reward, "info": t.info} for t in ep.turns], ep.success)
           for ep in played]
    gap = eval_frame_gap(model, encoder, cfg, played)
    decoys = play_with_decoys(model, encoder, cfg, seeds, seeds, None)
    return {"levels": levels, "seeds": f"vagen.warmstart.demos.distinct_eval_seeds(env, {levels})",
            "decoys": "vagen.frame_check.decoy_seeds: the next of those levels, the last's the first",
            "greedy": success_row(own), "decoy greedy": success_row(decoys),
            **{key: round(value, 4) for key, value in gap.items()}}


def add_frames(name: str, levels: int, write: bool = True) -> dict:
    import torch

    from vagen.config import checkpoints_dir, load_config, task_configs
    from vagen.episode import ChatEncoder
    from vagen.models import load_policy
    from vagen.warmstart.sft import CARD_FILE, code_revision

    torch.set_num_threads(1)
    path = checkpoints_dir() / name / CARD_FILE
    card = json.loads(path.read_text())
    cfg = load_config(card["config"])
    model, processor = load_policy(checkpoints_dir() / name, cfg.model.dtype)
    model.eval()
    encoder = ChatEncoder(processor)
    t0 = time.perf_counter()
    head = {"command": f"python scripts/card_frames.py {name} --levels {levels}", "code_revision": code_revision()}
    if cfg.rollout.tasks:
        frames = {**head, "tasks": {task: frame_rows(model, encoder, sub, levels) for task, sub in task_configs(cfg)
                                    if sub.env.render_mode == "vision"}}
    else:
        frames = {**head, **frame_rows(model, encoder, cfg, levels)}
    frames["seconds"] = round(time.perf_counter() - t0)
    card["frames"] = frames
    if write:
        path.write_text(json.dumps(card, indent=1) + "\n")
    return frames


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", help="shipped warm starts (assets/checkpoints/NAME) of visual configs")
    parser.add_argument("--levels", type=int, default=64)
    parser.add_argument("--dry-run", action="store_true", help="print the entry, leave the card as it is")
    args = parser.parse_args(argv)
    for name in args.names:
        frames = add_frames(name, args.levels, write=not args.dry_run)
        print(name, json.dumps({k: v for k, v in frames.items() if k not in ("command", "code_revision")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
