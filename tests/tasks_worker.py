"""Run by tests/test_tasks_vllm.py as its own process: `vagen.train.main` with the arguments given, each rollout of
its `vagen.tasks.TaskRollouts` written as a JSON line to `--record`: the version and whether it drained, each played
episode's task, group id, admission number and its turns' versions, and each task's admitted groups, groups in
flight and waiting episodes after the rollout."""

import argparse
import json
import sys

import vagen.tasks
from vagen.train import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", required=True)
    args, rest = parser.parse_known_args()
    real_play = vagen.tasks.TaskRollouts.play

    def play(self, decoder, version, saves_in=0):
        episodes, stats = real_play(self, decoder, version, saves_in)
        record = {"version": version, "drain": saves_in == 1,
                  "episodes": [{"task": ep.task, "group_id": ep.group_id, "admission": ep.admission,
                                "versions": [t.version for t in ep.turns]} for ep in episodes],
                  "tasks": {name: {"started": part.admission.started, "in_flight": sorted(part.game.groups),
                                   "waiting": len(part.game.waiting)} for name, part in self.parts}}
        with open(args.record, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return episodes, stats

    vagen.tasks.TaskRollouts.play = play
    sys.exit(main(rest))
