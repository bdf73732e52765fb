import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).parent / "dp_worker.py"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(ranks: int, out: Path, cache: str):
    launcher = shutil.which("deepspeed")
    if launcher is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    port = _free_port()
    cmd = [launcher, "--num_gpus", str(ranks), "--master_port", str(port), str(WORKER), "--out", str(out),
           "--cache", cache]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    # DeepSpeed's CPU all-reduce maps one shared-memory file per rank and never removes it: without
    # vagen.train.init_distributed unlinking them, every run would leave 66 MB per rank in /dev/shm.
    left = sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    assert not left, f"shared-memory files left behind by the run: {[p.name for p in left]}"
    return torch.load(out)


def test_two_cpu_ranks_give_the_parameters_of_one_rank_with_the_same_global_batch(tmp_path, model_cache):
    one = _launch(1, tmp_path / "one.pt", model_cache)
    two = _launch(2, tmp_path / "two.pt", model_cache)
    from vagen.models import load_policy, resolve_model_path

    initial, _ = load_policy(resolve_model_path("builtin:tiny-text", model_cache, seed=0))
    moved = 0.0
    for name, start in initial.state_dict().items():
        # Tolerance: float32 gradients summed in a different order (gloo all-reduce vs. local
        # accumulation), then two Adam steps: agreement to 1e-5 absolute on weights of scale ~0.02.
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=1e-4, msg=name)
        moved = max(moved, float((one[name] - start).abs().max()))
    assert moved > 1e-3  # the update really changed the parameters
