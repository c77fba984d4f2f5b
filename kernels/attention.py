"""Sparse decode attention over selected hot-buffer slots (GQA, one query token per sequence).

Shapes: q (B, Hq, D); k_buf, v_buf (B, Hkv, S, D) hot buffer with S slots; slots (B, Hkv, K)
int32/int64 slot indices into S, padded with -1. Query head h reads kv head h // (Hq // Hkv).
"""
from __future__ import annotations

import torch

from ._dispatch import FLOAT_DTYPES, INDEX_DTYPES, check, kernel_module, use_triton


def _validate(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor) -> None:
    check(q.dim() == 3, f"q must be (B, Hq, D), got shape {tuple(q.shape)}")
    check(k_buf.dim() == 4 and k_buf.shape == v_buf.shape,
          f"k_buf and v_buf must both be (B, Hkv, S, D), got {tuple(k_buf.shape)} and {tuple(v_buf.shape)}")
    B, Hq, D = q.shape
    Bk, Hkv, S, Dk = k_buf.shape
    check(Bk == B and Dk == D, f"k_buf {tuple(k_buf.shape)} does not match q {tuple(q.shape)} in batch or head_dim")
    check(Hkv > 0 and Hq % Hkv == 0, f"Hq={Hq} must be a multiple of Hkv={Hkv} (GQA)")
    check(slots.dim() == 3 and tuple(slots.shape[:2]) == (B, Hkv),
          f"slots must be (B, Hkv, K) = ({B}, {Hkv}, K), got {tuple(slots.shape)}")
    check(slots.dtype in INDEX_DTYPES, f"slots must be int32 or int64, got {slots.dtype}")
    check(q.dtype in FLOAT_DTYPES, f"q dtype {q.dtype} unsupported; use float16, bfloat16 or float32")
    check(k_buf.dtype == q.dtype and v_buf.dtype == q.dtype,
          f"q, k_buf, v_buf must share a dtype, got {q.dtype}, {k_buf.dtype}, {v_buf.dtype}")
    devices = {q.device, k_buf.device, v_buf.device, slots.device}
    check(len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}")


def reference_sparse_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                                      slots: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Plain PyTorch, fp32 softmax and accumulation. Returns (B, Hq, D) in q's dtype."""
    B, Hq, D = q.shape
    Hkv, S = k_buf.shape[1], k_buf.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    valid = slots >= 0                                            # (B, Hkv, K)
    # rows of the flattened (B*Hkv*S, D) buffers: index_select is ~8x faster on CPU than a
    # gather with an index expanded over D, and moves the same values
    K = slots.shape[2]
    rows = (torch.arange(B * Hkv, device=slots.device).view(B, Hkv, 1) * S + slots.clamp(min=0).long()).view(-1)
    k = k_buf.reshape(B * Hkv * S, D).index_select(0, rows).view(B, Hkv, K, D).float()  # (B, Hkv, K, D)
    v = v_buf.reshape(B * Hkv * S, D).index_select(0, rows).view(B, Hkv, K, D).float()
    qg = q.float().view(B, Hkv, G, D)
    s = torch.einsum("bhgd,bhkd->bhgk", qg, k) * scale
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))   # all-masked row: p = 0, not NaN
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bhgk,bhkd->bhgd", p, v)
    o = torch.where(denom > 0, o / denom.clamp_min(1e-30), torch.zeros_like(o))
    return o.reshape(B, Hq, D).to(q.dtype)


def sparse_decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                            slots: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of each query head over the hot-buffer slots its kv head selected.

    q (B, Hq, D); k_buf, v_buf (B, Hkv, S, D); slots (B, Hkv, K), -1 = padding. Returns (B, Hq, D)
    in q's dtype; a row with no valid slot returns zeros. scale defaults to D ** -0.5. Slot values
    must lie in [-1, S) (not checked on CUDA: that would cost a device sync per call).
    """
    _validate(q, k_buf, v_buf, slots)
    if use_triton(q, k_buf, v_buf, slots):
        return kernel_module("_attention_triton").launch(q, k_buf, v_buf, slots, scale)
    if not q.is_cuda and slots.numel():
        S = k_buf.shape[2]
        check(int(slots.max()) < S and int(slots.min()) >= -1, f"slots must lie in [-1, {S})")
    return reference_sparse_decode_attention(q, k_buf, v_buf, slots, scale)
