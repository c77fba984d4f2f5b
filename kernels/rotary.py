"""Rotary position embedding of a layer's queries and keys in one launch: what transformers'
``apply_rotary_pos_emb`` (Llama, Mistral, Qwen2, Qwen3) computes in about ten small kernels (a
multiply by cos, the rotated half's negation and concatenation, a multiply by sin and an add, for
q and again for k).

For q (B, Hq, T, D) and k (B, Hk, T, D), cos and sin (B or 1, T, D) broadcast over the heads, and
x1, x2 the two halves of each row's last dimension:

    out[..., :D/2] = x1 * cos[..., :D/2] + (-x2) * sin[..., :D/2]
    out[..., D/2:] = x2 * cos[..., D/2:] + x1 * sin[..., D/2:]

each product rounded to the tensors' dtype and the sum rounded again, as torch's elementwise ops
do (fp16 and bf16 computed in fp32 from the rounded operands; no fused multiply-add in fp32), so
the result is bit for bit the function's. The outputs are new tensors shaped and strided like q and
k (``torch.empty_like``: no host sync, so a CUDA graph can capture the launch).
"""
from __future__ import annotations

import torch

from ._dispatch import FLOAT_DTYPES, check, kernel_module, use_triton


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The function's math, op for op (cos and sin (B or 1, T, D) broadcast over the heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rotary` computes these in one launch (else it runs the reference): 4-D q and
    k, 3-D cos and sin of one float dtype, an even head dimension, matching batch and length
    (cos's batch 1 broadcasts), all on one device where kernels run Triton, no gradients."""
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    B, _, T, D = q.shape
    if D % 2 or D == 0 or k.shape[0] != B or k.shape[2:] != (T, D) or cos.shape[1:] != (T, D) \
            or cos.shape[0] not in (1, B):
        return False
    if q.dtype not in FLOAT_DTYPES or any(t.dtype != q.dtype for t in tensors):
        return False
    if any(t.device != q.device for t in tensors) or any(t.requires_grad for t in tensors):
        return False
    return use_triton(*tensors)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) with the rotary embedding applied (module docstring): one Triton launch where
    :func:`supported`, the reference otherwise."""
    check(q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and sin.shape == cos.shape,
          f"q and k must be (batch, heads, tokens, head_dim) and cos, sin (batch or 1, tokens, head_dim): got "
          f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if supported(q, k, cos, sin):
        return kernel_module("_rotary_triton").rotary(q, k, cos, sin)
    return reference_rotary(q, k, cos, sin)
