#!/usr/bin/env bash
# One device call for the runtime (issue 4): GPU engine tests and bench_runtime on CUDA; results in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tee "$OUT/runtime_env.txt"
timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_runtime_gpu.py 2>&1 | tee "$OUT/runtime_gpu_tests.txt" | tail -30
timeout 300 $PY benchmarks/bench_runtime.py --device cuda "$@" 2>&1 | tee "$OUT/bench_runtime_cuda.txt"
