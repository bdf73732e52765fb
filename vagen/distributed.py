"""Everything about ranks, in one place: the process-group start that training and evaluation share,
the rank's device, collectives, and the agreement that keeps ZeRO-3's collective forward passes paired.

Every other module asks this one: whether the job is distributed (`Dist.active`), whether a model's
forward passes are collective (`partitioned_over_ranks`), how to all-reduce, gather or broadcast.
"""

from __future__ import annotations

import datetime
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


# File systems on which another machine may hold a lock that this machine's /proc cannot show.
_SHARED_FILE_SYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                        "fuse.sshfs", "fuse.glusterfs", "fuse.cephfs", "9p", "afs", "ocfs2", "gfs2", "wekafs")


def _build_lock_files() -> list[str]:
    """Every extension's build lock where torch builds DeepSpeed's ops: `$TORCH_EXTENSIONS_DIR/<op>/lock`,
    else `<torch's cache root>/<python>_<accelerator>/<op>/lock` (any python and accelerator folder)."""
    import glob

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return sorted(glob.glob(os.path.join(glob.escape(root), "*", "lock")))
    from torch.utils.cpp_extension import get_default_build_root

    return sorted(glob.glob(os.path.join(glob.escape(get_default_build_root()), "*", "*", "lock")))


def _lock_holders(path: str) -> list[int]:
    """Live processes on this machine with `path` open (a builder keeps its lock file open until it
    releases it)."""
    target = os.path.realpath(path)
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's process
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    holders.append(int(pid))
                    break
            except OSError:
                continue
    return holders


def _shared_file_system(path: str, mounts: str = "/proc/self/mounts") -> str | None:
    """The type of the network file system `path` lies on (by the mount table `mounts`), None for a local one."""
    path, best, kind = os.path.realpath(path), "", None
    try:
        with open(mounts) as table:
            for line in table:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind if kind in _SHARED_FILE_SYSTEMS else None


def clear_stale_build_locks(lock_blocks: bool | None = None, settle_s: float = 0.2,
                            mounts: str = "/proc/self/mounts") -> list[str]:
    """Remove the build lock of a DeepSpeed op whose builder is gone, so that a run killed during the
    first-time build (~45 s for the CPU all-reduce op) does not leave every later run waiting forever
    and without a word. Returns what it said (also printed to stderr).

    Torch releases whose `cpp_extension` uses `FileBaton` lock a build by creating `<op>/lock` and wait,
    with no time limit and no message, while the file exists; the builder keeps the file open until it
    removes it. A lock that no process on this machine has open therefore has no builder here: on a
    local file system it is removed; on a shared one (a builder on another machine cannot be seen) it is
    named with the command that removes it. A lock a live process holds is never touched. Later releases
    take a kernel lock instead (`filelock`, freed when the holder dies), whose leftover files block
    nothing and stay. `lock_blocks` overrides which kind the installed torch uses; `mounts` is the
    mount table."""
    import fcntl
    import sys
    import time

    if lock_blocks is None:
        import torch.utils.cpp_extension as cpp_extension

        lock_blocks = hasattr(cpp_extension, "FileBaton")
    locks = _build_lock_files() if lock_blocks else []
    if not locks:
        return []
    said = []
    # One checker at a time (the ranks on this machine start together); the kernel frees this lock
    # with its holder, so a killed checker leaves nothing behind. A read-only cache checks unserialised.
    try:
        check = open(os.path.join(os.path.dirname(os.path.dirname(locks[0])), ".vagen_lock_check"), "a")
    except OSError:
        check = open(os.devnull, "a")
    with check:
        fcntl.flock(check, fcntl.LOCK_EX)
        for lock in locks:
            try:
                first = os.stat(lock)
            except FileNotFoundError:
                continue
            holders = _lock_holders(lock)
            if not holders:
                # a builder that is releasing closes the file just before removing it: let it finish
                time.sleep(settle_s)
                try:
                    again = os.stat(lock)
                except FileNotFoundError:
                    continue
                if (again.st_dev, again.st_ino) != (first.st_dev, first.st_ino):
                    continue
                holders = _lock_holders(lock)
            op = os.path.basename(os.path.dirname(lock))
            age = time.time() - first.st_mtime
            if holders:
                said.append(f"DeepSpeed op {op}: process {', '.join(map(str, holders))} is building it (lock {lock}, "
                            f"{age:.0f} s old); this run waits for it")
                continue
            shared = _shared_file_system(lock, mounts)
            if shared:
                said.append(f"DeepSpeed op {op}: its build lock {lock} ({age:.0f} s old) is held by no process on this "
                            f"machine, but it lies on a shared file system ({shared}) where another machine may be "
                            f"building the op; this run waits for it. If no machine is building it (a killed run left "
                            f"it), remove it: rm {lock}  (or give each machine its own TORCH_EXTENSIONS_DIR)")
                continue
            try:
                os.unlink(lock)
            except OSError as error:
                said.append(f"DeepSpeed op {op}: its build lock {lock} ({age:.0f} s old) is held by no process, so "
                            f"a stopped build left it, but it cannot be removed ({error}); this run would wait for "
                            f"it forever: remove it (rm {lock}) and start again")
                continue
            said.append(f"DeepSpeed op {op}: removed its build lock {lock}, left {age:.0f} s ago by a build that "
                        f"was stopped before it finished (no process holds it); the op is built again now")
        fcntl.flock(check, fcntl.LOCK_UN)
    for line in said:
        print(line, file=sys.stderr, flush=True)
    return said


