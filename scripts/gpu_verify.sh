#!/usr/bin/env bash
# The short GPU verification of the CUDA-graph block path, for one lent H200 window:
# block-task eager / fused / graph p50 and the GEMM+attention floor, graph-vs-eager bf16 output
# error, and the engine's chunk interval graph vs fused (physis_ros/tools/gpu_verify.py says
# what each file holds). Never part of CI: it needs CUDA (--smoke: the same code on the CPU).
#   scripts/gpu_verify.sh [OUT_DIR] [--smoke]     OUT_DIR defaults to $OUT
# Each step is its own process with its own timeout and writes its JSON under OUT_DIR as it
# measures; a step that fails or times out loses only itself. Budget on an H200: at most
# 118 s (the step timeouts, imports included, 103 s, + 3 s grace each + nvidia-smi 3 s);
# expected well under a minute. verify.json and the table come last.
set -uo pipefail
OUT_DIR="" SMOKE=""
for a in "$@"; do
  case "$a" in
    --smoke) SMOKE=--smoke ;;
    -*) echo "usage: scripts/gpu_verify.sh [OUT_DIR] [--smoke]" >&2; exit 2 ;;
    *) OUT_DIR=$a ;;
  esac
done
OUT_DIR=${OUT_DIR:-${OUT:-}}
[ -n "$OUT_DIR" ] || { echo "usage: scripts/gpu_verify.sh [OUT_DIR] [--smoke] (or set OUT)" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "$SMOKE" ]; then
  MODEL=tiny; CHUNKS=4,8; T_ENV=60; T_BLOCK=120; T_ENGINE=120; T_SUM=60
else
  MODEL=${GPU_VERIFY_MODEL:-wan2.1-1.3b}; CHUNKS=8,16; T_ENV=12; T_BLOCK=38; T_ENGINE=45; T_SUM=8
fi
T0=$(date +%s)
step() {  # step NAME TIMEOUT_S MODULE ARGS...
  local name=$1 limit=$2 module=$3 t=$(date +%s) rc
  shift 3
  timeout -k 3 "$limit" "$PY" -m "physis_ros.tools.$module" "$@" --out "$OUT_DIR" $SMOKE \
    > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "gpu_verify: $name rc=$rc in $(( $(date +%s) - t )) s (limit $limit s)"
  [ $rc -eq 0 ] || tail -5 "$OUT_DIR/$name.log"
}
timeout 3 nvidia-smi > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
step env "$T_ENV" gpu_check env
step block "$T_BLOCK" gpu_verify block --model "$MODEL"
step engine "$T_ENGINE" gpu_check engine --model "$MODEL" --impls fused,graph --chunks "$CHUNKS"
step summary "$T_SUM" gpu_verify summary --model "$MODEL"
echo "gpu_verify: $(( $(date +%s) - T0 )) s in all"
cat "$OUT_DIR/summary.log"
