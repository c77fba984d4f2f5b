"""Triton: a decode token's anchor scoring and merge in one launch (probe.py says what it does)."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._launch import next_pow2, sm_count

FIT_TILE, FIT_WARPS = 32, 8      # a fit program's rows at a time, its warps (benchmarks/bench_fit.py --tiles)
FIT_DOTS = "tf32"                # the fit's dots on a GPU (the interpreter's are fp32: "ieee")
# The share of the multiprocessors a fit's launch may hold. None: all of them (about four programs
# each, the fastest fit). A fraction f: at most f x their number of programs, each looping over
# the work, so that a decode step's small kernels beside it find free multiprocessors instead of
# waiting for a fit program to finish (benchmarks/bench_fit.py --shares, stall_profile.py --fit-share).
FIT_SM_SHARE: float | None = None


@triton.jit
def _pin_one_kernel(
    p_k, p_pos, p_w1, p_b1, p_w2, p_b2, p_consts, p_ap, p_an, H, D, HID, A,
    s_kb, s_kh, s_kd, s_pb, s_ph, s_ab, s_ah, s_aa, s_nb, s_nh, s_na,
    BLOCK_D: tl.constexpr, BLOCK_HID: tl.constexpr, BLOCK_A: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    b, h = r // H, r % H
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    x = tl.load(p_k + b * s_kb + h * s_kh + o_d * s_kd, mask=m_d, other=0).to(tl.float32)
    o_h = tl.arange(0, BLOCK_HID)
    m_h = o_h < HID
    w1 = tl.load(p_w1 + o_h[:, None] * D + o_d[None, :], mask=m_h[:, None] & m_d[None, :], other=0)
    hid = tl.sum(w1 * x[None, :], 1) + tl.load(p_b1 + o_h, mask=m_h, other=0)
    act = 0.5 * hid * (1.0 + tl.erf(hid * 0.7071067811865476))                      # exact GELU
    logit = tl.sum(act * tl.load(p_w2 + o_h, mask=m_h, other=0), 0) + tl.load(p_b2)
    p = 1.0 / (1.0 + tl.exp(-logit))
    # the threshold at the sequence's length (head 0's position, as the reference reads it)
    n = (tl.load(p_pos + b * s_pb) + 1).to(tl.float64)
    thr = tl.sqrt(tl.sqrt(n * tl.load(p_consts)))
    thr = tl.minimum(tl.maximum(thr, tl.load(p_consts + 1)), tl.load(p_consts + 2))
    cand_p = tl.where(p.to(tl.float64) > thr, p, -1.0)
    cand_pos = tl.load(p_pos + b * s_pb + h * s_ph)
    # the A most probable of the anchors (entries 0..A-1) and the candidate (entry A), by rank
    o_a = tl.arange(0, BLOCK_A)
    m_a = o_a < A
    vals = tl.load(p_ap + b * s_ab + h * s_ah + o_a * s_aa, mask=m_a, other=float("-inf"))
    vals = tl.where(o_a == A, cand_p, vals)
    where = tl.load(p_an + b * s_nb + h * s_nh + o_a * s_na, mask=m_a, other=-1)
    where = tl.where(o_a == A, cand_pos, where)
    v_i, v_j = vals[:, None], vals[None, :]
    before = (v_j > v_i) | ((v_j == v_i) & (o_a[None, :] < o_a[:, None]))
    rank = tl.sum(before.to(tl.int32), 1)
    keep = (o_a <= A) & (rank < A)
    tl.debug_barrier()                                  # every entry read before any is overwritten
    tl.store(p_ap + b * s_ab + h * s_ah + rank * s_aa, vals, mask=keep)
    tl.store(p_an + b * s_nb + h * s_nh + rank * s_na, tl.where(vals >= 0, where, -1), mask=keep)


def pin_one(k, pos, w1, b1, w2, b2, consts, anchor_p, anchors) -> None:
    B, H, _, D = k.shape
    HID, A = w1.shape[0], anchors.shape[-1]
    w1, b1, w2, b2 = (t.contiguous() for t in (w1, b1, w2, b2))
    _pin_one_kernel[(B * H,)](
        k, pos, w1, b1, w2, b2, consts, anchor_p, anchors, H, D, HID, A,
        k.stride(0), k.stride(1), k.stride(3), pos.stride(0), pos.stride(1),
        anchor_p.stride(0), anchor_p.stride(1), anchor_p.stride(2),
        anchors.stride(0), anchors.stride(1), anchors.stride(2),
        BLOCK_D=next_pow2(D), BLOCK_HID=next_pow2(HID), BLOCK_A=next_pow2(A + 1),
    )


# the row counts vary by recalibration: one compiled kernel for all (Triton would specialize each
# on being 1 or a multiple of 16), which the engine loads once at install (step_graph)
@triton.jit(do_not_specialize=["N", "ROWS", "T", "ITEMS"])
def _fit_grads_kernel(
    p_x, p_y, p_wn, p_w1, p_c1, p_w2, p_c2, p_g, p_z, N, D, HID, ROWS, T, G, ITEMS,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, WRITE_Z: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Work items i = p * T + t (of ITEMS = P * T), program k taking items k, k + programs, ...:
    probe p's rows [t * ROWS, (t + 1) * ROWS), BLOCK_N at a time; the item's gradient sums go to
    row i of p_g (G floats: dw1 (D, HID), dc1, dw2 (HID each), dc2), whichever program ran it."""
    first, programs = tl.program_id(0), tl.num_programs(0)
    for k in range(0, tl.cdiv(ITEMS - first, programs)):
        item = (first + k * programs).to(tl.int64)
        _fit_item(p_x, p_y, p_wn, p_w1, p_c1, p_w2, p_c2, p_g, p_z, N, D, HID, ROWS, T, G, item // T, item % T,
                  BLOCK_N, BLOCK_D, BLOCK_H, WRITE_Z, PRECISION)


