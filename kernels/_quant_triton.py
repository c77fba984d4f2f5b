"""Triton block quantize (whole-word, two-pass and relay kernels; a general one for any D) and row dequantize.

The dequantize kernel serves both `dequantize_blocks` (rows in order) and the fused
`swap_in_dequant` (rows gathered through index tensors, source possibly pinned host memory);
`swap_in_dequant_pair` runs the words kernel's programs for a layer's keys and values in one launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2, on_device
from .quant import PARAM_DTYPES, param_shape


@triton.jit
def _pair_of(lo, hi, BITS: tl.constexpr, PARAM_DTYPE: tl.constexpr):
    """(scale, zero) of groups with minimum lo and maximum hi, rounded to the storage dtype and
    back to fp32 (quant.quant_params: codes are computed against the stored pair)."""
    zero = lo.to(PARAM_DTYPE).to(tl.float32)
    scale = (tl.maximum(hi - zero, 0.0) / ((1 << BITS) - 1)).to(PARAM_DTYPE).to(tl.float32)
    return scale, zero


@triton.jit
def _inverse(scale):
    """Exact reciprocal of each scale, 0 where the scale is 0 (codes then cost a multiply)."""
    return tl.where(scale > 0, tl.math.div_rn(1.0, tl.where(scale > 0, scale, 1.0)), 0.0)


# ~65 lines on purpose: two passes over one block in one program (the second needs the first's
# pairs, behind a barrier), with the three layouts' pair folds side by side.
@triton.jit
def _quantize_kernel(
    p_x, p_packed, p_scale, p_zero, T, D, P,
    BITS: tl.constexpr, SPAN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    LAYOUT: tl.constexpr,
):
    """Any D, one program per block. Pass 1 folds the min / max of the layout's groups (the block,
    each column, each row) and stores their pairs; pass 2 packs byte by byte, reading a code's
    pair back (a column's or a row's is indexed by the code) after a barrier."""
    i_n = tl.program_id(0).to(tl.int64)
    p_xn = p_x + i_n * T * D
    o_t = tl.arange(0, BLOCK_T)
    o_d = tl.arange(0, BLOCK_D)
    b_lo = tl.full([BLOCK_T, BLOCK_D], float("inf"), tl.float32)
    b_hi = tl.full([BLOCK_T, BLOCK_D], float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        m = ((t0 + o_t) < T)[:, None] & (o_d < D)[None, :]
        b_x = tl.load(p_xn + (t0 + o_t)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        if LAYOUT == 2:       # token: each row's pair, from this tile alone
            scale, zero = _pair_of(tl.min(tl.where(m, b_x, float("inf")), 1),
                                   tl.max(tl.where(m, b_x, float("-inf")), 1), BITS, p_scale.dtype.element_ty)
            tl.store(p_scale + i_n * T + t0 + o_t, scale.to(p_scale.dtype.element_ty), mask=(t0 + o_t) < T)
            tl.store(p_zero + i_n * T + t0 + o_t, zero.to(p_zero.dtype.element_ty), mask=(t0 + o_t) < T)
        b_lo = tl.minimum(b_lo, tl.where(m, b_x, float("inf")))
        b_hi = tl.maximum(b_hi, tl.where(m, b_x, float("-inf")))
    if LAYOUT == 0:           # block: one pair, kept in registers
        lo = tl.min(tl.min(b_lo, 1), 0)
        hi = tl.max(tl.max(b_hi, 1), 0)
        scale, zero = _pair_of(lo, hi, BITS, tl.float32)
        tl.store(p_scale + i_n, scale)
        tl.store(p_zero + i_n, zero)
        inv = _inverse(scale)
    elif LAYOUT == 1:         # channel: a pair per column
        scale, zero = _pair_of(tl.min(b_lo, 0), tl.max(b_hi, 0), BITS, p_scale.dtype.element_ty)
        tl.store(p_scale + i_n * D + o_d, scale.to(p_scale.dtype.element_ty), mask=o_d < D)
        tl.store(p_zero + i_n * D + o_d, zero.to(p_zero.dtype.element_ty), mask=o_d < D)
    tl.debug_barrier()        # pass 2 reads the pairs other threads stored
    # pass 2 (the block is still in L2): byte p of a row holds stream bits [8p, 8p+8), touched by
    # at most SPAN codes starting at code 8p // BITS
    o_p = tl.arange(0, BLOCK_P)
    j0 = (o_p * 8) // BITS
    p_out = p_packed + i_n * T * P
    for t0 in range(0, T, BLOCK_T):
        m_t = (t0 + o_t) < T
        b_byte = tl.zeros([BLOCK_T, BLOCK_P], tl.int32)
        for s in tl.static_range(SPAN):
            j = j0 + s
            shift = j * BITS - o_p * 8          # code's bit 0 relative to the byte's bit 0
            m_j = (j < D) & (shift < 8) & (o_p < P)
            m = m_t[:, None] & m_j[None, :]
            b_x = tl.load(p_xn + (t0 + o_t)[:, None] * D + j[None, :], mask=m, other=0.0).to(tl.float32)
            if LAYOUT == 1:
                b_s = tl.load(p_scale + i_n * D + j, mask=m_j, other=0.0).to(tl.float32)[None, :]
                b_z = tl.load(p_zero + i_n * D + j, mask=m_j, other=0.0).to(tl.float32)[None, :]
                b_c = _codes(b_x, b_z, _inverse(b_s), BITS)
            elif LAYOUT == 2:
                b_s = tl.load(p_scale + i_n * T + t0 + o_t, mask=m_t, other=0.0).to(tl.float32)[:, None]
                b_z = tl.load(p_zero + i_n * T + t0 + o_t, mask=m_t, other=0.0).to(tl.float32)[:, None]
                b_c = _codes(b_x, b_z, _inverse(b_s), BITS)
            else:
                b_c = _codes(b_x, zero, inv, BITS)
            left = tl.maximum(shift, 0)[None, :]
            right = tl.maximum(-shift, 0)[None, :]
            b_part = tl.where(shift[None, :] >= 0, b_c << left, b_c >> right) & 0xFF
            b_byte = b_byte | tl.where(m, b_part, 0)
        m_o = m_t[:, None] & (o_p < P)[None, :]
        tl.store(p_out + (t0 + o_t)[:, None] * P + o_p[None, :], b_byte.to(tl.uint8), mask=m_o)


@triton.jit
def _gathered_rows(p_src_rows, p_dst_rows, o_m, m_m, GATHER: tl.constexpr):
    """Source and destination rows (int64) of rows ``o_m`` and the row mask (a gathered source
    row of -1 is skipped)."""
    if GATHER:
        o_src = tl.load(p_src_rows + o_m, mask=m_m, other=0).to(tl.int64)
        m_m = m_m & (o_src >= 0)
        o_dst = tl.load(p_dst_rows + o_m, mask=m_m, other=0).to(tl.int64)
    else:
        o_src = o_m.to(tl.int64)
        o_dst = o_m.to(tl.int64)
    return o_src, o_dst, m_m


@triton.jit
def _pair_at(p_scale, p_zero, o_src, o_blk, m_m, cols, m, D, LAYOUT: tl.constexpr):
    """fp32 scale and zero of the values at rows o_src (blocks o_blk, valid m_m: row-shaped, with
    trailing singleton dims) and columns ``cols`` (mask m: the values' shape): the block's pair,
    the row's (token) or the column's of the block (channel). A channel pair is loaded once for
    the lowest block of the program's rows and per row only for rows of other blocks (block runs
    are what selection swaps in: their pairs cost one read; reading the first row's block instead,
    without the reduction, measured no faster: docs/BENCHMARKS.md)."""
    if LAYOUT == 1:
        blk0 = tl.min(tl.where(m_m, o_blk, 1 << 62))
        # (blk0 broadcast as a tensor: the interpreter rejects a scalar mask combined with a tensor)
        m_0 = (cols < D) & (cols * 0 + blk0 < (1 << 62))
        own = m & (o_blk != blk0)
        s0 = tl.load(p_scale + blk0 * D + cols, mask=m_0, other=0.0)
        z0 = tl.load(p_zero + blk0 * D + cols, mask=m_0, other=0.0)
        b_s = tl.where(o_blk == blk0, s0, tl.load(p_scale + o_blk * D + cols, mask=own, other=0.0))
        b_z = tl.where(o_blk == blk0, z0, tl.load(p_zero + o_blk * D + cols, mask=own, other=0.0))
    elif LAYOUT == 2:
        b_s = tl.load(p_scale + o_src, mask=m_m, other=0.0)
        b_z = tl.load(p_zero + o_src, mask=m_m, other=0.0)
    else:
        b_s = tl.load(p_scale + o_blk, mask=m_m, other=0.0)
        b_z = tl.load(p_zero + o_blk, mask=m_m, other=0.0)
    return b_s.to(tl.float32), b_z.to(tl.float32)


@triton.jit
def _dequant_rows_kernel(
    p_packed, p_scale, p_zero, p_src_rows, p_dst, p_dst_rows, M, D, P, rows_per_block,
    stride_src, stride_dst,
    BITS: tl.constexpr, GATHER: tl.constexpr, LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_d = tl.program_id(1)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_src, o_dst, m_m = _gathered_rows(p_src_rows, p_dst_rows, o_m, o_m < M, GATHER)
    if tl.max(m_m.to(tl.int32), 0) > 0:     # rows that all copy nothing (a decode step's hits) stop here
        o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
        m_d = o_d < D
        o_bit = o_d * BITS
        o_byte = o_bit // 8
        b_off = (o_bit % 8)[None, :]
        p_row = p_packed + o_src[:, None] * stride_src
        m = m_m[:, None] & m_d[None, :]
        b_v = tl.load(p_row + o_byte[None, :], mask=m, other=0).to(tl.int32)
        if BITS != 8:
            # a code may straddle into the next byte (never further for BITS <= 8)
            m_hi = m & ((o_byte + 1) < P)[None, :] & (b_off + BITS > 8)
            b_hi = tl.load(p_row + (o_byte + 1)[None, :], mask=m_hi, other=0).to(tl.int32)
            b_v = ((b_v | (b_hi << 8)) >> b_off) & ((1 << BITS) - 1)
        b_s, b_z = _pair_at(p_scale, p_zero, o_src[:, None], (o_src // rows_per_block)[:, None], m_m[:, None],
                            o_d[None, :], m, D, LAYOUT)
        b_x = b_v.to(tl.float32) * b_s + b_z
        tl.store(p_dst + o_dst[:, None] * stride_dst + o_d[None, :], b_x.to(p_dst.dtype.element_ty), mask=m)


@triton.jit
def _load_units(p_xn, o_t, T, D, U: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr,
                LOAD2D: tl.constexpr):
    """Rows o_t of the (T, D) block at p_xn (D % U == 0) as fp32 units of U consecutive values:
    ((BLOCK_T, BLOCK_U, U) values, 0 where masked; (BLOCK_T, BLOCK_U) mask of valid units).

    LOAD2D: load a (BLOCK_T, BLOCK_U * U) tile of whole rows and reshape it (coalesced; the
    directly indexed three-dimensional tile, LOAD2D False, reads sectors twice: docs/BENCHMARKS.md).
    """
    o_u = tl.arange(0, BLOCK_U)
    m = (o_t < T)[:, None] & (o_u < D // U)[None, :]
    if LOAD2D:
        o_d = tl.arange(0, BLOCK_U * U)
        m2 = (o_t < T)[:, None] & (o_d < D)[None, :]
        b_x = tl.reshape(tl.load(p_xn + o_t[:, None] * D + o_d[None, :], mask=m2, other=0.0),
                         [BLOCK_T, BLOCK_U, U])
    else:
        o_v = o_u[None, :, None] * U + tl.arange(0, U)[None, None, :]
        b_x = tl.load(p_xn + o_t[:, None, None] * D + o_v, mask=m[:, :, None], other=0.0)
    return b_x.to(tl.float32), m


@triton.jit
def _tile_min_max(b_x, m):
    """Min and max of a (T, U-units, U) tile over its valid units (mask m: (T, U-units))."""
    lo = tl.min(tl.min(tl.min(tl.where(m[:, :, None], b_x, float("inf")), 2), 1), 0)
    hi = tl.max(tl.max(tl.max(tl.where(m[:, :, None], b_x, float("-inf")), 2), 1), 0)
    return lo, hi


@triton.jit
def _pack_with(b_x, lo, hi, p_packed, p_scale, p_zero, i_n, i_t, o_t, T, D, P, BITS: tl.constexpr,
               WORDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """Pack b_x, rows o_t (tile i_t) of block i_n as loaded by _load_units with U = 8 (D % 8 == 0:
    8 codes make exactly BITS bytes, stored as in _store_groups), the block's min and max known;
    tile 0 also writes the block's scale and zero point."""
    inv = _block_params(p_scale, p_zero, i_n, lo, hi, BITS, i_t == 0)
    _store_groups(_codes(b_x, lo, inv, BITS), p_packed + i_n * T * P, o_t, o_t < T, D // 8, P, BITS,
                  BLOCK_T, BLOCK_G, WORDS)


