#!/usr/bin/env bash
# One device call (issue 21 / 23): the whole gpu suite with decode_kernels=True the default, then
# the decode step with 8-token selection blocks (issue 23's quality setting) beside the storage
# block's, one sequence at 32K and 128K and 24 forks at 128K; the LRU ranking's variants.
# Carry .whl (`make device-wheels`).
#   bash benchmarks/gpu_decode_kernels.sh            (results in $OUT)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout ${SUITE_TIMEOUT:-330} $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/ 2>&1 | tee "$OUT/gpu_suite.txt" | tail -15
timeout 130 $PY benchmarks/e2e_h200.py --contexts 32768,131072 --variants hisparse-int4-step --selection-block 8 \
  --decode-steps 32 --chunk 32768 --json "$OUT/e2e_single_sel8.json" 2>&1 | tee "$OUT/e2e_single_sel8.txt" | cut -c1-400 | tail -5
timeout 120 $PY benchmarks/e2e_h200.py --contexts "" --variants hisparse-int4 --batch-context 131072 --hisparse-batch 24 \
  --decode-steps 24 --chunk 32768 --planted 24 --step-graphs --selection-block 8 --json "$OUT/e2e_batch_sel8.json" 2>&1 \
  | tee "$OUT/e2e_batch_sel8.txt" | cut -c1-400 | tail -5
timeout 60 $PY benchmarks/bench_lru.py 2>&1 | tee "$OUT/bench_lru.txt" | tail -12
