#!/usr/bin/env bash
# Device calls for issue 21's item 1 (dynamic parts without a stall over ~1 step at a short
# context), results in $OUT. `bash benchmarks/gpu_stalls.sh tests`: the gpu tests the
# recalibration's slices, the streams and the runtime's threads touch. `... 24` and `... 1`: the
# stall profile at batch 24 (300 steps) or 1 (600 steps) from 1,000 tokens, with the background
# recalibration on a worker thread (the default) and in slices after each step (--slices), one
# after the other on one machine. Each part well under a call's 10 minutes with a warm Triton
# cache (.device/triton.tgz, docs/BENCHMARKS.md). `... warm`: 60 steps at batch 1 with and
# without --no-warm-blas (the capture ahead's cuBLAS handles made at install), for the first
# capture ahead's step. `... suite`: the whole gpu suite (~330 s). `... fit`: the probe fit's
# kernel (its gpu tests, benchmarks/bench_fit.py), the stall profiles at batch 24 with it and with the
# torch ops (--torch-fit), and at batch 1. `... trace`: the stall profiles at batch 1 and 24 under
# torch.profiler (--trace), 300 steps each, each stall and a median step read from the timeline
# (step_trace.py); `trace1` / `trace24` one of them. `... changed`: the gpu tests of the code the
# twenty-ninth session changed (a key change looked ahead at a new batch's capture, the replaced
# graph reset off the step: test_step_graph), of the twenty-eighth's (the worker's fit paced, the fit kernel one compile for every
# row count, loaded at install), of the twenty-seventh's (a seal graph's layers read, quantized and
# written in groups: gather_layers with each layer's rows, scatter_layers), of the twenty-sixth's (every layer's
# float tails and recent queries in one gather at a recalibration's start, the driver library
# loaded in one place) and of the
# twenty-fifth's (the pages locked ahead, the seal from the hot buffers and its graph uploaded,
# the first launches warmed at install, captures ahead on one thread, the commit's anchors in one
# copy).
# `... pace`: the stall profile at batch 24 with the worker's fit unpaced and at most 2, 4 and 8
# iterations a step (--fit-per-step; recal_job.FIT_PER_STEP), or PACE_K="8 0 8x1 0x1" (Kx1:
# at batch 1), one after the other.
# `... share`: a step's stand-in beside the fit at shares of the SMs (bench_fit.py --shares), and
# the stall profile at batch 24 with the fit on half and a quarter of them.
# `... copies`: the gpu tests of the thirtieth session's changes (a key change's growth copies in one
# graph captured ahead, a growth's views made by the lock-ahead job: test_step_graph,
# test_hot_buffer, test_row_bank, test_host_pool, test_pinned), then the stall profile
# at batch 1 and 24 with the copies' graph and without it (--no-copy-graph), alternating, and
# with no pages locked ahead (--no-lock-ahead), 300 steps each; then at batch 1 with a GIL switch
# interval of 0.5 ms (does the lock-ahead job wait for the GIL behind the capture ahead?).
# Carry .whl and .device.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
part=${1:-tests}
if [ "$part" = tests ]; then
  timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_background_recalibration.py tests/test_streams.py \
    tests/test_host_pool.py tests/test_step_graph.py tests/test_runtime_planted.py 2>&1 \
    | tee "$OUT/stall_tests.txt" | tail -15
elif [ "$part" = suite ]; then
  timeout 480 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/ 2>&1 | tee "$OUT/gpu_suite.txt" | tail -15
elif [ "$part" = fit ]; then
  timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_kernels_gpu.py -k fit_grads 2>&1 \
    | tee "$OUT/fit_tests.txt" | tail -5
  timeout 150 $PY benchmarks/bench_fit.py --tiles 32x8,32x4,64x8,64x4,128x8,16x4,32x8xieee 2>&1 \
    | tee "$OUT/bench_fit.txt"
  for run in "24" "24 --torch-fit" "1"; do
    set -- $run
    timeout 150 $PY benchmarks/stall_profile.py --batch $1 --prompt 1000 --steps $(($1 == 1 ? 600 : 300)) ${2:-} 2>&1 \
      | tee "$OUT/stalls_fit_b${run// /}.txt" | tail -25
  done