@triton.jit
def _quantize_relay_kernel(
    p_x, p_part, p_packed, p_scale, p_zero, N, T, D, P, C, LAG,
    BITS: tl.constexpr, WORDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    LOAD2D: tl.constexpr, EMPTY: tl.constexpr,
):
    """Quantize reading the input from HBM once (D % 8 == 0): program k = n * C + i (grid
    (N + LAG) * C) publishes the min / max of row tile i of block n, then packs row tile i of
    block n - LAG once all C tiles of that block are published; that tile was read by program
    k - LAG * C a little before and comes from L2.

    A tile's min and max are one 64-bit word of p_part (N, C) int64 (max's bits high, min's low),
    filled with EMPTY (min +inf, max -inf: no tile gives it) before the launch. The packing
    program polls its block's C words until none is EMPTY: the data is its own flag (a 64-bit
    store is seen whole or not at all), so no counter and no memory fence.

    A program waits only on programs with lower numbers. The interpreter runs programs in order;
    the GPU dispatches a grid's programs in increasing order (as CUB's single-pass scan, which
    also waits only on predecessors, relies on), so every program waited on is running or done.
    LAG trades L2 reuse distance (LAG * C tiles) against waiting (RELAY_LAG_PROGRAMS).
    """
    k = tl.program_id(0)
    i_n = (k // C).to(tl.int64)
    i_t = k % C
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    p_words = p_part.to(tl.pointer_type(tl.int64))
    if i_n < N:
        b_x, m = _load_units(p_x + i_n * T * D, o_t, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
        lo, hi = _tile_min_max(b_x, m)
        w = (hi.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (lo.to(tl.int32, bitcast=True).to(tl.int64)
                                                                    & 0xFFFFFFFF)
        tl.store(p_words + i_n * C + i_t, w)
    i_p = i_n - LAG                                        # the block this program packs
    if i_p >= 0:
        b_x, _ = _load_units(p_x + i_p * T * D, o_t, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
        o_c = tl.arange(0, BLOCK_C)
        m_c = o_c < C
        p_w = p_words + i_p * C + o_c
        w = tl.load(p_w, mask=m_c, other=0, volatile=True)
        while tl.sum((w == EMPTY).to(tl.int32), 0) > 0:
            w = tl.load(p_w, mask=m_c, other=0, volatile=True)
        lo = tl.min(tl.where(m_c, (w & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True), float("inf")), 0)
        hi = tl.max(tl.where(m_c, (w >> 32).to(tl.int32).to(tl.float32, bitcast=True), float("-inf")), 0)
        _pack_with(b_x, lo, hi, p_packed, p_scale, p_zero, i_p, i_t, o_t, T, D, P, BITS, WORDS, BLOCK_T, BLOCK_G)


@triton.jit
def _codes(b_x, lo, inv, BITS: tl.constexpr):
    """Codes (int32) of fp32 values: round((x - lo) * inv) clamped to [0, 2^BITS - 1]; inv = 0 gives 0."""
    levels = (1 << BITS) - 1
    b_c = tl.floor((b_x - lo) * inv + 0.5)
    return tl.minimum(tl.maximum(b_c, 0.0), levels * 1.0).to(tl.int32)


@triton.jit
def _halves(b_w, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    """Even and odd columns of b_w (BLOCK_T, BLOCK_G): two (BLOCK_T, BLOCK_G // 2) tiles."""
    return tl.split(tl.reshape(b_w, [BLOCK_T, BLOCK_G // 2, 2]))


# ~70 lines on purpose: one branch per bit width's word pattern, each a few stores; they share the
# codes and masks, and splitting them into helpers would move the layout away from its comments.
@triton.jit
def _store_groups(b_c, p_on, o_t, m_t, n_g, P, BITS: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_G: tl.constexpr, WORDS: tl.constexpr):
    """Pack codes b_c (BLOCK_T, BLOCK_G, 8) int32 of rows o_t (valid where m_t) into the rows at p_on.

    Groups of 8 codes (n_g valid per row) make exactly BITS bytes. Every store is of whole words
    (32 bits; one 64-bit word per group at 8 bits: byte stores were much slower, docs/BENCHMARKS.md)
    unless WORDS is False: 5 / 6 bits then store bytes (rows of groups not a multiple of the 4 / 2
    groups that make whole words).
    Words are little-endian: stream bit s is bit s % 8 of byte s // 8, as in the contract.
    """
    o_i = tl.arange(0, 8)
    o_g = tl.arange(0, BLOCK_G)
    m_tg = m_t[:, None] & (o_g < n_g)[None, :]
    p_w = p_on.to(tl.pointer_type(tl.int32)) + o_t[:, None] * (P // 4)    # row starts, used where P % 4 == 0
    if BITS == 4:
        # 8 four-bit codes are one 32-bit word
        b_w = tl.sum(b_c << (o_i * 4)[None, None, :], 2)                               # (T, G)
        tl.store(p_w + o_g[None, :], b_w, mask=m_tg)
    elif BITS == 8:
        # 8 eight-bit codes are one 64-bit word (two 32-bit words per group in one 3D store wrote
        # more sectors than needed: docs/BENCHMARKS.md)
        b_w = tl.sum(b_c.to(tl.int64) << (o_i * 8).to(tl.int64)[None, None, :], 2)      # (T, G)
        tl.store(p_on.to(tl.pointer_type(tl.int64)) + o_t[:, None] * (P // 8) + o_g[None, :], b_w, mask=m_tg)
    elif WORDS:
        # codes 0-3 and 4-7 of each group as two 4*BITS-bit values A and B (shifts < 32, the sum
        # is an OR: the same in-thread shift-and-sum as 4 bits), then whole words of them
        o_j = tl.arange(0, 4)
        b_ab = tl.sum(tl.reshape(b_c, [BLOCK_T, BLOCK_G, 2, 4]) << (o_j * BITS)[None, None, None, :], 3)
        b_a, b_b = tl.split(b_ab)                                                   # (T, G) each
        a0, a1 = _halves(b_a, BLOCK_T, BLOCK_G)
        b0, b1 = _halves(b_b, BLOCK_T, BLOCK_G)
        if BITS == 6:
            # a pair of groups is 96 bits = 3 words: A0 B0 | A1 B1, 24 bits each
            o_q = tl.arange(0, BLOCK_G // 2)
            m_q = m_t[:, None] & (o_q < n_g // 2)[None, :]
            p_q = p_w + (o_q * 3)[None, :]
            tl.store(p_q, a0 | (b0 << 24), mask=m_q)
            tl.store(p_q + 1, (b0 >> 8) | (a1 << 16), mask=m_q)
            tl.store(p_q + 2, (a1 >> 16) | (b1 << 8), mask=m_q)
        else:
            # a quad of groups is 160 bits = 5 words: A0 B0 A1 B1 A2 B2 A3 B3, 20 bits each
            # (A and B are < 2^20: the arithmetic >> shifts in zeros)
            a0, a2 = _halves(a0, BLOCK_T, BLOCK_G // 2)
            a1, a3 = _halves(a1, BLOCK_T, BLOCK_G // 2)
            b0, b2 = _halves(b0, BLOCK_T, BLOCK_G // 2)
            b1, b3 = _halves(b1, BLOCK_T, BLOCK_G // 2)
            o_q = tl.arange(0, BLOCK_G // 4)
            m_q = m_t[:, None] & (o_q < n_g // 4)[None, :]
            p_q = p_w + (o_q * 5)[None, :]
            tl.store(p_q, a0 | (b0 << 20), mask=m_q)
            tl.store(p_q + 1, (b0 >> 12) | (a1 << 8) | (b1 << 28), mask=m_q)
            tl.store(p_q + 2, (b1 >> 4) | (a2 << 16), mask=m_q)
            tl.store(p_q + 3, (a2 >> 16) | (b2 << 4) | (a3 << 24), mask=m_q)
            tl.store(p_q + 4, (a3 >> 8) | (b3 << 12), mask=m_q)
    else:
        # byte fallback (5 / 6 bits, rows without whole pairs / quads of groups): BITS bytes per
        # group from a low word (stream bits 0-31) and a high word (bits 32 and up)
        s = o_i * BITS                               # stream bit of each code's bit 0
        low = s < 32
        # the bits are disjoint, so the sum is an OR; int32 wrap drops the bits a straddling code
        # carries past bit 31 (shift amounts are clamped below 32 on every lane: no undefined shifts)
        sl = tl.where(low, s, 0)[None, None, :]
        w_lo = tl.sum(tl.where(low[None, None, :], b_c << sl, 0), 2)                    # (T, G) bytes 0-3
        # bits 32+: a code starting below 32 gives its top bits (>> 32 - s, zero unless it straddles:
        # codes are < 2^BITS <= 2^31), a code starting at 32 or above gives all its bits
        sr = tl.minimum(tl.where(low, 32 - s, 0), 31)[None, None, :]
        sh = tl.where(low, 0, s - 32)[None, None, :]
        w_hi = tl.sum(tl.where(low[None, None, :], b_c >> sr, b_c << sh), 2)           # (T, G) bytes 4..BITS-1
        b_w = tl.where((o_i < 4)[None, None, :], w_lo[:, :, None], w_hi[:, :, None])
        b_b = (b_w >> ((o_i % 4) * 8)[None, None, :]) & 0xFF
        p_o = p_on + o_t[:, None, None] * P + (o_g[None, :, None] * BITS + o_i[None, None, :])
        tl.store(p_o, b_b.to(tl.uint8), mask=m_tg[:, :, None] & (o_i < BITS)[None, None, :])


@triton.jit
def _block_params(p_scale, p_zero, i_n, lo, hi, BITS: tl.constexpr, write):
    """Block i_n's scale and zero point (stored where ``write``); returns the exact reciprocal of
    the scale (0 if constant)."""
    scale = (hi - lo) / ((1 << BITS) - 1)
    tl.store(p_scale + i_n, scale, mask=write)
    tl.store(p_zero + i_n, lo, mask=write)
    # one exact reciprocal per block; codes then cost a multiply (a tie may round either way)
    return tl.where(scale > 0, tl.math.div_rn(1.0, tl.where(scale > 0, scale, 1.0)), 0.0)


@triton.jit
def _quantize_words_kernel(
    p_x, p_packed, p_scale, p_zero, T, D,
    BITS: tl.constexpr, U: tl.constexpr, WORD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr,
    LOAD2D: tl.constexpr,
):
    """One program per block (BLOCK_T >= T), read once into a (BLOCK_T, BLOCK_U, U) register tile:
    each unit of U consecutive codes of a row is U * BITS / WORD whole words of WORD (32 or 64)
    bits, built by in-thread shifts and sums and stored as whole words (D % U == 0).

    LOAD2D: see _load_units.
    """
    i_n = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T)
    o_u = tl.arange(0, BLOCK_U)
    o_i = tl.arange(0, U)
    n_u = D // U
    b_x, m = _load_units(p_x + i_n * T * D, o_t, T, D, U, BLOCK_T, BLOCK_U, LOAD2D)
    lo, hi = _tile_min_max(b_x, m)
    inv = _block_params(p_scale, p_zero, i_n, lo, hi, BITS, True)
    b_c = _codes(b_x, lo, inv, BITS)
    if WORD == 64:
        b_c = b_c.to(tl.int64)
        p_w = p_packed.to(tl.pointer_type(tl.int64))
    else:
        p_w = p_packed.to(tl.pointer_type(tl.int32))
    W: tl.constexpr = U * BITS // WORD
    row_words = n_u * W
    p_w = p_w + i_n * T * row_words + o_t[:, None] * row_words + o_u[None, :] * W
    s = o_i * BITS                                    # each code's first bit in its unit
    for j in tl.static_range(W):
        rel = s - j * WORD                            # its first bit relative to word j's bit 0
        left = (rel >= 0) & (rel < WORD)              # starts in word j (high bits past it wrap off)
        right = (rel < 0) & (rel + BITS > 0)          # started in word j - 1, its top bits land here
        shl = tl.where(left, rel, 0)[None, None, :].to(b_c.dtype)
        shr = tl.where(right, -rel, 0)[None, None, :].to(b_c.dtype)
        part = tl.where(left[None, None, :], b_c << shl, tl.where(right[None, None, :], b_c >> shr, 0))
        tl.store(p_w + j, tl.sum(part, 2), mask=m)    # disjoint bits: the sum is an OR


@triton.jit
def _quantize_twopass_kernel(
    p_x, p_packed, p_scale, p_zero, T, D, P,
    BITS: tl.constexpr, WORDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
    LOAD2D: tl.constexpr, PREFETCH: tl.constexpr, LAYOUT: tl.constexpr,
):
    """One program per block (D % 8 == 0), in row tiles of BLOCK_T rows: pass 1 folds the block's
    min / max (LAYOUT 0) or each column's (LAYOUT 1, channel: fp16 pairs per column), pass 2 reads
    the block again (from L2 while the blocks in flight fit in it: small blocks) and packs whole
    rows as _store_groups. PREFETCH: each pass loads the next tile before it works on the current
    one (two tiles in flight per program). (Fewer programs looping over the blocks, to bound the
    blocks in flight, had too few loads in flight: docs/BENCHMARKS.md.)"""
    i_n = tl.program_id(0).to(tl.int64)
    p_xn = p_x + i_n * T * D
    o_r = tl.arange(0, BLOCK_T)
    if LAYOUT == 1:
        acc_lo = tl.full([BLOCK_T, BLOCK_G, 8], float("inf"), tl.float32)
        acc_hi = tl.full([BLOCK_T, BLOCK_G, 8], float("-inf"), tl.float32)
    else:
        acc_lo = tl.full([BLOCK_T, BLOCK_G], float("inf"), tl.float32)
        acc_hi = tl.full([BLOCK_T, BLOCK_G], float("-inf"), tl.float32)
    b_next, m_next = _load_units(p_xn, o_r, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
    for t0 in range(0, T, BLOCK_T):
        if PREFETCH:
            b_x, m = b_next, m_next
            b_next, m_next = _load_units(p_xn, t0 + BLOCK_T + o_r, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
        else:
            b_x, m = _load_units(p_xn, t0 + o_r, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
        if LAYOUT == 1:
            acc_lo = tl.minimum(acc_lo, tl.where(m[:, :, None], b_x, float("inf")))
            acc_hi = tl.maximum(acc_hi, tl.where(m[:, :, None], b_x, float("-inf")))
        else:
            acc_lo = tl.minimum(acc_lo, tl.min(tl.where(m[:, :, None], b_x, float("inf")), 2))
            acc_hi = tl.maximum(acc_hi, tl.max(tl.where(m[:, :, None], b_x, float("-inf")), 2))
    if LAYOUT == 1:
        scale, lo = _pair_of(tl.min(acc_lo, 0), tl.max(acc_hi, 0), BITS, p_scale.dtype.element_ty)     # (G, 8)
        o_c = i_n * D + tl.arange(0, BLOCK_G)[:, None] * 8 + tl.arange(0, 8)[None, :]
        m_c = (tl.arange(0, BLOCK_G) < D // 8)[:, None]
        tl.store(p_scale + o_c, scale.to(p_scale.dtype.element_ty), mask=m_c)
        tl.store(p_zero + o_c, lo.to(p_zero.dtype.element_ty), mask=m_c)
        inv = _inverse(scale)[None, :, :]
        lo = lo[None, :, :]
    else:
        lo = tl.min(tl.min(acc_lo, 1), 0)
        hi = tl.max(tl.max(acc_hi, 1), 0)
        inv = _block_params(p_scale, p_zero, i_n, lo, hi, BITS, True)
    p_on = p_packed + i_n * T * P
    b_next, _ = _load_units(p_xn, o_r, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
    for t0 in range(0, T, BLOCK_T):
        o_t = t0 + o_r
        if PREFETCH:
            b_x = b_next
            b_next, _ = _load_units(p_xn, o_t + BLOCK_T, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
        else:
            b_x, _ = _load_units(p_xn, o_t, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
        _store_groups(_codes(b_x, lo, inv, BITS), p_on, o_t, o_t < T, D // 8, P, BITS, BLOCK_T, BLOCK_G, WORDS)


@triton.jit
def _quantize_axis_kernel(
    p_x, p_packed, p_scale, p_zero, T, D, P, n_parts,
    BITS: tl.constexpr, LAYOUT: tl.constexpr, WORDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """Channel (LAYOUT 1) and token (2) layouts, D % 8 == 0, the input read once. Program k works on
    part k % n_parts of block k // n_parts, held as one (BLOCK_T, BLOCK_G, 8) register tile:
    channel: a strip of BLOCK_G groups of 8 columns over all T rows (BLOCK_T >= T), whose columns'
    min / max are complete in the tile; token: a tile of BLOCK_T whole rows (BLOCK_G * 8 >= D).
    Codes are stored as _store_groups (a strip starts at byte g0 * BITS of each row)."""
    k = tl.program_id(0)
    i_n = (k // n_parts).to(tl.int64)
    i_p = k % n_parts
    o_r = tl.arange(0, BLOCK_T)
    o_g = tl.arange(0, BLOCK_G)
    o_i = tl.arange(0, 8)
    if LAYOUT == 1:
        t0 = 0
        g0 = i_p * BLOCK_G
    else:
        t0 = i_p * BLOCK_T
        g0 = 0
    o_t = t0 + o_r
    n_g = D // 8 - g0                                   # groups of the row from g0 on
    m_t = o_t < T
    o_d = tl.arange(0, BLOCK_G * 8)
    m2 = m_t[:, None] & (o_d < n_g * 8)[None, :]
    b_x = tl.load(p_x + i_n * T * D + o_t[:, None] * D + g0 * 8 + o_d[None, :], mask=m2, other=0.0)
    b_x = tl.reshape(b_x.to(tl.float32), [BLOCK_T, BLOCK_G, 8])        # whole rows: coalesced
    m = (m_t[:, None] & (o_g < n_g)[None, :])[:, :, None]
    lo = tl.where(m, b_x, float("inf"))
    hi = tl.where(m, b_x, float("-inf"))
    if LAYOUT == 1:
        scale, zero = _pair_of(tl.min(lo, 0), tl.max(hi, 0), BITS, p_scale.dtype.element_ty)      # (G, 8)
        o_c = i_n * D + g0 * 8 + o_g[:, None] * 8 + o_i[None, :]
        m_c = (o_g < n_g)[:, None]
        tl.store(p_scale + o_c, scale.to(p_scale.dtype.element_ty), mask=m_c)
        tl.store(p_zero + o_c, zero.to(p_zero.dtype.element_ty), mask=m_c)
        b_c = _codes(b_x, zero[None, :, :], _inverse(scale)[None, :, :], BITS)
    else:
        scale, zero = _pair_of(tl.min(tl.min(lo, 2), 1), tl.max(tl.max(hi, 2), 1), BITS,
                               p_scale.dtype.element_ty)                                        # (T,)
        tl.store(p_scale + i_n * T + o_t, scale.to(p_scale.dtype.element_ty), mask=m_t)
        tl.store(p_zero + i_n * T + o_t, zero.to(p_zero.dtype.element_ty), mask=m_t)
        b_c = _codes(b_x, zero[:, None, None], _inverse(scale)[:, None, None], BITS)
    _store_groups(b_c, p_packed + i_n * T * P + g0 * BITS, o_t, m_t, n_g, P, BITS, BLOCK_T, BLOCK_G, WORDS)


@triton.jit
def _dequant_grouped_kernel(
    p_packed, p_scale, p_zero, p_src_rows, p_dst, p_dst_rows, M, D, rows_per_block, stride_src, stride_dst,
    BITS: tl.constexpr, GATHER: tl.constexpr, LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr,
):
    """D % 8 == 0: each group of BITS bytes is read once into one int64 word and yields 8 codes
    (groups of 2 or 4 codes in int32 words were slower: narrower vectors, docs/BENCHMARKS.md)."""
    i_m = tl.program_id(0)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_src, o_dst, m_m = _gathered_rows(p_src_rows, p_dst_rows, o_m, o_m < M, GATHER)
    if tl.max(m_m.to(tl.int32), 0) > 0:     # rows that all copy nothing (a decode step's hits) stop here
        o_g = tl.arange(0, BLOCK_G)
        o_i = tl.arange(0, 8)
        m_g = (o_g < D // 8)[None, :, None]
        m_row = m_m[:, None, None]
        p_b = p_packed + o_src[:, None, None] * stride_src + (o_g[None, :, None] * BITS + o_i[None, None, :])
        b_b = tl.load(p_b, mask=m_row & m_g & (o_i < BITS)[None, None, :], other=0).to(tl.int64)
        b_w = tl.sum(b_b << (o_i * 8).to(tl.int64)[None, None, :], 2)                  # (M, G)
        b_c = (b_w[:, :, None] >> (o_i * BITS).to(tl.int64)[None, None, :]) & ((1 << BITS) - 1)
        cols = o_g[None, :, None] * 8 + o_i[None, None, :]
        b_s, b_z = _pair_at(p_scale, p_zero, o_src[:, None, None], (o_src // rows_per_block)[:, None, None], m_row,
                            cols, m_row & m_g, D, LAYOUT)
        b_x = b_c.to(tl.float32) * b_s + b_z
        p_o = p_dst + o_dst[:, None, None] * stride_dst + cols
        tl.store(p_o, b_x.to(p_dst.dtype.element_ty), mask=m_row & m_g)


@triton.jit
def _dequant_words_program(
    i_m, p_words, p_scale, p_zero, p_src_rows, p_dst, p_dst_rows, M, D, rows_per_block, stride_src, stride_dst,
    BITS: tl.constexpr, GATHER: tl.constexpr, LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Program i_m of _dequant_words_kernel (rows i_m * BLOCK_M on), which the pair kernel runs
    for keys and values in turn."""
    CPW: tl.constexpr = 32 // BITS
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_src, o_dst, m_m = _gathered_rows(p_src_rows, p_dst_rows, o_m, o_m < M, GATHER)
    if tl.max(m_m.to(tl.int32), 0) > 0:     # rows that all copy nothing (a decode step's hits) stop here
        o_w = tl.arange(0, BLOCK_W)
        o_c = tl.arange(0, CPW)
        m_w = (o_w < D // CPW)[None, :, None]
        m_row = m_m[:, None, None]
        b_w = tl.load(p_words + o_src[:, None] * stride_src + o_w[None, :],
                      mask=m_m[:, None] & (o_w < D // CPW)[None, :], other=0)               # (M, W)
        b_c = (b_w[:, :, None] >> (o_c * BITS)[None, None, :]) & ((1 << BITS) - 1)
        cols = o_w[None, :, None] * CPW + o_c[None, None, :]
        b_s, b_z = _pair_at(p_scale, p_zero, o_src[:, None, None], (o_src // rows_per_block)[:, None, None], m_row,
                            cols, m_row & m_w, D, LAYOUT)
        b_x = b_c.to(tl.float32) * b_s + b_z
        tl.store(p_dst + o_dst[:, None, None] * stride_dst + cols, b_x.to(p_dst.dtype.element_ty), mask=m_row & m_w)


@triton.jit
def _dequant_words_kernel(
    p_words, p_scale, p_zero, p_src_rows, p_dst, p_dst_rows, M, D, rows_per_block, stride_src, stride_dst,
    BITS: tl.constexpr, GATHER: tl.constexpr, LAYOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """4 and 8 bits, rows of whole 32-bit words (p_words: the packed rows as int32, stride in
    words): each word is one load and 32 / BITS codes, so a row is read in wide vector loads as
    the plain swap-in reads its rows."""
    _dequant_words_program(tl.program_id(0), p_words, p_scale, p_zero, p_src_rows, p_dst, p_dst_rows, M, D,
                           rows_per_block, stride_src, stride_dst, BITS, GATHER, LAYOUT, BLOCK_M, BLOCK_W)


@triton.jit
def _dequant_words_pair_kernel(
    p_words_k, p_scale_k, p_zero_k, p_dst_k, p_words_v, p_scale_v, p_zero_v, p_dst_v, p_src_rows, p_dst_rows,
    M, D, rows_per_block, stride_src_k, stride_dst_k, stride_src_v, stride_dst_v,
    BITS: tl.constexpr, LAYOUT_K: tl.constexpr, LAYOUT_V: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """_dequant_words_kernel of a layer's keys (axis 1 == 0) and values (axis 1 == 1), each in its
    own layout, at the same gathered rows: one launch keeps both tensors' reads in flight (the
    swap-in of a decode step is latency bound over PCIe)."""
    i_m = tl.program_id(0)
    if tl.program_id(1) == 0:
        _dequant_words_program(i_m, p_words_k, p_scale_k, p_zero_k, p_src_rows, p_dst_k, p_dst_rows, M, D,
                               rows_per_block, stride_src_k, stride_dst_k, BITS, True, LAYOUT_K, BLOCK_M, BLOCK_W)
    else:
        _dequant_words_program(i_m, p_words_v, p_scale_v, p_zero_v, p_src_rows, p_dst_v, p_dst_rows, M, D,
                               rows_per_block, stride_src_v, stride_dst_v, BITS, True, LAYOUT_V, BLOCK_M, BLOCK_W)


_SPAN = {4: 2, 5: 3, 6: 3, 8: 1}
REG_CAP = 16384          # one register tile holds at most this many (padded) values
_WORD_GROUPS = {4: 1, 5: 4, 6: 2, 8: 1}   # 8-code groups that make whole 32-bit words


# relay kernel: the word of a tile not yet reduced (min +inf low, max -inf high), as int64, and the
# default distance in programs between reducing a tile and packing it (docs/BENCHMARKS.md)
RELAY_EMPTY = (0xFF800000 << 32 | 0x7F800000) - (1 << 64)
RELAY_LAG_PROGRAMS = 1024

# words path: codes per unit and word bits, per bit width (a unit is whole words)
WORD_UNITS = {4: (8, 32), 5: (32, 32), 6: (16, 32), 8: (8, 64)}


def word_stores(d: int, bits: int) -> bool:
    """Whether rows of d codes (d % 8 == 0) pack into whole 32-bit words (else 5/6 bits store bytes)."""
    return (d // 8) % _WORD_GROUPS[bits] == 0


def tile_rows(block_t: int, block_g: int, values: int) -> int:
    """Rows of a (block_t-row) block in a tile of about ``values`` values (groups of 8 per row)."""
    return max(1, min(block_t, values // (block_g * 8)))


def words_fit(t: int, d: int, bits: int, unit: tuple[int, int], reg_cap: int) -> bool:
    """Whether method "words" with unit (codes, word bits) takes a t x d block: rows of whole units,
    units of whole words, the block one register tile of at most reg_cap padded values."""
    u, word = unit
    return d % u == 0 and (u * bits) % word == 0 and next_pow2(t) * next_pow2(d // u) * u <= reg_cap


TWOPASS_MAX_BYTES = 16384   # blocks up to this size take method "twopass" (see auto_method)


def auto_method(t: int, d: int, bits: int, elem_bytes: int) -> str:
    """The quantize kernel measured fastest for a t x d block (docs/BENCHMARKS.md, block quantize):
    "words" at 4 and 8 bits where the block is one register tile of whole words per thread;
    "twopass" for other blocks of at most TWOPASS_MAX_BYTES (larger ones outgrow L2 between the
    two reads); "relay" for larger blocks. Rows of d % 8 != 0 take the general kernel."""
    if bits in (4, 8) and words_fit(t, d, bits, WORD_UNITS[bits], REG_CAP):
        return "words"
    return "twopass" if t * d * elem_bytes <= TWOPASS_MAX_BYTES else "relay"


LAYOUT_IDS = {"block": 0, "channel": 1, "token": 2}
AXIS_TILE_VALUES = 4096     # token layout: rows per program (whole rows, about this many values)
# channel layout, method "strip": at most this many 8-column groups per strip (one program each)
# and the warps of a program (0: by tile size)
CHANNEL_STRIP = {"groups": 4, "warps": 2}
# channel layout's quantize kernel: "twopass" (one program per block: column pairs folded over row
# tiles of `tile` values, then whole rows packed from L2) or "strip" (the axis kernel, the input
# read once in column strips, whose 5 / 6-bit rows store a few words per row). On the H200, 64-token
# units: twopass 1024 x 1 warp 58.9-67.8 % of the HBM copy at every width and D = 64 / 128
# against 34-58 % for strips of 4 x 2 (docs/BENCHMARKS.md); bench_kernels.py --only layouts sweeps them
CHANNEL_QUANT = {"method": "twopass", "tile": 1024, "warps": 1}


def _outputs(x: torch.Tensor, bits: int, layout: str = "block") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, t, d = x.shape
    packed = torch.empty(n, t, (d * bits + 7) // 8, device=x.device, dtype=torch.uint8)
    scale = torch.empty(param_shape(layout, n, t, d), device=x.device, dtype=PARAM_DTYPES[layout])
    return packed, scale, torch.empty_like(scale)


def quantize(x: torch.Tensor, bits: int, layout: str = "block") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, T, D) -> packed (N, T, P) uint8 and the layout's scale / zero (quant.py), through the
    kernel :func:`auto_method` picks (block layout, D % 8 == 0), the axis kernel (channel and token
    layouts, D % 8 == 0, a channel strip of at most REG_CAP values) or the general one."""
    x = x.contiguous()
    n, t, d = x.shape
    if layout != "block":
        if layout == "channel" and d % 8 == 0 and CHANNEL_QUANT["method"] == "twopass":
            return launch_twopass(x, bits, CHANNEL_QUANT["tile"], CHANNEL_QUANT["warps"], layout="channel")
        if d % 8 == 0 and (layout == "token" or next_pow2(t) * 8 <= REG_CAP):
            return launch_axis(x, bits, layout)
        return launch_general(x, bits, layout)
    if d % 8:
        return launch_general(x, bits)
    method = auto_method(t, d, bits, x.element_size())
    if method == "words":
        return launch_words(x, bits, warps=4 if bits == 4 else 8)
    return launch_twopass(x, bits) if method == "twopass" else launch_relay(x, bits)


def launch_general(x: torch.Tensor, bits: int,
                   layout: str = "block") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Any D and layout: two passes over the block, packing byte by byte."""
    n, t, d = x.shape
    packed, scale, zero = _outputs(x, bits, layout)
    p = packed.shape[-1]
    BLOCK_D, BLOCK_P = next_pow2(d), next_pow2(p)
    BLOCK_T = max(1, min(next_pow2(t), 2048 // BLOCK_D))
    _quantize_kernel[(n,)](x, packed, scale, zero, t, d, p, BITS=bits, SPAN=_SPAN[bits], BLOCK_T=BLOCK_T,
                           BLOCK_D=BLOCK_D, BLOCK_P=BLOCK_P, LAYOUT=LAYOUT_IDS[layout], num_warps=4)
    return packed, scale, zero


def axis_tiles(t: int, d: int, layout: str, tile_values: int = AXIS_TILE_VALUES) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_G, parts per block) of the axis kernel: channel strips of every row and as
    many 8-column groups as REG_CAP allows; token tiles of whole rows, about tile_values values."""
    groups = next_pow2(d // 8)
    if layout == "channel":
        block_t = next_pow2(t)
        block_g = max(1, min(groups, CHANNEL_STRIP["groups"], REG_CAP // (block_t * 8)))
        return block_t, block_g, triton.cdiv(d // 8, block_g)
    block_t = tile_rows(next_pow2(t), groups, tile_values)
    return block_t, groups, triton.cdiv(t, block_t)


def launch_axis(x: torch.Tensor, bits: int, layout: str,
                tile_values: int = AXIS_TILE_VALUES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Channel or token layout, D % 8 == 0: one program per channel strip or row tile of each
    block, the input read once (_quantize_axis_kernel)."""
    n, t, d = x.shape
    packed, scale, zero = _outputs(x, bits, layout)
    BLOCK_T, BLOCK_G, parts = axis_tiles(t, d, layout, tile_values)
    # word stores need whole word groups in every strip (a strip starts at byte g0 * bits)
    words = word_stores(d, bits) and (parts == 1 or BLOCK_G % _WORD_GROUPS[bits] == 0)
    values = BLOCK_T * BLOCK_G * 8
    warps = CHANNEL_STRIP["warps"] if layout == "channel" and CHANNEL_STRIP["warps"] else 8 if values > 8192 else 4
    _quantize_axis_kernel[(n * parts,)](x, packed, scale, zero, t, d, packed.shape[-1], parts, BITS=bits,
                                        LAYOUT=LAYOUT_IDS[layout], WORDS=words, BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G,
                                        num_warps=warps)
    return packed, scale, zero


def launch_words(x: torch.Tensor, bits: int, unit: tuple[int, int] | None = None, warps: int = 4,
                 load2d: bool = True, reg_cap: int = REG_CAP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One program per block, one register tile, whole words per thread (_quantize_words_kernel)."""
    n, t, d = x.shape
    u, word = unit = unit or WORD_UNITS[bits]
    if not words_fit(t, d, bits, unit, reg_cap):
        raise ValueError(f"the words kernel needs D % {u} == 0 and a block of at most reg_cap={reg_cap} padded "
                         f"values (got {t} x {d}); quantize_blocks picks a kernel that fits")
    packed, scale, zero = _outputs(x, bits)
    _quantize_words_kernel[(n,)](x, packed, scale, zero, t, d, BITS=bits, U=u, WORD=word, BLOCK_T=next_pow2(t),
                                 BLOCK_U=next_pow2(d // u), LOAD2D=load2d, num_warps=warps)
    return packed, scale, zero


def launch_twopass(x: torch.Tensor, bits: int, tile_values: int = 2048, warps: int = 2, load2d: bool = True,
                   prefetch: bool = True, layout: str = "block") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One program per block reading it twice, the second time from L2 (_quantize_twopass_kernel),
    in row tiles of about ``tile_values`` values (D % 8 == 0; block or channel layout)."""
    if layout not in ("block", "channel"):
        raise ValueError(f"the twopass kernel packs the block and channel layouts, not {layout!r}")
    n, t, d = x.shape
    packed, scale, zero = _outputs(x, bits, layout)
    BLOCK_G = next_pow2(d // 8)
    BLOCK_T = tile_rows(next_pow2(t), BLOCK_G, tile_values)
    _quantize_twopass_kernel[(n,)](x, packed, scale, zero, t, d, packed.shape[-1], BITS=bits,
                                   WORDS=word_stores(d, bits), BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, LOAD2D=load2d,
                                   PREFETCH=prefetch, LAYOUT=LAYOUT_IDS[layout], num_warps=warps)
    return packed, scale, zero


def launch_relay(x: torch.Tensor, bits: int, tile_values: int = 2048, warps: int = 1, lag: int = 0,
                 load2d: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel of row-tile programs that read the input once and relay each block's min / max
    (_quantize_relay_kernel); lag in blocks (0: about RELAY_LAG_PROGRAMS programs) (D % 8 == 0)."""
    n, t, d = x.shape
    packed, scale, zero = _outputs(x, bits)
    BLOCK_G = next_pow2(d // 8)
    BLOCK_T = tile_rows(next_pow2(t), BLOCK_G, tile_values)
    c = triton.cdiv(t, BLOCK_T)
    lag = max(1, min(n, lag or triton.cdiv(RELAY_LAG_PROGRAMS, c)))
    part = torch.full((n, c), RELAY_EMPTY, device=x.device, dtype=torch.int64)
    _quantize_relay_kernel[((n + lag) * c,)](
        x, part, packed, scale, zero, n, t, d, packed.shape[-1], c, lag, BITS=bits, WORDS=word_stores(d, bits),
        BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, BLOCK_C=max(2, next_pow2(c)), LOAD2D=load2d, EMPTY=RELAY_EMPTY,
        num_warps=warps)
    return packed, scale, zero


# values per program of the row dequant kernels, by layout: a channel-layout program reads its
# block's D scale/zero pairs once, so it takes a whole 64-row run of one block at D = 128 (H200,
# runs of 64 rows: 86 % of the bulk pinned copy at 4 bits against 68 % at 2048; scattered single
# rows cost ~2x, and the 24 x 128K decode step is 2 % faster); token-layout programs of 64 rows
# too (91.7 % against 88.9 % at 2048 values). docs/BENCHMARKS.md;
# benchmarks/bench_kernels.py --only layouts sweeps it
ROWS_TILE_VALUES = {"block": 2048, "token": 8192, "channel": 8192}
# warps of a row dequant program by layout (0: 4 up to 2048 values, else 8; the channel layout's
# 64-row programs at 4 warps: 91.6 % of bulk at 4 bits against 82.7 % at 8);
# benchmarks/bench_kernels.py --only layouts sweeps them
ROWS_WARPS = {"block": 0, "token": 0, "channel": 4}


def _rows_warps(layout: str) -> int:
    """Warps of a row dequant program of the layout (ROWS_WARPS, else by its tile's size)."""
    return ROWS_WARPS[layout] or (4 if ROWS_TILE_VALUES[layout] <= 2048 else 8)


def _words_of(packed2d: torch.Tensor, d: int, bits: int) -> torch.Tensor | None:
    """The packed rows as int32 words where _dequant_words_kernel reads them (4 and 8 bits, rows of
    whole words: D % 8 == 0, aligned rows), else None."""
    return _int32_rows(packed2d) if d % 8 == 0 and bits in (4, 8) else None


def _words_tiles(d: int, bits: int, tile: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_W) of _dequant_words_kernel: rows of about ``tile`` values, at most 64."""
    block_w = next_pow2(d * bits // 32)
    return max(1, min(64, tile // (block_w * (32 // bits)))), block_w


def _launch_rows(packed2d, scale, zero, bits, rows_per_block, src_rows, dst2d, dst_rows, m, gather, layout):
    d, p = dst2d.shape[1], packed2d.shape[1]
    lid = LAYOUT_IDS[layout]
    tile = ROWS_TILE_VALUES[layout]
    warps = _rows_warps(layout)
    words = _words_of(packed2d, d, bits)
    if words is not None:
        BLOCK_M, BLOCK_W = _words_tiles(d, bits, tile)
        _dequant_words_kernel[(triton.cdiv(m, BLOCK_M),)](
            words, scale, zero, src_rows, dst2d, dst_rows, m, d, rows_per_block, words.stride(0), dst2d.stride(0),
            BITS=bits, GATHER=gather, LAYOUT=lid, BLOCK_M=BLOCK_M, BLOCK_W=BLOCK_W, num_warps=warps)
        return
    if d % 8 == 0:
        BLOCK_G = next_pow2(d // 8)
        BLOCK_M = max(1, min(64, tile // (BLOCK_G * 8)))
        _dequant_grouped_kernel[(triton.cdiv(m, BLOCK_M),)](
            packed2d, scale, zero, src_rows, dst2d, dst_rows, m, d, rows_per_block, packed2d.stride(0),
            dst2d.stride(0), BITS=bits, GATHER=gather, LAYOUT=lid, BLOCK_M=BLOCK_M, BLOCK_G=BLOCK_G,
            num_warps=warps)
        return
    BLOCK_D = min(next_pow2(d), 256)
    BLOCK_M = max(1, min(64, 2 * tile // BLOCK_D))
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(d, BLOCK_D))
    _dequant_rows_kernel[grid](packed2d, scale, zero, src_rows, dst2d, dst_rows, m, d, p, rows_per_block,
                               packed2d.stride(0), dst2d.stride(0), BITS=bits, GATHER=gather, LAYOUT=lid,
                               BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, num_warps=warps)


def _launch_rows_pair(packed_k, scale_k, zero_k, layout_k, packed_v, scale_v, zero_v, layout_v, bits,
                      rows_per_block, src_rows, dst_k, dst_v, dst_rows):
    """_launch_rows of keys and values at the same gathered rows as one launch of
    _dequant_words_pair_kernel (grid axis 1: keys, values) where both take the words path with
    one D; False, nothing launched, otherwise (the caller then launches each)."""
    d = dst_k.shape[1]
    words_k = _words_of(packed_k, d, bits) if dst_v.shape[1] == d else None
    words_v = _words_of(packed_v, d, bits) if words_k is not None else None
    if words_k is None or words_v is None:
        return False
    # one geometry for both: the smaller of the two layouts' row tiles (a program's tile then fits
    # either layout's budget; the pool's channel keys and token values both take 64 rows at
    # D = 128) and the fewer warps (channel programs of 64 rows ran 9 points slower at 8 warps than
    # at 4, docs/BENCHMARKS.md; token programs at 4 warps are not measured)
    BLOCK_M, BLOCK_W = _words_tiles(d, bits, min(ROWS_TILE_VALUES[layout_k], ROWS_TILE_VALUES[layout_v]))
    m = src_rows.numel()
    _dequant_words_pair_kernel[(triton.cdiv(m, BLOCK_M), 2)](
        words_k, scale_k, zero_k, dst_k, words_v, scale_v, zero_v, dst_v, src_rows, dst_rows, m, d, rows_per_block,
        words_k.stride(0), dst_k.stride(0), words_v.stride(0), dst_v.stride(0), BITS=bits,
        LAYOUT_K=LAYOUT_IDS[layout_k], LAYOUT_V=LAYOUT_IDS[layout_v], BLOCK_M=BLOCK_M, BLOCK_W=BLOCK_W,
        num_warps=min(_rows_warps(layout_k), _rows_warps(layout_v)))
    return True


def _int32_rows(packed2d: torch.Tensor) -> torch.Tensor | None:
    """(R, P) uint8 rows as (R, P / 4) int32 words of the same memory (row stride in words), or
    None unless P, the row stride and the base address are multiples of 4 bytes (a view [:, :P]
    of wider rows is read through its full rows)."""
    r, p = packed2d.shape
    s0 = packed2d.stride(0)
    if r == 0 or packed2d.stride(1) != 1 or p % 4 or s0 % 4 or packed2d.data_ptr() % 4:
        return None
    if packed2d.is_contiguous():
        return packed2d.view(torch.int32)
    if packed2d.storage_offset() + r * s0 > packed2d.untyped_storage().nbytes():
        return None                     # the last row's full width is not there to view
    return packed2d.as_strided((r, s0), (s0, 1)).view(torch.int32)[:, : p // 4]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, d: int,
               dtype: torch.dtype, layout: str = "block") -> torch.Tensor:
    """packed (N, T, P) -> (N, T, D) in dtype."""
    n, t, p = packed.shape
    out = torch.empty(n, t, d, device=packed.device, dtype=dtype)
    if out.numel() == 0:
        return out
    flat = packed.reshape(n * t, p)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    _launch_rows(flat, scale.contiguous(), zero.contiguous(), bits, t, flat, out.view(n * t, d), flat, n * t,
                 gather=False, layout=layout)
    return out


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    rows_per_block: int, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor,
                    layout: str = "block") -> None:
    """dst[dst_rows[i]] = dequant(packed[src_rows[i]]); packed may be pinned host memory (UVA)."""
    _launch_rows(packed, scale, zero, bits, rows_per_block, src_rows, dst, dst_rows, src_rows.numel(), gather=True,
                 layout=layout)


def dequantize_rows_pair(packed_k: torch.Tensor, scale_k: torch.Tensor, zero_k: torch.Tensor, layout_k: str,
                         packed_v: torch.Tensor, scale_v: torch.Tensor, zero_v: torch.Tensor, layout_v: str,
                         bits: int, rows_per_block: int, src_rows: torch.Tensor, dst_k: torch.Tensor,
                         dst_v: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dequantize_rows of keys into dst_k and of values into dst_v at the same rows (swap_in.py
    swap_in_dequant_pair; index tensors may be on the host): one launch where both read whole
    words (4 / 8 bits, D % 8 == 0), else one each."""
    if any(t.stride(-1) != 1 for t in (packed_k, packed_v, dst_k, dst_v)):
        raise ValueError("swap_in_dequant_pair needs unit stride in the last dim; pass .contiguous() tensors")
    src_rows, dst_rows = on_device(src_rows, dst_k.device), on_device(dst_rows, dst_k.device)
    if _launch_rows_pair(packed_k, scale_k, zero_k, layout_k, packed_v, scale_v, zero_v, layout_v, bits,
                         rows_per_block, src_rows, dst_k, dst_v, dst_rows):
        return
    dequantize_rows(packed_k, scale_k, zero_k, bits, rows_per_block, src_rows, dst_k, dst_rows, layout_k)
    dequantize_rows(packed_v, scale_v, zero_v, bits, rows_per_block, src_rows, dst_v, dst_rows, layout_v)
