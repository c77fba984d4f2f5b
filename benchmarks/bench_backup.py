"""A decode token's backup and a step's K/V swap-in on CUDA: fused launches against separate ones.

HostPool.backup of one token per sequence is one launch (kernels/swap_in.py backup_token: K and
V, their pool rows computed in the kernel) where it was the row arithmetic (2-3 small kernels), an
arange and one gather each for K and V; HostPool.load copies the float tail (quantized pools) or
the rows (unquantized) of K and V in one swap_in_pair launch where it was two gathers. This checks
both paths write the same pool and buffer contents (pinned host pool written and read over UVA,
inside a captured CUDA graph too), then times each inside a CUDA graph (``--reps`` calls per
graph, the per-call time of its replay), as the decode step replays them.

    python benchmarks/bench_backup.py [--batch 8] [--heads 8] [--dim 128] [--block 64] [--reps 200]

Needs a CUDA device (Triton).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
from graph_timing import graph_us

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hi_sparse.host_pool as host_pool  # noqa: E402
from hi_sparse.kernels import swap_in  # noqa: E402


@contextlib.contextmanager
def separate():
    """HostPool as before the fused launches: the backup's torch row arithmetic and one gather
    per tensor, two gathers per load."""
    saved = host_pool.device_path, host_pool.swap_in_pair

    def pair(a, b, rows, dst_a, dst_b, dst_rows):
        swap_in(a, rows, dst_a, dst_rows)
        swap_in(b, rows, dst_b, dst_rows)

    host_pool.device_path, host_pool.swap_in_pair = (lambda *a: False), pair
    try:
        yield
    finally:
        host_pool.device_path, host_pool.swap_in_pair = saved


def make_pool(args, bits):
    pool = host_pool.HostPool(1, args.heads, args.dim, args.block, torch.float16, pin=True, host_kv_bits=bits)
    pool.grow(args.batch * 4, args.batch)
    return pool


def inputs(args, pool, step: int):
    B, H, bs = args.batch, args.heads, args.block
    g = torch.Generator().manual_seed(step)
    tables = torch.stack([torch.randperm(B * 4, generator=g)[:4] for _ in range(B)]).cuda()
    units = pool.tail_units(torch.randperm(B, generator=g).cuda())
    starts = torch.randint(0, 4 * bs, (B,), generator=g)
    starts[0] = bs                                      # the first token of a block
    positions = starts[:, None].expand(B, H).contiguous().cuda()
    k, v = (torch.randn(B, H, 1, args.dim, generator=g).half().cuda() for _ in range(2))
    return tables, units, positions, k, v


def check(args) -> None:
    for bits in (None, 4):
        pools = [make_pool(args, bits) for _ in range(2)]
        for step in range(3):
            tables, units, positions, k, v = inputs(args, pools[0], step)
            for pool, fused in zip(pools, (True, False)):
                with contextlib.nullcontext() if fused else separate():
                    pool.backup(0, tables, units, positions[:, 0], k, v)
            torch.cuda.synchronize()
            for name, t in pools[0].layers[0].items():
                if not torch.equal(t, pools[1].layers[0][name]):
                    raise SystemExit(f"backup bits={bits} step {step}: {name} differs")
        # the load of a graph-captured step: rows of the tail (quantized) or the pool, -1 between
        pool = pools[0]
        n = pool.layers[0]["k_tail" if bits else "k"].shape[0]
        rows = torch.randint(0, n, (257,)).cuda()
        rows[::5] = -1
        dst_rows = torch.randperm(300)[:257].cuda()
        main = torch.full_like(rows, -1) if bits else rows
        tail = rows if bits else None
        outs = []
        for fused in (True, False):
            dk, dv = (torch.full((300, args.dim), float("nan"), dtype=torch.float16, device="cuda") for _ in range(2))
            with contextlib.nullcontext() if fused else separate():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    pool.load(0, main, tail, dk, dv, dst_rows)
                graph.replay()
            outs.append((dk, dv))
        torch.cuda.synchronize()
        for a, b in zip(*outs):
            if not torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)):
                raise SystemExit(f"load bits={bits}: the fused pair differs from two gathers")
    # the backup captured in a graph, replayed with new positions and tokens
    pools = [make_pool(args, 4) for _ in range(2)]
    tables, units, positions, k, v = inputs(args, pools[0], 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pools[0].backup(0, tables, units, positions[:, 0], k, v)
    for step in range(1, 4):
        _, _, p, k2, v2 = inputs(args, pools[0], step)
        positions.copy_(p)
        k.copy_(k2)
        v.copy_(v2)
        graph.replay()
        with separate():
            pools[1].backup(0, tables, units, positions[:, 0], k, v)
    torch.cuda.synchronize()
    for name, t in pools[0].layers[0].items():
        if not torch.equal(t, pools[1].layers[0][name]):
            raise SystemExit(f"a replayed backup differs: {name}")
    print("checks: backup (unquantized, 4-bit), load pair and a replayed backup agree with the separate launches")


def bench(args) -> None:
    print(f"\nB={args.batch} Hkv={args.heads} D={args.dim} block={args.block}: us per call, CUDA graph replay")
    print("| op | pool | separate | fused |\n|---|---|---:|---:|")
    for bits in (None, 4):
        pool = make_pool(args, bits)
        tables, units, positions, k, v = inputs(args, pool, 0)
        n = pool.layers[0]["k_tail" if bits else "k"].shape[0]
        rows = torch.randint(0, n, (args.batch * args.heads * 256,)).cuda()
        rows[::3] = -1
        dst_rows = torch.arange(rows.numel()).cuda()
        main = torch.full_like(rows, -1) if bits else rows
        dk, dv = (torch.empty(rows.numel(), args.dim, dtype=torch.float16, device="cuda") for _ in range(2))
        ops = {"backup": lambda: pool.backup(0, tables, units, positions[:, 0], k, v),
               "load": lambda: pool.load(0, main, rows if bits else None, dk, dv, dst_rows)}
        for name, fn in ops.items():
            with separate():
                before = graph_us(fn, args.reps, replays=5)
            after = graph_us(fn, args.reps, replays=5)
            print(f"| {name} | {'4-bit' if bits else 'fp16'} | {before:.2f} | {after:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_backup: needs a CUDA device")
        return 1
    check(args)
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