@triton.jit
def _fit_item(
    p_x, p_y, p_wn, p_w1, p_c1, p_w2, p_c2, p_g, p_z, N, D, HID, ROWS, T, G, p, t,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, WRITE_Z: tl.constexpr,
    PRECISION: tl.constexpr,
):
    o_d, o_h = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_H)
    m_d, m_h = o_d < D, o_h < HID
    m_dh = m_d[:, None] & m_h[None, :]
    w1 = tl.load(p_w1 + p * D * HID + o_d[:, None] * HID + o_h[None, :], mask=m_dh, other=0)
    c1 = tl.load(p_c1 + p * HID + o_h, mask=m_h, other=0)
    w2 = tl.load(p_w2 + p * HID + o_h, mask=m_h, other=0)
    c2 = tl.load(p_c2 + p)
    g_w1 = tl.zeros((BLOCK_D, BLOCK_H), tl.float32)
    g_c1 = tl.zeros((BLOCK_H,), tl.float32)
    g_w2 = tl.zeros((BLOCK_H,), tl.float32)
    g_c2 = tl.zeros((BLOCK_N,), tl.float32)
    start = t * ROWS
    end = tl.minimum(start + ROWS, N)
    for r0 in range(start, end, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        m_n = rows < end
        x = tl.load(p_x + p * N * D + rows[:, None] * D + o_d[None, :], mask=m_n[:, None] & m_d[None, :], other=0)
        h = tl.dot(x, w1, input_precision=PRECISION) + c1[None, :]                       # (BLOCK_N, BLOCK_H)
        cdf = 0.5 * (1.0 + tl.erf(h * 0.7071067811865476))
        a = h * cdf                                                                       # exact GELU
        z = tl.sum(a * w2[None, :], 1) + c2
        y = tl.load(p_y + p * N + rows, mask=m_n, other=0)
        wn = tl.load(p_wn + p * N + rows, mask=m_n, other=0)                              # 0 past the rows
        dz = (1.0 / (1.0 + tl.exp(-z)) - y) * wn
        dh = (cdf + h * tl.exp(-0.5 * h * h) * 0.3989422804014327) * dz[:, None] * w2[None, :]
        g_w1 += tl.dot(tl.trans(x), dh, input_precision=PRECISION)
        g_c1 += tl.sum(dh, 0)
        g_w2 += tl.sum(a * dz[:, None], 0)
        g_c2 += dz
        if WRITE_Z:
            tl.store(p_z + p * N + rows, z, mask=m_n)
    out = p_g + (p * T + t) * G
    tl.store(out + o_d[:, None] * HID + o_h[None, :], g_w1, mask=m_dh)
    tl.store(out + D * HID + o_h, g_c1, mask=m_h)
    tl.store(out + D * HID + HID + o_h, g_w2, mask=m_h)
    tl.store(out + D * HID + 2 * HID, tl.sum(g_c2, 0))


def fit_grads(x, y, wn, w1, c1, w2, c2, want_z: bool):
    P, N, D = x.shape
    HID = w1.shape[-1]
    x, y, wn, w1, c1, w2, c2 = (t.contiguous() for t in (x, y, wn, w1, c1, w2, c2))
    BLOCK_N = FIT_TILE
    # about four programs a streaming multiprocessor, each over whole tiles of rows
    T = max(1, min(triton.cdiv(N, BLOCK_N), triton.cdiv(4 * sm_count(x.device), P)))
    ROWS = triton.cdiv(triton.cdiv(N, T), BLOCK_N) * BLOCK_N
    T = triton.cdiv(N, ROWS)
    G = D * HID + 2 * HID + 1
    g = torch.empty(P, T, G, device=x.device)
    z = torch.empty(P, N, device=x.device) if want_z else g
    items = P * T
    programs = items if FIT_SM_SHARE is None else max(1, min(items, round(FIT_SM_SHARE * sm_count(x.device))))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():   # Triton's current device
        _fit_grads_kernel[(programs,)](
            x, y, wn, w1, c1, w2, c2, g, z, N, D, HID, ROWS, T, G, items,
            BLOCK_N=BLOCK_N, BLOCK_D=max(16, next_pow2(D)), BLOCK_H=max(16, next_pow2(HID)), WRITE_Z=want_z,
            PRECISION=FIT_DOTS if x.is_cuda else "ieee", num_warps=FIT_WARPS,
        )
    s = g.sum(1)                                                   # (P, G), over the programs in order
    grads = [s[:, :D * HID].view(P, D, HID), s[:, D * HID:D * HID + HID], s[:, D * HID + HID:D * HID + 2 * HID],
             s[:, D * HID + 2 * HID]]
    return grads, (z if want_z else None)
