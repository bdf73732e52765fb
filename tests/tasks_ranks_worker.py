"""Run by tests/test_tasks.py as one of two gloo ranks of a run over two tasks, rank 1 holding no row of the second
task: each task's advantages whitened over both ranks (`vagen.update.whiten_by_task`), and the refusal of a task
whose environments failed in every episode (`vagen.tasks.refuse_failed_tasks`), first where only rank 1's episodes
of a task failed, then where every rank's did. Prints one JSON line: what each step gave on this rank."""

import datetime
import json
import sys
from types import SimpleNamespace

import torch

from vagen.tasks import refuse_failed_tasks
from vagen.update import whiten_by_task

TASKS = ["sokoban_text", "frozenlake_text"]


def main() -> None:
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = torch.distributed.get_rank()
    # rank 0: a row of each task; rank 1: two rows of the first task, none of the second
    advantages = torch.tensor([[1.0, 2.0], [4.0, 0.0]]) if rank == 0 else torch.tensor([[3.0, 5.0], [7.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]]) if rank == 0 else torch.ones(2, 2)
    tasks = ["sokoban_text", "frozenlake_text"] if rank == 0 else ["sokoban_text", "sokoban_text"]
    whitened = whiten_by_task(advantages, mask, tasks, TASKS).tolist()
    outcomes = []
    for failing in ({1}, {0, 1}):  # the ranks whose frozenlake episodes all failed at reset
        episodes = [SimpleNamespace(task=name, error="reset: OSError: no EGL display" if rank in failing
                                    and name == "frozenlake_text" else None) for name in TASKS]
        try:
            refuse_failed_tasks(TASKS, episodes)
            outcomes.append("played")
        except RuntimeError as err:
            outcomes.append(f"raised: {err}")
    torch.distributed.barrier()  # both ranks got here: neither waits in a collective for the other
    torch.distributed.destroy_process_group()
    print(json.dumps({"whitened": whitened, "outcomes": outcomes}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