elif [ "$part" = pace ]; then
  run=0
  for k in ${PACE_K:-0 2 4 8}; do
    b=${k#*x}; b=${b:-24}; [ "$b" = "$k" ] && b=24; k=${k%x*}; run=$((run + 1))
    timeout 150 $PY benchmarks/stall_profile.py --batch $b --prompt 1000 --steps 300 --fit-per-step $k 2>&1 \
      | tee "$OUT/stalls_pace_b${b}_${k}_$run.txt" | grep -v "^  position" | tail -3
  done
elif [ "$part" = share ]; then
  timeout 200 $PY benchmarks/bench_fit.py --rows 16384 --shares 0.25,0.5,0.75 2>&1 | tee "$OUT/bench_fit_share.txt"
  for share in 0.5 0.25; do
    timeout 170 $PY benchmarks/stall_profile.py --batch 24 --prompt 1000 --steps 300 --fit-share $share 2>&1 \
      | tee "$OUT/stalls_share_b24_$share.txt" | tail -25
  done
elif [ "$part" = copies ]; then
  timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_step_graph.py tests/test_hot_buffer.py \
    tests/test_row_bank.py tests/test_host_pool.py tests/test_pinned.py 2>&1 | tee "$OUT/copies_tests.txt" | tail -8
  for run in "1" "1 --no-copy-graph" "24" "24 --no-copy-graph" "1 --no-lock-ahead" "24 --no-lock-ahead" \
             "1 --switch-interval 0.0005"; do
    set -- $run
    timeout 150 $PY benchmarks/stall_profile.py --batch $1 --prompt 1000 --steps 300 "${@:2}" 2>&1 \
      | tee "$OUT/stalls_copies_b${run// /}.txt" | grep -v "^  position 1[1-9]" | tail -16
  done
elif [ "$part" = changed ]; then
  timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests/test_host_pool.py tests/test_step_graph.py \
    tests/test_streams.py tests/test_host_syncs.py tests/test_background_recalibration.py \
    "tests/test_kernels_gpu.py::test_gather_layers_reads_every_layer_at_its_address" \
    "tests/test_kernels_gpu.py::test_scatter_layers_writes_every_layer_at_its_address" \
    "tests/test_kernels_gpu.py::test_the_fit_kernel_is_one_compile_for_every_row_count" \
    "tests/test_kernels_gpu.py::test_fit_grads_match_the_torch_ops" 2>&1 \
    | tee "$OUT/changed_tests.txt" | tail -15
elif [ "$part" = trace ] || [ "$part" = trace1 ] || [ "$part" = trace24 ]; then
  # 300 steps at each batch (each class of stall comes in them): the profiler's events are read
  # in Python at its end, ~50 us each on a slow CPU, ~1,000 a replayed step
  for b in $( [ "$part" = trace ] && echo 1 24 || echo "${part#trace}" ); do
    timeout 270 $PY benchmarks/stall_profile.py --batch $b --prompt 1000 --steps 300 \
      --trace "$OUT/trace_b$b.json.gz" 2>&1 | tee "$OUT/stalls_trace_b$b.txt" | tail -40
  done
elif [ "$part" = warm ]; then
  for mode in "" "--no-warm-blas"; do
    timeout 200 $PY benchmarks/stall_profile.py --batch 1 --prompt 1000 --steps 60 $mode 2>&1 \
      | tee "$OUT/stalls_warm${mode//-/_}.txt" | tail -20
  done
else
  steps=$([ "$part" = 1 ] && echo 600 || echo 300)
  for mode in "" "--slices"; do
    timeout 250 $PY benchmarks/stall_profile.py --batch "$part" --prompt 1000 --steps "$steps" $mode 2>&1 \
      | tee "$OUT/stalls_b${part}${mode//-/_}.txt" | tail -30
  done
fi
