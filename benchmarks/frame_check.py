"""The frame check (vagen.frame_check) on the shipped visual warm starts: a short training run of each config from
its warm start with `log.frame_check_every=1`, each in its own process on one thread. Prints, per config, the
gap and its positive share on the first iteration's batch (the warm start's own rollouts, before any update),
their means over the later iterations, and the check's cost: its seconds as a share of an iteration, over the
iterations after the first (whose timings include warming up).

    python benchmarks/frame_check.py                                   # every shipped visual warm start, 3 iterations
    python benchmarks/frame_check.py --configs sokoban_visual navigation_visual --iterations 4

The calibration of the collapse monitor's threshold (docs/algorithms.md, "Does the policy look?") was made
with this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("frozenlake_visual", "sokoban_visual", "navigation_visual", "manipulation_visual", "multitask_visual")


def run(config: str, iterations: int, out: Path, extra: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "vagen" / "train.py"), "--config", config, f"train.iterations={iterations}",
           "log.frame_check_every=1", f"train.run_dir={out}", f"train.run_name={config}", "log.progress=false",
           "log.tensorboard=false", "log.trackers=[]", f"train.save_every={iterations + 1}", *extra]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / config / "metrics.jsonl").read_text().splitlines()]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS))
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = parser.parse_args(argv)
    print("| config | turns scored (it. 0) | gap, nats/turn (it. 0) | positive (it. 0) | gap (later) | positive "
          "(later) | format ok (it. 0) | check s | iteration s | check share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            rows = run(config, args.iterations, Path(tmp), args.overrides)
            first, later = rows[0], rows[1:]
            check = mean([r["timing/frame_check"] for r in later if "timing/frame_check" in r])
            iteration = mean([r["timing/iteration"] for r in later])
            print(f"| {config} | {first.get('rollout/frame_gap_turns', 0):.0f} | {first.get('rollout/frame_gap', float('nan')):.2f} | "
                  f"{first.get('rollout/frame_gap_positive', float('nan')):.2f} | "
                  f"{mean([r['rollout/frame_gap'] for r in later if 'rollout/frame_gap' in r]):.2f} | "
                  f"{mean([r['rollout/frame_gap_positive'] for r in later if 'rollout/frame_gap_positive' in r]):.2f} | "
                  f"{first['rollout/format_ok']:.2f} | {check:.2f} | {iteration:.1f} | {check / iteration:.1%} |",
                  flush=True)
            for key in sorted(k for k in first if k.endswith("/frame_gap") and k != "rollout/frame_gap"):
                print(f"|   {key} (it. 0) | {first[key.replace('frame_gap', 'frame_gap_turns')]:.0f} | "
                      f"{first[key]:.2f} | {first[key + '_positive']:.2f} | | | | | | |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
