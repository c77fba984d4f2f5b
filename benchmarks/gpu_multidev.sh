#!/usr/bin/env bash
# One device call for issue 9's two-GPU part (run on nvidia-h200-x2): the gpu-marked two-GPU tests,
# the single-GPU engine tests (nothing regressed), then bench_multidev; results in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=index,name,driver_version --format=csv 2>&1 | tee "$OUT/multidev_env.txt"
timeout 240 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_runtime_multidevice.py tests/test_runtime_gpu.py \
  2>&1 | tee "$OUT/multidev_tests.txt" | tail -40
timeout 300 $PY benchmarks/bench_multidev.py "$@" 2>&1 | tee "$OUT/bench_multidev.txt"
