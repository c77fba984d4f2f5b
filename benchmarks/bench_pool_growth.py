"""Host time of a host pool's growth in place (HostPool.grow: 32 layers, 16 blocks more, 4-bit),
with its views made in the growth or made ahead by the lock-ahead job (Space.make_ready). On a GPU
the growth runs in a decode step. Here, on the CPU, the page registrations are left out (no
cudaHostRegister without a GPU): the job runs on the CPU, and only the host work is timed.

    python benchmarks/bench_pool_growth.py [--layers 32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hi_sparse import host_pool, pinned
from hi_sparse.host_pool import HostPool


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    # a pinned pool's path without a GPU: no registrations, the locker on the CPU
    pinned._register = lambda ptr, size: None
    pinned._unpin_all = lambda ranges: None
    host_pool.pin = lambda t: None
    torch.cuda.current_device = lambda: 0
    host_pool.lock_ahead = lambda todo, dev, replaces=None: pinned.lock_ahead(todo, torch.device("cpu"), replaces)
    for ahead in (False, True):
        times = []
        for _ in range(args.repeats):
            hp = HostPool(args.layers, 8, 128, 64, torch.bfloat16, pin=True, host_kv_bits=4)
            hp.before_grow = lambda: None                 # as the engine's: the growth checks for a move
            hp.grow(blocks=16, tails=4)
            if ahead:
                hp.lock_ahead(32)
                hp.locking.result()
            t0 = time.perf_counter()
            hp.grow(blocks=32)
            times.append(time.perf_counter() - t0)
        print(f"{args.layers} layers, 16 -> 32 blocks, views made {'ahead' if ahead else 'in the growth'}: "
              f"{statistics.median(times) * 1e3:.2f} ms (median of {args.repeats}, the fastest "
              f"{min(times) * 1e3:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
