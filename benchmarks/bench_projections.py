"""A decode step's q/k/v and gate/up projections on a GPU: the separate GEMMs a transformers layer
runs against the two fused ones ``fused_projections`` runs in their place (runtime/fused_projections.py).

One pass over --layers layers' own weights (so no weight is read from L2 twice, as in a step) is
captured in a CUDA graph and replayed; the times are per layer, of the kernels and the gaps
between them. Beside each, the time the weight bytes take at --hbm-tb-s. Also says how far the
fused columns are from the separate GEMMs' (cuBLAS may split the longer weight differently).

    python benchmarks/bench_projections.py [--batch 1,24] [--hidden 4096] [--heads 32,8] [--inter 14336] [--layers 32]
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from graph_timing import graph_us

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,24", help="rows per GEMM (sequences at decode)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", default="32,8", help="query heads, key-value heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--inter", type=int, default=14336, help="MLP width")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--hbm-tb-s", type=float, default=4.24, help="HBM bandwidth for the byte-time column")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_projections.py needs a CUDA GPU (it times CUDA graphs); none is visible here", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    hq, hk = (int(v) for v in args.heads.split(","))
    n, d = args.hidden, args.head_dim
    groups = {"q,k,v": [hq * d, hk * d, hk * d], "gate,up": [args.inter, args.inter]}
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, hidden {n}, {hq}/{hk} heads x {d}, MLP {args.inter}, "
          f"{args.layers} layers' weights per graph")
    print("| group | batch | separate us/layer | fused us/layer | saved us/layer | bytes at HBM us | "
          "max rel diff |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, outs in groups.items():
        fused = [torch.randn(sum(outs), n, generator=g, device="cuda", dtype=dtype) * n ** -0.5
                 for _ in range(args.layers)]
        parts = [list(w.split(outs)) for w in fused]          # views: the same bytes either way
        byte_us = sum(outs) * n * fused[0].element_size() / (args.hbm_tb_s * 1e6)
        for B in [int(v) for v in args.batch.split(",")]:
            x = torch.randn(B, 1, n, generator=g, device="cuda", dtype=dtype)
            with torch.no_grad():
                want = torch.cat([F.linear(x, p) for p in parts[0]], dim=-1)
                got = F.linear(x, fused[0])
                diff = float(((got - want).abs().max() / want.abs().max()).float())
                sep = graph_us(lambda: [F.linear(x, p) for ps in parts for p in ps], 1, args.replays) / args.layers
                one = graph_us(lambda: [F.linear(x, w) for w in fused], 1, args.replays) / args.layers
            print(f"| {name} | {B} | {sep:.2f} | {one:.2f} | {sep - one:.2f} | {byte_us:.2f} | {diff:.1e} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
