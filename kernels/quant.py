"""Block quantization: asymmetric uniform, one scale and zero point per block, bit-packed rows.

x (N, T, D): N blocks of T rows (tokens) of D values. For bits b in {4, 5, 6, 8}:
scale = (max - min) / (2^b - 1), zero = min, q = floor((x - zero) / scale + 0.5) clamped to
[0, 2^b - 1] (a constant block has scale 0 and q = 0). Each row packs its D codes into
P = ceil(D * b / 8) bytes, little-endian bit order: bit i of code j is stream bit j*b + i, and
stream bit s is bit s % 8 of byte s // 8.
"""
from __future__ import annotations

import torch

from ._dispatch import FLOAT_DTYPES, check, kernel_module, use_triton

SUPPORTED_BITS = (4, 5, 6, 8)


def packed_width(d: int, bits: int) -> int:
    """Bytes per packed row of d codes at `bits` bits."""
    return (d * bits + 7) // 8


def _check_bits(bits: int) -> None:
    check(bits in SUPPORTED_BITS, f"bits={bits} unsupported; use one of {SUPPORTED_BITS}")


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) integer codes < 2^bits -> (..., P) uint8, little-endian bit order."""
    d = q.shape[-1]
    p = packed_width(d, bits)
    shifts = torch.arange(bits, device=q.device)
    planes = ((q.long()[..., None] >> shifts) & 1).to(torch.uint8)     # (..., D, bits)
    stream = planes.flatten(-2)                                          # (..., D*bits)
    stream = torch.nn.functional.pad(stream, (0, p * 8 - d * bits))
    stream = stream.view(*q.shape[:-1], p, 8).long()
    weights = torch.arange(8, device=q.device)
    return (stream << weights).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """(..., P) uint8 -> (..., D) int64 codes (inverse of pack_codes)."""
    shifts = torch.arange(8, device=packed.device)
    stream = ((packed.long()[..., None] >> shifts) & 1).flatten(-2)[..., : d * bits]
    planes = stream.reshape(*packed.shape[:-1], d, bits)
    weights = torch.arange(bits, device=packed.device)
    return (planes << weights).sum(-1)


def _validate_quantize(x: torch.Tensor, bits: int) -> None:
    _check_bits(bits)
    check(x.dim() == 3, f"x must be (N, T, D) blocks, got shape {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} unsupported; use float16, bfloat16 or float32")
    check(x.numel() > 0, "x is empty; quantize at least one non-empty block")


def reference_quantize_blocks(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, T, D) -> packed (N, T, P) uint8, scale (N,) fp32, zero (N,) fp32."""
    levels = (1 << bits) - 1
    xf = x.float()
    lo = xf.amin(dim=(1, 2))
    hi = xf.amax(dim=(1, 2))
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.floor((xf - lo[:, None, None]) / safe[:, None, None] + 0.5).clamp(0, levels)
    q = torch.where(scale[:, None, None] > 0, q, torch.zeros_like(q))
    return pack_codes(q.long(), bits), scale, lo


def reference_dequantize_blocks(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                                d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed (N, T, P) -> x_hat (N, T, D) in dtype: code * scale + zero."""
    q = unpack_codes(packed, bits, d).float()
    return (q * scale.float()[:, None, None] + zero.float()[:, None, None]).to(dtype)


def quantize_blocks(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize N blocks of (T, D) values. x (N, T, D) float.

    Returns packed (N, T, P) uint8 with P = ceil(D * bits / 8), scale (N,) fp32, zero (N,) fp32.
    """
    _validate_quantize(x, bits)
    if use_triton(x):
        return kernel_module("_quant_triton").quantize(x, bits)
    return reference_quantize_blocks(x, bits)


def dequantize_blocks(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, D: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_blocks: packed (N, T, P) uint8, scale/zero (N,) -> (N, T, D) in dtype."""
    _check_bits(bits)
    check(packed.dim() == 3 and packed.dtype == torch.uint8,
          f"packed must be (N, T, P) uint8, got {tuple(packed.shape)} {packed.dtype}")
    check(packed.shape[-1] == packed_width(D, bits),
          f"packed rows hold {packed.shape[-1]} bytes but D={D} at {bits} bits needs {packed_width(D, bits)}")
    n = packed.shape[0]
    check(scale.shape == (n,) and zero.shape == (n,),
          f"scale and zero must be ({n},), got {tuple(scale.shape)} and {tuple(zero.shape)}")
    check(dtype in FLOAT_DTYPES, f"dtype {dtype} unsupported; use float16, bfloat16 or float32")
    if use_triton(packed, scale, zero):
        return kernel_module("_quant_triton").dequantize(packed, scale, zero, bits, D, dtype)
    return reference_dequantize_blocks(packed, scale, zero, bits, D, dtype)
