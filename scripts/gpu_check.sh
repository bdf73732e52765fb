#!/usr/bin/env bash
# The GPU checks in one command, for a machine with one CUDA GPU of 80 GB (H100, H200) and no network; under
# 8 minutes from an installed environment, each step with its time and vagen's memory verdict for this GPU:
#
#   bash scripts/gpu_check.sh [WHEELS] [--dry-run] [--gpu-gib G] [--with-runner] [--with-hf] [--with-staleness]
#
# Needs: torch with CUDA, transformers, deepspeed, vllm, peft, pytest, hypothesis and vagen
# (pip install -c constraints/gpu.txt -e ".[vllm,lora]" pytest hypothesis), nvidia-smi, gcc and the Python headers; whatever
# is missing is refused by name before anything runs. WHEELS, a folder of wheels made beforehand with
# scripts/gpu_wheels.sh, installs what the machine lacks without the network (skipped where deepspeed, vllm and
# vagen import already). --dry-run prints each step's command, time limit and memory verdict (at 80 GiB unless
# --gpu-gib says otherwise) and what is missing, on any machine. The steps are scripts/gpu_check.py's (its
# docstring): the copy bandwidth, benchmarks/bench_gpu.py at Qwen2.5-VL-3B's shape with vLLM rollouts (GRPO, LoRA
# r=64: its rollout throughput against the bandwidth bound), benchmarks/bench_packing.py at the 3B shape (the update's
# tokens/s with micro-batches by count, by tokens and packed), pytest -m gpu, scripts/gpu_engine_check.py linear
# and egl. Logs and the rows as JSON go to $OUT (or ./gpu_check).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
command -v "$PY" > /dev/null || { echo "gpu_check: no Python interpreter '$PY' (set PYTHON=/path/to/python)" >&2; exit 1; }

WHEELS=""
ARGS=()
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1; ARGS+=("$arg") ;;
    -*) ARGS+=("$arg") ;;
    *) if [ -d "$arg" ] && [ -z "$WHEELS" ]; then WHEELS="$arg"; else ARGS+=("$arg"); fi ;;
  esac
done

if [ "$DRY" -eq 0 ] && [ -n "$WHEELS" ] && ! "$PY" -c "import deepspeed, vllm, vagen" 2>/dev/null; then
  echo "[gpu_check] installing from $WHEELS (no network)"
  # Parts of a large wheel (split to travel) are joined first.
  for first in "$WHEELS"/*.whl.part-aa; do
    [ -e "$first" ] || continue
    whole="${first%.part-aa}"
    [ -e "$whole" ] || cat "${whole}".part-* > "$whole"
  done
  # Every wheel of the folder, without resolving: what the registry lacked is listed in $WHEELS/MISSING.
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl \
    || { echo "gpu_check: installing from $WHEELS failed (see above)" >&2; exit 1; }
  [ -s "$WHEELS/MISSING" ] && echo "gpu_check: not carried (not on the registry): $(tr '\n' ' ' < "$WHEELS/MISSING")"
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e "$ROOT" \
    || { echo "gpu_check: installing vagen failed" >&2; exit 1; }
fi
[ "$DRY" -eq 0 ] && { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true; }
exec "$PY" scripts/gpu_check.py ${ARGS[@]+"${ARGS[@]}"}
