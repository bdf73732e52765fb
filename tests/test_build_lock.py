"""A run killed during DeepSpeed's first-time op build leaves torch's build lock behind; the next run's
`init_distributed` removes it when its builder is gone (and never when a live process holds it), so that
torch's wait does not last forever."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from torch.utils import file_baton
from torch.utils.file_baton import FileBaton

from vagen.distributed import _shared_file_system, clear_stale_build_locks

# A builder as torch runs one: take the lock with torch's FileBaton (loaded from its file, without the
# seconds of importing torch), say so, build until killed.
BUILDER = textwrap.dedent("""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("file_baton", sys.argv[2])
    file_baton = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(file_baton)
    baton = file_baton.FileBaton(sys.argv[1])
    assert baton.try_acquire(), "the lock was already taken"
    print("building", flush=True)
    time.sleep(600)
""")


def start_builder(lock) -> subprocess.Popen:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(lock), file_baton.__file__],
                               stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "building"
    return builder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An extension cache with one op folder, as torch lays it out under TORCH_EXTENSIONS_DIR."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "deepspeed_shm_comm").mkdir()
    return tmp_path


def test_a_lock_left_by_a_killed_build_is_removed_and_torch_can_build_again(cache, capsys):
    lock = cache / "deepspeed_shm_comm" / "lock"
    builder = start_builder(lock)
    builder.send_signal(signal.SIGKILL)  # Ctrl-C or a timeout in the middle of the build
    builder.wait()
    assert lock.exists()
    # what every later run did before: torch's wait never ends while the file exists
    waiter = threading.Thread(target=FileBaton(str(lock), wait_seconds=0.01).wait, daemon=True)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()

    said = clear_stale_build_locks(lock_blocks=True, settle_s=0.01)

    assert not lock.exists()
    waiter.join(2.0)
    assert not waiter.is_alive()
    assert len(said) == 1 and "deepspeed_shm_comm" in said[0] and str(lock) in said[0] and "removed" in said[0]
    assert said[0] in capsys.readouterr().err
    assert FileBaton(str(lock)).try_acquire()  # the next build takes the lock


def test_a_lock_a_live_builder_holds_is_kept_and_named(cache):
    lock = cache / "deepspeed_shm_comm" / "lock"
    builder = start_builder(lock)
    try:
        said = clear_stale_build_locks(lock_blocks=True, settle_s=0.01)
        assert lock.exists()
        assert len(said) == 1 and f"process {builder.pid} is building it" in said[0] and "waits" in said[0]
    finally:
        builder.kill()
        builder.wait()
    # once that builder is gone, the same lock is stale
    assert "removed" in clear_stale_build_locks(lock_blocks=True, settle_s=0.01)[0]
    assert not lock.exists()


def test_only_stale_locks_go_among_several_ops(cache):
    (cache / "cpu_adam").mkdir()
    stale, held = cache / "cpu_adam" / "lock", cache / "deepspeed_shm_comm" / "lock"
    stale.touch()
    builder = start_builder(held)
    try:
        said = clear_stale_build_locks(lock_blocks=True, settle_s=0.01)
        assert not stale.exists() and held.exists()
        assert ["cpu_adam" in said[0], "deepspeed_shm_comm" in said[1]] == [True, True]
    finally:
        builder.kill()
        builder.wait()


def test_a_lock_on_a_shared_file_system_is_named_with_what_to_do_not_removed(cache, tmp_path_factory):
    lock = cache / "deepspeed_shm_comm" / "lock"
    lock.touch()
    mounts = tmp_path_factory.mktemp("mounts") / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw 0 0\nserver:/home {os.path.realpath(cache)} nfs4 rw 0 0\n")
    said = clear_stale_build_locks(lock_blocks=True, settle_s=0.01, mounts=str(mounts))
    assert lock.exists()
    assert len(said) == 1 and "shared file system (nfs4)" in said[0] and f"rm {lock}" in said[0]


def test_shared_file_system_takes_the_longest_mount_point(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nserver:/home /home nfs rw 0 0\n"
                      "/dev/nvme0 /home/scratch xfs rw 0 0\nserver:/x /home/scratch\\040b nfs4 rw 0 0\n")
    assert _shared_file_system("/home/me/.cache/lock", str(mounts)) == "nfs"
    assert _shared_file_system("/home/scratch/lock", str(mounts)) is None
    assert _shared_file_system("/home/scratch b/lock", str(mounts)) == "nfs4"
    assert _shared_file_system("/home/scratchy/lock", str(mounts)) == "nfs"  # a prefix of a name is not a mount
    assert _shared_file_system("/tmp/lock", str(mounts)) is None


def test_a_torch_whose_lock_is_a_kernel_lock_leaves_the_files_alone(cache):
    """Torch releases that lock builds with `filelock` leave a `lock` file after every build; it blocks
    nothing, and removing it under a live holder would let a second builder in."""
    lock = cache / "deepspeed_shm_comm" / "lock"
    lock.touch()
    assert clear_stale_build_locks(lock_blocks=False) == []
    assert lock.exists()


def test_init_distributed_clears_a_stale_lock_before_deepspeed_starts(cache):
    """The entry points' start, in a fresh process whose torch is made to look like a release that locks
    builds with `FileBaton`: the planted stale lock is gone by the time DeepSpeed's `init_distributed`
    (where the op build starts) is called. A one-rank gloo group stands in for DeepSpeed's start, whose
    first-time op build would take a minute in this empty cache."""
    lock = cache / "deepspeed_shm_comm" / "lock"
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    code = textwrap.dedent(f"""
        import os, torch, deepspeed
        import torch.utils.cpp_extension as cpp_extension
        from torch.utils.file_baton import FileBaton
        import vagen.distributed as d
        cpp_extension.FileBaton = FileBaton

        def start(dist_backend, verbose, timeout):
            print("lock at deepspeed start:", os.path.exists({str(lock)!r}))
            torch.distributed.init_process_group(dist_backend, rank=0, world_size=1, timeout=timeout)

        deepspeed.init_distributed = start
        dist = d.init_distributed(need_group=True)
        print("world", dist.world_size)
        d.leave_process_group(0)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(TORCH_EXTENSIONS_DIR=str(cache), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [line for line in done.stdout.splitlines() if not line.startswith("[")]  # DeepSpeed's log lines
    assert printed == ["lock at deepspeed start: False", "world 1"], done.stdout
    assert re.search(rf"removed its build lock {re.escape(str(lock))}, left 36\d\d s ago", done.stderr), done.stderr
