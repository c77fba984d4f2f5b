"""A decode step's device counters (runtime/metrics.py DEVICE_COUNTERS) added in one launch.

The step's counts come from several places: the hot-buffer lookup's per-head (selected, hits,
used prefetches) counts (R, 3), the prefetch's loaded mask (R, P), the selection's touched tokens
per row (R,) and the swap-in's host rows (main pool ``src`` and float tail ``src_tail``, -1 where a
row copies nothing). The reference sums each and adds the seven values (about ten small kernels
on a GPU); the Triton kernel reads them all and adds atomically (one launch, no host sync):

    acc += (sum selected, sum hits, sum used prefetches, sum selected, sum touched, sum loaded,
            (src >= 0).sum() * row_bytes + (src_tail >= 0).sum() * tail_bytes)
"""
from __future__ import annotations

import torch

from ._dispatch import check, kernel_module, use_triton


def reference_tally(acc: torch.Tensor, counts: torch.Tensor, loaded: torch.Tensor, touched: torch.Tensor,
                    src: torch.Tensor, src_tail: torch.Tensor | None, row_bytes: int, tail_bytes: int) -> None:
    nbytes = (src >= 0).sum() * row_bytes
    if src_tail is not None:
        nbytes = nbytes + (src_tail >= 0).sum() * tail_bytes
    per = counts.sum(0)
    acc[:7].add_(torch.stack([per[0], per[1], per[2], per[0], touched.sum().to(torch.int64),
                              loaded.sum(), nbytes]))


def tally(acc: torch.Tensor, counts: torch.Tensor, loaded: torch.Tensor, touched: torch.Tensor,
          src: torch.Tensor, src_tail: torch.Tensor | None, row_bytes: int, tail_bytes: int) -> None:
    """Add a decode step's counts into ``acc`` (>= 7 int64 counters, module docstring)."""
    check(acc.dtype == torch.int64 and acc.numel() >= 7, "acc must hold the 7 int64 device counters")
    check(counts.dim() == 2 and counts.shape[1] == 3 and loaded.shape[0] == counts.shape[0],
          f"counts must be (R, 3) and loaded (R, P), got {tuple(counts.shape)} and {tuple(loaded.shape)}")
    if use_triton(acc, src):
        kernel_module("_counts_triton").tally(acc, counts, loaded, touched, src, src_tail, row_bytes, tail_bytes)
        return
    reference_tally(acc, counts, loaded, touched, src, src_tail, row_bytes, tail_bytes)
