"""Triton swap-in: gather rows from (pinned host or device) memory into hot-buffer slots.

Rows move as 32-bit words (16-byte vector loads when rows and bases are 16-byte aligned, which
Triton infers from its divisibility specialisation), so one warp streams whole rows over UVA;
there is no cudaMemcpy per row. Pinned host tensors are passed directly: Triton resolves their
device-visible address with cuPointerGetAttribute. One kernel moves the rows of one tensor, of a
pair in one launch (a layer's keys and values: the same rows), and a decode token's backup (the
pool rows computed in the kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _quant_triton
from ._launch import next_pow2, on_device


@triton.jit
def _gather_rows_kernel(
    p_src, p_src_b, p_src_rows, p_dst, p_dst_b, p_dst_rows, p_start, p_map, M, W, H, bs,
    stride_src, stride_src_b, stride_dst, stride_dst_b, s_start, s_map, s_map_h,
    LISTED: tl.constexpr, TAIL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Rows i of the program (axis 0) of src into dst, or (axis 1 == 1: a pair's second tensors,
    the same rows) of src_b into dst_b. LISTED: at the rows of the lists src_rows / dst_rows.
    Else a decode token's backup: source row i = b * H + h (sequence b's key or value at KV head
    h) into the host pool row of its position start[b] (host_pool: unit's first row + offset)."""
    i_m = tl.program_id(0)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    if LISTED:
        o_src = tl.load(p_src_rows + o_m, mask=m_m, other=0).to(tl.int64)
        m_m = m_m & (o_src >= 0)            # -1: no row (fixed-width lists of a graph-captured step)
        o_dst = tl.load(p_dst_rows + o_m, mask=m_m, other=0).to(tl.int64)
    else:
        o_src = o_m.to(tl.int64)
        b, h = o_src // H, o_src % H
        pos = tl.load(p_start + b * s_start, mask=m_m, other=0).to(tl.int64)
        if TAIL:        # p_map: the first rows (B, H) of the sequences' tail units (HostPool.tail_units)
            unit = tl.load(p_map + b * s_map + h * s_map_h, mask=m_m, other=0).to(tl.int64)
        else:           # p_map: block tables (B, W) (HostPool.main_rows: a hole, -1, reads block 0)
            blk = tl.maximum(tl.load(p_map + b * s_map + pos // bs, mask=m_m, other=0).to(tl.int64), 0)
            unit = (blk * H + h) * bs
        o_dst = unit + pos % bs
    if tl.program_id(1) == 0:
        p_s = p_src + o_src[:, None] * stride_src
        p_d = p_dst + o_dst[:, None] * stride_dst
    else:
        p_s = p_src_b + o_src[:, None] * stride_src_b
        p_d = p_dst_b + o_dst[:, None] * stride_dst_b
    for w0 in range(0, W, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W)
        m = m_m[:, None] & (o_w < W)[None, :]
        b_x = tl.load(p_s + o_w[None, :], mask=m, other=0)
        tl.store(p_d + o_w[None, :], b_x, mask=m)


@triton.jit
def _layer_rows(p_table, p_rows, s_rows_l, M, WORD: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's layer (axis 1), its source or destination (the table's address, as words of
    WORD bytes), its rows (axis 0: o_m, their mask, and the rows listed: the layer's own where
    s_rows_l is not 0)."""
    layer = tl.program_id(1).to(tl.int64)
    o_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    row = tl.load(p_rows + layer * s_rows_l + o_m, mask=m_m, other=-1).to(tl.int64)
    base = tl.load(p_table + layer)
    if WORD == 4:
        at = base.to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        at = base.to(tl.pointer_type(tl.int16))
    else:
        at = base.to(tl.pointer_type(tl.uint8))
    return layer, o_m, m_m, row, at


@triton.jit
def _gather_layers_kernel(p_table, p_rows, p_out, M, W, s_rows_l, s_src, s_out_l, s_out_m,
                          BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows rows[i] (axis 0; the layer's own row of rows when s_rows_l is not 0) of the source of
    a layer (axis 1; its address in the table, as 32-bit words) into out[layer, i]; a row of -1
    writes zeros."""
    layer, o_m, m_m, row, src = _layer_rows(p_table, p_rows, s_rows_l, M, 4, BLOCK_M)
    p_s = src + row[:, None] * s_src
    p_d = p_out + layer * s_out_l + o_m[:, None].to(tl.int64) * s_out_m
    for w0 in range(0, W, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W)
        m = m_m[:, None] & (o_w < W)[None, :]
        b_x = tl.load(p_s + o_w[None, :], mask=m & (row >= 0)[:, None], other=0)
        tl.store(p_d + o_w[None, :], b_x, mask=m)


@triton.jit
def _scatter_layers_kernel(p_table, p_rows, p_src, M, W, s_rows_l, s_dst, s_src_l, s_src_m,
                           WORD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """src[layer, i] into row rows[i] (axis 0; the layer's own row of rows when s_rows_l is not
    0) of the destination of a layer (axis 1; its address in the table, as words of WORD bytes);
    a row of -1 writes nothing."""
    layer, o_m, m_m, row, dst = _layer_rows(p_table, p_rows, s_rows_l, M, WORD, BLOCK_M)
    keep = m_m & (row >= 0)
    p_d = dst + row[:, None] * s_dst
    p_s = p_src + layer * s_src_l + o_m[:, None].to(tl.int64) * s_src_m
    for w0 in range(0, W, BLOCK_W):
        o_w = w0 + tl.arange(0, BLOCK_W)
        m = keep[:, None] & (o_w < W)[None, :]
        tl.store(p_d + o_w[None, :], tl.load(p_s + o_w[None, :], mask=m), mask=m)


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """View rows as int32 words when the byte width allows it (int8/int16 otherwise)."""
    row_bytes = t.shape[1] * t.element_size()
    for dtype, size in ((torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)):
        if row_bytes % size == 0 and t.stride(0) * t.element_size() % size == 0 and t.data_ptr() % size == 0:
            return t.view(torch.uint8).view(dtype) if t.element_size() != size else t.view(dtype)
    return t.view(torch.uint8)


def _gather(srcs: tuple[torch.Tensor, ...], dsts: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
            m: int, listed: bool, tail: bool = False, heads: int = 1, block_size: int = 1) -> None:
    """One launch of _gather_rows_kernel over m rows of one or two (src, dst) pairs: rows are
    (src_rows, dst_rows) when listed, else a backup's (start, tail units or block tables)."""
    if any(t.stride(-1) != 1 for t in srcs + dsts):
        raise ValueError("swap_in needs rows with unit stride in the last dim; pass .contiguous() tensors")
    words = [_as_words(t) for t in srcs + dsts]
    if len({w.dtype for w in words}) > 1:   # different alignments: fall back to the narrower word
        words = [t.view(torch.uint8) for t in srcs + dsts]
    src, dst = words[:len(srcs)], words[len(srcs):]
    src_b, dst_b = src[-1], dst[-1]
    w = src[0].shape[1]
    s, d = srcs[0], dsts[0]
    dev = d.device if d.is_cuda or not s.is_cuda else s.device  # a device->host copy runs on src's GPU
    a, c = (on_device(t, dev) for t in rows)
    s_c = (c.stride(0), c.stride(1) if c.dim() > 1 else 1)
    BLOCK_W = min(next_pow2(w), 1024)
    BLOCK_M = max(1, min(32, 2048 // BLOCK_W))
    _gather_rows_kernel[(triton.cdiv(m, BLOCK_M), len(srcs))](
        src[0], src_b, a, dst[0], dst_b, c, a, c, m, w, heads, block_size,
        src[0].stride(0), src_b.stride(0), dst[0].stride(0), dst_b.stride(0), a.stride(0), *s_c,
        LISTED=listed, TAIL=tail, BLOCK_M=BLOCK_M, BLOCK_W=BLOCK_W, num_warps=4)


def swap_in(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]]; src (R, W) and dst (S, W) on the device or in pinned host
    memory (a device -> host copy writes the host rows over UVA)."""
    _gather((src,), (dst,), (src_rows, dst_rows), src_rows.numel(), listed=True)


def swap_in_pair(src_a: torch.Tensor, src_b: torch.Tensor, src_rows: torch.Tensor, dst_a: torch.Tensor,
                 dst_b: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """swap_in of src_a into dst_a and of src_b into dst_b (the same rows) in one launch."""
    _gather((src_a, src_b), (dst_a, dst_b), (src_rows, dst_rows), src_rows.numel(), listed=True)


def backup_token(k: torch.Tensor, v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor, start: torch.Tensor,
                 units: torch.Tensor, tail: bool, block_size: int) -> None:
    """A decode token's k, v (B * H, W) rows into the pool's dst_k, dst_v at their positions start
    (B,): in the float tails (tail: units are their first rows (B, H)), or in the main pool
    (units are the block tables (B, W))."""
    _gather((k, v), (dst_k, dst_v), (start, units), k.shape[0], listed=False, tail=tail,
            heads=k.shape[0] // start.shape[0], block_size=block_size)


def swap_in_dequant(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    rows_per_block: int, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor,
                    layout: str = "block") -> None:
    """Fused gather + dequantize of packed rows (pinned host or device) into dst (S, D)."""
    if packed.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("swap_in_dequant needs unit stride in the last dim; pass .contiguous() tensors")
    _quant_triton.dequantize_rows(packed, scale, zero, bits, rows_per_block, on_device(src_rows, dst.device), dst,
                                  on_device(dst_rows, dst.device), layout)


@triton.jit
def _plan_kernel(
    p_both, p_miss, p_loaded, p_slots, p_pslots, p_head_rows, p_tables, p_seq, p_kvh, p_n, p_tail,
    p_src, p_src_tail, p_dst, K, P, bs, H,
    s_both, s_miss, s_loaded, s_slots, s_pslots, s_head_rows, s_tables, s_seq, s_kvh, s_n, s_tail,
    QUANT: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < K + P
    sel, pre = m & (o < K), m & (o >= K)
    tok = tl.maximum(tl.load(p_both + r * s_both + o, mask=m, other=0), 0)
    take = (tl.load(p_miss + r * s_miss + o, mask=sel, other=0) != 0) | (
        tl.load(p_loaded + r * s_loaded + (o - K), mask=pre, other=0) != 0)
    slot = tl.where(sel, tl.load(p_slots + r * s_slots + o, mask=sel, other=0),
                    tl.load(p_pslots + r * s_pslots + (o - K), mask=pre, other=0))
    logical = tok // bs
    offset = tok % bs
    seq = tl.load(p_seq + r * s_seq)
    blk = tl.maximum(tl.load(p_tables + seq * s_tables + logical, mask=m, other=0), 0)
    main = (blk * H + tl.load(p_kvh + r * s_kvh)) * bs + offset          # host_pool.block_rows
    out = r * (K + P) + o
    if QUANT:   # a token of the last token's block is read from the float tail (decode.tail_block)
        in_tail = logical >= (tl.load(p_n + r * s_n) - 1) // bs
        tl.store(p_src + out, tl.where(take & (~in_tail), main, -1), mask=m)
        tl.store(p_src_tail + out, tl.where(take & in_tail, tl.load(p_tail + r * s_tail) + offset, -1), mask=m)
    else:
        tl.store(p_src + out, tl.where(take, main, -1), mask=m)
    tl.store(p_dst + out, tl.load(p_head_rows + r * s_head_rows) + slot, mask=m)


def swap_plan(both, miss, loaded, slots, pslots, head_rows, tables, seq, kv_head, n_head, tail, block_size: int,
              num_kv_heads: int):
    R, W = both.shape
    K, P = miss.shape[1], loaded.shape[1]
    if W != K + P or slots.shape != miss.shape or pslots.shape != loaded.shape:
        raise ValueError("both must be the selection then the prefetch, with their slots and masks")
    for t in (both, miss, loaded, slots, pslots, tables):
        if t.shape[1] and t.stride(1) != 1:
            raise ValueError("the plan's row tensors need contiguous rows")
    src = torch.empty(R * W, dtype=torch.int64, device=both.device)
    dst = torch.empty(R * W, dtype=torch.int64, device=both.device)
    src_tail = torch.empty(R * W, dtype=torch.int64, device=both.device) if tail is not None else None
    quant = tail is not None
    tail_arg = tail if quant else head_rows
    BLOCK = min(next_pow2(W), 1024)
    _plan_kernel[(R, triton.cdiv(W, BLOCK))](
        both, miss.view(torch.uint8), loaded.view(torch.uint8), slots, pslots, head_rows, tables, seq, kv_head,
        n_head, tail_arg, src, src_tail if quant else src, dst, K, P, block_size, num_kv_heads,
        both.stride(0), miss.stride(0), loaded.stride(0), slots.stride(0), pslots.stride(0), head_rows.stride(0),
        tables.stride(0), seq.stride(0), kv_head.stride(0), n_head.stride(0), tail_arg.stride(0),
        QUANT=quant, BLOCK=BLOCK,
    )
    return src, src_tail, dst


def _layers_blocks(w: int) -> tuple[int, int]:
    BLOCK_W = min(next_pow2(w), 1024)
    return max(1, min(32, 2048 // BLOCK_W)), BLOCK_W


def gather_layers(table: torch.Tensor, srcs: list[torch.Tensor], rows: torch.Tensor, out: torch.Tensor) -> None:
    """out[l, i] = srcs[l][rows[i]] (or rows[l, i]) in one launch, the sources read at their
    device addresses in ``table`` (L,) int64 (swap_in._layer_table): rows of 4-byte multiples at
    4-byte aligned addresses, one row stride; rows (M,) or (L, M), contiguous."""
    words = out.view(torch.int32)
    w, M = words.shape[-1], rows.shape[-1]
    BLOCK_M, BLOCK_W = _layers_blocks(w)
    stride = srcs[0].stride(0) * srcs[0].element_size() // 4
    _gather_layers_kernel[(triton.cdiv(M, BLOCK_M), len(srcs))](
        table, rows, words, M, w, M if rows.dim() == 2 else 0, stride, words.stride(0), words.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_W=BLOCK_W, num_warps=4)


_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def scatter_layers(table: torch.Tensor, dsts: list[torch.Tensor], rows: torch.Tensor, src: torch.Tensor,
                   word: int) -> None:
    """dsts[l][rows[i]] = src[l, i] (rows (M,) or (L, M), contiguous; -1: none) in one launch, the
    destinations written at their device addresses in ``table``: rows of ``word``-byte multiples
    at ``word``-aligned addresses, one row stride; src (L, M, ...) contiguous."""
    words = src.view(torch.uint8).view(_WORDS[word]).view(src.shape[0], src.shape[1], -1)
    w, M = words.shape[-1], rows.shape[-1]
    BLOCK_M, BLOCK_W = _layers_blocks(w)
    _scatter_layers_kernel[(triton.cdiv(M, BLOCK_M), len(dsts))](
        table, rows, words, M, w, M if rows.dim() == 2 else 0, dsts[0].stride(0) * dsts[0].element_size() // word,
        words.stride(0), words.stride(1), WORD=word, BLOCK_M=BLOCK_M, BLOCK_W=BLOCK_W, num_warps=4)
