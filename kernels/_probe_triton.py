"""Triton: a decode token's anchor scoring and merge in one launch (probe.py says what it does)."""
from __future__ import annotations

import triton
import triton.language as tl

from ._launch import next_pow2


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
