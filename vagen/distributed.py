"""Everything about ranks, in one place: the process-group start that training and evaluation share,
the rank's device, collectives, and the agreement that keeps ZeRO-3's collective forward passes paired.

Every other module asks this one: whether the job is distributed (`Dist.active`), whether a model's
forward passes are collective (`partitioned_over_ranks`), how to all-reduce, gather or broadcast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def active(self) -> bool:
        return initialized() and self.world_size > 1


def initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def world_size() -> int:
    return torch.distributed.get_world_size() if initialized() else 1


def cpu_threads(local_world: int) -> int:
    """Torch threads for one of `local_world` processes on this machine's CPU: OMP_NUM_THREADS when
    set (the user's or the launcher's choice), else the cores shared out evenly."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"OMP_NUM_THREADS={value!r} is not a positive whole number; set it to the threads "
                             f"each process may use (e.g. 1), or unset it to share the cores out evenly")
        return int(value)
    return max(1, (os.cpu_count() or 1) // local_world)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _unlink_shm_workspace(rank: int) -> None:
    """Remove the name of this rank's shared-memory all-reduce workspace once every rank has mapped it.

    DeepSpeed's CPU communication op creates /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>
    (66 MB) when all ranks share a machine and never unlinks it, so each run used to leave that much
    memory behind until reboot. The mappings stay valid after the unlink; the memory goes with the
    last process that maps it, even one that is killed."""
    torch.distributed.barrier()  # every rank has opened every other rank's workspace by now
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:  # the op was not built, or the ranks span machines
        pass


def rank_device(local_rank: int) -> torch.device:
    """The device of the rank with `local_rank` on its machine: its own GPU, or the CPU."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def init_distributed(need_group: bool = True) -> Dist:
    """The start of every entry point (training, evaluation, warm starts): the rank's device becomes the
    current CUDA device before any collective (NCCL would otherwise put every rank's communication on
    GPU 0), CPU ranks share the cores (`cpu_threads`), and the process group the DeepSpeed launcher
    describes is joined: gloo on CPU, NCCL on GPUs. Under plain `python` the group is one of one,
    made only when `need_group` (DeepSpeed engines need one; evaluation on one rank does not)."""
    if "RANK" not in os.environ and need_group:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = rank_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Two processes on two cores with default threading measured 4.6x slower than one thread each.
        torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if (need_group or world > 1) and not initialized():
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
        if device.type == "cpu":
            _unlink_shm_workspace(rank)
    return Dist(rank, world, local_rank, device)


def leave_process_group(code: int) -> int:
    """End of a command-line entry point: leave the process group (NCCL warns at exit otherwise)."""
    if initialized():
        torch.distributed.destroy_process_group()
    return code


def all_reduce(values: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) over ranks; the values themselves without a process group. NCCL reduces CUDA
    tensors only: CPU values travel through the rank's GPU."""
    if not initialized():
        return values
    on = values
    if torch.distributed.get_backend() == "nccl" and values.device.type != "cuda":
        on = values.to(torch.device("cuda", torch.cuda.current_device()))
    torch.distributed.all_reduce(on, op=torch.distributed.ReduceOp.MAX if op == "max" else torch.distributed.ReduceOp.SUM)
    return on.to(values.device)


def gather_objects(value, active: bool | None = None) -> list:
    """Every rank's `value`, in rank order (a list of one without a process group)."""
    if not (initialized() if active is None else active) or world_size() == 1:
        return [value]
    gathered: list = [None] * world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


def broadcast_object(value, dist: Dist):
    """Rank 0's `value` on every rank."""
    if not dist.active:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier(dist: Dist) -> None:
    if dist.active:
        torch.distributed.barrier()


def partitioned_over_ranks(module) -> bool:
    """ZeRO-3 over several ranks: every forward pass is collective (each layer gathers its parameters
    from all ranks), so every rank must run the same passes in the same order. DeepSpeed marks
    partitioned parameters with `ds_id`."""
    module = getattr(module, "module", module)  # a DeepSpeed engine forwards to .module
    first = next(module.parameters(), None)
    return first is not None and hasattr(first, "ds_id") and world_size() > 1


def gathered(params: list):
    """Inside, `params` hold their whole data on this rank: gathered from the ranks (a collective) where
    ZeRO-3 partitions them, and partitioned again on leaving; nothing happens to others."""
    import contextlib

    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class Lockstep:
    """Whether forward passes of `model` must run on all ranks together, and the agreement between
    ranks that keeps them so. On when `partitioned_over_ranks(model)`; otherwise every method is
    local and communicates nothing."""

    def __init__(self, model):
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.on = partitioned_over_ranks(model)

    def any(self, *flags: bool) -> list[bool]:
        """Each flag: whether it holds on any rank (a collective call when on)."""
        if not self.on:
            return [bool(f) for f in flags]
        values = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        return [bool(v) for v in values.tolist()]
