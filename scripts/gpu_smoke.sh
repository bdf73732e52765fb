#!/usr/bin/env bash
# A few iterations of a recipe on your own checkpoint and GPUs, through the steps a GPU adds (the engine's sleep,
# wake and weight reload, LoRA's sleep level, episodes carried over a sync), what each cost, and a line per run
# to paste into an issue:
#
#   bash scripts/gpu_smoke.sh RECIPE CHECKPOINT [key=value ...]
#   bash scripts/gpu_smoke.sh qwen2.5-vl-3b /models/Qwen2.5-VL-3B-Instruct
#   ENV=navigation_visual RANKS=4 CHECKS=recipe bash scripts/gpu_smoke.sh qwen2.5-vl-3b-lora /models/Qwen2.5-VL-3B-Instruct
#
# RECIPE is a file of configs/recipes/ (without .yaml), CHECKPOINT a local model directory. Settings from the
# environment: ENV (the environment config, default sokoban_visual), RANKS (default: the GPUs nvidia-smi lists,
# 1 without any), CHECKS (default "recipe lora stale"), ITERATIONS (default 3, at least 3), EVAL_EPISODES
# (default 2 a rank), OUT (default ./gpu_smoke/<recipe>-<time>), PYTHON (default python3), KEEP_CHECKPOINT=1
# (write each run's last checkpoint; its path and size are printed before anything runs), DRY_RUN=1 (the plan
# and the checks' verdicts only: nothing trains).
#
# 1. scripts/gpu_smoke.py plan: the runs (checks), each a new run in OUT/<check>/run:
#    `recipe` the recipe as it is; `lora` with LoRA adapters (vLLM's sleep level 1; skipped for a LoRA recipe);
#    `stale` with rollout.max_staleness=1 (episodes carried over a sync; skipped without vLLM). Each trains
#    ITERATIONS iterations, every one after the first on an engine that slept, woke and reloaded the weights,
#    and evaluates after the last iteration's sync. No checkpoint (train.save_last=false) unless KEEP_CHECKPOINT=1.
# 2. for each run, `python -m vagen.config ENV --config recipes/RECIPE ... --ranks RANKS --gpu-gib G` (G: the
#    first GPU's memory): the checks and the per-GPU memory estimate, into OUT/<check>/estimate.txt. A refusal
#    of any run stops here, before anything trains.
# 3. each run through the DeepSpeed launcher on RANKS GPUs (plain python for one rank), into OUT/<check>/train.log,
#    while nvidia-smi samples each GPU's memory every 500 ms into OUT/<check>/gpu_memory.csv.
# 4. scripts/gpu_smoke.py report: the first iteration and the steady ones apart, seconds per phase, the
#    sampler's log-prob gap per iteration (it grows after a sync where the engine serves stale weights), carried
#    episodes, the evaluation, start-up, the vLLM engine's start-up, peak memory per GPU against the estimate;
#    the summary lines in OUT/summary.txt. The exit status is 1 when a run failed or its report did.
#
# Extra key=value arguments override the recipe (on a CPU, a tiny test: builtin:tiny-vl with small sizes, as
# tests/test_gpu_smoke.py runs it).
set -uo pipefail
if [ $# -lt 2 ]; then
  sed -n '6,8p' "$0" | sed 's/^# \{0,1\}//' >&2
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

PLAN=(plan "$OUT" --env "$ENV_CONFIG" --recipe "$RECIPE" --checkpoint "$CHECKPOINT" --ranks "$RANKS"
      --iterations "${ITERATIONS:-3}" --checks "${CHECKS:-recipe lora stale}")
[ -n "${EVAL_EPISODES:-}" ] && PLAN+=(--eval-episodes "$EVAL_EPISODES")
[ "${KEEP_CHECKPOINT:-0}" = 1 ] && PLAN+=(--keep-checkpoint)
if ! "$PY" scripts/gpu_smoke.py "${PLAN[@]}" -- "$@"; then
  echo "[gpu_smoke] no plan: nothing was run" >&2
  exit 1
fi
mapfile -t RUNS < "$OUT/checks"
if [ ${#RUNS[@]} = 0 ]; then
  echo "[gpu_smoke] CHECKS=${CHECKS:-recipe lora stale} leaves no run to make: nothing was run" >&2
  exit 1
fi

GPU_GIB=()
if [ $HAVE_GPU = 1 ]; then  # GiB as the estimate counts them (81,559 MiB: 79.6)
  GPU_GIB=(--gpu-gib "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 |
                       awk '{printf "%.1f", $1 / 1024}')")
fi
for check in "${RUNS[@]}"; do
  mapfile -t CHECK_ARGS < "$OUT/$check/check_args"
  echo "[gpu_smoke] $check: estimate: $PY -m vagen.config ${CHECK_ARGS[*]} --ranks $RANKS ${GPU_GIB[*]}"
  if ! "$PY" -m vagen.config "${CHECK_ARGS[@]}" --ranks "$RANKS" "${GPU_GIB[@]}" > "$OUT/$check/estimate.txt" 2>&1; then
    cat "$OUT/$check/estimate.txt"
    echo "[gpu_smoke] the checks refused run $check on $RANKS rank(s): nothing was run" >&2
    exit 1
  fi
  cat "$OUT/$check/estimate.txt"
done
if [ "${DRY_RUN:-0}" = 1 ]; then
  for check in "${RUNS[@]}"; do
    mapfile -t TRAIN_ARGS < "$OUT/$check/train_args"
    echo "[gpu_smoke] $check would run: vagen/train.py ${TRAIN_ARGS[*]}"
  done
  echo "[gpu_smoke] DRY_RUN=1: nothing was trained; files: $OUT"
  exit 0
fi

if [ "$RANKS" -gt 1 ]; then
  LAUNCH=(deepspeed --num_gpus "$RANKS" vagen/train.py)
else
  LAUNCH=("$PY" vagen/train.py)
fi
: > "$OUT/summary.txt"
failed=0
for check in "${RUNS[@]}"; do
  mapfile -t TRAIN_ARGS < "$OUT/$check/train_args"
  SAMPLER=""
  if [ $HAVE_GPU = 1 ]; then
    nvidia-smi --query-gpu=index,memory.used,memory.total,name --format=csv,noheader,nounits -lms 500 \
      > "$OUT/$check/gpu_memory.csv" 2>/dev/null &
    SAMPLER=$!
  fi
  echo "[gpu_smoke] $check: ${LAUNCH[*]} ${TRAIN_ARGS[*]}"
  started=$EPOCHREALTIME
  "${LAUNCH[@]}" "${TRAIN_ARGS[@]}" > "$OUT/$check/train.log" 2>&1
  status=$?
  wall=$(awk -v a="$started" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  [ -n "$SAMPLER" ] && kill "$SAMPLER" 2>/dev/null
  if [ $status != 0 ]; then
    tail -40 "$OUT/$check/train.log"
    echo "[gpu_smoke] $check: training stopped with status $status; the whole log: $OUT/$check/train.log" >&2
    echo "gpu_smoke $RECIPE [$check] on $ENV_CONFIG: FAILED: training stopped with status $status" >> "$OUT/summary.txt"
    failed=1
    continue
  fi
  "$PY" scripts/gpu_smoke.py report "$OUT/$check" --check "$check" --recipe "$RECIPE" --env "$ENV_CONFIG" \
    --checkpoint "$CHECKPOINT" --ranks "$RANKS" --iterations "${ITERATIONS:-3}" --wall "$wall" \
    | tee "$OUT/$check/report.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || failed=1
  tail -1 "$OUT/$check/report.txt" >> "$OUT/summary.txt"
done
echo "[gpu_smoke] summary ($OUT/summary.txt):"
cat "$OUT/summary.txt"
echo "[gpu_smoke] files: $OUT"
exit $failed
