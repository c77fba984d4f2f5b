#!/usr/bin/env bash
# The decode step timed on the H200 (issue 21; since the eighth session): one sequence at 32K and
# 128K, 24 planted forks at 128K (whole-step graphs, int4 host, fused RMSNorms and rotary); then the
# gpu tests (the whole suite by default; SUITE="tests/a.py tests/b.py" for a part, SUITE=none for none).
# The whole suite takes ~320-400 s on the H200 (457 tests in the tenth session; 427 ran in 350 s):
# with the e2e rows (~230 s) that passes a call's 600 s, so run E2E=0 for the suite alone and
# SUITE=none for the rows.
# Carry .whl (`make device-wheels`).
#   bash benchmarks/gpu_fewer_kernels.sh            (results in $OUT)
#   SUITE=none bash benchmarks/gpu_fewer_kernels.sh; E2E=0 bash benchmarks/gpu_fewer_kernels.sh   (two calls)
# BENCH="bench_projections.py --batch 1,24" (a benchmarks/ script and its arguments): run first.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
if [ -n "${BENCH:-}" ]; then
  timeout 120 $PY benchmarks/$BENCH 2>&1 | tee "$OUT/bench.txt" | tail -12
fi
if [ "${E2E:-1}" != 0 ]; then
timeout 140 $PY benchmarks/e2e_h200.py --contexts 32768,131072 --variants hisparse-int4-step --decode-steps 32 \
  --chunk 32768 --json "$OUT/e2e_single.json" 2>&1 | tee "$OUT/e2e_single.txt" | cut -c1-400 | tail -6
timeout 130 $PY benchmarks/e2e_h200.py --contexts "" --variants hisparse-int4 --batch-context 131072 --hisparse-batch 24 \
  --decode-steps 24 --chunk 32768 --planted 24 --step-graphs --json "$OUT/e2e_batch.json" 2>&1 \
  | tee "$OUT/e2e_batch.txt" | cut -c1-400 | tail -6
fi
# AB="--no-fused-projections" (any e2e_h200.py flags): the 1 x 128K row again with them, in the same call
if [ -n "${AB:-}" ]; then
timeout 110 $PY benchmarks/e2e_h200.py --contexts 131072 --variants hisparse-int4-step --decode-steps 32 \
  --chunk 32768 $AB --json "$OUT/e2e_ab.json" 2>&1 | tee "$OUT/e2e_ab.txt" | cut -c1-400 | tail -4
fi
if [ "${SUITE:-tests/}" != none ]; then
  timeout ${SUITE_TIMEOUT:-450} $PY -m pytest -q -m gpu -p no:cacheprovider -rs ${SUITE:-tests/} 2>&1 | tee "$OUT/gpu_suite.txt" | tail -15
fi
# PROFILE=1: the device profiles of the 1 x 128K and the 24 x 128K steps too (PROFILE_ARGS=--graphs
# for the 1 x 128K step replayed from its whole-step graph; without it graphs are off: every
# kernel named), ~200 s more; use it with SUITE=none
if [ "${PROFILE:-0}" = 1 ]; then
  timeout 110 $PY benchmarks/decode_profile.py --context 131072 --top 40 ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile_single.txt" \
    | grep -v USDT | tail -46
  timeout 150 $PY benchmarks/decode_profile.py --context 131072 --batch 24 --planted 24 2>&1 | tee "$OUT/profile_batch.txt" \
    | grep -v USDT | tail -40
fi
