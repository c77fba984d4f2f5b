"""The recent rows a sequence keeps (runtime/recalibration.py ``remember_queries``): each row's
R rows (B, R, ...) fp32 shifted up by one and a new row (B, ...) written last, in place. The
reference concatenates and copies back (two kernels on a GPU); the Triton kernel does it in one
launch, each program owning a chunk of columns across the R rows (a decode step's query)."""
from __future__ import annotations

import torch

from ._dispatch import check, kernel_module, use_triton


def reference_push_recent(held: torch.Tensor, new: torch.Tensor) -> None:
    held.copy_(torch.cat([held[:, 1:], new[:, None].to(held.dtype)], 1))


def push_recent(held: torch.Tensor, new: torch.Tensor) -> None:
    """held (B, R, ...) float32, new (B, ...) of the same trailing shape: drop each row's oldest
    entry, append ``new`` (cast to fp32)."""
    check(held.dtype == torch.float32 and held.dim() >= 2 and new.shape[0] == held.shape[0]
          and new.shape[1:] == held.shape[2:],
          f"held must be (B, R, ...) fp32 and new (B, ...) alike, got {tuple(held.shape)} {held.dtype} and "
          f"{tuple(new.shape)}")
    if held.shape[1] == 0:
        return
    if use_triton(held, new):
        kernel_module("_recent_triton").push(held, new)
        return
    reference_push_recent(held, new)
