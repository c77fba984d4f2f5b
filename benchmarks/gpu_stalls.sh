#!/usr/bin/env bash
# Device calls for issue 21's item 1 (dynamic parts without a stall over ~1 step at a short
# context), results in $OUT. `bash benchmarks/gpu_stalls.sh tests`: the gpu tests the
# recalibration's slices, the streams and the runtime's threads touch. `... 24` and `... 1`: the
# stall profile at batch 24 (300 steps) or 1 (600 steps) from 1,000 tokens, with the background
# recalibration on a worker thread (the default) and in slices after each step (--slices), one
# after the other on one machine. `... gil24` and `... gil1`: the same with the GIL's short switch
# interval while the runtime's threads run (side_threads, the default) and with the interpreter's
# own (--switch-interval keep). Each part well under a call's 10 minutes with a warm Triton cache
# (.device/triton.tgz, docs/BENCHMARKS.md). `... warm`: 60 steps at batch 1 with and without
# --no-warm-blas (the capture ahead's cuBLAS handles made at install), for the first capture
# ahead's step. Carry .whl and .device.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
part=${1:-tests}
if [ "$part" = tests ]; then
  timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_background_recalibration.py tests/test_streams.py \
    tests/test_host_pool.py tests/test_step_graph.py tests/test_runtime_planted.py 2>&1 \
    | tee "$OUT/stall_tests.txt" | tail -15
elif [ "$part" = warm ]; then
  for mode in "" "--no-warm-blas"; do
    timeout 200 $PY benchmarks/stall_profile.py --batch 1 --prompt 1000 --steps 60 $mode 2>&1 \
      | tee "$OUT/stalls_warm${mode//-/_}.txt" | tail -20
  done
else
  batch=${part#gil}
  steps=$([ "$batch" = 1 ] && echo 600 || echo 300)
  modes=("" "--slices")
  [ "$part" != "$batch" ] && modes=("" "--switch-interval keep")
  for mode in "${modes[@]}"; do
    name=${mode//-/_}
    timeout 250 $PY benchmarks/stall_profile.py --batch "$batch" --prompt 1000 --steps "$steps" $mode 2>&1 \
      | tee "$OUT/stalls_${part}${name// /_}.txt" | tail -30
  done
fi