def device_index(local_rank: int, visible: int, local_world: int | None = None) -> int:
    """The CUDA index, among the `visible` devices this process sees, of the rank with `local_rank` of the
    `local_world` ranks on its machine:
    - one visible device: device 0, whatever the local rank. A site that binds one GPU per task (SLURM's
      `--gpus-per-task=1`, `--gpu-bind`, a site default) shows each rank its own GPU as device 0;
    - every rank's device visible (`local_world` at most `visible`, or unknown and `local_rank` below
      `visible`): device `local_rank`, as the DeepSpeed launcher, torchrun and `srun --gpus-per-node` give it;
    - otherwise refused: several devices per rank but not one each for every rank of the machine (e.g.
      `--gpus-per-task=2`) has no index that is surely the rank's own, and `local_rank % visible` could put
      two ranks on one GPU."""
    if visible == 1:
        return 0
    if local_rank < visible and (local_world is None or local_world <= visible):
        return local_rank
    raise RuntimeError(f"local rank {local_rank} of {local_world or 'an unknown number of'} ranks on this machine sees "
                       f"{visible} CUDA devices; expected either one device per rank (a GPU bound to each task, "
                       f"e.g. srun --gpus-per-task=1) or every rank's device (--gpus-per-node equal to the tasks per "
                       f"node, or CUDA_VISIBLE_DEVICES unset); bind one GPU per task or none")


def rank_device(local_rank: int, local_world: int | None = None) -> torch.device:
    """The device of the rank with `local_rank` of `local_world` on its machine: its own GPU
    (`device_index` among the devices this process sees), or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", device_index(local_rank, torch.cuda.device_count(), local_world))


def slurm_environment(environ) -> dict[str, str]:
    """The variables of torch's process-group start, read from what `srun` sets for each task of a step:
    RANK from SLURM_PROCID, LOCAL_RANK from SLURM_LOCALID, WORLD_SIZE from SLURM_STEP_NUM_TASKS,
    LOCAL_WORLD_SIZE from SLURM_STEP_TASKS_PER_NODE, MASTER_ADDR the step's first node, MASTER_PORT one per
    job (20000 + job id modulo 10000). Variables already set (a launcher's, the user's) are kept. Empty
    outside an srun step of several tasks: the batch script itself sets SLURM_PROCID=0 and SLURM_NTASKS for
    the whole job but is one process, which must not wait for the job's other tasks."""
    tasks = environ.get("SLURM_STEP_NUM_TASKS")
    if "RANK" in environ or "SLURM_PROCID" not in environ or not tasks or int(tasks) < 2:
        return {}
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" not in environ and not nodes:
        raise ValueError(f"srun started {tasks} tasks but set no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST to take "
                         f"the first node from; set MASTER_ADDR to the host of task 0")
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or tasks
    return {"RANK": environ["SLURM_PROCID"], "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"), "WORLD_SIZE": tasks,
            "LOCAL_WORLD_SIZE": per_node.split("(")[0].split(",")[0],  # "4(x2)": 4 tasks on each of 2 nodes
            "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodes),
            "MASTER_PORT": environ.get("MASTER_PORT") or str(20000 + int(environ.get("SLURM_JOB_ID", "0")) % 10000)}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[03-04,07],cpu1" -> "gpu03", "node7" -> "node7"."""
    import re

    head, depth = "", 0
    for char in nodelist:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            break
        head += char
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], head)


