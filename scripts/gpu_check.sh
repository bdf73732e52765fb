#!/usr/bin/env bash
# The GPU checks in one command, for a machine with one CUDA GPU and no network:
#
#   bash scripts/gpu_check.sh [WHEELS]
#
# 1. installs what the machine lacks from WHEELS (a folder of wheels made beforehand with
#    scripts/gpu_wheels.sh; skipped where deepspeed, vllm and vagen import already), without the network;
# 2. runs `pytest -m gpu` (tests/test_gpu.py: the shipped DeepSpeed configs, CUDA against CPU log-probs,
#    seeded sampling, and vLLM on CUDA: CUDA graphs, sleep, waking weights first, the synced policy), then
#    scripts/gpu_engine_check.py: the model runner, F.linear after ZeRO-3, each rank's EGL device, start-up time;
# 3. runs benchmarks/bench_gpu.py at Qwen2.5-VL-3B's shape with the hf and the vllm backend, a size that
#    fits the whole script in 8 minutes on an H100, and prints one table: seconds per iteration and per
#    rollout, generated and update tokens per second, peak memory, and the decoding bandwidth bound
#    (the measured device-to-device bandwidth over the bytes a decode step must read) beside each;
# 4. runs benchmarks/bench_staleness.py at rollout.max_staleness = 0 and 1 (sokoban_visual's shipped warm start,
#    image hooks off, 256-token turns, 5 iterations: a row of the CPU table in docs/benchmarks.md) and prints its
#    table: forward passes and tokens computed per trained turn, sequences per pass, the engine's idle share and
#    seconds per trained sample, k = 1 beside k = 0 (at most 7 more minutes; two engine start-ups and 10 iterations
#    of the tiny model).
# Logs and the rows as JSON go to $OUT (or ./gpu_check) for later reading.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WHEELS="${1:-}"
LOGS="${OUT:-$ROOT/gpu_check}"
mkdir -p "$LOGS"
PY="${PYTHON:-python3}"
started=$SECONDS
say() { echo "[gpu_check $((SECONDS - started)) s] $*"; }

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
  || { echo "gpu_check: needs a CUDA GPU and torch with CUDA" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

if ! "$PY" -c "import deepspeed, vllm, vagen" 2>/dev/null; then
  if [ -z "$WHEELS" ]; then
    echo "gpu_check: deepspeed, vllm or vagen is missing and no wheel folder was given; make one with" \
         "scripts/gpu_wheels.sh on a machine with the network and pass it: bash scripts/gpu_check.sh WHEELS" >&2
    exit 1
  fi
  say "installing from $WHEELS (no network)"
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
"$PY" - <<'PYEOF' | tee "$LOGS/versions.txt"
import importlib.metadata as md
import torch
names = ["torch", "transformers", "deepspeed", "vllm", "peft", "flash_attn"]
print("versions:", ", ".join(f"{n} {md.version(n.replace('_', '-')) if n != 'torch' else torch.__version__}"
                             for n in names if __import__('importlib').util.find_spec(n)),
      f"| CUDA {torch.version.cuda}")
PYEOF

say "pytest -m gpu"
"$PY" -m pytest -m gpu -q -x -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$LOGS/pytest_gpu.log" | tail -n 5
gpu_status=${PIPESTATUS[0]}

# The vLLM engine's GPU-only checks, one JSON line each (scripts/gpu_engine_check.py): the model runner vLLM
# chose (vagen pins V1) and the start-up time at the rank's engine sizes against vLLM's serving defaults;
# torch.nn.functional.linear after a ZeRO-3 partitioned build and an engine decoding after it; the EGL device of
# each local rank and a frame it renders.
engine_status=0
for check in runner linear egl; do
  say "engine check: $check"
  timeout 300 "$PY" scripts/gpu_engine_check.py "$check" > "$LOGS/engine_$check.log" 2>&1 || engine_status=1
  tail -n 1 "$LOGS/engine_$check.log" | tee -a "$LOGS/engine_checks.jsonl"
done

say "bandwidth"
"$PY" - > "$LOGS/bandwidth.json" <<'PYEOF'
import json, torch
x = torch.empty(2**30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
torch.cuda.synchronize(); start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20): y.copy_(x)
end.record(); torch.cuda.synchronize()
row = {"bytes_per_s": 2 * 20 * x.numel() / (start.elapsed_time(end) / 1e3)}
# vLLM's sampling step for 128 requests at Qwen's vocabulary, without and with a seed per request
# (vllm.seeded_requests: each seeded row draws its noise in a loop of its own)
from vllm.v1.sample.ops.topk_topp_sampler import random_sample
probs = torch.randn(128, 151_936, device="cuda").softmax(-1)
generators = {i: torch.Generator(device="cuda").manual_seed(i) for i in range(128)}
for name, gens in (("sample_ms_unseeded", {}), ("sample_ms_seeded", generators)):
    for _ in range(3): random_sample(probs, gens)
    torch.cuda.synchronize(); start.record()
    for _ in range(50): random_sample(probs, gens)
    end.record(); torch.cuda.synchronize()
    row[name] = start.elapsed_time(end) / 50
print(json.dumps(row))
PYEOF

SIZE=(--shape 3b --groups 8 --group-size 8 --turns 2 --max-new-tokens 128 --iterations 3)
for backend in hf vllm; do
  say "bench_gpu.py --backend $backend ${SIZE[*]}"
  timeout 300 "$PY" benchmarks/bench_gpu.py "${SIZE[@]}" --backend "$backend" --cache "$LOGS/cache" \
    --json "$LOGS/bench_$backend.json" > "$LOGS/bench_$backend.log" 2>&1 \
    || { echo "bench_gpu.py --backend $backend failed; the end of its log:"; tail -n 30 "$LOGS/bench_$backend.log"; }
done

# Bounded staleness against the synchronous run, measured where a forward pass costs what its weights' reads
# cost rather than what its sequences' arithmetic costs (docs/benchmarks.md, "Bounded staleness").
say "bench_staleness.py --ks 0 1"
timeout 420 "$PY" benchmarks/bench_staleness.py --envs sokoban_visual --ks 0 1 --seeds 0 --iterations 5 --timeout 200 \
  --json "$LOGS/staleness.json" > "$LOGS/staleness.log" 2>&1 \
  || { echo "bench_staleness.py failed or stopped; the end of its log:"; tail -n 30 "$LOGS/staleness.log"; }

say "table"
"$PY" - "$LOGS" <<'PYEOF'
import json, sys
from pathlib import Path
sys.path.insert(0, ".")
from benchmarks.bench_gpu import decode_bytes
logs = Path(sys.argv[1])
bandwidth = json.loads((logs / "bandwidth.json").read_text())["bytes_per_s"]
measured = json.loads((logs / "bandwidth.json").read_text())
print(f"\ndevice-to-device copy: {bandwidth / 1e12:.2f} TB/s (bytes read + written); vLLM's sampling step for 128 "
      f"requests at a 151,936 vocabulary: {measured['sample_ms_unseeded']:.2f} ms unseeded, "
      f"{measured['sample_ms_seeded']:.2f} ms with a seed per request")
print("| backend | s / iteration | generate s | generated tok/s | bound tok/s | share | update tok/s | sync s | peak GiB |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for backend in ("hf", "vllm"):
    path = logs / f"bench_{backend}.json"
    if not path.exists():
        print(f"| {backend} | failed (see {logs / f'bench_{backend}.log'}) |")
        continue
    r = json.loads(path.read_text())
    # mean context while decoding: the prompt of a turn (about 600 tokens of history and frame at this size)
    # plus half the response; a bound, so the smaller context is the generous one
    context = 600 + r["mean_response_tokens"] / 2
    bound = r["sequences"] * bandwidth / decode_bytes(r["shape"], r["sequences"], context)
    print(f"| {backend} | {r['iteration_s']:.1f} | {r['generate_s']:.1f} | {r['generated_tokens_per_s']:,.0f} | "
          f"{bound:,.0f} | {r['generated_tokens_per_s'] / bound:.0%} | {r['update_tokens_per_s']:,.0f} | "
          f"{r['weight_sync_s']:.2f} | {r['peak_gib']:.1f} |")
PYEOF
if [ -s "$LOGS/staleness.json" ]; then
  echo; echo "rollout.max_staleness = 1 against 0 (ratios to k = 0 in parentheses; $LOGS/staleness.log):"
  "$PY" benchmarks/bench_staleness.py --table "$LOGS/staleness.json"
fi
say "done (pytest -m gpu exit $gpu_status, engine checks exit $engine_status)"
[ "$gpu_status" -ne 0 ] && exit "$gpu_status"
exit "$engine_status"
