#!/usr/bin/env bash
# Device calls for issue 21's whole-step decode graphs (decode_graphs="step", the default) and
# background recalibration (background_recalibration=True), results in $OUT. Their gpu
# tests and the per-layer graphs' (whose keys are now bucketed); the 32K prefill to the first token
# with the recalibration in the step and in the background; one sequence at 32K and 128K with
# per-layer and whole-step graphs side by side (and the fair dense baseline); 24 x 128K with
# whole-step graphs. Carry .whl (`make device-wheels`, gpu_env.sh). More than one call's 10
# minutes: `bash benchmarks/gpu_step_graphs.sh tests` (tests and prefill), then `... decode`.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
part=${1:-tests}
if [ "$part" = tests ]; then
timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_step_graph.py tests/test_hot_buffer.py tests/test_runtime_batched.py \
  tests/test_batch_step.py tests/test_background_recalibration.py tests/test_host_pool.py 2>&1 | tee "$OUT/step_graph_tests.txt" | tail -25
timeout 150 $PY benchmarks/prefill_profile.py --context 32768 --chunk 32768 --repeats 2 \
  --variants dense,hisparse-int4,hisparse-int4-bg --profile hisparse-int4-bg 2>&1 | tee "$OUT/prefill.txt" | tail -24
else
timeout 320 $PY benchmarks/e2e_h200.py --contexts 32768,131072 --variants dense-static,hisparse-int4,hisparse-int4-step,hisparse-int4-step-torch \
  --decode-steps 32 --chunk 32768 --json "$OUT/e2e_single.json" 2>&1 | tee "$OUT/e2e_single.txt" | cut -c1-400 | tail -8
timeout 150 $PY benchmarks/e2e_h200.py --contexts "" --variants hisparse-int4 --batch-context 131072 --hisparse-batch 24 \
  --decode-steps 24 --chunk 32768 --planted 24 --step-graphs --json "$OUT/e2e_batch.json" 2>&1 \
  | tee "$OUT/e2e_batch.txt" | cut -c1-400 | tail -6
fi
