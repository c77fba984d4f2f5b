"""Per-block key bounds and the Quest upper bound of q.k per block.

block_bounds: k (Hkv, L, D) -> kmin, kmax (Hkv, NB, D), NB = ceil(L / block_size).
block_scores: q (..., Hkv, G, D), kmin/kmax (..., Hkv, NB, D) -> (..., Hkv, NB) fp32 =
max over g of sum_d max(q*kmin, q*kmax). Leading batch dims are an extension of the contract so a
whole decode batch is scored in one launch.
"""
from __future__ import annotations

import torch

from ._dispatch import FLOAT_DTYPES, check, kernel_module, use_triton


def reference_block_bounds(k: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k (Hkv, L, D) -> (kmin, kmax), each (Hkv, NB, D) in k's dtype; partial last block uses its rows."""
    h, length, d = k.shape
    nb = -(-length // block_size)
    pad = nb * block_size - length
    lo = torch.nn.functional.pad(k.float(), (0, 0, 0, pad), value=float("inf"))
    hi = torch.nn.functional.pad(k.float(), (0, 0, 0, pad), value=float("-inf"))
    kmin = lo.view(h, nb, block_size, d).amin(dim=2)
    kmax = hi.view(h, nb, block_size, d).amax(dim=2)
    return kmin.to(k.dtype), kmax.to(k.dtype)


def reference_block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q (..., Hkv, G, D), kmin/kmax (..., Hkv, NB, D) -> (..., Hkv, NB) fp32.

    max(q*kmin, q*kmax) summed over d equals relu(q).kmax + min(q, 0).kmin, so two matmuls do it.
    """
    qf = q.float()
    pos, neg = qf.clamp(min=0), qf.clamp(max=0)
    s = pos @ kmax.float().transpose(-1, -2) + neg @ kmin.float().transpose(-1, -2)   # (..., Hkv, G, NB)
    return s.amax(dim=-2)


def top_blocks(scores: torch.Tensor, n: int, chunk: int = 1024) -> torch.Tensor:
    """Indices (..., n) int64 of the n highest scores along the last dim (same set as torch.topk).

    One torch.topk over a long row runs on few thread blocks when the batch is small (one decode
    sequence), so long rows go in two exact stages: the top n of each chunk, then the top n of
    those candidates (every global top-n element is in its chunk's top n). Order is unspecified.
    """
    nb = scores.shape[-1]
    check(0 < n <= nb, f"n={n} must be in 1..{nb} (the number of blocks)")
    rows = scores.numel() // max(nb, 1)
    if nb <= 4 * chunk or n > chunk // 4 or rows > 64:      # many rows already fill the GPU
        return scores.topk(n, dim=-1, sorted=False).indices
    n_chunks = -(-nb // chunk)
    padded = torch.nn.functional.pad(scores, (0, n_chunks * chunk - nb), value=float("-inf"))
    vals, idx = padded.view(*scores.shape[:-1], n_chunks, chunk).topk(n, dim=-1, sorted=False)
    idx = idx + torch.arange(0, n_chunks * chunk, chunk, device=scores.device)[:, None]
    best = vals.flatten(-2).topk(n, dim=-1, sorted=False).indices
    return idx.flatten(-2).gather(-1, best)


def block_bounds(k: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max of the keys of each block of block_size tokens.

    k (Hkv, L, D) -> kmin, kmax (Hkv, ceil(L / block_size), D) in k's dtype.
    """
    check(k.dim() == 3, f"k must be (Hkv, L, D), got shape {tuple(k.shape)}")
    check(k.shape[1] > 0, "k has no tokens (L = 0); bounds need at least one token")
    check(isinstance(block_size, int) and block_size > 0, f"block_size must be a positive int, got {block_size!r}")
    check(k.dtype in FLOAT_DTYPES, f"k dtype {k.dtype} unsupported; use float16, bfloat16 or float32")
    if use_triton(k):
        return kernel_module("_bounds_triton").bounds(k, block_size)
    return reference_block_bounds(k, block_size)


def block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest upper bound of q.k per block: q (..., Hkv, G, D), kmin/kmax (..., Hkv, NB, D) -> (..., Hkv, NB) fp32."""
    check(q.dim() >= 3, f"q must be (..., Hkv, G, D), got shape {tuple(q.shape)}")
    check(kmin.shape == kmax.shape, f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} differ")
    check(kmin.dim() == q.dim() and kmin.shape[:-2] == q.shape[:-2] and kmin.shape[-1] == q.shape[-1],
          f"kmin/kmax {tuple(kmin.shape)} must be (..., Hkv, NB, D) matching q {tuple(q.shape)}")
    for name, t in (("q", q), ("kmin", kmin), ("kmax", kmax)):
        check(t.dtype in FLOAT_DTYPES, f"{name} dtype {t.dtype} unsupported; use float16, bfloat16 or float32")
    check(len({q.device, kmin.device, kmax.device}) == 1, "q, kmin and kmax must be on one device")
    if use_triton(q, kmin, kmax):
        return kernel_module("_bounds_triton").scores(q, kmin, kmax)
    return reference_block_scores(q, kmin, kmax)
