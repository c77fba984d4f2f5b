"""Block quantization: asymmetric uniform, bit-packed rows, scale and zero point per block, channel or token.

x (N, T, D): N blocks of T rows (tokens) of D values. For bits b in {4, 5, 6, 8} and a *layout*
that says which values share a scale and zero point:

- ``"block"``: one pair per block, scale/zero (N,) fp32;
- ``"channel"``: one pair per column of a block (min / max over its T tokens), (N, D) fp16 --
  keys (a few channels carry most of a key's range: one scale per block spends the levels on them);
- ``"token"``: one pair per row (min / max over its D channels), (N, T) fp16 -- values.

Per group of values sharing a pair: zero = min and scale = (max - zero) / (2^b - 1), both first
rounded to the layout's storage dtype (codes are computed against the stored pair, so dequantizing
with it is exact up to the rounding of the codes), q = round((x - zero) / scale) clamped to
[0, 2^b - 1] (scale 0: q = 0). fp16 pairs hold 2 x 16 bits per D or T values (6-12 % of a 4-bit
row at D = 64-128) and need |x| < 65504, which bf16 / fp16 KV caches hold.
Each row packs its D codes into P = ceil(D * b / 8) bytes, little-endian bit order: bit i of code
j is stream bit j*b + i, and stream bit s is bit s % 8 of byte s // 8.
"""
from __future__ import annotations

import torch

from ._dispatch import FLOAT_DTYPES, check, kernel_module, use_triton

SUPPORTED_BITS = (4, 5, 6, 8)
LAYOUTS = ("block", "channel", "token")
PARAM_DTYPES = {"block": torch.float32, "channel": torch.float16, "token": torch.float16}
_REDUCE_DIMS = {"block": (1, 2), "channel": (1,), "token": (2,)}


def param_shape(layout: str, n: int, t: int, d: int) -> tuple[int, ...]:
    """Shape of the scale (and zero) of n blocks of t x d values in ``layout``."""
    return {"block": (n,), "channel": (n, d), "token": (n, t)}[layout]


def quant_params(lo: torch.Tensor, hi: torch.Tensor, bits: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) in ``dtype`` of groups with minimum lo and maximum hi (fp32 tensors): zero is
    lo rounded to dtype, scale (hi - zero) / (2^bits - 1) rounded to dtype (never negative)."""
    zero = lo.to(dtype)
    scale = ((hi - zero.float()).clamp_min(0) / ((1 << bits) - 1)).to(dtype)
    return scale, zero


def packed_width(d: int, bits: int) -> int:
    """Bytes per packed row of d codes at `bits` bits."""
    return (d * bits + 7) // 8


def _check_bits(bits: int) -> None:
    check(bits in SUPPORTED_BITS, f"bits={bits} unsupported; use one of {SUPPORTED_BITS}")


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) integer codes < 2^bits -> (..., P) uint8, little-endian bit order. In uint8
    throughout (codes and bit planes fit), the bytes assembled by shift-or: int64 planes summed
    were 8x the bytes, which at a batch's units left the CPU's caches and ran ~9x slower."""
    d = q.shape[-1]
    p = packed_width(d, bits)
    shifts = torch.arange(bits, dtype=torch.uint8, device=q.device)
    planes = (q.to(torch.uint8)[..., None] >> shifts) & 1                # (..., D, bits)
    stream = torch.nn.functional.pad(planes.flatten(-2), (0, p * 8 - d * bits))
    stream = stream.view(*q.shape[:-1], p, 8)
    out = stream[..., 0].clone()
    for j in range(1, 8):
        out |= stream[..., j] << j
    return out


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """(..., P) uint8 -> (..., D) int64 codes (inverse of pack_codes; bit planes in uint8)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.to(torch.uint8)[..., None] >> shifts) & 1).flatten(-2)[..., : d * bits]
    planes = stream.reshape(*packed.shape[:-1], d, bits)
    out = planes[..., 0].clone()
    for j in range(1, bits):
        out |= planes[..., j] << j
    return out.long()


def _check_layout(layout: str) -> None:
    check(layout in LAYOUTS, f"layout={layout!r} unknown; use one of {LAYOUTS}")


def _validate_quantize(x: torch.Tensor, bits: int, layout: str) -> None:
    _check_bits(bits)
    _check_layout(layout)
    check(x.dim() == 3, f"x must be (N, T, D) blocks, got shape {tuple(x.shape)}")
    check(x.dtype in FLOAT_DTYPES, f"x dtype {x.dtype} unsupported; use float16, bfloat16 or float32")
    check(x.numel() > 0, "x is empty; quantize at least one non-empty block")


def _expand(p: torch.Tensor, layout: str) -> torch.Tensor:
    """A layout's (N,), (N, D) or (N, T) pair as fp32, broadcastable to (N, T, D)."""
    p = p.float()
    return {"block": lambda: p[:, None, None], "channel": lambda: p[:, None, :],
            "token": lambda: p[:, :, None]}[layout]()


