"""Triton sparse decode attention (flash-decoding over gathered hot-buffer slots).

One program per (sequence, kv head, split of the selected tokens) serves all G = Hq // Hkv query
heads of the group, so each gathered K/V row is read from HBM once. When B * Hkv programs cannot
fill the GPU, the K selected tokens are split across programs and a second kernel merges the
partial (max, sum, output) triples.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2, sm_count

BLOCK_N = 64          # selected tokens per inner step


# One kernel of ~65 lines on purpose: its parameter list is a third of it (strides), and the body
# is one streaming loop (online softmax) that would only be split across call boundaries.
@triton.jit
def _decode_kernel(
    p_q, p_k, p_v, p_slots, p_out, p_part_o, p_part_ml,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_sb, stride_sh, stride_ob, stride_oh,
    Hkv, K, D, chunk, n_split, scale,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, IEEE: tl.constexpr,
):
    i_bh = tl.program_id(0)
    i_split = tl.program_id(1)
    i_b = (i_bh // Hkv).to(tl.int64)
    i_h = (i_bh % Hkv).to(tl.int64)
    o_g = tl.arange(0, BLOCK_G)
    o_d = tl.arange(0, BLOCK_D)
    m_g = o_g < G
    m_d = o_d < D

    p_qg = p_q + i_b * stride_qb + (i_h * G + o_g).to(tl.int64)[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_qg, mask=m_g[:, None] & m_d[None, :], other=0.0)

    # m starts finite so a tile with no valid slot gives exp(-inf - m) = 0, never NaN
    b_m = tl.full([BLOCK_G], -1e30, tl.float32)
    b_l = tl.zeros([BLOCK_G], tl.float32)
    b_acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    p_k0 = p_k + i_b * stride_kb + i_h * stride_kh
    p_v0 = p_v + i_b * stride_vb + i_h * stride_vh
    p_s0 = p_slots + i_b * stride_sb + i_h * stride_sh
    start = i_split * chunk
    end = tl.minimum(start + chunk, K)
    for n0 in range(start, end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        b_slot = tl.load(p_s0 + o_n, mask=o_n < end, other=-1)
        m_n = b_slot >= 0
        o_row = tl.where(m_n, b_slot, 0).to(tl.int64)
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(p_k0 + o_row[:, None] * stride_ks + o_d[None, :], mask=m_kv, other=0.0)
        if IEEE:
            b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
        else:
            b_s = tl.dot(b_q, tl.trans(b_k))
        b_s = tl.where(m_n[None, :], b_s * scale, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        b_v = tl.load(p_v0 + o_row[:, None] * stride_vs + o_d[None, :], mask=m_kv, other=0.0)
        if IEEE:
            b_pv = tl.dot(b_p.to(b_v.dtype), b_v, input_precision="ieee")
        else:
            b_pv = tl.dot(b_p.to(b_v.dtype), b_v)
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new

    if SPLIT:
        o_part = (i_bh * n_split + i_split).to(tl.int64)
        p_po = p_part_o + (o_part * BLOCK_G + o_g)[:, None] * BLOCK_D + o_d[None, :]
        tl.store(p_po, b_acc)
        p_pml = p_part_ml + (o_part * 2) * BLOCK_G + o_g
        tl.store(p_pml, b_m)
        tl.store(p_pml + BLOCK_G, b_l)
    else:
        b_o = tl.where(b_l[:, None] > 0, b_acc / tl.maximum(b_l, 1e-30)[:, None], 0.0)
        p_o = p_out + i_b * stride_ob + (i_h * G + o_g).to(tl.int64)[:, None] * stride_oh + o_d[None, :]
        tl.store(p_o, b_o.to(p_out.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])


@triton.jit
def _merge_kernel(
    p_part_o, p_part_ml, p_out, stride_ob, stride_oh, Hkv, D, n_split,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (sequence, query head): all splits' partials in one tile, no serial loop."""
    i_bh = tl.program_id(0)
    i_g = tl.program_id(1)
    i_b = (i_bh // Hkv).to(tl.int64)
    i_h = (i_bh % Hkv).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < n_split
    o_part = i_bh.to(tl.int64) * n_split + o_s
    b_m = tl.load(p_part_ml + (o_part * 2) * BLOCK_G + i_g, mask=m_s, other=-1e30)
    b_l = tl.load(p_part_ml + (o_part * 2 + 1) * BLOCK_G + i_g, mask=m_s, other=0.0)
    b_o = tl.load(p_part_o + ((o_part * BLOCK_G + i_g) * BLOCK_D)[:, None] + o_d[None, :], mask=m_s[:, None], other=0.0)
    b_w = tl.exp(b_m - tl.max(b_m, 0))
    b_sum = tl.sum(b_l * b_w, 0)
    b_acc = tl.sum(b_o * b_w[:, None], 0)
    b_res = tl.where(b_sum > 0, b_acc / tl.maximum(b_sum, 1e-30), 0.0)
    p_o = p_out + i_b * stride_ob + (i_h * G + i_g) * stride_oh + o_d
    tl.store(p_o, b_res.to(p_out.dtype.element_ty), mask=o_d < D)


MAX_SPLIT = 64        # the merge holds all splits of one head in registers


def plan_splits(batch_heads: int, k: int, sms: int, block_n: int = BLOCK_N) -> tuple[int, int]:
    """(n_split, chunk): split the K selected tokens only as far as needed to give ~2 programs per SM."""
    max_split = max(1, min(MAX_SPLIT, triton.cdiv(k, block_n)))
    n_split = min(max_split, max(1, triton.cdiv(2 * sms, batch_heads)))
    chunk = triton.cdiv(triton.cdiv(k, n_split), block_n) * block_n
    return triton.cdiv(k, chunk), chunk


def launch(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
           scale: float | None, n_split: int | None = None, block_n: int = BLOCK_N,
           num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q (B, Hq, D), k_buf/v_buf (B, Hkv, S, D), slots (B, Hkv, K) -> (B, Hq, D) in q's dtype.

    n_split, block_n, num_warps, num_stages override the defaults (benchmark sweeps use them).
    """
    B, Hq, D = q.shape
    Hkv, K = k_buf.shape[1], slots.shape[2]
    G = Hq // Hkv
    scale = float(D ** -0.5 if scale is None else scale)
    out = torch.empty_like(q)
    if K == 0 or B == 0:
        return out.zero_()
    # the kernels index the last dim with unit stride; copy only the rare odd layouts
    q, k_buf, v_buf, slots = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_buf, v_buf, slots))
    BLOCK_G, BLOCK_D = max(16, next_pow2(G)), max(16, next_pow2(D))
    if n_split is None:
        n_split, chunk = plan_splits(B * Hkv, K, sm_count(q.device), block_n)
    else:
        chunk = triton.cdiv(triton.cdiv(K, min(n_split, MAX_SPLIT)), block_n) * block_n
        n_split = triton.cdiv(K, chunk)
    split = n_split > 1
    if split:
        part_o = torch.empty(B * Hkv * n_split * BLOCK_G * BLOCK_D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(B * Hkv * n_split * 2 * BLOCK_G, device=q.device, dtype=torch.float32)
    else:
        part_o = part_ml = out
    ieee = q.dtype == torch.float32
    _decode_kernel[(B * Hkv, n_split)](
        q, k_buf, v_buf, slots, out, part_o, part_ml,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), k_buf.stride(2),
        v_buf.stride(0), v_buf.stride(1), v_buf.stride(2), slots.stride(0), slots.stride(1),
        out.stride(0), out.stride(1), Hkv, K, D, chunk, n_split, scale,
        G=G, BLOCK_G=BLOCK_G, BLOCK_N=block_n, BLOCK_D=BLOCK_D, SPLIT=split, IEEE=ieee,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        _merge_kernel[(B * Hkv, G)](part_o, part_ml, out, out.stride(0), out.stride(1), Hkv, D, n_split,
                                    G=G, BLOCK_G=BLOCK_G, BLOCK_D=BLOCK_D, BLOCK_S=max(2, next_pow2(n_split)),
                                    num_warps=4)
    return out
