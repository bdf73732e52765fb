"""Environments that fail on purpose, for the tests of environment failures (in the trainer's process and
in `env.workers` processes, which import this module to build them)."""

import os
import signal
import time

from vagen.env_workers import build_env


class FaultyEnv:
    """A real environment that fails at given steps: `faults` maps (level seed, step number) to `raise`
    (an exception), `slow` (the step takes two seconds), `hang` (Python sleeps past any timeout), `hang_in_c` (sleeps with the alarm signal
    blocked, as a call stuck inside a C library does) or `exit` (the process ends at once)."""

    def __init__(self, env, faults: dict):
        self.env, self.faults, self.seed, self.steps = env, faults, None, 0

    def reset(self, seed):
        self.seed, self.steps = seed, 0
        return self.env.reset(seed=seed)

    def step(self, text):
        fault = self.faults.get((self.seed, self.steps))
        self.steps += 1
        if fault == "raise":
            raise ValueError("level state out of bounds")
        if fault == "slow":
            time.sleep(2.0)
        if fault == "hang":
            time.sleep(30)
        if fault == "hang_in_c":
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(30)
        if fault == "exit":
            os._exit(3)
        return self.env.step(text)

    def __getattr__(self, name):
        return getattr(self.env, name)


class FaultyFactory:
    """Picklable: makes `FaultyEnv`s over the environment of an `env` config section."""

    def __init__(self, cfg_env, faults: dict):
        self.cfg_env, self.faults = cfg_env, faults

    def __call__(self):
        return FaultyEnv(build_env(self.cfg_env), self.faults)
