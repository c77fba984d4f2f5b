"""The seal after a planned decode step whose tokens complete blocks (issue 21), on a GPU with a
pinned quantized pool (4-bit by default): ``seal_tails`` of B blocks at every layer op by op (~80 launches a layer)
against the same seal replayed from its CUDA graph (host_seal.SealGraph): host time of the call,
device time (CUDA events), and the capture's host time once. ``--room`` pads the graph for a
larger batch than the blocks sealed (a batch whose sequences are at different offsets).

    python benchmarks/bench_seal_graph.py --batch 24 --layers 32 [--group-mib 1,32,128] [--streams 1,4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hi_sparse import host_seal
from hi_sparse.host_pool import HostPool
from hi_sparse.host_seal import SealGraph


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=24, help="blocks sealed (one per sequence)")
    ap.add_argument("--room", type=int, default=0, help="the graph's room in blocks (default: --batch)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=512, help="pool blocks")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--bits", default="4", help="host_kv_bits: 4, 5, 6, 8, auto or budget (seed seals op by op)")
    ap.add_argument("--streams", default="1,4", help="comma list: streams the graph spreads the layers over "
                                                     "(host_seal.SealGraph.STREAMS; the first is the default's row)")
    ap.add_argument("--group-mib", default="32", help="comma list: MiB of float keys and values the graph seals "
                    "together (host_seal.GROUP_BYTES; 1: a layer a group at the default shape), each with every "
                    "--streams")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_seal_graph.py needs an NVIDIA GPU (the seal graph is CUDA only)")
    dev = torch.device("cuda")
    B, L, H, D, bs = args.batch, args.layers, args.kv_heads, args.head_dim, args.block_size
    room = max(args.room, B)
    bits = int(args.bits) if args.bits.isdigit() else args.bits
    pool = HostPool(L, H, D, bs, torch.bfloat16, pin=True, host_kv_bits=bits)
    pool.grow(blocks=args.blocks, tails=B)
    g = torch.Generator(device=dev).manual_seed(0)
    for layer in range(L):                         # every tail full: B blocks to seal
        k = torch.randn(B, H, bs, D, generator=g, device=dev).to(torch.bfloat16)
        pool.backup(layer, torch.arange(B, device=dev)[:, None], pool.tail_units(torch.arange(B)).to(dev),
                    torch.zeros(B, dtype=torch.long, device=dev), k, k.flip(-1))
    torch.cuda.synchronize()
    items = [(int(b), int(b)) for b in range(B)]

    def timed(graphs: bool) -> tuple[float, float]:
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        e0.record()
        pool.seal_tails(items, dev, graphs=graphs, room=room)
        e1.record()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        return 1e3 * host, e0.elapsed_time(e1)

    print(f"seal of {B} blocks (room {room}) x {L} layers, {H} KV heads x {D}, {bs}-token blocks, host_kv_bits={bits} "
          "pinned pool, "
          f"{torch.cuda.get_device_name()}: median of {args.repeats}")
    timed(False)                                   # warm: kernels compiled
    runs = [timed(False) for _ in range(args.repeats)]
    print(f"  {'op by op':30s} host {statistics.median(r[0] for r in runs):8.3f} ms   "
          f"device {statistics.median(r[1] for r in runs):7.3f} ms")
    for mib, streams in ((int(m), int(x)) for m in args.group_mib.split(",") for x in args.streams.split(",")):
        host_seal.GROUP_BYTES, SealGraph.STREAMS = mib << 20, streams
        pool._seal_graphs.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pool.ready_seal(room, dev)
        capture_ms = 1e3 * (time.perf_counter() - t0)
        assert "failed" not in pool._seal_graphs, "the capture failed (see the warning)"
        timed(True)
        runs = [timed(True) for _ in range(args.repeats)]
        label = f"graph, {mib} MiB, {streams} stream(s)"
        print(f"  {label:30s} host {statistics.median(r[0] for r in runs):8.3f} ms   "
              f"device {statistics.median(r[1] for r in runs):7.3f} ms   (capture: host {capture_ms:.1f} ms, once per "
              "batch size and pool layout)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
