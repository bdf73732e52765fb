#!/usr/bin/env bash
# Makes the folder of wheels that scripts/gpu_check.sh installs on a GPU machine without the network:
#
#   bash scripts/gpu_wheels.sh [OUT]          # OUT defaults to ./gpu_wheels
#
# For a machine whose Python is 3.12 with torch 2.11 built for CUDA 13 (torch, torchvision and torchaudio are
# there already). The versions are constraints/gpu-torch2.11.txt's: vLLM 0.26.0 is the release whose pins match
# that torch (torch==2.11.0, torchvision==0.26.0, torchaudio==2.11.0) and whose kernels link CUDA 13
# (libcudart.so.13, libnvrtc.so.13); later releases pin torch 2.13 or 2.14. transformers is carried at that
# file's pin too, replacing the image's (5.24 and 5.25 fail vLLM 0.26's multimodal processing). DeepSpeed is
# built here into a wheel (its ops are compiled on first use, as on the CPU).
# Wheels larger than 60 MiB are split into parts (name.whl.part-aa, -ab, ...) so that each travels in a
# call that carries at most 64 MiB; gpu_check.sh joins them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/gpu_wheels}"
CONSTRAINTS="$ROOT/constraints/gpu-torch2.11.txt"
pin() { sed -n "s/^$1==\([^ ]*\).*/\1/p" "$CONSTRAINTS"; }
VLLM=$(pin vllm)
DEEPSPEED=$(pin deepspeed)
TRANSFORMERS=$(pin transformers)
mkdir -p "$OUT"
# What the GPU machine's image holds already (torch's CUDA libraries among them): never downloaded again.
PRESENT="torch torchvision torchaudio triton numpy pillow tokenizers safetensors huggingface-hub
  peft accelerate pyyaml regex requests tqdm psutil sentencepiece filelock typing-extensions protobuf aiohttp
  prometheus-client tiktoken einops cloudpickle ninja six setuptools opencv-python-headless numba llvmlite
  jinja2 markupsafe networkx sympy mpmath fsspec packaging pydantic pydantic-core annotated-types anyio h11
  httpx httpcore idna certifi charset-normalizer urllib3 click rich pygments markdown-it-py mdurl uvloop
  msgpack xxhash pytest hypothesis imageio matplotlib tensorboard"
PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform linux_x86_64 --platform any --python-version 3.12 --implementation cp --only-binary=:all:)

echo "[gpu_wheels] vllm==$VLLM and its requirements for Python 3.12 (those the image holds left out)"
REQS="$OUT/vllm-requirements.in"
python3 - "$REQS" "$VLLM" "$TRANSFORMERS" $PRESENT <<'PYEOF'
import json, subprocess, sys, tempfile
out, version, transformers, present = sys.argv[1], sys.argv[2], sys.argv[3], {n.lower() for n in sys.argv[4:]}
with tempfile.TemporaryDirectory() as tmp:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-deps", "--ignore-installed",
                    "--report", f"{tmp}/r.json", f"vllm=={version}"], check=True)
    meta = json.load(open(f"{tmp}/r.json"))["install"][0]["metadata"]
from pip._vendor.packaging.requirements import Requirement
env = {"python_version": "3.12", "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux",
       "extra": ""}
kept = []
for line in meta["requires_dist"]:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    if req.name.lower().replace("_", "-") in present:
        continue
    req.marker = None
    kept.append(f"transformers=={transformers}" if req.name.lower() == "transformers" else str(req))
open(out, "w").write("\n".join(kept) + "\n")
print(f"[gpu_wheels] {len(kept)} requirements of vllm {version} to carry")
PYEOF
pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT" "vllm==$VLLM"
# Their requirements, and theirs in turn, one wheel at a time without pip's resolver (which would fetch
# torch and its CUDA libraries again): what the image holds is skipped; a requirement the registry cannot
# satisfy is listed in MISSING and left out (vLLM imports most of them only for the features that use
# them: structured outputs, the API server, other kernels).
python3 - "$OUT" "$REQS" $PRESENT <<'PYEOF'
import subprocess, sys, zipfile
from pathlib import Path
from pip._vendor.packaging.requirements import Requirement
out, reqs, present = Path(sys.argv[1]), Path(sys.argv[2]), {n.lower() for n in sys.argv[3:]}
platform = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform",
            "manylinux2014_x86_64", "--platform", "linux_x86_64", "--platform", "any", "--python-version", "3.12",
            "--implementation", "cp", "--only-binary=:all:"]
env = {"python_version": "3.12", "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux"}
def key(name): return name.lower().replace("_", "-")
skip = present | {"torch", "torchvision", "torchaudio", "triton"}
queue, seen, missing = [Requirement(line) for line in reqs.read_text().split("\n") if line.strip()], set(), []
while queue:
    req = queue.pop(0)
    if key(req.name) in seen or key(req.name) in skip or key(req.name).startswith("nvidia-"):
        continue
    seen.add(key(req.name))
    before = set(out.glob("*.whl"))
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *platform, "-d", str(out),
                           str(req)], capture_output=True, text=True)
    new = set(out.glob("*.whl")) - before
    if done.returncode or not new:
        missing.append(str(req))
        print(f"[gpu_wheels] not available here: {req}")
        continue
    for wheel in new:
        meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
        for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                dep = Requirement(line.split(":", 1)[1].strip())
                extras = [""] + sorted(req.extras)
                if dep.marker is None or any(dep.marker.evaluate({**env, "extra": e}) for e in extras):
                    dep.marker = None
                    queue.append(dep)
(out / "MISSING").write_text("\n".join(missing) + ("\n" if missing else ""))
print(f"[gpu_wheels] {len(seen) - len(missing)} wheels of requirements, {len(missing)} not available")
PYEOF
echo "[gpu_wheels] deepspeed==$DEEPSPEED (a wheel built here; pure Python, its ops compiled on first use)"
pip wheel -q --no-deps -w "$OUT" "deepspeed==$DEEPSPEED"
for wheel in "$OUT"/*.whl; do
  if [ "$(stat -c %s "$wheel")" -gt $((60 * 2**20)) ]; then
    split -b 60M "$wheel" "$wheel.part-" && rm "$wheel"
  fi
done
du -sh "$OUT"
echo "[gpu_wheels] done: $OUT (carry it to the GPU machine; bash scripts/gpu_check.sh $OUT)"
