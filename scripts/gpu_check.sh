#!/usr/bin/env bash
# The full GPU measurement of the block path: fused vs eager block, floors, batching, engine
# interval, profiles for the cost-model calibration (scripts/gpu_verify.sh is the short
# verification). Never part of CI: it needs CUDA (--smoke: the same code on the CPU with tiny
# presets, seconds).
#   scripts/gpu_check.sh OUT_DIR [--smoke]
# Each step is its own process with its own timeout and writes its JSON under OUT_DIR as it
# measures (physis_ros/tools/gpu_check.py says what each holds); a step that fails or times
# out loses only itself. The summary table is printed last. Budget on an H200: about
# 2.5 minutes, at most 265 s (the sum of the step timeouts).
set -uo pipefail
OUT_DIR=${1:?usage: scripts/gpu_check.sh OUT_DIR [--smoke]}
SMOKE=${2:-}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$SMOKE" = "--smoke" ]; then
  PRESETS=${GPU_CHECK_PRESETS:-tiny push-wm}; ENGINE=tiny; T_ENV=60; T_BLOCK=240; T_ENGINE=240
else
  PRESETS="wan2.1-1.3b wan2.1-14b dit-33b"; ENGINE=wan2.1-1.3b; T_ENV=25; T_BLOCK=55; T_ENGINE=60
fi
T0=$(date +%s)
step() {  # step NAME TIMEOUT_S ARGS...
  local name=$1 limit=$2 t=$(date +%s) rc
  shift 2
  timeout -k 5 "$limit" "$PY" -m physis_ros.tools.gpu_check "$@" --out "$OUT_DIR" $SMOKE \
    > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "gpu_check: $name rc=$rc in $(( $(date +%s) - t )) s (limit $limit s)"
  [ $rc -eq 0 ] || tail -5 "$OUT_DIR/$name.log"
}
nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
step env "$T_ENV" env
for p in $PRESETS; do
  # the largest preset gets 5 s more: its fp32 reference and profile batches are the longest
  extra=0; [ "$p" = dit-33b ] && extra=5
  step "block_$p" $(( T_BLOCK + extra )) block --model "$p"
done
step engine "$T_ENGINE" engine --model "$ENGINE"
echo "gpu_check: $(( $(date +%s) - T0 )) s in all"
step summary 15 summary --presets "${PRESETS// /,}"
cat "$OUT_DIR/summary.log"