def _reference_codes(x: torch.Tensor, bits: int,
                     layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (N, T, D) as fp32 and the layout's scale and zero (stored dtype) of units x."""
    levels = (1 << bits) - 1
    xf = x.float()
    dims = _REDUCE_DIMS[layout]
    scale, zero = quant_params(xf.amin(dim=dims), xf.amax(dim=dims), bits, PARAM_DTYPES[layout])
    s, z = _expand(scale, layout), _expand(zero, layout)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.floor((xf - z) / safe + 0.5).clamp(0, levels)
    return torch.where(s > 0, q, torch.zeros_like(q)), scale, zero


def reference_quantize_blocks(x: torch.Tensor, bits: int,
                              layout: str = "block") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, T, D) -> packed (N, T, P) uint8, scale and zero (param_shape(layout)) in PARAM_DTYPES[layout]."""
    q, scale, zero = _reference_codes(x, bits, layout)
    return pack_codes(q.long(), bits), scale, zero


def fake_quantize_blocks(x: torch.Tensor, bits: int, layout: str = "block") -> torch.Tensor:
    """x (N, T, D) quantized and dequantized to fp32 as reference_quantize_blocks then
    reference_dequantize_blocks would, without packing: on x's device, for measuring errors."""
    q, scale, zero = _reference_codes(x, bits, layout)
    return q * _expand(scale, layout) + _expand(zero, layout)


def reference_dequantize_blocks(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                                d: int, dtype: torch.dtype = torch.float32, layout: str = "block") -> torch.Tensor:
    """packed (N, T, P) -> x_hat (N, T, D) in dtype: code * scale + zero."""
    q = unpack_codes(packed, bits, d).float()
    return (q * _expand(scale, layout) + _expand(zero, layout)).to(dtype)


def quantize_blocks(x: torch.Tensor, bits: int,
                    layout: str = "block") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize N blocks of (T, D) values. x (N, T, D) float.

    Returns packed (N, T, P) uint8 with P = ceil(D * bits / 8), scale and zero of
    ``param_shape(layout, N, T, D)`` in ``PARAM_DTYPES[layout]``.
    """
    _validate_quantize(x, bits, layout)
    if use_triton(x):
        return kernel_module("_quant_triton").quantize(x, bits, layout)
    return reference_quantize_blocks(x, bits, layout)


def check_params(scale: torch.Tensor, zero: torch.Tensor, layout: str, shape: tuple[int, ...]) -> None:
    """scale and zero must both be ``shape`` in the layout's storage dtype."""
    _check_layout(layout)
    want = PARAM_DTYPES[layout]
    check(tuple(scale.shape) == tuple(shape) and tuple(zero.shape) == tuple(shape),
          f"scale and zero must be {tuple(shape)} for layout {layout!r}, got {tuple(scale.shape)} and "
          f"{tuple(zero.shape)}")
    check(scale.dtype == want and zero.dtype == want,
          f"scale and zero of layout {layout!r} are {want}, got {scale.dtype} and {zero.dtype}: pass what "
          "quantize_blocks returned")


def dequantize_blocks(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, D: int,
                      dtype: torch.dtype = torch.float32, layout: str = "block") -> torch.Tensor:
    """Inverse of quantize_blocks: packed (N, T, P) uint8 and its scale / zero -> (N, T, D) in dtype."""
    _check_bits(bits)
    check(packed.dim() == 3 and packed.dtype == torch.uint8,
          f"packed must be (N, T, P) uint8, got {tuple(packed.shape)} {packed.dtype}")
    check(packed.shape[-1] == packed_width(D, bits),
          f"packed rows hold {packed.shape[-1]} bytes but D={D} at {bits} bits needs {packed_width(D, bits)}")
    n, t = packed.shape[:2]
    check_params(scale, zero, layout, param_shape(layout, n, t, D))
    check(dtype in FLOAT_DTYPES, f"dtype {dtype} unsupported; use float16, bfloat16 or float32")
    if use_triton(packed, scale, zero):
        return kernel_module("_quant_triton").dequantize(packed, scale, zero, bits, D, dtype, layout)
    return reference_dequantize_blocks(packed, scale, zero, bits, D, dtype, layout)
