"""Import a script of benchmarks/ (not a package) as a module, for the tests of its functions."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    """benchmarks/NAME.py as the module `NAME_benchmark` (loaded once)."""
    module_name = f"{name}_benchmark"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
