#!/usr/bin/env bash
# One device call for the kernels (issue 6): environment, GPU tests, benchmarks; results in $OUT.
# Usage (device tool, repository root): bash benchmarks/gpu_kernels.sh [--quick] [--only swap,attention,quant,hit]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  $PY -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/env.txt"
SKIP_TESTS=${SKIP_TESTS:-0}
if [ "$SKIP_TESTS" != 1 ]; then
  timeout 240 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -25
fi
timeout ${BENCH_TIMEOUT:-400} $PY benchmarks/bench_kernels.py --out "$OUT/bench_kernels.json" "$@" 2>&1 | tee "$OUT/bench_kernels.txt"
