"""Triton: the rotary embedding of q and k in one launch (rotary.py says what it computes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2
from ._norm_triton import _to_bf16


@triton.jit
def _rounded(v, BF16: tl.constexpr, F16: tl.constexpr):
    """v (fp32) rounded to the tensors' dtype (ties to even), kept in fp32."""
    if BF16:
        v = _to_bf16(v)
    elif F16:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _rotate_rows(p_x, p_out, p_cos, p_sin, b, t, cb, H, s_b, s_h, s_t, s_d, o_b, o_h, o_t, o_d,
                 c_b, c_t, c_d, HALF, BH: tl.constexpr, BD: tl.constexpr, BF16: tl.constexpr,
                 F16: tl.constexpr):
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    m_d = d < HALF
    m = (h < H)[:, None] & m_d[None, :]
    c = p_cos + cb * c_b + t * c_t
    s = p_sin + cb * c_b + t * c_t
    c1 = tl.load(c + d * c_d, mask=m_d, other=0).to(tl.float32)[None, :]
    c2 = tl.load(c + (HALF + d) * c_d, mask=m_d, other=0).to(tl.float32)[None, :]
    s1 = tl.load(s + d * c_d, mask=m_d, other=0).to(tl.float32)[None, :]
    s2 = tl.load(s + (HALF + d) * c_d, mask=m_d, other=0).to(tl.float32)[None, :]
    row = p_x + b * s_b + t * s_t + h[:, None] * s_h
    x1 = tl.load(row + d[None, :] * s_d, mask=m, other=0).to(tl.float32)
    x2 = tl.load(row + (HALF + d[None, :]) * s_d, mask=m, other=0).to(tl.float32)
    # each product rounded, then the sum: x * cos + rotate_half(x) * sin, as torch computes it
    y1 = _rounded(_rounded(x1 * c1, BF16, F16) - _rounded(x2 * s1, BF16, F16), BF16, F16)
    y2 = _rounded(_rounded(x2 * c2, BF16, F16) + _rounded(x1 * s2, BF16, F16), BF16, F16)
    out = p_out + b * o_b + t * o_t + h[:, None] * o_h
    tl.store(out + d[None, :] * o_d, y1.to(p_out.dtype.element_ty), mask=m)
    tl.store(out + (HALF + d[None, :]) * o_d, y2.to(p_out.dtype.element_ty), mask=m)


@triton.jit
def _rotary_kernel(p_q, p_k, p_qo, p_ko, p_cos, p_sin, T, HQ, HK, HALF, COS_B,
                   q_b, q_h, q_t, q_d, k_b, k_h, k_t, k_d, qo_b, qo_h, qo_t, qo_d, ko_b, ko_h, ko_t, ko_d,
                   c_b, c_t, c_d, BH: tl.constexpr, BD: tl.constexpr, BF16: tl.constexpr, F16: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)
    b = bt // T
    t = bt % T
    cb = b * COS_B                                   # cos and sin of batch 1 broadcast
    if tl.program_id(1) == 0:
        _rotate_rows(p_q, p_qo, p_cos, p_sin, b, t, cb, HQ, q_b, q_h, q_t, q_d, qo_b, qo_h, qo_t, qo_d,
                     c_b, c_t, c_d, HALF, BH, BD, BF16, F16)
    else:
        _rotate_rows(p_k, p_ko, p_cos, p_sin, b, t, cb, HK, k_b, k_h, k_t, k_d, ko_b, ko_h, ko_t, ko_d,
                     c_b, c_t, c_d, HALF, BH, BD, BF16, F16)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if B * T == 0:
        return q_out, k_out
    if sin.stride() != cos.stride():
        sin = sin.contiguous()
        cos = cos.contiguous()
    BH, BD = next_pow2(max(HQ, HK)), next_pow2(D // 2)
    args = (q, k, q_out, k_out, cos, sin, T, HQ, HK, D // 2, int(cos.shape[0] > 1),
            *q.stride(), *k.stride(), *q_out.stride(), *k_out.stride(), *cos.stride())
    # no fused multiply-add: torch rounds each fp32 product before the sum
    meta = dict(BH=BH, BD=BD, BF16=q.dtype == torch.bfloat16, F16=q.dtype == torch.float16,
                num_warps=max(1, min(8, BH * BD // 256)), enable_fp_fusion=False)
    launch = _rotary_kernel[(B * T, 2)]
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):                   # Triton launches on the current device
            launch(*args, **meta)
    else:
        launch(*args, **meta)
    return q_out, k_out
