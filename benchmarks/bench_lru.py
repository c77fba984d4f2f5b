"""The hot buffer's LRU ranking on a device: ways to find the k least recent of S slots per head.

A decode step ranks each layer's slots by stamp (int64, unique per head) to pick the victims of
its misses (hot_buffer.HotBufferState._lru): the k smallest, oldest first. This times, per call
on (heads, S) stamps, ``topk(k, largest=False, sorted=True)`` (what the runtime uses),
``sort().indices[:, :k]``, the same on int32 stamps, one Triton program per head sorting packed
stamp and slot keys (``lru_order``, on a GPU), and ``argmin`` (k = 1), each checked to give
the same slots as topk. CUDA graphs hold each variant (the decode step runs in one), so the
times are of the kernels, not their launches. Then a decode step's append of one token per head
(rows = batch x KV heads): the least recent slot by ``argmin`` and the install kernel, against
the one-launch ``insert_one`` kernel (hot_buffer.HotBufferState.insert on CUDA). On a GPU also
the lookup's ranking taken from the bank's kept order (``ranked``) against the sort, and a decode
step's lookup and prefetch in one launch (``lru_step``) against the four kernels of the two calls.

    python benchmarks/bench_lru.py [--heads 8,192] [--slots 4096] [--k 2112,64,1] [--append-rows 8,192]
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from graph_timing import graph_us

from hi_sparse.kernels._launch import next_pow2


# One Triton program per head sorting all S packed keys: slower than torch's radix sort on an H200
# (84 us against 38 at 8 x 4,096, docs/BENCHMARKS.md), kept here as the measured alternative
@triton.jit
def _order_kernel(p_stamp, p_order, S, W, s_stamp, s_order, LOG_S: tl.constexpr, BLOCK: tl.constexpr):
    # one program per head: the slots of the W smallest stamps, oldest first. Stamps are unique per
    # head, so (stamp - the head's least) << LOG_S | slot sorts as the stamps do (exact while a
    # head's stamps span < 2**(63 - LOG_S) ticks: ~2e15 at 4,096 slots), and its low bits are the slot
    h = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < S
    stamp = tl.load(p_stamp + h * s_stamp + o, mask=m, other=0)
    least = tl.min(tl.where(m, stamp, (1 << 62)), 0)
    key = tl.where(m, ((stamp - least) << LOG_S) | o.to(tl.int64), 0x7FFFFFFFFFFFFFFF)
    key = tl.sort(key, 0)
    tl.store(p_order + h * s_order + o, key & ((1 << LOG_S) - 1), mask=o < W)


def lru_order(stamp: torch.Tensor, width: int) -> torch.Tensor:
    """Slots (H, width) of the ``width`` smallest of each row's stamps (H, S), unique per row,
    oldest first: ``stamp.sort(dim=1).indices[:, :width]`` in one launch."""
    H, S = stamp.shape
    order = torch.empty(H, width, dtype=torch.int64, device=stamp.device)
    BLOCK = next_pow2(S)
    _order_kernel[(H,)](stamp, order, S, width, stamp.stride(0), order.stride(0),
                        LOG_S=max(1, (BLOCK - 1).bit_length()), BLOCK=BLOCK, num_warps=8 if BLOCK > 2048 else 4)
    return order


def variants(stamps: torch.Tensor, k: int) -> dict:
    out = {"topk sorted": lambda: stamps.topk(k, dim=1, largest=False, sorted=True).indices,
           "sort int64": lambda: stamps.sort(dim=1).indices[:, :k],
           "sort int32": lambda: stamps.to(torch.int32).sort(dim=1).indices[:, :k]}
    if stamps.is_cuda:
        out["triton sort (lru_order)"] = lambda: lru_order(stamps, k)
    if k == 1:
        out["argmin"] = lambda: stamps.argmin(dim=1, keepdim=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="8", help="heads (batch x KV heads), comma-separated")
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--k", default="2112,64,1")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--append-rows", default="8,192", help="rows (batch x KV heads) of the append's timing")
    args = ap.parse_args()
    dev = torch.device(args.device)
    g = torch.Generator().manual_seed(0)

    def timed(fn) -> float:
        """Microseconds per call: in a CUDA graph of --reps calls on a GPU, a plain loop on a CPU."""
        if dev.type != "cuda":
            import time
            t0 = time.perf_counter()
            for _ in range(args.reps):
                fn()
            return 1e6 * (time.perf_counter() - t0) / args.reps
        return graph_us(fn, args.reps)

    for heads in [int(x) for x in args.heads.split(",")]:
        rows = [torch.randperm(4 * args.slots, generator=g)[:args.slots] * 1000 for _ in range(heads)]
        stamps = torch.stack(rows).to(dev)                     # unique per head, as the runtime's
        print(f"\n{heads} heads x {args.slots} slots, {dev}")
        print("| k | variant | us per call | same slots as topk |\n|---|---|---:|---|")
        for k in [int(x) for x in args.k.split(",")]:
            want = None
            for name, fn in variants(stamps, k).items():
                got = fn()
                want = got if want is None else want
                same = torch.equal(got, want)
                us = timed(fn)
                print(f"| {k} | {name} | {us:.1f} | {same} |", flush=True)
    if dev.type == "cuda":
        kept_order(args, g, dev, timed)
        append(args, dev, timed)
        lookup_prefetch(args, g, dev, timed)
    return 0


def kept_order(args, g: torch.Generator, dev: torch.device, timed) -> None:
    """The lookup's ranking from the bank's kept LRU order (kernels/_lru_triton.py ``ranked``: the
    order without the hits, then the hits; no sort) against sorting the stamps, after a lookup
    stamped half of its K selected tokens' slots as hits; checked equal to the sort."""
    from hi_sparse.kernels._lru_triton import ranked
    K = min(2064, args.slots // 2)
    print("\n| heads | ranking after a lookup (S 4,096, K 2,064, half hits) | us per call | same as the sort |\n"
          "|---|---|---:|---|")
    for heads in [int(x) for x in args.heads.split(",")]:
        S = args.slots
        stamps = torch.stack([torch.randperm(4 * S, generator=g)[:S] for _ in range(heads)]).to(torch.int32)
        order = stamps.argsort(dim=1).to(torch.int32)
        clock = int(stamps.max()) + 1
        slot = torch.full((heads, K), -1, dtype=torch.int64)
        for h in range(heads):
            hits = torch.randperm(S, generator=g)[:K // 2]
            at = torch.randperm(K, generator=g)[:K // 2].sort().values
            slot[h, at] = hits
            stamps[h, hits] = (clock + K + at).to(torch.int32)
        stamps, order, slot = stamps.to(dev), order.to(dev), slot.to(dev)
        clock_t = torch.tensor(clock, device=dev)
        want = stamps.sort(dim=1).indices
        same = torch.equal(ranked(order, stamps, slot, clock_t), want)
        for name, fn in (("sort of the int32 stamps", lambda: stamps.sort(dim=1).indices),
                         ("kept order (ranked)", lambda: ranked(order, stamps, slot, clock_t))):
            print(f"| {heads} | {name} | {timed(fn):.1f} | {same} |", flush=True)


def append(args, dev: torch.device, timed) -> None:
    """One token per row into a full hot buffer: argmin + install (two launches) against insert_one."""
    from hi_sparse.hot_buffer import HotBufferBank, ticks
    from hi_sparse.kernels.lru import insert_one_triton, install_slots

    print("\n| rows (batch x KV heads) | append of one token | us per call |\n|---|---|---:|")
    for rows in [int(x) for x in args.append_rows.split(",")]:
        bank = HotBufferBank(rows, args.slots, dev, rows=1, kernels=True)
        hb = bank.rows(0)
        hb.ensure_tokens(2 * args.slots)
        hb.insert(torch.arange(args.slots, device=dev), bank.reserve(ticks(inserted=args.slots)))
        tok = torch.full((rows, 1), args.slots, device=dev)
        clock = torch.tensor(bank.reserve(1), device=dev)

        def two_launches():
            victims = hb.slot_stamp.argmin(dim=1, keepdim=True)
            install_slots(hb.token_slot_s, hb.slot_token_s, hb.slot_stamp_s, hb.prefetched_s, None, tok, victims,
                          clock.expand(rows, 1), False)

        def one_launch():
            insert_one_triton(tok, hb.token_slot_s, hb.slot_token_s, hb.slot_stamp_s, hb.prefetched_s, clock,
                              args.slots)
        for name, fn in (("argmin + install", two_launches), ("insert_one", one_launch)):
            print(f"| {rows} | {name} | {timed(fn):.1f} |", flush=True)



def lookup_prefetch(args, g: torch.Generator, dev: torch.device, timed) -> None:
    """A decode step's lookup of K = 2,048 selected tokens (half of them resident) and the
    prefetch of P = 80 after it, on full hot buffers of 4,096 slots a head: one launch
    (``HotBufferState.lookup_prefetch``, the ``lru_step`` kernel) against the two calls' four
    (hits, ranked, install, prefetch). Each call first restores the state (five copies); the
    restore alone is timed too and taken off. Checked: both leave the same state."""
    from hi_sparse.hot_buffer import HotBufferBank, ticks

    S = args.slots
    K, P = min(2048, S // 2), 80
    print(f"\n| heads | a decode step's lookup ({K}, half resident) and prefetch ({P}) | us per call | "
          "same state |\n|---|---|---:|---|")
    for heads in [int(x) for x in args.heads.split(",")]:
        bank = HotBufferBank(heads, S, dev, rows=1, kernels=True)
        hb = bank.rows(0)
        hb.ensure_tokens(4 * S)
        hb.insert(torch.arange(S, device=dev), bank.reserve(ticks(inserted=S)))
        bank.sync_order()
        sel = torch.stack([torch.cat((torch.randperm(S, generator=g)[:K // 2],
                                      S + torch.randperm(2 * S, generator=g)[:K - K // 2]))
                           [torch.randperm(K, generator=g)] for _ in range(heads)]).to(dev)
        pre = (3 * S + torch.arange(P)).expand(heads, P).contiguous().to(dev)
        clock = torch.tensor(bank.reserve(ticks(selected=K, prefetched=P)), device=dev)
        state = bank.buffers()
        saved = [t.clone() for t in state]

        def restore():
            for t, s0 in zip(state, saved):
                t.copy_(s0)

        def one_launch():
            restore()
            hb.lookup_prefetch(sel, pre, clock)

        def four_launches():
            restore()
            hb.lookup(sel, clock, P)
            hb.prefetch(pre)

        ends = []
        for fn in (one_launch, four_launches):
            fn()
            ends.append([t.clone() for t in state])
        same = all(torch.equal(a, b) for a, b in zip(*ends))
        base = timed(restore)
        for name, fn in (("lru_step (one launch)", one_launch), ("lookup + prefetch (four launches)", four_launches)):
            print(f"| {heads} | {name} | {timed(fn) - base:.1f} | {same} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
