"""The hot buffer's LRU ranking on a device: ways to find the k least recent of S slots per head.

A decode step ranks each layer's slots by stamp (int64, unique per head) to pick the victims of
its misses (hot_buffer.HotBufferState._lru): the k smallest, oldest first. This times, per call
on (heads, S) stamps, ``topk(k, largest=False, sorted=True)`` (what the runtime uses),
``sort().indices[:, :k]``, the same on int32 stamps, and ``argmin`` (k = 1), each checked to give
the same slots as topk. CUDA graphs hold each variant (the decode step runs in one), so the
times are of the kernels, not their launches.

    python benchmarks/bench_lru.py [--heads 8] [--slots 4096] [--k 2112,64,1]
"""
from __future__ import annotations

import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--k", default="2112,64,1")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randperm(4 * args.slots, generator=g)[:args.slots] * 1000 for _ in range(args.heads)]
    stamps = torch.stack(rows).to(dev)                     # unique per head, as the runtime's

    def variants(k: int) -> dict:
        out = {"topk sorted": lambda: stamps.topk(k, dim=1, largest=False, sorted=True).indices,
               "sort int64": lambda: stamps.sort(dim=1).indices[:, :k],
               "sort int32": lambda: stamps.to(torch.int32).sort(dim=1).indices[:, :k]}
        if k == 1:
            out["argmin"] = lambda: stamps.argmin(dim=1, keepdim=True)
        return out

    print(f"{args.heads} heads x {args.slots} slots, {dev}")
    print("| k | variant | us per call | same slots as topk |\n|---|---|---:|---|")
    for k in [int(x) for x in args.k.split(",")]:
        want = None
        for name, fn in variants(k).items():
            got = fn()
            want = got if want is None else want
            same = torch.equal(got, want)
            if dev.type == "cuda":
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(args.reps):
                        fn()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                graph.replay()
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                us = 1e3 * start.elapsed_time(end) / args.reps
            else:
                import time
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    fn()
                us = 1e6 * (time.perf_counter() - t0) / args.reps
            print(f"| {k} | {name} | {us:.1f} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
