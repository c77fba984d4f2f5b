"""Triton: a decode step's counters added on the device in one launch (counts.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2


@triton.jit
def _tally_kernel(p_acc, p_counts, p_loaded, p_touched, p_src, p_tail, R, NT, NL, N, row_bytes, tail_bytes,
                  s_counts, HAS_TAIL: tl.constexpr, BR: tl.constexpr, BT: tl.constexpr, BLOCK: tl.constexpr):
    # every program: the bytes of its share of the swap-in rows and its share of the loaded
    # prefetches; program 0 also the per-head counts and the touched tokens (per row). The adds
    # are relaxed: nothing orders them (the totals are read after the launch), and the default
    # acq_rel puts fences around each
    pid = tl.program_id(0)
    o = pid * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    nbytes = tl.sum((tl.load(p_src + o, mask=m, other=-1) >= 0).to(tl.int64), 0) * row_bytes
    if HAS_TAIL:
        nbytes += tl.sum((tl.load(p_tail + o, mask=m, other=-1) >= 0).to(tl.int64), 0) * tail_bytes
    tl.atomic_add(p_acc + 6, nbytes, sem="relaxed")
    tl.atomic_add(p_acc + 5, tl.sum(tl.load(p_loaded + o, mask=o < NL, other=0).to(tl.int64), 0), sem="relaxed")
    if pid == 0:
        r = tl.arange(0, BR)
        rm = r < R
        selected = tl.sum(tl.load(p_counts + r * s_counts, mask=rm, other=0), 0)
        tl.atomic_add(p_acc + 0, selected, sem="relaxed")            # lookups
        tl.atomic_add(p_acc + 1, tl.sum(tl.load(p_counts + r * s_counts + 1, mask=rm, other=0), 0), sem="relaxed")
        tl.atomic_add(p_acc + 2, tl.sum(tl.load(p_counts + r * s_counts + 2, mask=rm, other=0), 0), sem="relaxed")
        tl.atomic_add(p_acc + 3, selected, sem="relaxed")            # every selected token is used
        t = tl.arange(0, BT)
        tl.atomic_add(p_acc + 4, tl.sum(tl.load(p_touched + t, mask=t < NT, other=0).to(tl.int64), 0), sem="relaxed")


def tally(acc: torch.Tensor, counts: torch.Tensor, loaded: torch.Tensor, touched: torch.Tensor,
          src: torch.Tensor, src_tail: torch.Tensor | None, row_bytes: int, tail_bytes: int) -> None:
    R = counts.shape[0]
    N, NL = src.numel(), loaded.numel()
    if counts.stride(1) != 1 or not (loaded.is_contiguous() and touched.is_contiguous() and src.is_contiguous()):
        raise ValueError("tally needs counts with contiguous rows, and loaded, touched and src contiguous")
    tail = src if src_tail is None else src_tail.contiguous()
    BLOCK = min(next_pow2(max(N, NL, 1)), 4096)
    _tally_kernel[(max(1, triton.cdiv(max(N, NL), BLOCK)),)](
        acc, counts, loaded.view(torch.uint8), touched, src, tail, R, touched.numel(), NL, N, row_bytes, tail_bytes,
        counts.stride(0), HAS_TAIL=src_tail is not None, BR=next_pow2(max(R, 1)), BT=next_pow2(touched.numel()),
        BLOCK=BLOCK, num_warps=8)
