#!/usr/bin/env bash
# One device call for the runtime (issue 4): GPU engine tests and bench_runtime on CUDA; results in $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# hi_sparse maps to runtime/ and hi_sparse.kernels to kernels/ (pyproject package-dir): links, no install.
PP=$(mktemp -d)
mkdir -p "$PP/hi_sparse"
for f in runtime/*; do ln -s "$PWD/$f" "$PP/hi_sparse/"; done
ln -s "$PWD/kernels" "$PP/hi_sparse/kernels"
ln -s "$PWD/easymats" "$PP/easymats"
export PYTHONPATH="$PP${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tee "$OUT/runtime_env.txt"
timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_runtime_gpu.py 2>&1 | tee "$OUT/runtime_gpu_tests.txt" | tail -30
timeout 300 $PY benchmarks/bench_runtime.py --device cuda "$@" 2>&1 | tee "$OUT/bench_runtime_cuda.txt"
