#!/usr/bin/env bash
# The stall profile of an earlier commit beside this checkout's, on one device machine (the
# twenty-fourth session's before/after numbers in docs/BENCHMARKS.md). Make the earlier tree here
# first, `git worktree add .device/base COMMIT`, and carry .whl and .device. Then:
#   bash benchmarks/gpu_compare.sh base B    the earlier commit's stall profile at batch B
#   bash benchmarks/gpu_compare.sh new B     this checkout's (its gpu tests and timelines: gpu_stalls.sh
#                                            changed, trace1, trace24)
# Results in $OUT (base_bB.txt, new_bB.txt); 300 steps from 1,000 tokens, as gpu_stalls.sh's trace.
set -uo pipefail
export TRITON_CACHE_DIR=/tmp/tc; mkdir -p /tmp/tc
[ -f /tmp/tc/.x ] || { [ -f .device/triton.tgz ] && tar xzf .device/triton.tgz -C /tmp/tc; touch /tmp/tc/.x; }
source "$(dirname "$0")/gpu_env.sh"
b=${2:-1}
case "${1:-}" in
  base)
    (cd .device/base && bash -c 'source benchmarks/gpu_env.sh; timeout 200 $PY benchmarks/stall_profile.py --batch '"$b"' --prompt 1000 --steps 300' \
      2>&1 | tee "$OUT/base_b$b.txt" | grep -v "^  position" | tail -14) ;;
  new)
    timeout 200 $PY benchmarks/stall_profile.py --batch "$b" --prompt 1000 --steps 300 2>&1 | tee "$OUT/new_b$b.txt" \
      | grep -v "^  position" | tail -16 ;;
  *) echo "usage: bash benchmarks/gpu_compare.sh base|new [BATCH]" >&2; exit 2 ;;
esac
