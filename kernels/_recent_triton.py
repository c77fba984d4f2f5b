"""Triton: a ring of recent rows shifted by one and the new row appended, in one launch (recent.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2


@triton.jit
def _push_kernel(p_held, p_new, R, W, s_hb, s_hr, s_nb, BR: tl.constexpr, BLOCK: tl.constexpr):
    # program (b, column chunk): the chunk's R rows read whole, then written back one row up, the
    # new row last (each program owns its columns: no other program reads what it writes)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    r = tl.arange(0, BR)
    cm = c < W
    src = p_held + b * s_hb + (r[:, None] + 1) * s_hr + c[None, :]
    up = tl.load(src, mask=(r[:, None] + 1 < R) & cm[None, :], other=0.0)
    new = tl.load(p_new + b * s_nb + c, mask=cm, other=0.0).to(tl.float32)
    val = tl.where(r[:, None] == R - 1, new[None, :], up)
    tl.debug_barrier()                 # every thread's reads before any write (rows overlap across threads)
    tl.store(p_held + b * s_hb + r[:, None] * s_hr + c[None, :], val, mask=(r[:, None] < R) & cm[None, :])


def push(held: torch.Tensor, new: torch.Tensor) -> None:
    B, R = held.shape[:2]
    W = held[0, 0].numel()
    h = held.view(B, R, W)
    n = new.reshape(B, W)
    if h.stride(2) != 1 or n.stride(1) != 1:
        raise ValueError("push needs rows with contiguous columns")
    BLOCK = min(next_pow2(W), max(16, 4096 // next_pow2(R)))
    _push_kernel[(B, triton.cdiv(W, BLOCK))](h, n, R, W, h.stride(0), h.stride(1), n.stride(0), BR=next_pow2(R),
                                              BLOCK=BLOCK)
