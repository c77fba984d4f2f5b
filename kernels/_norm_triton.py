"""Triton: RMSNorm of rows in one launch, ROWS rows per program (norm.py says what it computes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2

# elements a program holds: small rows (a per-head q_norm / k_norm of 128) are packed several to a
# program so that one does not spend a whole program (and its launch share) on 128 elements
_TILE = 2048


@triton.jit
def _to_bf16(v):
    """v (fp32) rounded to the nearest bfloat16, ties to even, kept in fp32 (then a cast to bfloat16
    is exact). Done on the bits: the interpreter's own fp32 -> bf16 cast truncates, the GPU's
    rounds; this is the GPU's rounding (and torch's) in both. NaN stays NaN."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))


@triton.jit
def _rms_norm_kernel(p_x, p_w, p_out, R, N, s_x, s_out, inv_n, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     X_BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    m_c = cols < N
    m = (rows < R)[:, None] & m_c[None, :]
    x = tl.load(p_x + rows[:, None] * s_x + cols[None, :], mask=m, other=0)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 1) * inv_n                          # mean(h * h) over the row
    h = h * tl.rsqrt(var + eps)[:, None]
    if X_BF16:                                              # rounded to x's dtype, as the module does
        y = _to_bf16(h)
    else:
        y = h.to(p_x.dtype.element_ty).to(tl.float32)
    w = tl.load(p_w + cols, mask=m_c, other=0).to(tl.float32)
    out = w[None, :] * y                                    # one rounding, to the promoted dtype
    if OUT_BF16:
        out = _to_bf16(out)
    tl.store(p_out + rows[:, None] * s_out + cols[None, :], out.to(p_out.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    N = x.shape[-1]
    rows = x.reshape(-1, N)                                 # a view where x allows one
    if N > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    R = rows.shape[0]
    if R == 0:
        return out
    BLOCK = next_pow2(N)
    ROWS = max(1, min(_TILE // BLOCK, next_pow2(R)))
    warps = max(1, min(16, ROWS * BLOCK // 512))
    launch = _rms_norm_kernel[(triton.cdiv(R, ROWS),)]
    args = (rows, weight, out, R, N, rows.stride(0), N, 1.0 / N, float(eps))
    meta = dict(ROWS=ROWS, BLOCK=BLOCK, X_BF16=x.dtype == torch.bfloat16, OUT_BF16=out.dtype == torch.bfloat16,
                num_warps=warps)
    if x.is_cuda and x.device.index != torch.cuda.current_device():
        with torch.cuda.device(x.device):                   # Triton launches on the current device
            launch(*args, **meta)
    else:
        launch(*args, **meta)
    return out
