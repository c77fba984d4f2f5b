"""Quantize variants kept for measurements: the benchmark-only kernels and every kernel's tuning.

The product quantizes through ``hi_sparse.kernels.quantize_blocks`` (the kernel
``_quant_triton.auto_method`` picks, at its default launch geometry). Benchmarks and the kernel
tests compare against, and sweep, more: :func:`quantize` here takes ``method`` ("auto", "words",
"twopass", "relay", and the two kept only as baselines, "fused": one register tile per block,
and "split": a partial min / max kernel, then a pack kernel, the input read twice) and the launch
geometry of each. Measurements: docs/BENCHMARKS.md (block quantize sessions).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hi_sparse.kernels import _quant_triton as Q
from hi_sparse.kernels._launch import next_pow2
from hi_sparse.kernels._quant_triton import _load_units, _pack_with, _tile_min_max

MINMAX_CHUNK = 16384     # split: values per partial min / max program (H200 sweep: 16384 / 8 warps best)
METHODS = ("auto", "fused", "split", "words", "relay", "twopass")


@triton.jit
def _minmax_kernel(p_x, p_part, numel, C, CHUNK: tl.constexpr):
    """Partial min / max of chunk c of block n (blocks flattened to numel values): part (N, C, 2)."""
    i_n = tl.program_id(0).to(tl.int64)
    i_c = tl.program_id(1)
    o = i_c * CHUNK + tl.arange(0, CHUNK)
    m = o < numel
    b_x = tl.load(p_x + i_n * numel + o, mask=m, other=0.0).to(tl.float32)
    p_out = p_part + (i_n * C + i_c) * 2
    tl.store(p_out, tl.min(tl.where(m, b_x, float("inf")), 0))
    tl.store(p_out + 1, tl.max(tl.where(m, b_x, float("-inf")), 0))


@triton.jit
def _pack_loaded(b_x, p_part, p_packed, p_scale, p_zero, i_n, i_t, o_t, T, D, P, C,
                 BITS: tl.constexpr, WORDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """Pack b_x, rows o_t (tile i_t) of block i_n as loaded by _load_units with U = 8 (D % 8 == 0:
    8 codes make exactly BITS bytes, stored as in _store_groups), once the block's C partial
    min / max pairs are in p_part (N, C, 2); tile 0 also writes the block's scale and zero point."""
    o_c = tl.arange(0, BLOCK_C)
    m_c = o_c < C
    p_pn = p_part + (i_n * C + o_c) * 2
    lo = tl.min(tl.load(p_pn, mask=m_c, other=float("inf")), 0)
    hi = tl.max(tl.load(p_pn + 1, mask=m_c, other=float("-inf")), 0)
    _pack_with(b_x, lo, hi, p_packed, p_scale, p_zero, i_n, i_t, o_t, T, D, P, BITS, WORDS, BLOCK_T, BLOCK_G)


@triton.jit
def _pack_grouped_kernel(
    p_x, p_part, p_packed, p_scale, p_zero, T, D, P, C,
    BITS: tl.constexpr, WORDS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
    LOAD2D: tl.constexpr = False,
):
    """Split path, second kernel: one program per (block, tile of BLOCK_T rows) packs its tile after
    _minmax_kernel wrote the C partials (small programs keep enough loads in flight). LOAD2D: see
    _load_units."""
    i_n = tl.program_id(0).to(tl.int64)
    i_t = tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    b_x, _ = _load_units(p_x + i_n * T * D, o_t, T, D, 8, BLOCK_T, BLOCK_G, LOAD2D)
    _pack_loaded(b_x, p_part, p_packed, p_scale, p_zero, i_n, i_t, o_t, T, D, P, C, BITS, WORDS, BLOCK_T,
                 BLOCK_G, BLOCK_C)


@triton.jit
def _quantize_fused_kernel(
    p_x, p_packed, p_scale, p_zero, T, D, P,
    BITS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, WORDS: tl.constexpr,
):
    """D % 8 == 0, one program per block (BLOCK_T >= T): the whole block is one
    (BLOCK_T, BLOCK_G, 8) register tile, read from memory once."""
    i_n = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, BLOCK_T)
    b_x, m = _load_units(p_x + i_n * T * D, o_t, T, D, 8, BLOCK_T, BLOCK_G, False)
    lo, hi = _tile_min_max(b_x, m)
    _pack_with(b_x, lo, hi, p_packed, p_scale, p_zero, i_n, 0, o_t, T, D, P, BITS, WORDS, BLOCK_T, BLOCK_G)


