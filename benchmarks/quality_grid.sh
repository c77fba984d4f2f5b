#!/usr/bin/env bash
# The quality grid of docs/BENCHMARKS.md ("Quality on a real model"): SmolLM2-135M-Instruct on
# the license texts, dense against HiSparse, the most informative cells first, in two streams
# (STREAM=a: ~6K tokens; STREAM=b: ~2K, then 8K; both by default, one after the other). Every
# result is appended to docs/quality/smollm2-cpu.jsonl; --resume skips cells already there, so
# the script can be stopped and started again.
# Tables: python -m hi_sparse.eval --table docs/quality/smollm2-cpu.jsonl
# Contexts: 2048 and 6144 prompt tokens, and 7680 (+ the 512-token continuation = the model's 8192).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/quality/smollm2-cpu.jsonl}
STREAM=${STREAM:-ab}
run() { nice -n 10 "$PY" -m hi_sparse.eval --json "$OUT" --resume "$@"; }
if [[ $STREAM == *a* ]]; then
  run --context 6144 --top-k 256,512,1024 --bits none --passes perplexity
  run --context 6144 --top-k 512 --bits 4,auto --passes perplexity
  run --context 6144 --top-k 512 --bits none,4 --passes needle
  run --context 6144 --top-k 2048 --bits none --passes perplexity
  run --context 6144 --top-k 1024 --bits 4,auto --passes perplexity
  run --context 6144 --top-k 512 --bits 8,6,5 --passes perplexity
  run --context 6144 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --passes perplexity
  run --context 6144 --top-k 256,512,1024,2048 --bits none,4,auto --passes needle
fi
if [[ $STREAM == *b* ]]; then
  run --context 2048 --top-k 512 --bits none,4 --full-budget --passes perplexity
  run --context 2048 --top-k 256,1024,2048 --bits none --passes perplexity
  run --context 7680 --top-k 512 --bits none,4 --passes perplexity
  run --context 2048 --top-k 512 --bits none,4 --passes needle
  run --context 7680 --top-k 512 --bits none,4 --passes needle
  run --context 2048 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --passes perplexity
  run --context 7680 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --passes perplexity
  run --context 2048,7680 --top-k 256,512,1024,2048 --bits none,4,auto --passes needle
fi
run --context 2048,6144,7680 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --passes needle
