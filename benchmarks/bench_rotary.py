"""Rotary embedding on a GPU: transformers' apply_rotary_pos_emb (about ten small kernels for q
and k) against the one-launch Triton kernel that ``fused_rotary`` runs in its place inside a
HiSparse model's forward (kernels/rotary.py).

Each variant is captured in a CUDA graph of --reps calls and the graph is replayed (the decode
step runs in one), so the times are of the kernels and the gaps between them, not of Python or
the launches. Also says whether the two agree bit for bit (they should: the kernel rounds like
torch).

    python benchmarks/bench_rotary.py [--batch 1,24] [--tokens 1] [--heads 32,8] [--dtype bf16] [--reps 200]
"""
from __future__ import annotations

import argparse
import sys

import torch
from graph_timing import graph_us as timed, missing_gpu_or_triton

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,24", help="sequences per call")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per sequence (1: a decode step)")
    ap.add_argument("--heads", default="32,8", help="query heads, key-value heads (Llama-3-8B: 32,8)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if missing_gpu_or_triton("bench_rotary.py"):
        return 2
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hi_sparse.kernels.rotary import rotary

    dtype = DTYPES[args.dtype]
    hq, hk = (int(v) for v in args.heads.split(","))
    T, D = args.tokens, args.head_dim
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, {hq} q / {hk} kv heads x {D}, {T} token(s), "
          f"{args.reps} calls per graph")
    print("| batch | apply_rotary_pos_emb us | fused us | speed-up | bit-equal |\n|---:|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)
    for B in [int(v) for v in args.batch.split(",")]:
        q = torch.randn(B, T, hq, D, generator=g).to("cuda", dtype).transpose(1, 2)   # as the attention passes it
        k = torch.randn(B, T, hk, D, generator=g).to("cuda", dtype).transpose(1, 2)
        angles = torch.randint(0, 1 << 17, (B, T, 1), generator=g) * 5e5 ** (-torch.arange(0, D, 2) / D)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to("cuda", dtype), angles.sin().to("cuda", dtype)
        with torch.no_grad():
            same = all(torch.equal(a, b) for a, b in zip(rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)))
            eager_us = timed(lambda: apply_rotary_pos_emb(q, k, cos, sin), args.reps)
            fused_us = timed(lambda: rotary(q, k, cos, sin), args.reps)
        print(f"| {B} | {eager_us:.2f} | {fused_us:.2f} | {eager_us / fused_us:.1f}x | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
