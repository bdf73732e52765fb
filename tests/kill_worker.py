"""Run by tests/test_resume.py as its own process: `vagen.train.main` with the arguments given, killed
with SIGKILL at a chosen moment: `--kill-in-update N` in the update of iteration N (0-based), or
`--kill-in-save N` while checkpoint step_N is being written (its model files written, the engine
states not yet)."""

import argparse
import os
import signal
import sys

import vagen.update
from vagen.train import main


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-in-update", type=int, default=None)
    parser.add_argument("--kill-in-save", type=int, default=None)
    args, rest = parser.parse_known_args()
    if args.kill_in_update is not None:
        real_update, calls = vagen.update.ppo_update, []

        def ppo_update(*a, **k):
            calls.append(1)
            if len(calls) == args.kill_in_update + 1:
                kill()
            return real_update(*a, **k)

        vagen.update.ppo_update = ppo_update
    if args.kill_in_save is not None:
        from deepspeed.runtime.engine import DeepSpeedEngine

        real_save = DeepSpeedEngine.save_checkpoint

        def save_checkpoint(self, save_dir, *a, **k):
            if f"step_{args.kill_in_save}.tmp" in str(save_dir):
                kill()
            return real_save(self, save_dir, *a, **k)

        DeepSpeedEngine.save_checkpoint = save_checkpoint
    sys.exit(main(rest))
