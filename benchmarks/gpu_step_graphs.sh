#!/usr/bin/env bash
# One device call for issue 21's whole-step decode graphs (decode_graphs="step"), results in $OUT:
# their gpu tests and the per-layer graphs' (whose keys are now bucketed), then one sequence at 32K
# and 128K with per-layer graphs and whole-step graphs side by side (and the fair dense baseline),
# then 24 x 128K with whole-step graphs. Carry the transformers wheel (.whl, gpu_env.sh).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_step_graph.py tests/test_runtime_batched.py \
  tests/test_batch_step.py 2>&1 | tee "$OUT/step_graph_tests.txt" | tail -25
timeout 240 $PY benchmarks/e2e_h200.py --contexts 32768,131072 --variants dense-static,hisparse-int4,hisparse-int4-step \
  --decode-steps 32 --chunk 32768 --json "$OUT/e2e_single.json" 2>&1 | tee "$OUT/e2e_single.txt" | cut -c1-400 | tail -8
timeout 150 $PY benchmarks/e2e_h200.py --contexts "" --variants hisparse-int4 --batch-context 131072 --hisparse-batch 24 \
  --decode-steps 24 --chunk 32768 --planted 24 --step-graphs --json "$OUT/e2e_batch.json" 2>&1 \
  | tee "$OUT/e2e_batch.txt" | cut -c1-400 | tail -6
