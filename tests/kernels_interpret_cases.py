"""Triton kernels against their references under the CPU interpreter (run by test_kernels_interpret).

Run as a script in a fresh process with TRITON_INTERPRET=1 and HISPARSE_FORCE_TRITON=1 set before
anything imports Triton; prints one JSON object {case: error message or ""}. Shapes are small:
the interpreter costs about 0.5 ms per program instance.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable

import torch

import hi_sparse.kernels as K


def quant_variants():
    """benchmarks/quant_variants.py: quantize with a method and launch geometry (and the baseline
    kernels the product does not use), which the cases below check as well."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import quant_variants as module
    return module


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")           # an unwritten (NaN-poisoned) element or an overflow
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def _attention(B: int, Hq: int, Hkv: int, S: int, D: int, Kn: int, dtype: torch.dtype, tol: float) -> None:
    g = torch.Generator().manual_seed(B * 100 + D)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    slots = torch.randint(0, S, (B, Hkv, Kn), generator=g)
    slots[..., ::7] = -1                    # padding anywhere, not only at the end
    slots[0, 0] = -1                        # one group with nothing selected -> zeros
    out = K.sparse_decode_attention(q, k, v, slots.to(torch.int32))
    ref = K.reference_sparse_decode_attention(q.double().float(), k.float(), v.float(), slots)
    _need(out.dtype == dtype and out.shape == (B, Hq, D), f"bad output {out.dtype} {tuple(out.shape)}")
    err = _rel(out.float(), ref)
    _need(err < tol, f"relative error {err:.2e} >= {tol}")
    _need(bool((out[0, : Hq // Hkv] == 0).all()), "empty selection must give zeros")


def _swap(W: int, dtype: torch.dtype) -> None:
    src = (torch.randn(40, W) * 100).to(dtype)
    dst = torch.full((30, W), 7, dtype=dtype)
    if dtype.is_floating_point:
        dst.fill_(float("nan"))
    src_rows, dst_rows = torch.tensor([39, 0, 5, 17, 22]), torch.tensor([29, 3, 4, 0, 11])
    K.swap_in(src, src_rows, dst, dst_rows)
    _need(torch.equal(dst[dst_rows], src[src_rows]), "copied rows differ")
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[dst_rows] = False
    expect = torch.full_like(dst[untouched], 7) if not dtype.is_floating_point else None
    _need(bool(dst[untouched].isnan().all()) if expect is None else torch.equal(dst[untouched], expect),
          "rows outside dst_rows were written")


def _gather_layers(dtype: torch.dtype, row: tuple, every: int) -> None:
    """gather_layers (the same rows of every layer in one launch) against indexing each source:
    sources of different lengths, a row stride of ``every`` rows, -1 rows read as zeros."""
    g = torch.Generator().manual_seed(3)
    srcs = [(torch.randn(n * every, *row, generator=g) * 50).to(dtype)[::every] for n in (9, 12, 10)]
    rows = torch.tensor([[8, 1], [-1, 2], [0, 9], [3, 9], [3, 9], [-1, 9], [7, 9]])[:, 0]     # a strided column
    out = K.gather_layers(srcs, rows)
    _need(out.shape == (3, 7, *row) and out.dtype == dtype, f"shape {tuple(out.shape)} {out.dtype}")
    for layer, t in enumerate(srcs):
        want = t[rows.clamp_min(0)].clone()
        want[rows < 0] = 0
        _need(torch.equal(out[layer], want), f"layer {layer}'s rows differ")


def _gather_layers_own_rows() -> None:
    """gather_layers with each layer's own rows (L, M): layer l reads rows[l]; -1 reads zeros."""
    g = torch.Generator().manual_seed(4)
    srcs = [torch.randn(n, 6, generator=g) for n in (9, 12, 10)]
    rows = torch.tensor([[8, -1, 0, 3], [11, 2, -1, 2], [-1, -1, 9, 0]])
    out = K.gather_layers(srcs, rows)
    for layer, t in enumerate(srcs):
        want = t[rows[layer].clamp_min(0)].clone()
        want[rows[layer] < 0] = 0
        _need(torch.equal(out[layer], want), f"layer {layer}'s rows differ")


def _scatter_layers(dtype: torch.dtype, row: tuple, own: bool, column: bool) -> None:
    """scatter_layers (rows of one (L, M, ...) tensor into L tensors in one launch) against
    writing each layer's rows: rows shared (M,) or each layer's own (L, M), -1 rows writing
    nothing; ``column``: destinations that are a column slice of wider rows (a pool's packed rows
    at a narrower width), whose other columns stay."""
    g = torch.Generator().manual_seed(5)
    wide = (row[0] + 4, *row[1:]) if column else row
    dsts = [(torch.randn(n, *wide, generator=g) * 50).to(dtype) for n in (9, 12, 10)]
    before = [t.clone() for t in dsts]
    views = [t[:, :row[0]] if column else t for t in dsts]
    rows = torch.tensor([[8, -1, 0, 3], [11, 2, -1, 5], [-1, 4, 9, 1]]) if own else torch.tensor([8, -1, 0, 3])
    src = (torch.randn(3, 4, *row, generator=g) * 50).to(dtype)
    K.scatter_layers(src, views, rows)
    for layer, t in enumerate(dsts):
        r = rows[layer] if own else rows
        want = before[layer].clone()
        want[r[r >= 0], :row[0]] = src[layer][r >= 0]
        _need(torch.equal(t, want), f"layer {layer} differs")


def _swap_skip(bits: int | None) -> None:
    """A source row of -1 copies nothing (fixed-width row lists of a graph-captured decode step)."""
    d, t = 16, 8
    dst = torch.full((6, d), float("nan"))
    src_rows, dst_rows = torch.tensor([3, -1, 9, -1]), torch.tensor([0, 1, 2, 3])
    if bits is None:
        src = torch.randn(12, d)
        K.swap_in(src, src_rows, dst, dst_rows)
        ref = src[[3, 9]]
    else:
        packed, scale, zero = K.reference_quantize_blocks(torch.randn(2, t, d), bits)
        flat = packed.reshape(2 * t, -1)
        K.swap_in_dequant(flat, scale, zero, bits, t, src_rows, dst, dst_rows)
        ref = torch.full((6, d), float("nan"))
        K.reference_swap_in_dequant(flat, scale, zero, bits, t, src_rows, ref, dst_rows)
        ref = ref[[0, 2]]
    _need(torch.allclose(dst[[0, 2]], ref, rtol=1e-6, atol=1e-6), "present rows differ")
    _need(bool(dst[[1, 3, 4, 5]].isnan().all()), "a -1 source row wrote its destination")


def _swap_dequant(bits: int, d: int = 60) -> None:
    n, t = 3, 8
    x = torch.randn(n, t, d)
    packed, scale, zero = K.reference_quantize_blocks(x, bits)
    flat = packed.reshape(n * t, -1)
    src_rows, dst_rows = torch.tensor([23, 0, 9, 16, 8]), torch.tensor([6, 0, 1, 2, 5])
    dst = torch.full((7, d), float("nan"))
    K.swap_in_dequant(flat, scale, zero, bits, t, src_rows, dst, dst_rows)
    ref = torch.full((7, d), float("nan"))
    K.reference_swap_in_dequant(flat, scale, zero, bits, t, src_rows, ref, dst_rows)
    _need(torch.allclose(dst[dst_rows], ref[dst_rows], rtol=1e-6, atol=1e-6), "dequantized rows differ")
    _need(bool(dst[[3, 4]].isnan().all()), "rows outside dst_rows were written")


def _valid_rounding(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> None:
    """Each code is a correct rounding of (x - zero) / scale: within half a step (plus float slack)."""
    d = x.shape[-1]
    codes = K.unpack_codes(packed, bits, d).double()
    exact = (x.double() - zero.double()[:, None, None]) / scale.double().clamp_min(1e-30)[:, None, None]
    exact = torch.where(scale[:, None, None] > 0, exact, torch.zeros_like(exact))
    worst = float((codes - exact).abs().max())
    _need(worst <= 0.5 + 1e-3, f"a code is {worst:.4f} steps from its value")


def _quantize(bits: int, d: int = 60, t: int = 63, n: int = 2, **tuning) -> None:
    """Public quantize_blocks, or the Triton quantize with tuning keywords (path selection) when given."""
    x = torch.randn(n, t, d) * torch.linspace(1.0, 30.0, n)[:, None, None]
    x[-1, 3:] = x[-1, 0, 0]                 # one block of few distinct values (many exact ties)
    if tuning:
        packed, scale, zero = quant_variants().quantize(x, bits, **tuning)
    else:
        packed, scale, zero = K.quantize_blocks(x, bits)
    rp, rs, rz = K.reference_quantize_blocks(x, bits)
    _need(packed.shape == rp.shape and packed.dtype == torch.uint8, f"packed shape {tuple(packed.shape)}")
    _need(torch.allclose(scale, rs, rtol=1e-6) and torch.equal(zero, rz), "scale/zero differ")
    _valid_rounding(x, packed, scale, zero, bits)


def _layout_quantize(bits: int, layout: str, n: int, t: int, d: int, channel_quant: dict | None = None) -> None:
    """quantize_blocks in a channel / token layout against the reference: the same pairs (fp16,
    equal or one rounding apart), codes that round each value against the kernel's own pair, and
    the round trip within half a step of every value. channel_quant: the channel kernel's settings
    (_quant_triton.CHANNEL_QUANT) for this call."""
    from hi_sparse.kernels import _quant_triton
    x = torch.randn(n, t, d) * torch.linspace(0.5, 20.0, d) + torch.linspace(-3.0, 3.0, d)
    x[-1, :, 1] = 2.25                     # a constant column (channel scale 0)
    x[-1, 2] = -1.0                        # a constant row (token scale 0)
    saved = dict(_quant_triton.CHANNEL_QUANT)
    _quant_triton.CHANNEL_QUANT.update(channel_quant or {})
    try:
        packed, scale, zero = K.quantize_blocks(x, bits, layout)
    finally:
        _quant_triton.CHANNEL_QUANT.update(saved)
    rp, rs, rz = K.reference_quantize_blocks(x, bits, layout)
    _need(packed.shape == rp.shape and scale.shape == rs.shape and scale.dtype == torch.float16,
          f"shapes {tuple(packed.shape)} {tuple(scale.shape)} {scale.dtype}")
    _need(torch.equal(zero, rz) and torch.allclose(scale.float(), rs.float(), rtol=1e-3, atol=0),
          "scale / zero differ from the reference")
    view = {"channel": lambda p: p.float()[:, None, :], "token": lambda p: p.float()[:, :, None]}[layout]
    s, z = view(scale), view(zero)
    levels = (1 << bits) - 1
    exact = torch.where(s > 0, ((x - z) / s.clamp_min(1e-30)).clamp(0, levels), torch.zeros_like(x))
    codes = K.unpack_codes(packed, bits, d).float()
    worst = float((codes - exact).abs().max())
    _need(worst <= 0.5 + 1e-3, f"a code is {worst:.4f} steps from its value")
    x_hat = K.dequantize_blocks(packed, scale, zero, bits, d, layout=layout)
    err = (x_hat - x).abs() - (0.5 * s + 1e-3 * x.abs() + 1e-6)
    _need(float(err.max()) <= 0, f"a value is {float(err.max()):.3g} past half a step")


def _layout_swap_dequant(bits: int, layout: str, d: int, wide_rows: bool = False, first_row: int = 9) -> None:
    """swap_in_dequant in a channel / token layout against the reference: rows in a run of one
    block (one pair read for the run) and rows of other blocks, a -1 row, NaN-poisoned dst; with
    wide_rows the packed rows are a view [:, :P] of 8-bit-wide rows (a mixed-width host pool);
    first_row: the first source row (-1: a skipped row first)."""
    n, t = 3, 8
    packed, scale, zero = K.reference_quantize_blocks(torch.randn(n, t, d) * 4 + 1, bits, layout)
    flat = packed.reshape(n * t, -1)
    if wide_rows:
        wide = torch.zeros(n * t, K.packed_width(d, 8), dtype=torch.uint8)
        wide[:, : flat.shape[1]] = flat
        flat = wide[:, : flat.shape[1]]
    if layout == "token":
        scale, zero = scale.reshape(-1), zero.reshape(-1)
    src_rows = torch.tensor([first_row, 10, 11, 12, 23, -1, 0, 16])
    dst_rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8])
    dst = torch.full((10, d), float("nan"))
    K.swap_in_dequant(flat, scale, zero, bits, t, src_rows, dst, dst_rows, layout)
    ref = torch.full((10, d), float("nan"))
    K.reference_swap_in_dequant(flat, scale, zero, bits, t, src_rows, ref, dst_rows, layout)
    done = [int(dst_rows[i]) for i in range(len(src_rows)) if src_rows[i] >= 0]
    rest = [i for i in range(len(dst)) if i not in done]
    _need(torch.allclose(dst[done], ref[done], rtol=1e-6, atol=1e-6), "dequantized rows differ")
    _need(bool(dst[rest].isnan().all()), "a -1 row or a row outside dst_rows was written")


def _swap_dequant_skipped_programs(bits: int, layout: str, d: int) -> None:
    """swap_in_dequant where whole programs of rows are -1 (a decode step's hits: such a program
    stops early) before and after the rows to copy, against the reference."""
    n, t = 3, 8
    packed, scale, zero = K.reference_quantize_blocks(torch.randn(n, t, d) * 4 + 1, bits, layout)
    flat = packed.reshape(n * t, -1)
    if layout == "token":
        scale, zero = scale.reshape(-1), zero.reshape(-1)
    src_rows = torch.tensor([-1] * 130 + [10, 11, -1, 23, 0, 16] + [-1] * 70)
    dst_rows = torch.arange(len(src_rows))
    dst = torch.full((len(src_rows), d), float("nan"))
    K.swap_in_dequant(flat, scale, zero, bits, t, src_rows, dst, dst_rows, layout)
    ref = torch.full((len(src_rows), d), float("nan"))
    K.reference_swap_in_dequant(flat, scale, zero, bits, t, src_rows, ref, dst_rows, layout)
    done = (src_rows >= 0).nonzero().flatten()
    _need(len(done) == 5 and torch.allclose(dst[done], ref[done], rtol=1e-6, atol=1e-6), "dequantized rows differ")
    _need(bool(dst[src_rows < 0].isnan().all()), "a -1 row was written")


def _constant_block() -> None:
    x = torch.full((2, 16, 64), -1.5)
    packed, scale, zero = K.quantize_blocks(x, 6)
    _need(torch.equal(scale, torch.zeros(2)) and torch.equal(zero, x[:, 0, 0]), "constant block: scale must be 0")
    _need(torch.equal(K.dequantize_blocks(packed, scale, zero, 6, 64), x), "constant block must round-trip exactly")


def _auto_picks(bits: int, t: int, method: str) -> None:
    from hi_sparse.kernels import _quant_triton
    picked = _quant_triton.auto_method(t, 64, bits, 4)
    _need(picked == method, f"auto picks {picked}")
    _quantize(bits, 64, t, 2)


def _relay_infinite_block() -> None:
    """A block of +-inf values through the relay kernel: its min / max word is not the empty word
    the programs poll for, so the run ends and the zero point is -inf."""
    from hi_sparse.kernels import _quant_triton
    x = torch.randn(3, 16, 64)
    x[1] = float("inf")
    x[1, 0, 0] = float("-inf")
    _, _, zero = _quant_triton.launch_relay(x, 4, tile_values=512)
    _need(zero[1] == float("-inf") and bool(torch.isfinite(zero[[0, 2]]).all()), f"zero points {zero.tolist()}")


def _fused_too_big() -> None:
    try:
        quant_variants().quantize(torch.randn(1, 64, 128), 4, method="fused", reg_cap=4096)
    except ValueError as exc:
        _need("raise reg_cap or use method='auto'" in str(exc), f"unclear message: {exc}")
    else:
        _need(False, "a block over reg_cap must be refused by method='fused'")


def _dequantize(bits: int, d: int = 60) -> None:
    x = torch.randn(2, 63, d)
    packed, scale, zero = K.reference_quantize_blocks(x, bits)
    for dtype in (torch.float32, torch.float16):
        out = K.dequantize_blocks(packed, scale, zero, bits, d, dtype=dtype)
        ref = K.reference_dequantize_blocks(packed, scale, zero, bits, d, dtype=dtype)
        _need(out.dtype == dtype and torch.allclose(out.float(), ref.float(), rtol=1e-3, atol=1e-6),
              f"{dtype}: dequantized values differ")


def _bounds() -> None:
    k = torch.randn(2, 63, 60)
    kmin, kmax = K.block_bounds(k, 16)
    rmin, rmax = K.reference_block_bounds(k, 16)
    _need(torch.equal(kmin, rmin) and torch.equal(kmax, rmax), "bounds differ")


def _scores_listed() -> None:
    q, kmin = torch.randn(2, 2, 3, 60), torch.randn(2, 2, 40, 60)
    kmax = kmin + torch.rand(2, 2, 40, 60)
    blocks = torch.randint(-1, 40, (2, 2, 21))
    s = K.block_scores(q, kmin, kmax, blocks)
    ref = K.reference_block_scores(q, kmin, kmax, blocks)
    _need(torch.equal(torch.isinf(s), blocks < 0), "listed scores: -1 entries must score -inf")
    err = _rel(torch.where(blocks >= 0, s, 0.0), torch.where(blocks >= 0, ref, 0.0))
    _need(s.shape == (2, 2, 21) and err < 1e-5, f"listed scores differ: {err:.2e}")


def _two_level_per_row() -> None:
    """Rows of a batch with their own limits (NaN bounds past a row's blocks) give each row what a
    call with that row's limit gives."""
    q, kmin = torch.randn(3, 2, 3, 60), torch.randn(3, 2, 45, 60)
    kmax = kmin + torch.rand(3, 2, 45, 60)
    kmin[2, :, 20:], kmax[2, :, 20:] = float("inf"), float("-inf")       # row 2 holds 20 blocks
    smin, smax = K.superblock_bounds(kmin, kmax, 4)
    limits = torch.tensor([38, 45, 17])
    blocks, sc = K.two_level_candidates(q, kmin, kmax, smin, smax, 4, n_super=3, limit=limits[:, None])
    for r, lim in enumerate(limits.tolist()):
        b1, s1 = K.two_level_candidates(q[r:r + 1], kmin[r:r + 1], kmax[r:r + 1], smin[r:r + 1], smax[r:r + 1], 4,
                                        n_super=3, limit=lim)
        for h in range(2):
            got = sorted(zip(blocks[r, h].tolist(), sc[r, h].tolist()))
            want = sorted(zip(b1[0, h].tolist(), s1[0, h].tolist()))
            _need([b for b, _ in got] == [b for b, _ in want], f"row {r}: candidate blocks differ")
            for (b, x), (_, y) in zip(got, want):
                _need(b < 0 and x == float("-inf") or abs(x - y) <= 1e-4 * max(1.0, abs(y)), f"row {r}: scores")


def _strided_bounds() -> None:
    """Bounds sliced out of wider ones (a bank's, holding more blocks than are in use) are read in
    place through their strides: the same scores as from contiguous copies, every mode."""
    q, full = torch.randn(2, 3, 2, 60), torch.randn(2, 3, 57, 60)
    wider = torch.cat([full, full[:, :, :5]], 2) + torch.rand(2, 3, 62, 60)          # strides of its own
    kmin, kmax = full[:, :, :45], wider[:, :, :45]
    _need(not kmin.is_contiguous(), "the case needs strided bounds")
    idx = torch.randint(-1, 45, (2, 3, 7))
    for mode, blocks in (("every block", None), ("listed blocks", idx)):
        got = K.block_scores(q, kmin, kmax, blocks)
        want = K.block_scores(q, kmin.contiguous(), kmax.contiguous(), blocks)
        _need(torch.equal(got, want), f"scores of strided bounds differ ({mode})")
    smin, smax = K.superblock_bounds(kmin.contiguous(), kmax.contiguous(), 4)
    wide_s = torch.randn(2, 3, 15, 60)
    wide_s[:, :, :12], wide_s2 = smin, torch.randn(2, 3, 15, 60)
    wide_s2[:, :, :12] = smax
    a = K.two_level_candidates(q, kmin, kmax, wide_s[:, :, :12], wide_s2[:, :, :12], 4, n_super=3, limit=40)
    b = K.two_level_candidates(q, kmin.contiguous(), kmax.contiguous(), smin, smax, 4, n_super=3, limit=40)
    _need(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "two-level candidates of strided bounds differ")


def _two_level() -> None:
    q, kmin = torch.randn(2, 2, 3, 60), torch.randn(2, 2, 45, 60)
    kmax = kmin + torch.rand(2, 2, 45, 60)
    smin, smax = K.superblock_bounds(kmin, kmax, 4)                     # 12 super-blocks, last partial
    s_sup = K.block_scores(q, smin, smax, limit=10)
    _need(bool(torch.isinf(s_sup[..., 10:]).all()), "super-blocks at or past limit must score -inf")
    blocks, sc = K.two_level_candidates(q, kmin, kmax, smin, smax, 4, n_super=3, limit=38)
    sup = K.top_blocks(K.reference_block_scores(q, smin, smax, limit=10), 3)
    want = (sup[..., None] * 4 + torch.arange(4)).flatten(-2)
    want = torch.where(want < 38, want, -1)
    ref = K.reference_block_scores(q, kmin, kmax, want)
    for r in range(4):
        got_r = sorted(zip(blocks.view(4, -1)[r].tolist(), sc.view(4, -1)[r].tolist()))
        want_r = sorted(zip(want.view(4, -1)[r].tolist(), ref.view(4, -1)[r].tolist()))
        _need([b for b, _ in got_r] == [b for b, _ in want_r], f"row {r}: candidate blocks differ")
        for (b, x), (_, y) in zip(got_r, want_r):
            _need((b < 0 and x == float("-inf")) or abs(x - y) <= 1e-4 * max(1.0, abs(y)), f"row {r}: scores differ")


def _scores() -> None:
    q, kmin = torch.randn(2, 2, 3, 60), torch.randn(2, 2, 40, 60)
    kmax = kmin + torch.rand(2, 2, 40, 60)
    s = K.block_scores(q, kmin, kmax)
    err = _rel(s, K.reference_block_scores(q, kmin, kmax))
    _need(s.shape == (2, 2, 40) and err < 1e-5, f"scores differ: {err:.2e}")


def _install(masked: bool, flag: bool, broadcast: bool) -> None:
    """install_slots on a consistent random state (tokens resident in some slots, the map its
    inverse): the kernel writes what the reference does to every state column (not the spill
    columns or column 0 of the map, which hold no state)."""
    g = torch.Generator().manual_seed(int(masked) * 4 + int(flag) * 2 + int(broadcast))
    H, S, T, M = 3, 40, 120, 17
    slot_token = torch.full((H, S + 1), -1, dtype=torch.int64)
    token_slot = torch.full((H, 1 + T), -1, dtype=torch.int64)
    for h in range(H):
        toks = torch.randperm(T, generator=g)[:30]
        slots = torch.randperm(S, generator=g)[:30]
        slot_token[h, slots] = toks
        token_slot[h, toks + 1] = slots
    stamp = torch.randint(0, 1 << 40, (H, S + 1), generator=g)
    pf = torch.rand(H, S + 1, generator=g) < 0.3
    pf[:, S] = False
    slots = torch.stack([torch.randperm(S, generator=g)[:M] for _ in range(H)])
    if broadcast:                               # one token list and stamp run for every head
        free = [t for t in range(T) if all(int(token_slot[h, t + 1]) < 0 for h in range(H))]
        tokens = torch.tensor(free[:M])[None].expand(H, -1)
        stamps = (1000 + torch.arange(M))[None].expand(H, -1)
    else:
        tokens = torch.stack([torch.tensor([t for t in torch.randperm(T, generator=g).tolist()
                                            if int(token_slot[h, t + 1]) < 0][:M]) for h in range(H)])
        stamps = torch.randint(1 << 41, 1 << 42, (H, M), generator=g)
    mask = torch.rand(H, M, generator=g) < 0.6 if masked else None
    got = [t.clone() for t in (token_slot, slot_token, stamp, pf)]
    want = [t.clone() for t in (token_slot, slot_token, stamp, pf)]
    K.install_slots(*got, mask, tokens, slots, stamps, flag)
    K.reference_install_slots(*want, mask, tokens, slots, stamps, flag)
    for name, a, b in zip(("token_slot", "slot_token", "slot_stamp", "prefetched"), got, want):
        a, b = (a[:, 1:], b[:, 1:]) if name == "token_slot" else (a[:, :S], b[:, :S])
        _need(torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:5].tolist()}")


def _insert_one(per_head: bool) -> None:
    """A decode step's append (HotBufferState.insert of one token, with its key and value) in one
    Triton launch against the torch path: the same slots returned, the same LRU state and the same
    hot K / V rows (of the bank's second row: heads past the first row's), with empty slots left,
    after lookups that reorder the stamps, and when every slot is taken (an eviction)."""
    from hi_sparse.hot_buffer import HotBufferBank, ticks
    H, S, D = 3, 12, 5
    banks = [HotBufferBank(H, S, "cpu", rows=2, kernels=k) for k in (False, True)]
    hot = [(torch.zeros(2 * H * S, D), torch.zeros(2 * H * S, D, dtype=torch.float16)) for _ in banks]
    g = torch.Generator().manual_seed(3)
    n = 5
    for b in banks:
        b.rows(1).ensure_tokens(64)
        b.rows(1).insert(torch.arange(n), b.reserve(ticks(inserted=n)))
    for step in range(14):
        if step % 3 == 2:                                       # a lookup reorders the stamps
            sel = torch.stack([torch.randperm(n, generator=g)[:4] for _ in range(H)])
            for b in banks:
                b.rows(1).lookup(sel, b.reserve(ticks(selected=4)))
        pos = torch.full((H, 1), n) if per_head else torch.tensor([n])
        k, v = torch.randn(H, 1, D, generator=g), torch.randn(H, 1, D, generator=g)
        got = [b.rows(1).insert(pos, b.reserve(ticks(inserted=1)), (k, v, *kv)) for b, kv in zip(banks, hot)]
        n += 1
        _need(torch.equal(got[0], got[1]), f"step {step}: slots {got[1].tolist()} against {got[0].tolist()}")
        for name in ("slot_token", "slot_stamp", "prefetched", "token_slot"):     # without the spill columns
            a, c = (getattr(b, name) for b in banks)
            _need(torch.equal(a, c), f"step {step}: {name} differs")
        _need(all(torch.equal(x, y) for x, y in zip(*hot)), f"step {step}: the hot K / V rows differ")
    _need(bool(hot[1][0][H * S:].abs().sum() > 0) and bool(hot[1][0][:H * S].abs().sum() == 0),
          "the keys went to the wrong row's slots")


def _pin_one(seed: int, A: int, bf16: bool, scale: float) -> None:
    """A decode token's anchor scoring and merge (anchors.pin_new_tokens with one token, kernels
    on) against the torch path, step by step from empty anchors to full ones that new tokens
    displace: the same anchors, probabilities within fp32 rounding; tokens under the threshold
    change nothing; equal (saturated) probabilities keep the anchors first."""
    from hi_sparse.anchors import pin_new_tokens
    from hi_sparse.probe import ImportanceProbe, threshold_constants, write_params
    from hi_sparse.row_bank import RowBank

    g = torch.Generator().manual_seed(seed)
    B, H, D = 3, 2, 24
    probe = ImportanceProbe(D, seed=seed)
    with torch.no_grad():
        for prm in probe.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * scale)   # scale 1: saturated, ties
    banks = []
    for _ in range(2):
        bank = RowBank("cpu")
        bank.add("anchors", (H, A), torch.int64, -1)
        bank.add("anchor_p", (H, A), torch.float32, -1.0)
        bank.grow_rows(B + 1)
        banks.append(bank)
    thresholds = (2.0, 0.2, 0.9)                     # at lengths 7-3060: 0.2 (the floor) to 0.79
    # not fitted yet: the kernel runs and pins nothing (its gate's threshold is 2); the fit opens
    # the gate in place (write_params), as a recalibration does under a captured step
    k0 = torch.randn(B, H, 1, D, generator=g)
    pin_new_tokens(probe, banks[0], slice(1, B + 1), k0, torch.full((B, H, 1), 50), torch.zeros(B, dtype=torch.int64),
                   thresholds, True)
    _need(bool((banks[0].t["anchors"] == -1).all() and (banks[0].t["anchor_p"] == -1).all()),
          "an unfitted probe's kernel pinned a token")
    gate = probe.gate(torch.device("cpu"), *thresholds)
    write_params([probe], [probe.fc1.weight.T[None].clone(), probe.fc1.bias[None].clone(),
                           probe.fc2.weight.clone(), probe.fc2.bias.clone()])
    _need(probe.fitted and gate is probe.gate(torch.device("cpu"), *thresholds)
          and torch.equal(gate, threshold_constants(torch.device("cpu"), *thresholds)), "the fit left the gate shut")
    n_kept = displaced = 0
    for step in range(4 * A):
        full_before = (banks[1].t["anchors"] >= 0).all(-1)
        before = banks[1].t["anchors"].clone()
        k = torch.randn(B, H, 1, D, generator=g)
        k = k.bfloat16() if bf16 else k
        pos = (torch.tensor([100, 7, 3000]) + step)[:, None, None].expand(B, H, 1)
        for bank, kernels in zip(banks, (True, False)):
            pin_new_tokens(probe, bank, slice(1, B + 1), k, pos, torch.zeros(B, dtype=torch.int64), thresholds,
                           kernels)
        got, want = banks[0].t, banks[1].t
        _need(torch.equal(got["anchors"], want["anchors"]),
              f"step {step}: anchors {got['anchors'].tolist()} against {want['anchors'].tolist()}")
        _need(torch.allclose(got["anchor_p"], want["anchor_p"], rtol=1e-5, atol=1e-6), f"step {step}: anchor_p")
        n_kept = int((want["anchors"] >= 0).sum())
        displaced += int((full_before & (want["anchors"] != before).any(-1)).sum())
    _need(n_kept >= B * H * A // 2 and displaced > 0,
          f"{n_kept} of {B * H * A} anchors held, {displaced} displaced: the case tests too little")
    _need(bool((banks[0].t["anchors"][0] == -1).all()), "a row outside the batch changed")


def _fit_data(g: torch.Generator, P: int, N: int, D: int, HID: int, pad: int) -> tuple:
    """A fit iteration's inputs (kernels/probe.py fit_grads): keys of fp16 values, targets in [0, 1],
    the last ``pad`` rows of each probe padding (weight 0, keys 0, as fit_iterations pads)."""
    x = torch.randn(P, N, D, generator=g).half().float()
    y = torch.rand(P, N, generator=g) ** 4
    wn = torch.rand(P, N, generator=g) / N
    x[:, N - pad:], y[:, N - pad:], wn[:, N - pad:] = 0, 0, 0
    params = (torch.randn(P, D, HID, generator=g) * D ** -0.5, torch.randn(P, HID, generator=g) * 0.1,
              torch.randn(P, HID, generator=g) * HID ** -0.5, torch.randn(P, generator=g) * 0.1)
    return x, y, wn, params


def _fit_grads(P: int, N: int, D: int, HID: int, want_z: bool, share: float | None = None) -> None:
    """A probe fit's gradients in one launch against the torch ops they replace: several programs a
    probe (the interpreter's 4 multiprocessors), each over one or more tiles of rows, a ragged last
    tile, non-power-of-2 widths, padding rows. ``share`` (FIT_SM_SHARE): fewer programs than work
    items, each looping over several (of different probes), with the same sums as one a program."""
    from hi_sparse.kernels import _probe_triton
    from hi_sparse.kernels.probe import fit_grads, reference_fit_grads
    x, y, wn, params = _fit_data(torch.Generator().manual_seed(P * N), P, N, D, HID, pad=N // 5)
    _probe_triton.FIT_SM_SHARE = share
    try:
        got, z = fit_grads(x, y, wn, *params, want_z=want_z)
        if share is not None:       # the items' sums are the same whichever program ran them
            _probe_triton.FIT_SM_SHARE = None
            alone, _ = fit_grads(x, y, wn, *params, want_z=False)
            _need(all(torch.equal(a, b) for a, b in zip(got, alone)), "a looping program's sums differ")
    finally:
        _probe_triton.FIT_SM_SHARE = None
    want, want_z_ = reference_fit_grads(x, y, wn, *params)
    for name, a, b in zip(("dw1", "dc1", "dw2", "dc2"), got, want):
        _need(a.shape == b.shape and _rel(a, b) < 1e-5, f"{name}: {tuple(a.shape)}, rel {_rel(a, b):.2e}")
    _need(z is None if not want_z else _rel(z, want_z_) < 1e-6, "z")


def _fit_whole() -> None:
    """fit_probes (probes of different training sizes, padded) with the kernel's gradients ends where
    the torch fit ends: parameters and losses within float rounding after 40 Adam iterations."""
    import pytest

    from hi_sparse.kernels._dispatch import FORCE_ENV
    from hi_sparse.probe import ImportanceProbe, fit_probes
    g = torch.Generator().manual_seed(9)
    D = 20
    data = [(torch.randn(n, D, generator=g).half().float(), torch.rand(n, generator=g) ** 6) for n in (40, 90)]
    kernel, torch_ = ([ImportanceProbe(D, seed=i) for i in range(2)] for _ in range(2))
    got = fit_probes(kernel, data, steps=40)
    os.environ[FORCE_ENV] = "0"
    try:
        want = fit_probes(torch_, data, steps=40)
    finally:
        os.environ[FORCE_ENV] = "1"
    _need(got == pytest.approx(want, rel=1e-4, abs=1e-6), f"losses {got} against {want}")
    for a, b in zip(kernel, torch_):
        for pa, pb in zip(a.parameters(), b.parameters()):
            _need(_rel(pa.detach(), pb.detach()) < 1e-4, f"parameters apart: {_rel(pa.detach(), pb.detach()):.2e}")
    _need(want[0] < 0.9 * ImportanceProbe(D).fit(*data[0], steps=1),
          "the fit learned nothing: the case tests too little")


def _hot_buffer_oracle() -> None:
    """The hot buffer's LRU oracle test (tests/test_hot_buffer.py) with its banks' kernels on:
    every lookup, prefetch and install a Triton launch."""
    from test_hot_buffer import test_lru_matches_naive_oracle as oracle

    from hi_sparse.hot_buffer import HotBufferBank
    init = HotBufferBank.__init__
    HotBufferBank.__init__ = lambda self, *a, **kw: init(self, *a, **{**kw, "kernels": True})
    try:
        for seed, S, H, near in ((1, 6, 2, False), (7, 17, 3, True), (42, 24, 1, False), (99, 9, 3, True)):
            oracle.hypothesis.inner_test(seed=seed, S=S, H=H, near_limit=near)
    finally:
        HotBufferBank.__init__ = init


def _prefetch_room() -> None:
    """A prefetch right after a lookup, with no limit of its own, takes at most the room the
    lookup left per head (S - selected) and stamps after the lookup's stamps: a head whose
    selection filled every slot prefetches nothing, the other loads all; kernels as the torch path."""
    from hi_sparse.hot_buffer import HotBufferBank, ticks
    H, S = 2, 6
    loaded = []
    for kernels in (True, False):
        b = HotBufferBank(H, S, "cpu", rows=1, kernels=kernels)
        b.rows(0).ensure_tokens(16)
        b.rows(0).insert(torch.arange(10), b.reserve(ticks(inserted=S)))            # 4..9 resident
        state = b.rows(0)
        sel = torch.tensor([[1, 2, 3, 7, 8, 9], [4, 5, -1, -1, -1, -1]])        # head 0: 3 hits, 3 misses
        state.lookup(sel, b.reserve(ticks(selected=6, prefetched=2)), prefetch=2)
        got, _ = state.prefetch(torch.tensor([[0, 4], [0, 1]]))             # 4 was a victim of head 0
        loaded.append((got.tolist(), b.slot_stamp.clone(), b.slot_token.clone()))
    _need(loaded[0][0] == [[False, False], [True, True]], f"loaded {loaded[0][0]}")
    _need(torch.equal(loaded[0][1], loaded[1][1]) and torch.equal(loaded[0][2], loaded[1][2]),
          "the kernel's stamps or slots differ from the torch path's")


def _engine_decode_kernels(bits: int | None = None, T: int = 200, group: int = 16,
                           lru_step_heads: int | None = None) -> None:
    """Decode steps of an engine with decode_kernels (the selection's assembly and the hot buffer's
    lookup, prefetch and install as Triton kernels) leave the same LRU state, hit counts and
    outputs as one on the torch reference. T 800 and group 2: two-level scoring applies (48
    blocks and more), and its listed blocks are ranked as they are (selection.select).
    lru_step_heads: hot_buffer.LRU_STEP_MAX_HEADS for the run (0: the four-launch lookup and
    prefetch)."""
    from hi_sparse import hot_buffer
    from hi_sparse.config import HiSparseConfig
    from hi_sparse.engine import HiSparseEngine
    from hi_sparse.metrics import DEVICE_COUNTERS
    from hi_sparse.workloads import run_decode, run_prefill

    base = dict(max_seq_len=1024, cache_block_size=16, window_size=16, global_tokens=4, top_k=48,
                audit_every=0, telemetry=False, recalibrate_every=1 << 20, host_kv_bits=bits, bound_group=group)
    g = torch.Generator().manual_seed(3)
    k, v, q = torch.randn(1, 2, T, 16, generator=g), torch.randn(1, 2, T, 16, generator=g), torch.randn(
        1, 4, T, 16, generator=g)
    steps = [(torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 1, 16, generator=g),
              torch.randn(1, 2, 1, 16, generator=g)) for _ in range(10)]   # crosses a block at 208
    results = []
    limit = hot_buffer.LRU_STEP_MAX_HEADS
    for kernels in (True, False):
        eng = HiSparseEngine(HiSparseConfig(**base, decode_kernels=kernels), 1, 4, 2, 16)
        sid = eng.add_sequences(1)
        run_prefill(eng, sid, k, v, q)
        if lru_step_heads is not None:
            hot_buffer.LRU_STEP_MAX_HEADS = lru_step_heads
        try:
            outs = [run_decode(eng, sid, *step) for step in steps]
        finally:
            hot_buffer.LRU_STEP_MAX_HEADS = limit
        bank = eng.layers[0].hot
        bounds = [eng.layers[0].bank.t[name].clone() for name in ("kmin", "kmax", "smin", "smax")]
        results.append((outs, [t.clone() for t in (bank.slot_token, bank.slot_stamp, bank.prefetched,
                                                     bank.token_slot)] + bounds,
                        {name: getattr(eng.stats, name) for name in DEVICE_COUNTERS}))
    (a_out, a_state, a_counts), (b_out, b_state, b_counts) = results
    # every device counter (kernels/counts.py's one launch against the reference's sums)
    _need(a_counts == b_counts and a_counts["hot_buffer_hits"] > 0 and a_counts["swap_in_bytes"] > 0,
          f"counters {a_counts} != {b_counts}")
    _need(all(torch.equal(x, y) for x, y in zip(a_state, b_state)), "the LRU state or the key bounds differ")
    _need(all(torch.equal(x, y) for x, y in zip(a_out, b_out)), "the outputs differ")


def _push_recent(B: int, R: int, shape: tuple, dtype: torch.dtype) -> None:
    """A decode step's query appended to the recent ones (kernels/recent.py) against the
    reference: every row shifted up by one, the new one last (cast to fp32), other rows untouched."""
    from hi_sparse.kernels.recent import push_recent, reference_push_recent
    g = torch.Generator().manual_seed(B * 10 + R)
    bank = torch.randn(B + 2, R, *shape, generator=g)
    new = torch.randn(B, *shape, generator=g).to(dtype)
    want = bank.clone()
    reference_push_recent(want[1:B + 1], new)
    push_recent(bank[1:B + 1], new)
    _need(torch.equal(bank, want), "the recent rows differ from the reference")


def _tally(tail: bool, R: int, P: int, N: int) -> None:
    """A decode step's counters in one launch (kernels/counts.py) against the reference's sums:
    rows of -1 count nothing; several programs add into the same counters."""
    from hi_sparse.kernels.counts import reference_tally, tally
    g = torch.Generator().manual_seed(R * 7 + N)
    counts = torch.randint(0, 50, (R, 3), generator=g)
    loaded = torch.rand(R, P, generator=g) < 0.4
    touched = torch.randint(0, 900, (R,), generator=g)                    # per row, as select's
    src = torch.where(torch.rand(N, generator=g) < 0.6, torch.randint(0, 99, (N,), generator=g), -1)
    src_tail = torch.where(src < 0, torch.randint(-1, 9, (N,), generator=g), -1) if tail else None
    start = torch.arange(7, dtype=torch.int64) * 1000
    got, want = start.clone(), start.clone()
    tally(got, counts, loaded, touched, src, src_tail, 37, 5)
    reference_tally(want, counts, loaded, touched, src, src_tail, 37, 5)
    _need(torch.equal(got, want), f"counters {got.tolist()} against {want.tolist()}")


def _select(sinks: int, sb_mult: int, prefetch: int, anchors: int, seed: int, fused: bool = True, bs: int = 8,
            top_k: int = 72, n_max: int = 400) -> None:
    """selection.select's Triton ranking and assembly (kernels=True) against its torch path: every
    field equal, on rows of different lengths (up to n_max) and paddings, anchors inside and outside
    the candidates, NaN scores past a row's tokens. fused: the mask and ranking in one launch
    (ranked_candidates), else as for rows over RANK_MAX blocks (candidate_scores + topk)."""
    import hi_sparse.selection as selection
    from hi_sparse.selection import candidate_blocks, select

    g = torch.Generator().manual_seed(seed)
    R, window = 5, 16
    n = torch.randint(100, n_max, (R, 1), generator=g)
    n[0] = 30                                           # shorter than the budget: everything visible
    first = torch.randint(0, 20, (R, 1), generator=g)
    first[1] = 0
    nb = -(-int(n.max()) // bs)
    scores = torch.randn(R, nb, generator=g)
    scores[torch.arange(nb)[None] * bs >= n] = float("nan")
    anc = torch.randint(-1, n_max, (R, anchors), generator=g)
    n_cand = candidate_blocks(nb, int(n.max()) - window, int(first.min()), bs)
    kw = dict(sinks=sinks, store_block=bs * sb_mult)
    want = select(scores, n, first, window, top_k, bs, anc, None, prefetch, n_cand, **kw)
    calls: list[str] = []
    saved = {name: getattr(selection, name) for name in ("ranked_candidates", "candidate_scores", "RANK_MAX")}
    for name in ("ranked_candidates", "candidate_scores"):                # which launches the branch makes
        setattr(selection, name, lambda *a, fn=saved[name], name=name: calls.append(name) or fn(*a))
    selection.RANK_MAX = saved["RANK_MAX"] if fused else 0
    try:
        got = select(scores, n, first, window, top_k, bs, anc, None, prefetch, n_cand, kernels=True, **kw)
    finally:
        for name, value in saved.items():
            setattr(selection, name, value)
    _need(calls == ["ranked_candidates" if fused else "candidate_scores"], f"the kernel branch called {calls}")
    for name in ("tokens", "prefetch", "block_hits", "loaded", "both"):
        a, b = getattr(got, name), getattr(want, name)
        _need(a.shape == b.shape and torch.equal(a, b), f"{name} differs: {a.tolist()} != {b.tolist()}"[:600])


def _candidates(dtype: torch.dtype) -> None:
    """The ranking's input (kernels/select.py candidate_scores) against select's torch mask: block j
    of row r a candidate when it starts before the window and ends after the row's first position,
    its score as fp32 there and -inf elsewhere, NaN scores past a row's tokens masked."""
    from hi_sparse.kernels.select import candidate_scores
    g = torch.Generator().manual_seed(11)
    R, bs, window, nb = 6, 8, 16, 1500                   # two programs per row
    n = torch.randint(0, nb * bs, (R, 1), generator=g)
    n[0], n[1] = 10, 16 + 3 * bs                       # no candidate; the window starting at a block boundary
    first = torch.randint(0, 40, (R, 1), generator=g)
    first[2] = 3 * bs                                  # the padding ending at a block boundary
    scores = torch.randn(R, nb, generator=g).to(dtype)
    scores[torch.arange(nb)[None] * bs >= n] = float("nan")
    blk0 = torch.arange(nb) * bs
    want = torch.where((blk0 < n - window) & (blk0 + bs > first), scores.float(), float("-inf"))
    got = candidate_scores(scores, n, first, window, bs)
    _need(got.dtype == torch.float32 and torch.equal(got, want),
          f"differs at {(got != want).nonzero()[:6].tolist()}")


def _ranked_reference(s: torch.Tensor, take: int) -> torch.Tensor:
    """The ranking's contract on rows without NaN: the take highest, best first, ties (-0 and +0
    one) to the lower column (a stable descending sort keeps equal scores in column order)."""
    return torch.sort(s, dim=1, descending=True, stable=True).indices[:, :take]


def _rank_candidates(nb: int, take: int, ties: bool, seed: int) -> None:
    """ranked_candidates (the candidate mask and its ranking in one launch) against candidate_scores
    + torch.topk(sorted=True): s the same, top's scores topk's values in order, its columns
    topk's where the scores are distinct, and exactly the stable descending sort's (ties to the
    lower column). Rows of different lengths and paddings, NaN past a row's tokens, rows with
    fewer candidates than take (-inf entries then, in column order), none, a window starting at
    a block boundary; ties: scores of a few values, -0 and +0 among them."""
    from hi_sparse.kernels.select import candidate_scores, ranked_candidates
    g = torch.Generator().manual_seed(seed)
    R, bs, window = 7, 8, 16
    n = torch.randint(window, nb * bs + 1, (R, 1), generator=g)
    n[0], n[1], n[2] = 10, window + 5 * bs, window + (take // 2) * bs + 3    # none; a block boundary; < take
    n[3] = nb * bs                                                          # the whole row
    first = torch.randint(0, 3 * bs, (R, 1), generator=g)
    first[4] = 2 * bs                                                       # the padding ends at a boundary
    scores = torch.randn(R, nb, generator=g)
    if ties:
        scores = torch.randint(-2, 3, (R, nb), generator=g).float()
        scores[scores == 0] = torch.tensor([0.0, -0.0])[torch.randint(0, 2, (int((scores == 0).sum()),),
                                                                      generator=g)]
    scores[torch.arange(nb)[None] * bs >= n] = float("nan")
    s, top = ranked_candidates(scores, n, first, window, bs, take)
    blk0 = torch.arange(nb) * bs
    want_s = torch.where((blk0 < n - window) & (blk0 + bs > first), scores, float("-inf"))   # select's mask
    _need(torch.equal(s, want_s), f"s differs at {(s != want_s).nonzero()[:6].tolist()}")
    _need(torch.equal(candidate_scores(scores, n, first, window, bs), want_s), "candidate_scores differs")
    vals, idx = want_s.topk(take, dim=1, sorted=True)
    _need(top.shape == (R, take) and top.dtype == torch.int64, f"top {tuple(top.shape)} {top.dtype}")
    _need(torch.equal(s.gather(1, top), vals), "top's scores are not topk's values in order")
    distinct = torch.stack([torch.isin(vals[r], vals[r].unique()[torch.unique(vals[r], return_counts=True)[1] == 1])
                            for r in range(R)])
    _need(torch.equal(top[distinct], idx[distinct]), "top's columns differ from topk's at distinct scores")
    ref = _ranked_reference(want_s, take)
    _need(torch.equal(top, ref), f"ties: top {top[(top != ref).any(1)][:2].tolist()} "
          f"against {ref[(top != ref).any(1)][:2].tolist()}")
    _need(bool((vals[2] == float("-inf")).any()) and bool((vals[0] == float("-inf")).all()),
          "the case has no row with fewer candidates than take")


def _rank_listed(nb: int, M: int, take: int, ties: bool, seed: int) -> None:
    """ranked_listed (the candidates among listed blocks, two-level scoring's, ranked as they are)
    against ranked_candidates of the same scores scattered over every block: the same blocks in
    the same order, -1 where that ranking reaches blocks of score -inf (or NaN). Blocks listed in
    random order with -1 padding, NaN past a row's tokens, rows with fewer candidates than take,
    none; ties: scores of a few values, -0 and +0 among them. Then select over the listed blocks
    (kernels) against select over the scattered scores (its torch path; with ties its kernels):
    every field equal."""
    from hi_sparse.kernels.select import ranked_candidates, ranked_listed
    from hi_sparse.selection import candidate_blocks, select
    g = torch.Generator().manual_seed(seed)
    R, bs, window = 6, 8, 16
    n = torch.randint(window + bs, nb * bs + 1, (R, 1), generator=g)
    n[0], n[1] = 10, window + (take // 2) * bs + 3                          # none; fewer than take
    n[2] = nb * bs
    first = torch.randint(0, 3 * bs, (R, 1), generator=g)
    blocks = torch.stack([torch.randperm(nb, generator=g)[:M] for _ in range(R)])
    blocks[:, -3:] = -1                                                     # padding of the list
    blocks[3, 5:9] = -1
    sc = torch.randn(R, M, generator=g)
    if ties:
        sc = torch.randint(-2, 3, (R, M), generator=g).float()
        sc[sc == 0] = torch.tensor([0.0, -0.0])[torch.randint(0, 2, (int((sc == 0).sum()),), generator=g)]
    sc[blocks * bs >= n] = float("nan")
    sc[blocks < 0] = float("-inf")
    full = torch.full((R, nb + 1), float("-inf")).scatter_(1, blocks + 1, sc)[:, 1:]
    top = ranked_listed(blocks, sc, n, first, window, bs, take)
    s, want = ranked_candidates(full, n, first, window, bs, take)
    want = torch.where(s.gather(1, want) > float("-inf"), want, -1)
    _need(torch.equal(top, want), f"top {top[(top != want).any(1)][:2].tolist()} against "
          f"{want[(top != want).any(1)][:2].tolist()}")
    _need(bool((want[0] == -1).all()) and bool((want[1] == -1).any()), "the case lacks a row of too few candidates")
    anc = torch.randint(-1, nb * bs, (R, 5), generator=g)
    n_cand = candidate_blocks(nb, int(n.max()) - window, int(first.min()), bs)
    kw = dict(sinks=2, store_block=2 * bs)
    # ties: against the kernels over every block (torch's topk orders ties as it likes)
    ref = select(full, n, first, window, 72, bs, anc, None, 1, n_cand, kernels=ties, **kw)
    got = select((blocks, sc), n, first, window, 72, bs, anc, None, 1, n_cand, kernels=True, nb=nb, **kw)
    for name in ("tokens", "prefetch", "block_hits", "loaded", "both"):
        a, b = getattr(got, name), getattr(ref, name)
        _need(a.shape == b.shape and torch.equal(a, b), f"select: {name} differs")


def _row_topk(nb: int, dtype: torch.dtype) -> None:
    """top_blocks through the ranking kernel (the super-blocks of two_level_candidates): the same
    set as torch.topk over (..., nb) scores with -inf entries, any leading dims; best first, ties
    to the lower index, in the kernel; NaN ranks lowest (never over a scored block, nor -inf)."""
    from hi_sparse.kernels import _select_triton
    g = torch.Generator().manual_seed(nb)
    x = torch.randn(3, 2, nb, generator=g).to(dtype)
    x[..., 1::9] = float("-inf")
    x[0, 1, 2:7] = x[0, 1, 9] = x[0, 1].max() + 1                       # ties among the best
    x[1, 0] = -x[1, 0].abs()                                            # the best of negative scores
    n = min(9, nb // 2)
    got = K.top_blocks(x, n)
    _need(got.shape == (3, 2, n), f"shape {tuple(got.shape)}")
    want = x.float().topk(n, dim=-1)
    same = got.sort(-1).values == want.indices.sort(-1).values
    _need(bool(same.all(-1).view(-1)[[0, 2, 3, 4, 5]].all()), "top_blocks' set differs from torch.topk's")
    _need(torch.equal(x.float().gather(-1, got).sort(-1).values, want.values.sort(-1).values)
          and bool((got.sort(-1).values.diff(dim=-1) > 0).all()), "top_blocks' set differs from torch.topk's (ties)")
    flat = x.float().reshape(6, nb)
    ranked = _select_triton.row_topk(x.reshape(6, nb), n)
    _need(torch.equal(ranked, _ranked_reference(flat, n)), "not best first with ties to the lower index")
    y = x[:, :, :1].float().expand(3, 2, nb).clone()                   # a NaN row among equal ones
    y[..., 3::4] = float("nan")
    y[..., 2::4] = float("-inf")
    top = K.top_blocks(y, nb // 2 + nb // 4)
    _need(not bool(y.gather(-1, top).isnan().any()), "NaN ranked over a -inf or scored block")
    one = K.top_blocks(x[0, 0], n)
    _need(torch.equal(one, got[0, 0]), "a 1-d row ranks differently")


def _widen(dtype: torch.dtype, d: int) -> None:
    """widen_bounds (one decode key per row) against its reference: exactly the same bounds."""
    from hi_sparse.kernels.bounds import reference_widen_bounds, widen_bounds

    g = torch.Generator().manual_seed(d)
    B, H, NB, G = 3, 2, 12, 4
    kmin = torch.randn(B, H, NB, d, generator=g).to(dtype)
    kmax = kmin + torch.rand(B, H, NB, d, generator=g).to(dtype)
    smin = torch.randn(B, H, NB // G, d, generator=g).to(dtype)
    smax = smin + torch.rand(B, H, NB // G, d, generator=g).to(dtype)
    k = (2 * torch.randn(B, H, 1, d, generator=g)).to(dtype)
    start = torch.tensor([0, 37, 95])
    got = [t.clone() for t in (kmin, kmax, smin, smax)]
    want = [t.clone() for t in (kmin, kmax, smin, smax)]
    widen_bounds(*got, k, start, 8, G)
    reference_widen_bounds(*want, k, start, 8, G)
    for name, a, b in zip(("kmin", "kmax", "smin", "smax"), got, want):
        _need(torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:4].tolist()}")
    _need(not torch.equal(got[0], kmin), "nothing was widened")


def _swap_pair(dtype: torch.dtype, W: int) -> None:
    """swap_in_pair (K and V rows in one launch) against two reference gathers: -1 source rows copy
    nothing, rows outside dst_rows stay, two programs of rows, a second destination of another
    row stride (a slice); rows moved as 32-bit (fp16 W=16), 16-bit (W=34) or 8-bit words (W=7)."""
    from hi_sparse.kernels.swap_in import swap_in_pair
    g = torch.Generator().manual_seed(W)

    def rows(n: int) -> torch.Tensor:
        x = torch.randn(n, W, generator=g) * 50
        return x.to(dtype) if dtype.is_floating_point else x.to(torch.int64).to(dtype)

    src_a, src_b = rows(50), rows(50)
    src_rows = torch.randperm(50, generator=g)[:40]
    src_rows[[1, 7, 33]] = -1
    dst_rows = torch.randperm(45, generator=g)[:40]
    poison = float("nan") if dtype.is_floating_point else 7
    got = [torch.full((45, W), poison, dtype=dtype), torch.full((45, W + 8), poison, dtype=dtype)[:, 4:W + 4]]
    want = [t.clone() for t in got]
    swap_in_pair(src_a, src_b, src_rows, got[0], got[1], dst_rows)
    K.reference_swap_in(src_a, src_rows, want[0], dst_rows)
    K.reference_swap_in(src_b, src_rows, want[1], dst_rows)
    for name, a, b in zip("ab", got, want):
        _need(torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"dst_{name} differs")
    _need(not torch.equal(got[0][dst_rows[0]], got[1][dst_rows[0]]), "the case cannot tell K from V")
    _need(bool((got[0][dst_rows[[1, 7, 33]]] != got[0][dst_rows[[1, 7, 33]]]).all()) if dtype.is_floating_point
          else bool((got[0][dst_rows[[1, 7, 33]]] == 7).all()), "a -1 source row wrote its destination")


def _swap_dequant_pair(bits: int, layout_k: str = "channel", layout_v: str = "token", d: int = 64) -> None:
    """swap_in_dequant_pair (a layer's K and V, each in its layout, in one launch) bit-equal to two
    swap_in_dequant calls: a run of one block's rows and rows of others, -1 rows and a whole
    program of them (3 programs of 64 rows), keys from a view [:, :P] of wider rows and values
    into a slice (row strides that differ between K and V), fp32 keys and fp16 values. 4 / 8 bits
    take the pair kernel (no launch per tensor); 5 bits falls back to one launch each."""
    from hi_sparse.kernels import _quant_triton
    from hi_sparse.kernels.swap_in import swap_in_dequant_pair
    n, t = 3, 8
    g = torch.Generator().manual_seed(bits)
    sets = []
    for layout, wide in ((layout_k, True), (layout_v, False)):
        packed, scale, zero = K.reference_quantize_blocks(torch.randn(n, t, d, generator=g) * 4 + 1, bits, layout)
        flat = packed.reshape(n * t, -1)
        if wide:
            rows = torch.zeros(n * t, flat.shape[1] + 8, dtype=torch.uint8)
            rows[:, : flat.shape[1]] = flat
            flat = rows[:, : flat.shape[1]]
        if layout == "token":
            scale, zero = scale.reshape(-1), zero.reshape(-1)
        sets.append((flat, scale, zero, layout))
    src_rows = torch.tensor([-1] * 64 + [9, 10, 11, 12, 23, -1, 0, 16] + [-1] * 60 + [5, -1, 17, 2])
    dst_rows = torch.randperm(140, generator=g)[: len(src_rows)]
    got = [torch.full((140, d), float("nan")), torch.full((140, d + 8), float("nan"), dtype=torch.float16)[:, 4:d + 4]]
    want = [x.clone() for x in got]
    launches = []
    launch_rows = _quant_triton._launch_rows

    def counted(*args, **kwargs):
        launches.append(kwargs["layout"])
        return launch_rows(*args, **kwargs)

    _quant_triton._launch_rows = counted
    try:
        swap_in_dequant_pair(*sets[0], *sets[1], bits, t, src_rows, got[0], got[1], dst_rows)
    finally:
        _quant_triton._launch_rows = launch_rows
    _need(len(launches) == (0 if bits in (4, 8) else 2), f"launches per tensor: {launches}")
    for (flat, scale, zero, layout), dst in zip(sets, want):
        K.swap_in_dequant(flat, scale, zero, bits, t, src_rows, dst, dst_rows, layout)
    for name, a, b in zip("kv", got, want):
        _need(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), f"dst_{name} differs")
    present = int((src_rows >= 0).sum())
    counts = [(int((~x.isnan()).all(1).sum()), int(x.isnan().all(1).sum())) for x in got]
    _need(counts == [(present, 140 - present)] * 2, f"(rows written, rows left) of K and V: {counts}")


def _backup_token(bits: int | None) -> None:
    """HostPool.backup of a decode token (B=2 sequences at different positions, one the first of its
    block, then the last ones of their blocks, then one in a hole of its table) in one launch
    (kernels/swap_in.py backup_token) against the torch path: every tensor of the pool the same,
    the token where unit_rows says."""
    import hi_sparse.host_pool as host_pool
    from hi_sparse.kernels._dispatch import FORCE_ENV
    g = torch.Generator().manual_seed(11)
    B, H, D, bs = 2, 2, 16, 8
    pools = [host_pool.HostPool(1, H, D, bs, torch.float16, pin=False, host_kv_bits=bits) for _ in range(2)]
    for pool in pools:
        pool.grow(6, 3)
    tables = torch.tensor([[4, 0, 5, -1, -1], [2, -1, 1, 3, -1]])
    tails = torch.tensor([2, 0])
    units = pools[0].tail_units(tails).t().contiguous().t()                     # (B, H) of strides (1, B)
    launches = []
    fused = host_pool.backup_token
    host_pool.backup_token = lambda *a, **kw: launches.append(1) or fused(*a, **kw)
    try:
        for step in ([13, 16], [15, 31], [25, 24]):             # 25: a hole in the table (main_rows: block 0)
            positions = torch.tensor(step)[:, None].expand(B, H).clone()      # per sequence and head, as decode's
            k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
            for pool, forced in zip(pools, ("1", "0")):
                os.environ[FORCE_ENV] = forced                                 # "0": the torch path
                pool.backup(0, tables, units, positions[:, 0], k, v)
            os.environ[FORCE_ENV] = "1"
            _need(len(launches) == 1, f"{len(launches)} fused backups for one step")
            launches.clear()
            for name in pools[0].layers[0]:
                _need(torch.equal(pools[0].layers[0][name], pools[1].layers[0][name]), f"step {step}: {name} differs")
            b, h = 1, 1                                           # the second sequence's token by hand
            blk = tails[b] if bits else tables[b, step[b] // bs]
            row = pools[0].unit_rows(blk, h) + step[b] % bs
            got = pools[0].layers[0]["v_tail" if bits else "v"][row]
            _need(torch.equal(got, v[b, h, 0].half()), f"step {step}: the token is not at row {int(row)}")
    finally:
        host_pool.backup_token = fused
        os.environ[FORCE_ENV] = "1"


def _swap_plan(quantized: bool) -> None:
    """swap_plan (a step's swap-in rows in one launch) against batch_state.swap_rows, on tokens of
    every kind: padding, main-pool blocks, the last token's block (the float tail when quantized:
    unfilled, or just completed by the step's token, which a planned step seals after it), copied
    or not."""
    import types

    from hi_sparse.batch_state import swap_rows
    from hi_sparse.host_pool import HostPool
    from hi_sparse.kernels.swap_in import swap_plan

    class Host:
        block_size, num_kv_heads = 8, 2
        unit_rows, block_rows = HostPool.unit_rows, HostPool.block_rows

    g = torch.Generator().manual_seed(int(quantized))
    B, H, K, P, bs = 2, 2, 20, 8, 8
    R = B * H
    n = torch.tensor([72, 72, 45, 45])[:, None]         # tokens per row: the first sequence's last block full
    both = torch.stack([torch.randperm(int(n[r]), generator=g)[:K + P] for r in range(R)])
    both[:, ::7] = -1
    both[:, 3] = n[:, 0] - 2                                          # the unfilled last block
    miss, loaded = torch.rand(R, K, generator=g) < 0.5, torch.rand(R, P, generator=g) < 0.5
    miss[:, 3] = True
    slots, pslots = torch.randint(0, 64, (R, K), generator=g), torch.randint(0, 64, (R, P), generator=g)
    heads = torch.arange(R)
    batch = types.SimpleNamespace(head_rows=(heads * 64)[:, None], tables=torch.stack([torch.randperm(12, generator=g)
                                                                                      for _ in range(B)]),
                                  seq_of_head=(heads // H)[:, None], kv_head=(heads % H)[:, None])
    tail = (100 + heads * bs)[:, None] if quantized else None
    want = swap_rows(Host(), batch, both, miss, loaded, slots, pslots, n, tail)
    got = swap_plan(both, miss, loaded, slots, pslots, batch.head_rows, batch.tables, batch.seq_of_head,
                    batch.kv_head, n, tail, bs, H)
    for name, a, b in zip(("src", "src_tail", "dst"), got, want):
        _need((a is None and b is None) or torch.equal(a, b), f"{name} differs")
    if quantized:
        _need(bool((got[1] >= 0).any()), "no token came from the tail")
        last = got[1].view(R, K + P)[:, 3]                   # n - 2, copied: in the last token's block
        _need(bool((last >= 0).all()), f"a token of the last token's block was not read from the tail: {last}")


def _rms_norm(dtype: torch.dtype, lead: tuple[int, ...], N: int, w_dtype: torch.dtype | None = None,
              row_pad: int = 0) -> None:
    """kernels/norm.py rms_norm against its reference (transformers' LlamaRMSNorm math): fp32
    within 1e-6 relative per element; fp16 / bf16 equal in >= 99 % of the elements and within one
    ulp elsewhere. Rows of magnitudes 3 to 3e-3, so that eps matters in some. ``row_pad`` > 0
    reads rows of a wider tensor (a row stride other than N)."""
    g = torch.Generator().manual_seed(N)
    rows = torch.arange(torch.Size(lead).numel()).reshape(*lead, 1)
    x = (3 * torch.randn(*lead, N + row_pad, generator=g) * 10.0 ** -(rows % 4)).to(dtype)[..., :N]
    w = (1 + 0.5 * torch.randn(N, generator=g)).to(w_dtype or dtype)
    got, want = K.rms_norm(x, w, 1e-5), K.reference_rms_norm(x, w, 1e-5)
    _need(got.dtype == want.dtype and got.shape == want.shape, f"bad output {got.dtype} {tuple(got.shape)}")
    a, b = got.double(), want.double()
    _need(bool(torch.isfinite(a).all()), "non-finite output (an unwritten element?)")
    diff = (a - b).abs()
    if want.dtype == torch.float32:
        worst = float((diff / b.abs().clamp_min(1e-30)).max())
        _need(worst <= 1e-6, f"relative error {worst:.2e} > 1e-6")
        return
    mantissa = 7 if want.dtype == torch.bfloat16 else 10
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30))) - mantissa)
    same = float((diff == 0).double().mean())
    _need(same >= 0.99, f"only {same:.1%} of the elements equal")
    _need(bool((diff <= ulp).all()), f"{int((diff > ulp).sum())} elements more than one ulp off")


def _fused_norms_in_a_model(dtype: torch.dtype) -> None:
    """enable_hisparse_kv_cache(fused_norms=True) on a tiny random Llama: every RMSNorm runs the
    kernel, the logits of a few greedy tokens equal those of the same model with fused_norms=False,
    and disable gives each module its class's forward back."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hi_sparse as hs
    from hi_sparse.integration import binding_of
    from hi_sparse.kernels import _dispatch

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    models = [LlamaForCausalLM(LlamaConfig(**kw)).to(dtype).eval() for _ in range(2)]
    with torch.no_grad():                              # norm weights that matter (they start at 1)
        for name, p in models[0].named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    models[1].load_state_dict(models[0].state_dict())
    opts = dict(max_seq_len=64, block_size=8, window_size=8, global_tokens=0, top_k=32, telemetry=False)
    calls = []
    module = _dispatch.kernel_module("_norm_triton")
    launch = module.rms_norm
    module.rms_norm = lambda *a: calls.append(1) or launch(*a)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(5))
    out = []
    try:
        for model, fused in zip(models, (True, False)):
            model.generation_config.eos_token_id = None
            hs.enable_hisparse_kv_cache(model, **opts, fused_norms=fused)
            _need(binding_of(model).fused_norm_count == (5 if fused else 0),
                  f"fused_norms={fused}: {binding_of(model).fused_norm_count} norms fused")
            with torch.no_grad():
                out.append(model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, output_logits=True,
                                          return_dict_in_generate=True))
            if fused:
                _need(len(calls) >= 5 * 3, f"the kernel ran {len(calls)} times in 3 forwards of 5 norms")
                calls.clear()
    finally:
        module.rms_norm = launch
    _need(not calls, "fused_norms=False ran the kernel")
    _need(torch.equal(out[0].sequences, out[1].sequences), "the greedy tokens differ")
    for a, b in zip(out[0].logits, out[1].logits):
        _need(_rel(a.float(), b.float()) < (1e-5 if dtype == torch.float32 else 1e-2), "the logits differ")
    norms = [m for m in models[0].modules() if type(m).__name__.endswith("RMSNorm")]
    _need(all("forward" in vars(m) for m in norms), "not every norm was fused")
    hs.disable_hisparse_kv_cache(models[0])
    hs.disable_hisparse_kv_cache(models[1])
    _need(not any("forward" in vars(m) for m in norms), "disable left a fused forward behind")


def _rotary(dtype: torch.dtype, B: int, Hq: int, Hk: int, T: int, D: int, cos_b: int) -> None:
    """kernels.rotary against transformers' apply_rotary_pos_emb, bit for bit: q a transposed view
    (as the attention forward passes it), k contiguous, cos and sin of batch 1 (broadcast) or B,
    of large positions (angles whose products round)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from hi_sparse.kernels.rotary import reference_rotary, rotary, supported
    g = torch.Generator().manual_seed(D + T)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k = (3 * torch.randn(B, Hk, T, D, generator=g)).to(dtype)
    pos = torch.randint(0, 100000, (cos_b, T), generator=g).double()
    angles = pos[..., None] * 1e4 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    _need(supported(q, k, cos, sin), "the kernel does not take these")
    want = apply_rotary_pos_emb(q, k, cos, sin)
    got = rotary(q, k, cos, sin)
    for name, w, r, o in zip("qk", want, reference_rotary(q, k, cos, sin), got):
        _need(torch.equal(w, r), f"the reference's {name} differs from transformers'")
        _need(o.shape == w.shape and o.dtype == w.dtype, f"{name}: {o.shape} {o.dtype}")
        _need(torch.equal(o, w), f"{name}: {int((o != w).sum())} of {w.numel()} elements differ")


def _fused_rotary_in_a_model(dtype: torch.dtype) -> None:
    """enable_hisparse_kv_cache(fused_rotary=True) on a tiny random Llama: every layer's rotary
    embedding runs the kernel inside the model's forwards, the greedy tokens and logits equal
    those of the same model with fused_rotary=False bit for bit, a call outside a HiSparse
    forward runs the original function, and disabling the last such model puts it back."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    import hi_sparse as hs
    from hi_sparse import fused_rotary
    from hi_sparse.integration import binding_of

    original = modeling_llama.apply_rotary_pos_emb
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    models = [LlamaForCausalLM(LlamaConfig(**kw)).to(dtype).eval() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    opts = dict(max_seq_len=64, block_size=8, window_size=8, global_tokens=0, top_k=32, telemetry=False)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(5))
    name = modeling_llama.__name__
    out = []
    try:
        for model, fused in zip(models, (True, False, True)):
            model.generation_config.eos_token_id = None
            hs.enable_hisparse_kv_cache(model, **opts, fused_rotary=fused)
            _need(binding_of(model).fused_rotary == ([name] if fused else []),
                  f"fused_rotary={fused}: {binding_of(model).fused_rotary}")
        patch = fused_rotary.patch_of(name)
        _need(patch is not None and len(patch.bindings) == 2, "the wrapper is not installed once for two models")
        for model, fused in zip(models[:2], (True, False)):
            before = patch.calls
            with torch.no_grad():
                out.append(model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, output_logits=True,
                                          return_dict_in_generate=True))
            calls = patch.calls - before
            _need(calls == (2 * 3 if fused else 0),
                  f"fused_rotary={fused}: {calls} fused calls in 3 forwards of 2 layers")
        q, k = torch.randn(1, 4, 2, 16).to(dtype), torch.randn(1, 2, 2, 16).to(dtype)
        cos, sin = torch.randn(1, 2, 16).to(dtype), torch.randn(1, 2, 16).to(dtype)
        before = patch.calls
        modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)       # outside any HiSparse forward
        _need(patch.calls == before, "a call outside the model's forward ran the kernel")
        _need(torch.equal(out[0].sequences, out[1].sequences), "the greedy tokens differ")
        for a, b in zip(out[0].logits, out[1].logits):
            _need(torch.equal(a, b), f"the logits differ by {_rel(a.float(), b.float()):.2e}")
        hs.disable_hisparse_kv_cache(models[0])
        _need(fused_rotary.patch_of(name) is patch, "disabling one of two models removed the wrapper")
        hs.disable_hisparse_kv_cache(models[2])
        _need(modeling_llama.apply_rotary_pos_emb is original, "disabling the last model left the wrapper")
    finally:                                        # a failed case leaves no wrapper for the next
        for model in models:
            try:
                hs.disable_hisparse_kv_cache(model)
            except ValueError:                      # not enabled (any more)
                pass
        modeling_llama.apply_rotary_pos_emb = original


CASES: dict[str, Callable[[], None]] = {
    "attention-fp32-d60-split": lambda: _attention(1, 4, 2, 50, 60, 100, torch.float32, 1e-5),
    "attention-fp16-d64-single": lambda: _attention(2, 8, 4, 40, 64, 40, torch.float16, 5e-3),
    "swap_in-fp32-w60": lambda: _swap(60, torch.float32),
    "swap_in-uint8-w7": lambda: _swap(7, torch.uint8),
    "swap_in-skips-minus-one": lambda: _swap_skip(None),
    "gather_layers-bf16-rows": lambda: _gather_layers(torch.bfloat16, (4, 6), 1),
    "gather_layers-fp32-strided": lambda: _gather_layers(torch.float32, (5,), 2),
    "gather_layers-uint8-torch": lambda: _gather_layers(torch.uint8, (7,), 1),
    "gather_layers-own-rows": _gather_layers_own_rows,
    "scatter_layers-uint8-words-column": lambda: _scatter_layers(torch.uint8, (8,), False, True),
    "scatter_layers-fp16-halves-own": lambda: _scatter_layers(torch.float16, (1,), True, False),
    "scatter_layers-uint8-bytes-own": lambda: _scatter_layers(torch.uint8, (1,), True, False),
    "scatter_layers-bf16-rows": lambda: _scatter_layers(torch.bfloat16, (4, 6), False, False),
    "swap_in_dequant-skips-minus-one": lambda: _swap_skip(4),
    **{f"swap_in_dequant-{b}bit": (lambda b=b: _swap_dequant(b)) for b in (4, 5, 6, 8)},
    **{f"swap_in_dequant-{b}bit-d64": (lambda b=b: _swap_dequant(b, 64)) for b in (4, 5, 6, 8)},
    **{f"quantize-{b}bit": (lambda b=b: _quantize(b)) for b in (4, 5, 6, 8)},
    # d64 at t200 / t16: the fused kernel's register path (whole block one tile; t200 pads to 16384 values)
    **{f"quantize-{b}bit-d64-t200": (lambda b=b: _quantize(b, 64, 200, method="fused")) for b in (4, 5, 6, 8)},
    **{f"quantize-{b}bit-d64-t16": (lambda b=b: _quantize(b, 64, 16, method="fused")) for b in (4, 5, 6, 8)},
    **{f"quantize-{b}bit-d7": (lambda b=b: _quantize(b, 7, 9)) for b in (4, 5, 6, 8)},
    # D % 8 == 0 paths of the Triton quantize: the fused register tile at D=24 (3 groups: 5/6 bits
    # store bytes) and the split two-kernel path
    **{f"quantize-{b}bit-d24-fused": (lambda b=b: _quantize(b, 24, 9, 3, method="fused")) for b in (5, 6)},
    **{f"quantize-{b}bit-d64-split": (lambda b=b: _quantize(b, 64, 40, 3, method="split")) for b in (4, 5, 6, 8)},
    # 5/6 bits store whole 32-bit words per quad / pair of groups where a row has whole ones: D=96 is
    # 12 groups padded to 16 (the last quad / pair masked off); D=40 (5 groups) stores bytes
    **{f"quantize-{b}bit-d96-t5": (lambda b=b: _quantize(b, 96, 5, method="fused")) for b in (5, 6)},
    **{f"quantize-{b}bit-d40-split": (lambda b=b: _quantize(b, 40, 7, method="split")) for b in (5, 6)},
    # the words path: units of whole 32/64-bit words per thread (D=64: 2 units of 32 at 5 bits),
    # ragged T=63, the 2D load (default) and the 3D one, and the other unit of each width
    **{f"quantize-{b}bit-d64-t63-words": (lambda b=b: _quantize(b, 64, 63, method="words")) for b in (4, 5, 6, 8)},
    **{f"quantize-{b}bit-d64-words-3d-u{u}": (lambda b=b, u=u: _quantize(b, 64, 5, method="words", unit=u,
                                                                          load2d=False))
       for b, u in ((4, (16, 64)), (5, (64, 64)), (6, (32, 64)), (8, (16, 64)))},
    # the relay kernel: 3 blocks of 5 row tiles (the last ragged), each program waiting on the
    # min / max the programs of the block before (lag 1) or two before published; and a block of
    # +-inf values (its min / max word is not the empty word)
    **{f"quantize-{b}bit-d64-t40-relay": (lambda b=b: _quantize(b, 64, 40, 3, method="relay", pack_values=512))
       for b in (4, 5, 6, 8)},
    "quantize-8bit-d64-t40-relay-lag2": lambda: _quantize(8, 64, 40, 3, method="relay", pack_values=512, lag=2),
    # "auto" on a 32 KB fp32 block at 5 / 6 bits is the relay kernel (4 row tiles, lag 2)
    **{f"quantize-{b}bit-d64-t128-auto-relay": (lambda b=b: _auto_picks(b, 128, "relay")) for b in (5, 6)},
    "quantize-relay-infinite-block": _relay_infinite_block,
    # the two-pass kernel: one program per block, 5 row tiles of 8 rows (the last ragged), with and
    # without loading the next tile first
    **{f"quantize-{b}bit-d64-t40-twopass": (lambda b=b: _quantize(b, 64, 40, 3, method="twopass", pack_values=512))
       for b in (4, 5, 6, 8)},
    "quantize-4bit-d64-t40-twopass-no-prefetch": lambda: _quantize(4, 64, 40, 3, method="twopass", pack_values=512,
                                                                  prefetch=False),
    # channel / token layouts (keys / values of the host pool): the channel default (two passes)
    # and the token axis kernel at D=64, channel strips (method "strip"; T=300, D=128: 4 strips of
    # 32 columns, 5 / 6 bits store words per quad / pair), token row tiles (T=300: 5 tiles), the
    # general kernel (D=60; T=2100 is a channel strip over REG_CAP)
    **{f"quantize-{b}bit-{lay}-d64": (lambda b=b, lay=lay: _layout_quantize(b, lay, 3, 16, 64))
       for b in (4, 5, 6, 8) for lay in ("channel", "token")},
    **{f"quantize-{b}bit-channel-t300-strips": (lambda b=b: _layout_quantize(b, "channel", 1, 300, 128,
                                                                             {"method": "strip"}))
       for b in (4, 5, 6)},
    "quantize-5bit-channel-t300-twopass": lambda: _layout_quantize(5, "channel", 1, 300, 128),
    "quantize-5bit-token-t300-tiles": lambda: _layout_quantize(5, "token", 1, 300, 64),
    **{f"quantize-{b}bit-{lay}-d60-general": (lambda b=b, lay=lay: _layout_quantize(b, lay, 2, 9, 60))
       for b in (5, 8) for lay in ("channel", "token")},
    "quantize-4bit-channel-t2100-general": lambda: _layout_quantize(4, "channel", 1, 2100, 16, {"method": "strip"}),
    # the channel layout through the two-pass kernel: column pairs folded over 5 row tiles of 8
    # rows (the last ragged), whole rows packed
    **{f"quantize-{b}bit-channel-twopass": (lambda b=b: _layout_quantize(
        b, "channel", 3, 40, 64, {"method": "twopass", "tile": 512, "warps": 2})) for b in (4, 5, 6, 8)},
    # swap-in with fused dequant per layout: 4 / 8 bits read whole words, 5 bits the byte groups,
    # D=60 the general rows kernel; 4 bits from rows of a wider (mixed-width) pool
    **{f"swap_in_dequant-{b}bit-{lay}": (lambda b=b, lay=lay: _layout_swap_dequant(b, lay, 64))
       for b in (4, 5, 8) for lay in ("channel", "token")},
    **{f"swap_in_dequant-6bit-{lay}-d60": (lambda lay=lay: _layout_swap_dequant(6, lay, 60))
       for lay in ("channel", "token")},
    **{f"swap_in_dequant-4bit-{lay}-wide-rows": (lambda lay=lay: _layout_swap_dequant(4, lay, 64, True))
       for lay in ("channel", "token")},
    # a skipped row (-1) first in the program
    **{f"swap_in_dequant-{b}bit-channel-skipped-first": (lambda b=b: _layout_swap_dequant(b, "channel", 64,
                                                                                       first_row=-1)) for b in (4, 5)},
    **{f"swap_in_dequant-{b}bit-{lay}-skipped-programs-d{d}": (
        lambda b=b, lay=lay, d=d: _swap_dequant_skipped_programs(b, lay, d))
       for b, lay, d in ((4, "channel", 64), (8, "token", 64), (5, "channel", 64), (6, "token", 60))},
    "quantize-constant-block": _constant_block,
    "quantize-fused-too-big": _fused_too_big,
    **{f"dequantize-{b}bit": (lambda b=b: _dequantize(b)) for b in (4, 5, 6, 8)},
    **{f"dequantize-{b}bit-d64": (lambda b=b: _dequantize(b, 64)) for b in (4, 5, 6, 8)},
    **{f"dequantize-{b}bit-d7": (lambda b=b: _dequantize(b, 7)) for b in (4, 5, 6, 8)},
    "block_bounds-t63-d60": _bounds,
    "block_scores-d60": _scores,
    "block_scores-listed-d60": _scores_listed,
    "two_level_candidates-d60": _two_level,
    "two_level_candidates-per-row-limit": _two_level_per_row,
    "block_scores-strided-bounds": _strided_bounds,
    "ranked_listed-nb300-m64-take12": lambda: _rank_listed(300, 64, 12, False, 1),
    "ranked_listed-nb90-m40-take9-ties": lambda: _rank_listed(90, 40, 9, True, 2),
    **{f"install_slots-{'masked' if m else 'all'}-{'flag' if f else 'noflag'}-{'bcast' if b else 'rows'}":
       (lambda m=m, f=f, b=b: _install(m, f, b)) for m in (False, True) for f in (False, True) for b in (False, True)},
    "install_slots-hot-buffer-oracle": _hot_buffer_oracle,
    "insert_one-positions": lambda: _insert_one(False),
    "pin_one-a4-saturated": lambda: _pin_one(1, 4, False, 1.0),
    "pin_one-a5-bf16": lambda: _pin_one(2, 5, True, 0.25),
    "pin_one-a16": lambda: _pin_one(3, 16, False, 0.25),
    # a probe fit's gradients (kernels/probe.py fit_grads) and a whole fit through them
    "fit_grads-one-tile-a-program": lambda: _fit_grads(2, 100, 20, 12, True),
    "fit_grads-two-tiles-a-program-d128-h64": lambda: _fit_grads(3, 200, 128, 64, False),
    # two programs (half of the interpreter's 4 multiprocessors) over 3 probes' 6 items
    "fit_grads-two-programs-loop-over-the-items": lambda: _fit_grads(3, 100, 20, 12, True, share=0.5),
    "fit_grads-whole-fit": _fit_whole,
    "insert_one-per-head": lambda: _insert_one(True),
    "push_recent-r5-bf16": lambda: _push_recent(3, 5, (4, 12), torch.bfloat16),
    "push_recent-r16-wide": lambda: _push_recent(2, 16, (3, 700), torch.float32),
    "prefetch-takes-the-room-a-lookup-left": _prefetch_room,
    "tally-tail-several-programs": lambda: _tally(True, 6, 33, 9000),
    "tally-no-tail-one-program": lambda: _tally(False, 3, 5, 40),
    "decode-kernels-in-an-engine": _engine_decode_kernels,
    "decode-kernels-in-an-engine-int4": lambda: _engine_decode_kernels(4),
    "decode-kernels-in-an-engine-two-level": lambda: _engine_decode_kernels(4, T=800, group=2),
    # the lookup and prefetch as four launches (the path of many heads: LRU_STEP_MAX_HEADS)
    "decode-kernels-in-an-engine-four-lru-launches": lambda: _engine_decode_kernels(4, lru_step_heads=0),
    "select-assembly-sinks4-prefetch1-anchors6": lambda: _select(4, 1, 1, 6, 0),
    "select-assembly-nosinks-noprefetch-noanchors": lambda: _select(0, 1, 0, 0, 1),
    "select-assembly-storage-block-x2": lambda: _select(4, 2, 1, 6, 2),
    "select-assembly-many-anchors": lambda: _select(2, 1, 2, 20, 3),
    "select-assembly-unfused-rank": lambda: _select(4, 1, 1, 6, 0, fused=False),
    # the anchor test over 8 chunks of anchors (a (2048, 8) tile each), groups of 4 lanes (the
    # largest power of 2 dividing bs = 12); over 4096 storage blocks (two tiles of the counts)
    "select-assembly-anchor-chunks-bs12": lambda: _select(4, 2, 1, 40, 4, bs=12, top_k=1000, n_max=3000),
    "select-assembly-many-storage-blocks": lambda: _select(2, 1, 1, 6, 9, fused=False, bs=2, n_max=10000),
    "select-candidates-fp32": lambda: _candidates(torch.float32),
    **{f"rank-candidates-nb{nb}-take{t}{'-ties' if ties else ''}": (lambda nb=nb, t=t, ties=ties:
                                                                     _rank_candidates(nb, t, ties, nb + t))
       for nb, t, ties in ((37, 20, False), (300, 48, False), (20, 20, False), (37, 30, True), (150, 48, True))},
    **{f"top_blocks-kernel-nb{nb}-{str(d)[6:]}": (lambda nb=nb, d=d: _row_topk(nb, d))
       for nb, d in ((37, torch.float32), (100, torch.float32), (64, torch.bfloat16))},
    "select-candidates-bf16": lambda: _candidates(torch.bfloat16),
    "widen_bounds-fp32-d60": lambda: _widen(torch.float32, 60),
    "widen_bounds-bf16-d64": lambda: _widen(torch.bfloat16, 64),
    "swap_plan-unquantized": lambda: _swap_plan(False),
    "swap_plan-quantized": lambda: _swap_plan(True),
    "swap_in_pair-fp16-w16": lambda: _swap_pair(torch.float16, 16),
    "swap_in_pair-uint8-w7": lambda: _swap_pair(torch.uint8, 7),
    "swap_in_pair-uint8-w34": lambda: _swap_pair(torch.uint8, 34),
    # K (channel) and V (token) pairs of a 4 / 8-bit pool in one launch; block pairs; 5 bits: two launches
    **{f"swap_in_dequant_pair-{b}bit": (lambda b=b: _swap_dequant_pair(b)) for b in (4, 8)},
    "swap_in_dequant_pair-8bit-token-block": lambda: _swap_dequant_pair(8, "token", "block"),
    "swap_in_dequant_pair-5bit-two-launches": lambda: _swap_dequant_pair(5),
    "backup_token-unquantized": lambda: _backup_token(None),
    "backup_token-4bit": lambda: _backup_token(4),
    # RMSNorm (kernels/norm.py): rows packed several to a program (a ragged last one), a wide row
    # over two programs, per-head rows under leading dims, strided rows with an fp32 weight
    "rms_norm-fp32-n60": lambda: _rms_norm(torch.float32, (5,), 60),
    "rms_norm-fp32-n60-ragged-programs": lambda: _rms_norm(torch.float32, (37,), 60),
    "rms_norm-bf16-n576": lambda: _rms_norm(torch.bfloat16, (3,), 576),
    "rms_norm-fp16-n128-heads": lambda: _rms_norm(torch.float16, (2, 3), 128),
    "rms_norm-bf16-strided-fp32-weight": lambda: _rms_norm(torch.bfloat16, (2, 3), 96, torch.float32, row_pad=8),
    "fused-norms-in-a-model-fp32": lambda: _fused_norms_in_a_model(torch.float32),
    "fused-norms-in-a-model-bf16": lambda: _fused_norms_in_a_model(torch.bfloat16),
    # rotary embedding (kernels/rotary.py): one decode token, a prompt of several, cos of batch B
    "rotary-bf16-decode": lambda: _rotary(torch.bfloat16, 1, 8, 2, 1, 64, 1),
    "rotary-fp16-prompt-batch-cos": lambda: _rotary(torch.float16, 3, 6, 3, 5, 32, 3),
    "rotary-fp32-gqa-d128": lambda: _rotary(torch.float32, 2, 4, 1, 3, 128, 1),
    "fused-rotary-in-a-model-fp32": lambda: _fused_rotary_in_a_model(torch.float32),
    "fused-rotary-in-a-model-bf16": lambda: _fused_rotary_in_a_model(torch.bfloat16),
}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("HISPARSE_FORCE_TRITON") != "1":
        sys.exit("set TRITON_INTERPRET=1 and HISPARSE_FORCE_TRITON=1 before running this script")
    torch.manual_seed(0)
    results = {}
    for name, case in CASES.items():
        try:
            case()
            results[name] = ""
        except Exception:  # noqa: BLE001 - every failure is reported per case to the parent test
            results[name] = traceback.format_exc(limit=3)
    loaded = sorted(m for m in sys.modules if m.startswith("hi_sparse.kernels._") and m.endswith("_triton"))
    print(json.dumps({"results": results, "triton_modules": loaded}))


if __name__ == "__main__":
    main()
