"""The environment for a child process the tests start."""

import os

# The `distributed` fixture's process group of one writes these into this process's environment; a
# child that inherited them would join that group's rendezvous and fail on its port (EADDRINUSE).
DISTRIBUTED_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict:
    """os.environ without the process-group variables, one thread per process, and `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def worker_args():
    """The arguments of a worker the tests start under the DeepSpeed launcher: `--out` (what it
    writes), `--cache` (the built-in models' cache) and the launcher's `--local_rank`."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache", required=True)
    return parser.parse_args()