def quantize(x: torch.Tensor, bits: int, method: str = "auto", reg_cap: int = Q.REG_CAP, fused_warps: int = 0,
             chunk: int = MINMAX_CHUNK, minmax_warps: int = 8, pack_values: int = 0, pack_warps: int = 0,
             unit: tuple[int, int] | None = None, load2d: bool = True, pack_load2d: bool = True,
             lag: int = 0, prefetch: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, T, D) -> packed (N, T, P) uint8, scale (N,), zero (N,) fp32 through ``method`` (D % 8
    == 0; other D take the general kernel). The keywords after ``method`` are launch geometry, 0
    meaning the product's default: reg_cap and fused_warps (fused, words; twopass's warps),
    chunk and minmax_warps (split's first kernel), pack_values and pack_warps (rows per tile of
    split, twopass and relay; warps of split and relay), unit and load2d (words), pack_load2d
    (split, twopass, relay), lag (relay) and prefetch (twopass)."""
    if method not in METHODS:
        raise ValueError(f"method={method!r} unknown; use one of {', '.join(METHODS)}")
    x = x.contiguous()
    n, t, d = x.shape
    if d % 8:
        return Q.launch_general(x, bits)
    if method == "auto":
        method = Q.auto_method(t, d, bits, x.element_size())
        if method == "words":
            fused_warps = fused_warps or (4 if bits == 4 else 8)
    if method == "words":
        return Q.launch_words(x, bits, unit, fused_warps or 4, load2d, reg_cap)
    if method == "twopass":
        return Q.launch_twopass(x, bits, pack_values or 2048, fused_warps or 2, pack_load2d, prefetch)
    if method == "relay":
        return Q.launch_relay(x, bits, pack_values or 2048, pack_warps or 1, lag, pack_load2d)
    if method == "fused":
        return _fused(x, bits, reg_cap, fused_warps)
    return _split(x, bits, chunk, minmax_warps, pack_values, pack_warps, pack_load2d)


def _fused(x: torch.Tensor, bits: int, reg_cap: int, warps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, t, d = x.shape
    BLOCK_T, BLOCK_G = next_pow2(t), next_pow2(d // 8)
    if BLOCK_T * BLOCK_G * 8 > reg_cap:
        raise ValueError(f"method='fused' holds a block as one register tile of at most reg_cap={reg_cap} "
                         f"values; a {t} x {d} block needs {BLOCK_T * BLOCK_G * 8}: raise reg_cap or use "
                         "method='auto'")
    packed, scale, zero = Q._outputs(x, bits)
    warps = warps or (8 if BLOCK_T * BLOCK_G * 8 > 8192 else 4)   # 8192 values: 4 warps best
    _quantize_fused_kernel[(n,)](x, packed, scale, zero, t, d, packed.shape[-1], BITS=bits, BLOCK_T=BLOCK_T,
                                 BLOCK_G=BLOCK_G, WORDS=Q.word_stores(d, bits), num_warps=warps)
    return packed, scale, zero


def _split(x: torch.Tensor, bits: int, chunk: int, minmax_warps: int, pack_values: int, pack_warps: int,
           load2d: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two streaming passes of small programs (the input is read from HBM twice)."""
    n, t, d = x.shape
    packed, scale, zero = Q._outputs(x, bits)
    chunk = min(chunk, next_pow2(t * d))      # no lanes masked off beyond a small block
    c = triton.cdiv(t * d, chunk)
    part = torch.empty(n, c, 2, device=x.device, dtype=torch.float32)
    _minmax_kernel[(n, c)](x, part, t * d, c, CHUNK=chunk, num_warps=minmax_warps)
    # H200 sweep (2026-11-30, diag_quant.py --words --split-only): 2 warps per pack program of
    # 2048 values (1024 at 8 bits)
    BLOCK_G = next_pow2(d // 8)
    BLOCK_T = Q.tile_rows(next_pow2(t), BLOCK_G, pack_values or (1024 if bits == 8 else 2048))
    _pack_grouped_kernel[(n, triton.cdiv(t, BLOCK_T))](
        x, part, packed, scale, zero, t, d, packed.shape[-1], c, BITS=bits, WORDS=Q.word_stores(d, bits),
        BLOCK_T=BLOCK_T, BLOCK_G=BLOCK_G, BLOCK_C=max(2, next_pow2(c)), LOAD2D=load2d, num_warps=pack_warps or 2)
    return packed, scale, zero
