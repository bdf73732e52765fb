"""The per-test time limit (tests/time_limit.py): a test that overruns is named, with where it was, and
stopped, instead of the suite hanging without a word."""

import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_test_past_its_limit_is_named_with_its_stack_and_stopped(tmp_path):
    (tmp_path / "test_waits.py").write_text("import time\n\n\ndef test_waits_for_a_lock_nobody_frees():\n"
                                            "    time.sleep(120)\n")
    env = {**os.environ, "VAGEN_TEST_TIMEOUT": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "time_limit",
                           "--rootdir", str(tmp_path), "test_waits.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=100)
    seconds = time.monotonic() - start
    out = done.stdout + done.stderr
    assert done.returncode == 2, out  # interrupted, as Ctrl-C does: pytest's summary, a non-zero status
    assert ("TIME LIMIT: test test_waits.py::test_waits_for_a_lock_nobody_frees ran past its time limit of 1 s "
            "(VAGEN_TEST_TIMEOUT; 0 turns the limit off); it is interrupted.") in out
    assert f'File "{tmp_path / "test_waits.py"}", line 5 in test_waits_for_a_lock_nobody_frees' in out  # where
    assert seconds < 60, f"{seconds:.0f} s: the test was not stopped at its limit"


def test_the_limit_is_longer_for_slow_tests_and_can_be_turned_off(monkeypatch):
    import pytest
    from time_limit import DEFAULT_S, time_limit

    class Item:
        def __init__(self, *marks):
            self.keywords = dict.fromkeys(marks)

    monkeypatch.delenv("VAGEN_TEST_TIMEOUT", raising=False)
    assert time_limit(Item()) == DEFAULT_S == 900 and time_limit(Item("slow")) == 3600
    monkeypatch.setenv("VAGEN_TEST_TIMEOUT", "0")
    assert time_limit(Item("slow")) == 0
    monkeypatch.setenv("VAGEN_TEST_TIMEOUT", "15m")
    with pytest.raises(pytest.UsageError, match="VAGEN_TEST_TIMEOUT='15m' is not a number of seconds"):
        time_limit(Item())
