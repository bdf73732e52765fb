import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]


def _learning():
    spec = importlib.util.spec_from_file_location("learning_benchmark", ROOT / "benchmarks" / "learning.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_failed_run_keeps_the_curves_of_the_runs_that_finished(tmp_path, monkeypatch):
    learning = _learning()

    class Child:  # a child process: PPO exits with 1 before writing its part, the others finish
        def __init__(self, command, env):
            method, part = command[command.index("--methods") + 1], Path(command[command.index("--part") + 1])
            self.returncode = 1 if method == "PPO" else 0
            if self.returncode == 0:
                part.write_text(json.dumps([{"iteration": 20, "method": method}]))

        def poll(self):
            return self.returncode

    monkeypatch.setattr(subprocess, "Popen", Child)
    args = SimpleNamespace(methods=["TRICO", "PPO", "GRPO"], seeds=1, jobs=2, minutes=1.0, eval_n=8, eval_every=1,
                           sft_steps_per_eval=2, threads=1, warm_start=None, overrides=[])
    curves, failed = learning.run_in_children("frozenlake", args, tmp_path)
    assert failed == ["PPO seed 0 (exit 1)"]
    assert curves == {"TRICO": {0: [{"iteration": 20, "method": "TRICO"}]},
                      "GRPO": {0: [{"iteration": 20, "method": "GRPO"}]}}
