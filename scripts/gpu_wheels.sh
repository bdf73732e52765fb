#!/usr/bin/env bash
# Makes the folder of wheels that scripts/gpu_check.sh installs on a GPU machine without the network:
#
#   bash scripts/gpu_wheels.sh [OUT]          # OUT defaults to ./gpu_wheels
#
# For a machine whose Python is 3.12 with torch 2.11 built for CUDA 13 (torch, torchvision and torchaudio are
# there already). vLLM 0.26.0 is the release whose pins match that torch (torch==2.11.0, torchvision==0.26.0,
# torchaudio==2.11.0) and whose kernels link CUDA 13 (libcudart.so.13, libnvrtc.so.13); later releases pin
# torch 2.13 or 2.14. DeepSpeed is built here into a wheel (its ops are compiled on first use, as on the CPU).
# Wheels larger than 60 MiB are split into parts (name.whl.part-aa, -ab, ...) so that each travels in a
# call that carries at most 64 MiB; gpu_check.sh joins them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/gpu_wheels}"
VLLM=0.26.0
DEEPSPEED=0.19.8
mkdir -p "$OUT"
# What the GPU machine's image holds already (torch's CUDA libraries among them): never downloaded again.
PRESENT="torch torchvision torchaudio triton numpy pillow transformers tokenizers safetensors huggingface-hub
  peft accelerate pyyaml regex requests tqdm psutil sentencepiece filelock typing-extensions protobuf aiohttp
  prometheus-client tiktoken einops cloudpickle ninja six setuptools opencv-python-headless numba llvmlite
  jinja2 markupsafe networkx sympy mpmath fsspec packaging pydantic pydantic-core annotated-types anyio h11
  httpx httpcore idna certifi charset-normalizer urllib3 click rich pygments markdown-it-py mdurl uvloop
  msgpack xxhash pytest hypothesis imageio matplotlib tensorboard"
PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform linux_x86_64 --platform any --python-version 3.12 --implementation cp --only-binary=:all:)

echo "[gpu_wheels] vllm==$VLLM and its requirements for Python 3.12 (those the image holds left out)"
REQS="$OUT/vllm-requirements.in"
python3 - "$REQS" "$VLLM" $PRESENT <<'PYEOF'
import json, subprocess, sys, tempfile
out, version, present = sys.argv[1], sys.argv[2], {n.lower() for n in sys.argv[3:]}
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
    kept.append(str(req))
open(out, "w").write("\n".join(kept) + "\n")
print(f"[gpu_wheels] {len(kept)} requirements of vllm {version} to carry")
PYEOF
pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT" "vllm==$VLLM"
# Their own requirements, resolved against the image's torch, one at a time: a requirement the registry
# cannot satisfy is listed in MISSING and left out (vLLM imports most of them only for the features that
# use them: structured outputs, the API server, other kernels).
: > "$OUT/MISSING"
while read -r req; do
  [ -n "$req" ] || continue
  pip download -q "${PLATFORM[@]}" -d "$OUT" "$req" "torch==2.11.0" "torchvision==0.26.0" "torchaudio==2.11.0" \
    2>/dev/null || { echo "$req" >> "$OUT/MISSING"; echo "[gpu_wheels] not available here: $req"; }
done < "$REQS"
for name in torch torchvision torchaudio triton 'nvidia_*'; do rm -f "$OUT"/${name}-*.whl; done
echo "[gpu_wheels] deepspeed==$DEEPSPEED (a wheel built here; pure Python, its ops compiled on first use)"
pip wheel -q --no-deps -w "$OUT" "deepspeed==$DEEPSPEED"
for wheel in "$OUT"/*.whl; do
  if [ "$(stat -c %s "$wheel")" -gt $((60 * 2**20)) ]; then
    split -b 60M "$wheel" "$wheel.part-" && rm "$wheel"
  fi
done
du -sh "$OUT"
echo "[gpu_wheels] done: $OUT (carry it to the GPU machine; bash scripts/gpu_check.sh $OUT)"
