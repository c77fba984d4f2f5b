"""RMSNorm in one launch: what transformers' LlamaRMSNorm (and Mistral's, Qwen2's, Qwen3's) computes
in about eight small kernels (to fp32, pow, mean, add eps, rsqrt, mul, to dtype, weight mul).

For each row h = x.to(fp32) of the last dimension (N elements):

    y = (h * rsqrt(mean(h * h) + eps)).to(x.dtype)
    out = weight * y

the product in torch's type promotion of (weight.dtype, x.dtype): computed in fp32 from the two
rounded operands and rounded once to that dtype, as torch's elementwise multiply does for fp16 and
bf16. The output is a new tensor (``torch.empty``: no host sync, so a CUDA graph can capture it).
"""
from __future__ import annotations

import torch

from ._dispatch import FLOAT_DTYPES, check, kernel_module, use_triton

MAX_N = 16384        # a row is held in one program's registers; longer rows run the reference


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The module's math, op for op (transformers' LlamaRMSNorm.forward)."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., N) over its last dimension with weight (N,) (module docstring): one Triton
    launch on CUDA tensors, the reference otherwise."""
    check(x.dim() >= 1 and weight.dim() == 1 and weight.shape[0] == x.shape[-1],
          f"weight must be 1-D with one entry per element of x's last dimension: x {tuple(x.shape)}, "
          f"weight {tuple(weight.shape)}")
    check(x.dtype in FLOAT_DTYPES and weight.dtype in FLOAT_DTYPES,
          f"x and weight must be float16, bfloat16 or float32, got {x.dtype} and {weight.dtype}: cast them first")
    check(x.device == weight.device, f"x is on {x.device} and weight on {weight.device}: move one of them")
    check(isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0,
          f"eps must be a number >= 0 (the module's variance_epsilon), got {eps!r}")
    if use_triton(x, weight) and 0 < x.shape[-1] <= MAX_N:
        return kernel_module("_norm_triton").rms_norm(x, weight, float(eps))
    return reference_rms_norm(x, weight, eps)
