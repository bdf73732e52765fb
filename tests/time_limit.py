"""A time limit per test, so that a suite never hangs without a word (loaded by conftest.py).

A test that runs past its limit (setup, call and teardown together) is named on the terminal with the stacks
of every thread of the test process, then interrupted as Ctrl-C would: pytest stops, prints where the test
was and the summary so far, and exits non-zero; a subprocess.run in flight kills its child. Where the test
does not return to Python within `GRACE_S` (stuck inside a C call), the process exits with status 1.

The limit is VAGEN_TEST_TIMEOUT seconds (default 900: the slowest default-run tests take 2-3 minutes on two
loaded cores), four times that for tests marked slow; 0 turns it off. A signal timer is not used: the
environment workers' step timeout (vagen/env_workers.py) sets and clears SIGALRM's timer itself.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

import pytest

DEFAULT_S = 900.0
SLOW_FACTOR = 4
GRACE_S = 60.0


def time_limit(item) -> float:
    """Seconds `item` may run (0: no limit)."""
    value = os.environ.get("VAGEN_TEST_TIMEOUT", "")
    try:
        limit = float(value) if value else DEFAULT_S
    except ValueError:
        raise pytest.UsageError(f"VAGEN_TEST_TIMEOUT={value!r} is not a number of seconds; set e.g. 900, or 0 "
                                f"for no time limit") from None
    return limit * (SLOW_FACTOR if "slow" in item.keywords else 1)


def _say(config, text: str) -> None:
    """`text` and every thread's stack on the terminal, past pytest's capture of the test's output."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else _nothing():
        sys.stderr.write(text)
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Watchdog(threading.Thread):
    def __init__(self, item, limit: float):
        super().__init__(name=f"time limit of {item.nodeid}", daemon=True)
        self.item, self.limit, self.done = item, limit, threading.Event()

    def run(self) -> None:
        if self.done.wait(self.limit):
            return
        _say(self.item.config, f"\n\nTIME LIMIT: test {self.item.nodeid} ran past its time limit of "
                               f"{self.limit:.0f} s (VAGEN_TEST_TIMEOUT; 0 turns the limit off); it is "
                               f"interrupted. The stacks of its threads:\n")
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        if self.done.wait(GRACE_S):
            return
        _say(self.item.config, f"\n\nTIME LIMIT: test {self.item.nodeid} did not stop within {GRACE_S:.0f} s of "
                               f"its interruption; the test process exits. The stacks of its threads:\n")
        os._exit(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = time_limit(item)
    if limit <= 0:
        yield
        return
    watchdog = Watchdog(item, limit)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.done.set()
