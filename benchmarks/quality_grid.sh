#!/usr/bin/env bash
# The quality grid of docs/BENCHMARKS.md ("Quality on a real model"): SmolLM2-135M-Instruct on
# the license texts, dense against HiSparse, most informative cells first. Every result is
# appended to docs/quality/smollm2-cpu.jsonl; --resume skips cells already there, so the script
# can be stopped and started again. Tables: python -m hi_sparse.eval --table docs/quality/smollm2-cpu.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/quality/smollm2-cpu.jsonl}
run() { nice -n 10 "$PY" -m hi_sparse.eval --json "$OUT" --resume "$@"; }
# 1. ~6K tokens (the reference of issues 22 and 23)
run --context 6144 --top-k 256,512,1024,2048 --bits none --passes perplexity
run --context 6144 --top-k 512,1024 --bits 4,auto --passes perplexity
run --context 6144 --top-k 512 --bits 8,6,5 --passes perplexity
run --context 6144 --top-k 512,1024 --bits none,4,auto --passes needle
# 2. ~2K tokens: the whole grid of perplexity, the full budget, needles at the main cells
run --context 2048 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --full-budget --passes perplexity
run --context 2048 --top-k 256,512,1024 --bits none,4,auto --passes needle
# 3. the model's 8K context: 7680 prompt + 512 continuation tokens
run --context 7680 --top-k 512,1024,2048 --bits none,4,auto --passes perplexity
run --context 7680 --top-k 512,1024 --bits none,4,auto --passes needle
# 4. the rest of the grid
run --context 6144 --top-k 256,1024,2048 --bits 8,6,5,4,auto --passes perplexity
run --context 6144 --top-k 256,2048 --bits none,4,auto --passes needle
run --context 7680 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --passes perplexity
run --context 2048 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --passes needle
run --context 6144 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --passes needle
run --context 7680 --top-k 256,512,1024,2048 --bits none,8,6,5,4,auto --passes needle
