#!/usr/bin/env bash
# GPU check of the distributed runtime (issue 4). Never part of CI: it needs CUDA.
#   benchmarks/gpu_check.sh OUT_DIR
# 1. the distributed correctness tests with every rank computing on cuda (several ranks share
#    one GPU: NCCL refuses duplicate GPUs, so they use gloo with CPU staging), float32,
#    compared with the oracle on the same GPU: 2 and 4 ranks, several placements, placement
#    balanced by costs measured on the GPU, running streams moved to new layouts (KV rings
#    moved between ranks), a killed and a hung rank;
# 2. physis-bench engine --ranks 2 for wan2.1-1.3b, random weights, bf16, on one GPU
#    (1-rank baseline in the same run).
# Writes OUT_DIR/{env.json, tests.log, tests.xml, bench_wan2.1-1.3b.json, bench.log}.
# Budget: 8 minutes in all (each step has its own timeout).
set -uo pipefail
OUT_DIR=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT_DIR"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: CUDA is not available here (torch.cuda.is_available() is False); this check runs only on a GPU machine" >&2
  exit 2
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1

"$PY" - > "$OUT_DIR/env.json" <<'PYEOF'
import json, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
PYEOF

status=0
echo "== correctness tests on cuda (gloo ranks sharing the GPU)"
PHYSIS_TEST_DEVICE=cuda timeout 270 "$PY" -m pytest test/serve/test_dist_engine.py -q -x \
  -p no:cacheprovider --junitxml="$OUT_DIR/tests.xml" > "$OUT_DIR/tests.log" 2>&1 || status=1
tail -3 "$OUT_DIR/tests.log"

echo "== bench wan2.1-1.3b, bf16, 2 ranks on one GPU"
timeout 180 "$PY" -m physis_ros.bench.cli engine --ranks 2 --model wan2.1-1.3b --device cuda \
  --dtype bfloat16 --steps 4 --window 2 --chunks 8 --skip 2 --json \
  > "$OUT_DIR/bench_wan2.1-1.3b.json" 2> "$OUT_DIR/bench.log" || status=1
cat "$OUT_DIR/bench_wan2.1-1.3b.json"
exit $status
