#!/usr/bin/env bash
# One iteration of a recipe on your own checkpoint and GPUs, and what it cost, with a line to paste into an issue:
#
#   bash scripts/gpu_smoke.sh RECIPE CHECKPOINT [key=value ...]
#   bash scripts/gpu_smoke.sh qwen2.5-vl-3b /models/Qwen2.5-VL-3B-Instruct
#   ENV=navigation_visual RANKS=4 bash scripts/gpu_smoke.sh qwen2.5-vl-3b-lora /models/Qwen2.5-VL-3B-Instruct
#
# RECIPE is a file of configs/recipes/ (without .yaml), CHECKPOINT a local model directory. Settings from the
# environment: ENV (the environment config, default sokoban_visual), RANKS (default: the GPUs nvidia-smi lists,
# 1 without any), OUT (default ./gpu_smoke/<recipe>-<time>), PYTHON (default python3).
#
# 1. `python -m vagen.config ENV --config recipes/RECIPE model.path=CHECKPOINT --ranks RANKS --gpu-gib G` (G: the
#    first GPU's memory): the checks and the per-GPU memory estimate, into OUT/estimate.txt; a refusal stops here.
# 2. the recipe for one iteration (train.iterations=1, no evaluation, a new run in OUT/run), through the
#    DeepSpeed launcher on RANKS GPUs (plain python for one rank), into OUT/train.log, while nvidia-smi samples
#    each GPU's memory every 500 ms into OUT/gpu_memory.csv. The checkpoint the run writes at its end is
#    removed afterwards (KEEP_CHECKPOINT=1 keeps it).
# 3. scripts/gpu_smoke.py reads them: seconds per phase (the metrics' timing/ keys), start-up, the vLLM
#    engine's start-up, peak memory per GPU against the estimate, and the summary line, also in OUT/summary.txt.
#
# Extra key=value arguments override the recipe (on a CPU, a tiny test: builtin:tiny-vl with small sizes, as
# tests/test_gpu_smoke.py runs it).
set -uo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
RECIPE="$1"; CHECKPOINT="$2"; shift 2
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
ENV_CONFIG="${ENV:-sokoban_visual}"
OUT="${OUT:-$ROOT/gpu_smoke/$RECIPE-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
HAVE_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; fi
if [ -z "${RANKS:-}" ]; then
  if [ $HAVE_GPU = 1 ]; then RANKS=$(nvidia-smi -L | wc -l); else RANKS=1; fi
fi
CONFIG=(--config "$ENV_CONFIG" --config "recipes/$RECIPE" "model.path=$CHECKPOINT")
CHECK=("$ENV_CONFIG" --config "recipes/$RECIPE" "model.path=$CHECKPOINT")  # python -m vagen.config's form

GPU_GIB=()
if [ $HAVE_GPU = 1 ]; then
  GPU_GIB=(--gpu-gib "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 |
                       awk '{printf "%.0f", $1 / 1024}')")
fi
echo "[gpu_smoke] estimate: $PY -m vagen.config ${CHECK[*]} --ranks $RANKS ${GPU_GIB[*]} $*"
if ! "$PY" -m vagen.config "${CHECK[@]}" --ranks "$RANKS" "${GPU_GIB[@]}" "$@" > "$OUT/estimate.txt" 2>&1; then
  cat "$OUT/estimate.txt"
  echo "[gpu_smoke] the checks refused this recipe on $RANKS rank(s): nothing was run" >&2
  exit 1
fi
cat "$OUT/estimate.txt"

SAMPLER=""
if [ $HAVE_GPU = 1 ]; then
  nvidia-smi --query-gpu=index,memory.used,memory.total,name --format=csv,noheader,nounits -lms 500 \
    > "$OUT/gpu_memory.csv" 2>/dev/null &
  SAMPLER=$!
fi
RUN=("${CONFIG[@]}" train.iterations=1 train.resume=null eval.every=0 eval.before_training=false
     log.progress=false "train.run_dir=$OUT" train.run_name=run "$@")
if [ "$RANKS" -gt 1 ]; then
  LAUNCH=(deepspeed --num_gpus "$RANKS" vagen/train.py)
else
  LAUNCH=("$PY" vagen/train.py)
fi
echo "[gpu_smoke] one iteration: ${LAUNCH[*]} ${RUN[*]}"
started=$EPOCHREALTIME
"${LAUNCH[@]}" "${RUN[@]}" > "$OUT/train.log" 2>&1
status=$?
wall=$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
[ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
if [ $status != 0 ]; then
  tail -40 "$OUT/train.log"
  echo "[gpu_smoke] training stopped with status $status; the whole log: $OUT/train.log" >&2
  exit $status
fi
[ "${KEEP_CHECKPOINT:-0}" = 1 ] || rm -rf "$OUT/run/checkpoints"
"$PY" scripts/gpu_smoke.py "$OUT" --recipe "$RECIPE" --env "$ENV_CONFIG" --checkpoint "$CHECKPOINT" \
  --ranks "$RANKS" --wall "$wall" | tee "$OUT/report.txt"
tail -1 "$OUT/report.txt" > "$OUT/summary.txt"
echo "[gpu_smoke] files: $OUT"
