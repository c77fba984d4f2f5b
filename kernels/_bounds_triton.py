"""Triton block bounds (min/max keys per block) and Quest block scores."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2


@triton.jit
def _bounds_kernel(
    p_k, p_kmin, p_kmax, stride_kh, stride_kl, stride_bh, stride_bn, L, D, block_size,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_h = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_min = tl.full([BLOCK_D], float("inf"), tl.float32)
    b_max = tl.full([BLOCK_D], float("-inf"), tl.float32)
    row0 = i_n * block_size
    for t0 in range(0, block_size, BLOCK_T):
        o_row = row0 + t0 + o_t
        m_row = (t0 + o_t < block_size) & (o_row < L)
        m = m_row[:, None] & m_d[None, :]
        b_k = tl.load(p_k + i_h * stride_kh + o_row[:, None] * stride_kl + o_d[None, :], mask=m, other=0.0)
        b_k = b_k.to(tl.float32)
        b_min = tl.minimum(b_min, tl.min(tl.where(m, b_k, float("inf")), 0))
        b_max = tl.maximum(b_max, tl.max(tl.where(m, b_k, float("-inf")), 0))
    o_out = i_h * stride_bh + i_n * stride_bn + o_d
    tl.store(p_kmin + o_out, b_min.to(p_kmin.dtype.element_ty), mask=m_d)
    tl.store(p_kmax + o_out, b_max.to(p_kmax.dtype.element_ty), mask=m_d)


@triton.jit
def _scores_kernel(
    p_q, p_kmin, p_kmax, p_idx, p_blocks, p_out, M, NSUP, D, LIMIT, p_limit, s_lim_o, s_lim_h, HKV, LIMIT_DIV,
    s_lo_r, s_lo_n, s_hi_r, s_hi_n,
    G: tl.constexpr, MODE: tl.constexpr, GROUP: tl.constexpr, BLOCK_NB: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_LIMIT: tl.constexpr,
):
    """Scores of M entries per (batch, KV head) row. MODE 0: blocks 0..M-1 (M = NB); 1: the block
    indices listed in p_idx (M per row); 2: the GROUP blocks of each of the NSUP super-blocks listed
    in p_idx (M = NSUP * GROUP), block numbers also written to p_blocks. Blocks < 0 or >= LIMIT
    score -inf (and are written as -1); ROW_LIMIT: LIMIT is each row's own, ceil(limit / LIMIT_DIV)
    of row (o, h) = divmod(row, HKV) at p_limit + o * s_lim_o + h * s_lim_h."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_nb = tl.program_id(1)
    if ROW_LIMIT:
        LIMIT = tl.load(p_limit + (i_bh // HKV) * s_lim_o + (i_bh % HKV) * s_lim_h)
        LIMIT = (LIMIT + LIMIT_DIV - 1) // LIMIT_DIV
    o_nb = i_nb * BLOCK_NB + tl.arange(0, BLOCK_NB)
    o_d = tl.arange(0, BLOCK_D)
    m_out = o_nb < M
    if MODE == 1:
        o_blk = tl.load(p_idx + i_bh * M + o_nb, mask=m_out, other=-1)
    elif MODE == 2:
        sup = tl.load(p_idx + i_bh * NSUP + o_nb // GROUP, mask=m_out, other=-1)
        o_blk = tl.where(sup >= 0, sup * GROUP + o_nb % GROUP, -1)
    else:
        o_blk = o_nb.to(tl.int64)
    m_nb = m_out & (o_blk >= 0) & (o_blk < LIMIT)
    m = m_nb[:, None] & (o_d < D)[None, :]
    # the bounds through their strides (row, block; D contiguous): a bank's bounds sliced to the
    # blocks in use are read in place (a copy to contiguous rows cost a launch per tensor per step)
    b_lo = tl.load(p_kmin + i_bh * s_lo_r + o_blk[:, None] * s_lo_n + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_hi = tl.load(p_kmax + i_bh * s_hi_r + o_blk[:, None] * s_hi_n + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_best = tl.full([BLOCK_NB], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        b_q = tl.load(p_q + (i_bh * G + g) * D + o_d, mask=o_d < D, other=0.0).to(tl.float32)
        b_s = tl.sum(tl.maximum(b_q[None, :] * b_lo, b_q[None, :] * b_hi), 1)
        b_best = tl.maximum(b_best, b_s)
    b_best = tl.where(m_nb, b_best, float("-inf"))
    tl.store(p_out + i_bh * M + o_nb, b_best, mask=m_out)
    if MODE == 2:
        tl.store(p_blocks + i_bh * M + o_nb, tl.where(m_nb, o_blk, -1), mask=m_out)


def bounds(k: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k (Hkv, L, D) -> kmin, kmax (Hkv, NB, D) in k's dtype."""
    h, length, d = k.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    nb = triton.cdiv(length, block_size)
    kmin = torch.empty(h, nb, d, device=k.device, dtype=k.dtype)
    kmax = torch.empty_like(kmin)
    BLOCK_D = next_pow2(d)
    BLOCK_T = max(1, min(next_pow2(block_size), 4096 // BLOCK_D))
    _bounds_kernel[(h, nb)](k, kmin, kmax, k.stride(0), k.stride(1), kmin.stride(0), kmin.stride(1),
                            length, d, block_size, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=4)
    return kmin, kmax


def _rows_of_blocks(t: torch.Tensor, nb: int, d: int) -> torch.Tensor:
    """(..., NB, D) bounds as (rows, NB, D), a view where the strides allow (D contiguous; a bank's
    bounds sliced to the blocks in use are), else a contiguous copy."""
    v = t.reshape(-1, nb, d)                 # a view where the strides allow one
    return v if v.stride(2) == 1 else v.contiguous()


def scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, blocks: torch.Tensor | None = None,
           limit: int | torch.Tensor | None = None, super_idx: torch.Tensor | None = None, group: int = 1,
           limit_div: int = 1, block_values: int = 4096, num_warps: int = 4):
    """q (..., Hkv, G, D), kmin/kmax (..., Hkv, NB, D) -> (..., Hkv, M) fp32: every block (M = NB),
    the listed `blocks` (..., Hkv, M), or with `super_idx` (..., Hkv, S) the blocks of those
    super-blocks of `group` blocks (M = S * group; returns (blocks, scores) then). Blocks >= limit
    score -inf; a tensor limit broadcastable to (..., Hkv) is each row's, in units of
    ``limit_div`` blocks (rounded up: a super-block's limit from a block limit). Keywords after
    limit_div: benchmark tuning."""
    lead = q.shape[:-2]
    g, d = q.shape[-2:]
    nb = kmin.shape[-2]
    qf = q.reshape(-1, g, d).contiguous()
    lo, hi = (_rows_of_blocks(t, nb, d) for t in (kmin, kmax))
    mode, nsup, idx = 0, 1, None
    if super_idx is not None:
        mode, nsup = 2, super_idx.shape[-1]
        idx = super_idx.reshape(-1, nsup).contiguous()
        m = nsup * group
    elif blocks is not None:
        mode, m = 1, blocks.shape[-1]
        idx = blocks.reshape(-1, m).contiguous()
    else:
        m = nb
    out = torch.empty(lead + (m,), device=q.device, dtype=torch.float32)
    blk = torch.empty(lead + (m,), device=q.device, dtype=torch.int64) if mode == 2 else out
    row_limit = isinstance(limit, torch.Tensor)
    if row_limit:        # a view (B, 1) -> (B, Hkv) with a 0 stride: no copy, no launch
        lim = limit.expand(lead).reshape(-1, lead[-1])
        host_limit, lim_args = 0, (lim, lim.stride(0), lim.stride(1), lead[-1], limit_div)
    else:
        host_limit = nb if limit is None else -(-limit // limit_div)
        lim_args = (out, 0, 0, 1, 1)
    if out.numel():
        BLOCK_D = next_pow2(d)
        BLOCK_NB = max(16, min(256, block_values // BLOCK_D))
        _scores_kernel[(qf.shape[0], triton.cdiv(m, BLOCK_NB))](
            qf, lo, hi, out if idx is None else idx, blk, out, m, nsup, d, host_limit, *lim_args,
            lo.stride(0), lo.stride(1), hi.stride(0), hi.stride(1),
            G=g, MODE=mode, GROUP=group, BLOCK_NB=BLOCK_NB, BLOCK_D=BLOCK_D, ROW_LIMIT=row_limit,
            num_warps=num_warps)
    return (blk, out) if mode == 2 else out


@triton.jit
def _widen_cell(p_lo, p_hi, p_k, p_start, D, cell_size, s_lb, s_lh, s_ln, s_hb, s_hh, s_hn, s_kb, s_kh, b, h,
                BLOCK_D: tl.constexpr):
    # the bounds of the cell (block or super-block) holding row b's new key take it in
    o = tl.arange(0, BLOCK_D)
    m = o < D
    cell = tl.load(p_start + b) // cell_size
    # compared in fp32 (exact for fp16 / bf16 values, and the store gives back the same value)
    k = tl.load(p_k + b * s_kb + h * s_kh + o, mask=m).to(tl.float32)
    lo = p_lo + b * s_lb + h * s_lh + cell * s_ln + o
    hi = p_hi + b * s_hb + h * s_hh + cell * s_hn + o
    new_lo = tl.minimum(tl.load(lo, mask=m).to(tl.float32), k, propagate_nan=tl.PropagateNan.ALL)
    new_hi = tl.maximum(tl.load(hi, mask=m).to(tl.float32), k, propagate_nan=tl.PropagateNan.ALL)
    tl.store(lo, new_lo.to(p_lo.dtype.element_ty), mask=m)
    tl.store(hi, new_hi.to(p_hi.dtype.element_ty), mask=m)


@triton.jit
def _widen_kernel(p_lo, p_hi, p_slo, p_shi, p_k, p_start, D, block_size, group, s_lb, s_lh, s_ln, s_hb, s_hh, s_hn,
                  s_slb, s_slh, s_sln, s_shb, s_shh, s_shn, s_kb, s_kh, BLOCK_D: tl.constexpr):
    # program (b, h, level): level 0 widens the key's block, level 1 its super-block (one launch)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    if tl.program_id(2) == 0:
        _widen_cell(p_lo, p_hi, p_k, p_start, D, block_size, s_lb, s_lh, s_ln, s_hb, s_hh, s_hn, s_kb, s_kh, b, h,
                    BLOCK_D)
    else:
        _widen_cell(p_slo, p_shi, p_k, p_start, D, block_size * group, s_slb, s_slh, s_sln, s_shb, s_shh, s_shn,
                    s_kb, s_kh, b, h, BLOCK_D)


def widen(kmin, kmax, smin, smax, k, start, block_size: int, group: int) -> None:
    B, H, _, D = k.shape
    for t in (kmin, kmax, smin, smax, k):
        if t.stride(-1) != 1:
            raise ValueError("bounds and keys need contiguous last dims")
    start = start.contiguous()
    _widen_kernel[(B, H, 2)](kmin, kmax, smin, smax, k, start, D, block_size, group, kmin.stride(0), kmin.stride(1),
                             kmin.stride(2), kmax.stride(0), kmax.stride(1), kmax.stride(2), smin.stride(0),
                             smin.stride(1), smin.stride(2), smax.stride(0), smax.stride(1), smax.stride(2),
                             k.stride(0), k.stride(1), BLOCK_D=next_pow2(D))