def init_distributed(need_group: bool = True, timeout_minutes: float = 30) -> Dist:
    """The start of every entry point (training, evaluation, warm starts): the rank's device becomes the
    current CUDA device before any collective (NCCL would otherwise put every rank's communication on
    GPU 0), CPU ranks share the cores (`cpu_threads`), and the process group that the launcher describes
    is joined (the DeepSpeed launcher and torchrun set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT;
    under `srun` they are read from SLURM's variables, `slurm_environment`): gloo on CPU, NCCL on GPUs,
    with `timeout_minutes` for every collective (`train.dist_timeout_minutes`). Under plain `python` the
    group is one of one, made only when `need_group` (DeepSpeed engines need one; evaluation on one rank
    does not). On a GPU the rank's device is `device_index`'s and LOCAL_RANK is set to its index, since
    DeepSpeed and vLLM's `external_launcher` read LOCAL_RANK as a device index; `Dist.local_rank` keeps the
    launcher's rank on the machine."""
    os.environ.update(slurm_environment(os.environ))
    if "RANK" not in os.environ and need_group:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    device = rank_device(local_rank, int(local_world) if local_world else None)
    if device.type == "cuda":
        # DeepSpeed's engine and ZeRO-3's partitioning, and vLLM's `external_launcher` worker, each take
        # LOCAL_RANK as the CUDA index: under one GPU bound per task it must name the device this process sees.
        os.environ["LOCAL_RANK"] = str(device.index)
        torch.cuda.set_device(device)
        render_on_rank_device(device)  # before any environment (or env worker process) opens a GL context
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # Two processes on two cores with default threading measured 4.6x slower than one thread each.
        torch.set_num_threads(cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    if (need_group or world > 1) and not initialized():
        import deepspeed

        clear_stale_build_locks()  # DeepSpeed builds its ops on first use, from init_distributed on
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False,
                                   timeout=datetime.timedelta(minutes=timeout_minutes))
        if device.type == "cpu":
            _unlink_shm_workspace(rank)
    return Dist(rank, world, local_rank, device)


def mujoco_egl_device(cuda_index: int | None, egl_devices: int, environ) -> str | None:
    """The `MUJOCO_EGL_DEVICE_ID` for a rank on CUDA device `cuda_index` (None: a CPU rank) where MuJoCo sees
    `egl_devices` EGL devices: the rank's own GPU (within MuJoCo's count), so that its renderers, and those of
    its env workers, sit beside its engine instead of every rank's on GPU 0. None (leave it as it is) where
    MuJoCo does not render through EGL (`MUJOCO_GL`, egl by default in `envs_visual`), where it is set already,
    on a CPU (MuJoCo raises for an id its devices do not have) and where MuJoCo sees no EGL device."""
    if environ.get("MUJOCO_GL", "egl").lower() != "egl" or "MUJOCO_EGL_DEVICE_ID" in environ:
        return None
    if cuda_index is None or egl_devices <= 0:
        return None
    return str(cuda_index % egl_devices)


def egl_device_count() -> int:
    """EGL devices MuJoCo can render on, counted in a process of its own (importing mujoco here would fix its
    GL backend before `envs_visual` chooses it); 0 where EGL is missing."""
    import subprocess
    import sys

    script = ("import os; os.environ['MUJOCO_GL'] = 'egl'; from mujoco.egl import egl_ext as EGL; "
              "print(len(EGL.eglQueryDevicesEXT()))")
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        return int(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else 0
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0


def render_on_rank_device(device: torch.device, environ=os.environ, count=egl_device_count) -> str | None:
    """Set `MUJOCO_EGL_DEVICE_ID` in `environ` (inherited by env worker processes) for a rank on `device`
    (`mujoco_egl_device`); EGL devices are counted only where it can apply. Returns what was set."""
    if device.type != "cuda" or mujoco_egl_device(0, 1, environ) is None:
        return None
    value = mujoco_egl_device(device.index, count(), environ)
    if value is not None:
        environ["MUJOCO_EGL_DEVICE_ID"] = value
    return value


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
