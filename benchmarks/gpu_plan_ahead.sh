#!/usr/bin/env bash
# The step planned ahead (issue 21, twelfth session), A/B in one process: 1 x 128K and 24 planted
# forks at 128K, phases of 12 greedy steps alternating engine.plan_ahead off and on; then the fair
# dense baseline (dense-static: StaticCache, one CUDA graph a step) at its largest batch of 128K
# sequences, tried at 7, 6, then 5. Carry .whl (`make device-wheels`).
#   bash benchmarks/gpu_plan_ahead.sh            (results in $OUT)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 130 $PY benchmarks/e2e_h200.py --contexts 131072 --variants hisparse-int4-step --decode-steps 32 \
  --chunk 32768 --ab-plan-ahead --ab-phases 4 --ab-steps 12 --json "$OUT/ab_single.json" 2>&1 \
  | tee "$OUT/ab_single.txt" | cut -c1-300 | tail -3
timeout 150 $PY benchmarks/e2e_h200.py --contexts "" --variants hisparse-int4 --batch-context 131072 --hisparse-batch 24 \
  --decode-steps 24 --chunk 32768 --planted 24 --step-graphs --ab-plan-ahead --ab-phases 4 --ab-steps 12 \
  --json "$OUT/ab_batch.json" 2>&1 | tee "$OUT/ab_batch.txt" | cut -c1-300 | tail -3
timeout ${DENSE_TIMEOUT:-280} $PY benchmarks/e2e_h200.py --contexts "" --variants dense --batch-context 131072 \
  --dense-static-batch ${DENSE_BATCHES:-7,6,5} --decode-steps 32 --chunk 32768 --json "$OUT/dense_static.json" 2>&1 \
  | tee "$OUT/dense_static.txt" | cut -c1-300 | tail -4
