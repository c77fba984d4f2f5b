"""Host time of a host pool's growth in place (HostPool.grow: 32 layers, 4-bit, from --blocks
blocks by the storage's geometric step), with its views made in the growth or made ahead by the
lock-ahead job (Space.make_ready); and how many chunks that job registers. On a GPU the growth
runs in a decode step. Here, on the CPU, the page registrations are counted, not made (no
cudaHostRegister without a GPU): the job runs on the CPU, and only the host work is timed.

    python benchmarks/bench_pool_growth.py [--layers 32] [--blocks 16] [--repeats 15]

--blocks 16 is a 1,000-token prompt at batch 1; 384 the same at batch 24.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hi_sparse import host_pool, pinned
from hi_sparse.host_pool import HostPool
from hi_sparse.storage import _growth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16, help="blocks before the growth (a prompt's)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    grown = args.blocks + _growth(args.blocks)
    # a pinned pool's path without a GPU: registrations counted, the locker on the CPU
    chunks: list[int] = []
    pinned._register = lambda ptr, size: chunks.append(size)
    pinned._unpin_all = lambda ranges: None
    host_pool.pin = lambda t: None
    torch.cuda.current_device = lambda: 0
    host_pool.lock_ahead = lambda todo, dev, replaces=None: pinned.lock_ahead(todo, torch.device("cpu"), replaces)
    for ahead in (False, True):
        times = []
        for _ in range(args.repeats):
            hp = HostPool(args.layers, 8, 128, 64, torch.bfloat16, pin=True, host_kv_bits=4)
            hp.before_grow = lambda: None                 # as the engine's: the growth checks for a move
            hp.grow(blocks=args.blocks, tails=4)
            chunks.clear()
            if ahead:
                hp.lock_ahead(grown)
                hp.locking.result()
            t0 = time.perf_counter()
            hp.grow(blocks=grown)
            times.append(time.perf_counter() - t0)
        made = "ahead" if ahead else "in the growth"
        print(f"{args.layers} layers, {args.blocks} -> {grown} blocks, views made {made}: "
              f"{statistics.median(times) * 1e3:.2f} ms (median of {args.repeats}, the fastest "
              f"{min(times) * 1e3:.2f} ms); {'the job' if ahead else 'the growth'} registered {len(chunks)} "
              f"ranges ({sum(chunks) / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
