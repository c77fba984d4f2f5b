#!/usr/bin/env bash
# The quality grid of docs/BENCHMARKS.md ("Quality on a real model"): SmolLM2-135M-Instruct on
# the license texts, dense against HiSparse, the most informative cells first. Two streams of one
# torch thread each run side by side on a 2-core machine (a decode step is mostly Python and small
# ops, so two 1-thread processes do nearly twice the work of one 2-thread process):
#   STREAM=a  ~6K tokens (all cells), then the 8K needles
#   STREAM=b  ~2K tokens (all cells, with the full-budget check), then the 8K perplexities
#   STREAM=ab (default) both, one after the other, in this shell.
# Every result is appended to $OUT (docs/quality/smollm2-cpu.jsonl), with the source revision;
# --resume skips cells already there, so the script can be stopped and started again.
# Tables: python -m hi_sparse.eval --table docs/quality/smollm2-cpu.jsonl
# Contexts: 2048 and 6144 prompt tokens, and 7680 (+ the 512-token continuation = the model's 8192).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/quality/smollm2-cpu.jsonl}
STREAM=${STREAM:-ab}
TK=256,512,1024,2048
run() { nice -n 10 "$PY" -m hi_sparse.eval --threads 1 --json "$OUT" --resume "$@"; }
context() {  # all cells of one context, the most informative first
  local c=$1; shift
  run --context "$c" --top-k $TK --bits none,4,auto --passes perplexity "$@"
  run --context "$c" --top-k 512 --bits none,4 --passes needle
  run --context "$c" --top-k $TK --bits none,4,auto --passes needle
  run --context "$c" --top-k $TK --bits 8,6,5 --passes perplexity
  run --context "$c" --top-k $TK --bits 8,6,5 --passes needle
}
if [[ $STREAM == *a* ]]; then
  context 6144
  run --context 7680 --top-k $TK --bits none,4,auto --passes needle
  run --context 7680 --top-k $TK --bits 8,6,5 --passes needle
fi
if [[ $STREAM == *b* ]]; then
  context 2048 --full-budget
  run --context 7680 --top-k $TK --bits none,4,auto --passes perplexity
  run --context 7680 --top-k $TK --bits 8,6,5 --passes perplexity
fi
