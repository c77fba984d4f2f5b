#!/usr/bin/env bash
# One device call for issue 9 and the runtime's CUDA checks: environment, the gpu-marked runtime,
# integration and agent tests, then benchmarks/e2e_h200.py; results in $OUT.
# Usage (device tool, repository root, with .whl carried: transformers 5.23 for the integration):
#   bash benchmarks/gpu_e2e.sh [e2e_h200.py arguments]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c 'import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)'
  free -g | head -2
} 2>&1 | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-150} $PY -m pytest -q -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/test_runtime_gpu.py tests/test_integration.py tests/test_agent_gpu.py} 2>&1 | tee "$OUT/gpu_tests.txt" | tail -30
fi
timeout ${BENCH_TIMEOUT:-330} $PY benchmarks/e2e_h200.py --json "$OUT/e2e.json" "$@" 2>&1 | tee "$OUT/e2e.txt"
