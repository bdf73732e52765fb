"""Run by tests/test_tasks_vllm.py as its own process: `vagen.train.main` with the arguments given, each rollout of
its `vagen.tasks.TaskRollouts` written as a JSON line to `--record`: the version and whether it drained, each played
episode's task, group id, admission number, level seed and its turns' versions, and each task's admitted groups,
groups in flight and waiting episodes after the rollout. Under the DeepSpeed launcher each rank writes its own file,
`--record` with `.rank<R>` appended. `--nan-from N` makes every policy loss NaN from the update of iteration N
on, as tests/staleness_worker.py's option does."""

import argparse
import json
import os
import sys

import vagen.tasks
from vagen.distributed import leave_process_group
from vagen.train import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", required=True)
    parser.add_argument("--nan-from", type=int, default=None, help="as tests/staleness_worker.py's")
    args, rest = parser.parse_known_args()
    if "LOCAL_RANK" in os.environ:  # one process per rank: a file each
        args.record = f"{args.record}.rank{os.environ['RANK']}"
    real_play = vagen.tasks.TaskRollouts.play

    def play(self, decoder, version, saves_in=0):
        episodes, stats = real_play(self, decoder, version, saves_in)
        record = {"version": version, "drain": saves_in == 1,
                  "episodes": [{"task": ep.task, "group_id": ep.group_id, "admission": ep.admission,
                                "seed": ep.seed, "versions": [t.version for t in ep.turns]} for ep in episodes],
                  "tasks": {name: {"started": part.admission.started, "in_flight": sorted(part.game.groups),
                                   "waiting": len(part.game.waiting)} for name, part in self.parts}}
        with open(args.record, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return episodes, stats

    vagen.tasks.TaskRollouts.play = play
    if args.nan_from is not None:
        from staleness_worker import nan_from

        nan_from(args.nan_from)
    sys.exit(leave_process_group(main(rest)))
