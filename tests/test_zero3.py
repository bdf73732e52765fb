import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from child_env import child_env
from safetensors.torch import load_file

WORKER = Path(__file__).parent / "zero3_worker.py"
TIMEOUT = 600


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(ranks: int, out: Path, cache: str, worker: Path = WORKER, timeout: int = TIMEOUT) -> None:
    """`worker` on `ranks` ranks, by the DeepSpeed launcher run by this interpreter, so the test runs whether
    or not the `deepspeed` script is on PATH."""
    env = child_env()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
           str(_free_port()), str(worker), "--out", str(out), "--cache", cache]
    # A session of its own, so that a timeout ends the ranks too, not only the launcher.
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate()
        raise AssertionError(f"the {ranks} ranks did not finish in {timeout} s (a collective that one rank never "
                             f"joined?):\n{stdout[-3000:]}\n{stderr[-3000:]}") from None
    assert launcher.returncode == 0, stdout[-3000:] + stderr[-3000:]


def test_zero3_ranks_with_unequal_episodes_decode_in_lockstep_and_train_as_zero0(tmp_path, tiny_vl, model_cache):
    _launch(2, tmp_path, model_cache)
    _check_lockstep_and_update(tmp_path, tiny_vl, ("zero0", "zero3", "zero3_generate"))
    # per-turn samples (rollout.context=window) train under ZeRO-3 as under ZeRO-0
    _check_lockstep_and_update(tmp_path, tiny_vl, ("zero0_window", "zero3_window"))


def _check_lockstep_and_update(tmp_path, tiny_vl, stages):
    calls = {(stage, rank): torch.load(tmp_path / f"{stage}_rank{rank}.pt") for stage in stages for rank in (0, 1)}
    # one training rollout and one evaluation per rank and stage
    assert all(len(c) == 2 for c in calls.values()), {k: len(c) for k, c in calls.items()}
    params = {stage: load_file(tmp_path / stage / "checkpoints" / "step_1" / "actor" / "model.safetensors")
              for stage in stages}
    initial = tiny_vl[1].state_dict()
    for k, name in enumerate(("training rollout", "evaluation")):
        alone = [calls[stages[0], rank][k]["forwards"] for rank in (0, 1)]
        # the ranks' work is unequal: alone, they run different numbers of forward passes ...
        assert alone[0] != alone[1], f"{name}: both ranks ran {alone[0]} forward passes under ZeRO-0; the test " \
                                     f"needs ranks with unequal episodes"
        for stage in stages[1:]:
            # ... and under ZeRO-3 the rank that is done keeps passing until the other is
            synced = [calls[stage, rank][k]["forwards"] for rank in (0, 1)]
            assert synced[0] == synced[1] == max(alone), f"{stage}, {name}: forward passes per rank {synced}, " \
                                                         f"expected both {max(alone)} (ZeRO-0: {alone})"
            for rank in (0, 1):  # the same episodes, token for token
                assert calls[stage, rank][k]["input_ids"] == calls[stages[0], rank][k]["input_ids"], (stage, name, rank)
    # the same update: parameters as ZeRO-0's, gathered from the partitions
    moved = 0.0
    for stage in stages[1:]:
        assert params[stage].keys() == params[stages[0]].keys(), sorted(set(params[stage]) ^ set(params[stages[0]]))
        for name, expected in params[stages[0]].items():
            # ZeRO-3 over two ranks runs each batch whole (no shared prompt prefix: every rank must take the
            # same passes), ZeRO-0 shares the prefix: float sums in another order, which Adam turns into
            # differences of a few 1e-6 where a gradient is near its eps (docs/training.md).
            torch.testing.assert_close(params[stage][name], expected, atol=2e-5, rtol=0,
                                       msg=lambda m, stage=stage, name=name: f"{stage}, {name}: {m}")
            if name in initial:
                moved = max(moved, float((expected - initial[name]).abs().max()))
    assert moved > 1e-4, f"the update moved no parameter by more than {moved}"
    # ZeRO-3 builds actor, critic and reference partitioned: no rank ever held a whole model; ZeRO-0 whole
    for stage in stages:
        for rank in (0, 1):
            loads = torch.load(tmp_path / f"{stage}_loads_rank{rank}.pt")
            assert len(loads) == 3, (stage, rank, loads)  # actor, critic backbone, reference (KL is on)
            for held, whole in loads:
                if stage.startswith("zero0"):
                    assert held == whole, (stage, rank, held, whole)
                else:
                    assert held <= 0.6 * whole, (stage, rank, held, whole)


def test_the_zero3_build_leaves_torch_linear_as_it_was(distributed, monkeypatch):
    """`deepspeed.zero.Init`, under which the models are built partitioned, replaces `torch.nn.functional.linear`
    with DeepSpeed's autograd function and never puts it back; the vLLM engine built afterwards in the same
    process looks `F.linear` up at every call. One gloo rank, the shipped ZeRO-3 config."""
    import torch.nn.functional as F

    from vagen.config import load_config
    from vagen.models import base_checkpoint, load_policy
    from vagen.train import partitioned_build

    monkeypatch.setattr(F, "linear", torch._C._nn.linear)  # whatever an earlier test of the session left
    cfg = load_config("sokoban_text", ["train.deepspeed_config=deepspeed/zero3_fp32.json"])
    with partitioned_build(cfg, distributed) as partitioned:
        model, _ = load_policy(base_checkpoint(cfg.model), cfg.model.dtype)
        inside = F.linear
    assert partitioned and all(hasattr(p, "ds_id") for p in model.parameters()), "the model was not built partitioned"
    assert inside is not torch._C._nn.linear, "zero.Init no longer replaces F.linear: this test checks nothing"
    assert F.linear is torch._C._nn.linear, f"F.linear is {F.linear} after the ZeRO-3 build"
