"""RMSNorm on a GPU: transformers' LlamaRMSNorm module (about eight small kernels) against the
one-launch Triton kernel that ``fused_norms`` installs in its place (kernels/norm.py).

Each variant is captured in a CUDA graph of --reps calls and the graph is replayed (the decode
step runs in one), so the times are of the kernels and the gaps between them, not of Python or
the launches. Also prints the share of the output elements where the two agree bit for bit.

    python benchmarks/bench_norm.py [--rows 1,24] [--n 4096] [--dtype bf16] [--reps 200]
"""
from __future__ import annotations

import argparse
import sys

import torch
from graph_timing import graph_us as timed, missing_gpu_or_triton

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,24", help="rows per call (batch x tokens; heads for a q_norm)")
    ap.add_argument("--n", default="4096", help="row widths: 4096 Llama-3-8B, 576 SmolLM2, 128 a Qwen3 head")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--eps", type=float, default=1e-5)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if missing_gpu_or_triton("bench_norm.py"):
        return 2
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from hi_sparse.kernels import rms_norm

    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, eps {args.eps}, {args.reps} calls per graph")
    print("| rows | N | LlamaRMSNorm us | fused us | speed-up | bit-equal |\n|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for n in [int(v) for v in args.n.split(",")]:
        norm = LlamaRMSNorm(n, eps=args.eps).to("cuda", dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.5 * torch.randn(n, generator=g))
        for rows in [int(v) for v in args.rows.split(",")]:
            x = (3 * torch.randn(rows, n, generator=g)).to("cuda", dtype)
            with torch.no_grad():
                same = float((rms_norm(x, norm.weight, args.eps) == norm(x)).double().mean())
                module_us = timed(lambda: norm(x), args.reps)
                fused_us = timed(lambda: rms_norm(x, norm.weight, args.eps), args.reps)
            print(f"| {rows} | {n} | {module_us:.2f} | {fused_us:.2f} | {module_us / fused_us:.1f}x | {same:.2%} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
