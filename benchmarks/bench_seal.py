"""The seal step of a batch decoding in lockstep (issue 21): every sequence's token completes its
block on the same step, so each layer seals B blocks. One seal per sequence against
``HostPool.seal_many`` (one tail gather, one width choice and quantization per width), on the
CPU reference path (the GPU runs the Triton kernels; fewer launches there too).

    python benchmarks/bench_seal.py --batch 24
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hi_sparse.host_pool import HostPool


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--bits", default="4", help="host_kv_bits: 4, 5, 6, 8 or auto")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    B, H, D, bs = args.batch, args.kv_heads, args.head_dim, args.block_size
    bits = args.bits if args.bits == "auto" else int(args.bits)
    hp = HostPool(1, H, D, bs, torch.bfloat16, pin=False, host_kv_bits=bits)
    hp.grow(blocks=2 * B, tails=B)
    tables = [torch.tensor([2 * b, 2 * b + 1]) for b in range(B)]
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B, H, bs, D, generator=g).bfloat16()
    v = torch.randn(B, H, bs, D, generator=g).bfloat16()
    for b in range(B):          # every sequence holds bs - 1 tokens in its tail: the next one seals
        hp.backup(0, tables[b][None], hp.tail_units(torch.tensor([b])), torch.tensor([0]), k[None, b, :, :bs - 1],
                  v[None, b, :, :bs - 1])
    items = [(tables[b], b, bs - 1, k[b, :, bs - 1:], v[b, :, bs - 1:]) for b in range(B)]
    for name, run in (("one seal per sequence", lambda: [hp.seal(0, *it) for it in items]),
                      ("seal_many", lambda: hp.seal_many(0, items))):
        run()
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        print(f"{name}: {1e3 * statistics.median(times):.1f} ms per layer ({B} sequences, {H} KV heads x {D}, "
              f"{bs}-token blocks, host_kv_bits={bits}; median of {args.repeats})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
