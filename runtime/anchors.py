"""Anchors: the tokens pinned into every selection, per KV head; the one place they are merged.

Each row of a layer's bank keeps up to ``global_tokens`` anchor positions per KV head (-1
padded) with the probability that earned each its place. New tokens that the fitted importance
probe scores above the context-dependent threshold compete with them, and the most probable
``global_tokens`` stay (:func:`merge`). Recalibration replaces them wholesale from exact
attention mass (recalibration.pick_anchors).
"""

from __future__ import annotations

import torch

from hi_sparse.kernels._dispatch import use_triton
from hi_sparse.kernels.probe import pin_one

from .probe import ImportanceProbe, probe_threshold
from .row_bank import RowBank


def merge(anchor_p: torch.Tensor, anchors: torch.Tensor, p: torch.Tensor, pos: torch.Tensor) -> None:
    """Keep the most probable of the anchors (anchor_p, anchors (..., A)) and the candidates
    (p, pos (..., M); p < 0 for none), in place, most probable first; of equal probabilities the
    anchors stay before the candidates, in their order (a stable sort: a new token displaces an
    anchor only when it is more probable; topk leaves the order of ties to the device)."""
    top_p, i = torch.cat([anchor_p, p], -1).sort(dim=-1, descending=True, stable=True)
    top_p, i = top_p[..., :anchors.shape[-1]], i[..., :anchors.shape[-1]]
    pos = torch.cat([anchors, pos], -1).gather(-1, i)
    anchors.copy_(torch.where(top_p >= 0, pos, -1))
    anchor_p.copy_(top_p)


def pins_on_device(probe: ImportanceProbe, device: torch.device, kernels: bool) -> bool:
    """Whether a decode token's pin at a layer on ``device`` is the one-launch kernel, which reads
    whether the probe is fitted from the device (ImportanceProbe.gate) rather than the host."""
    w = probe.fc1.weight
    return kernels and w.device == device and w.dtype == torch.float32 and use_triton(w)


def pin_key(probe: ImportanceProbe, device: torch.device, kernels: bool) -> bool | None:
    """What a captured decode body's key holds of the probe: whether it is fitted (the reference
    pins only then), None where the kernel reads that from the device."""
    return None if pins_on_device(probe, device, kernels) else probe.fitted


def pin_new_tokens(probe: ImportanceProbe, bank: RowBank, rows: slice, k: torch.Tensor, pos: torch.Tensor,
                   first: torch.Tensor, threshold: tuple[float, float, float], kernels: bool = False) -> None:
    """Score new keys k (B, Hkv, T, D) at positions pos (B, Hkv, T) (each sequence's consecutive
    positions, the same for every head) of the sequences in ``rows`` with the layer's probe and
    merge those above the threshold at each sequence's length (and after its left padding, first
    (B,)) into its anchors. A no-op until the probe is fitted, and with no anchor slots. No host
    sync. ``kernels``: a decode token's scoring and merge in one Triton launch where the keys and
    the probe are on one GPU (kernels/probe.py)."""
    A = bank.size("anchors", 1)
    T = k.shape[2]
    w = probe.fc1.weight
    if A and T == 1 and pins_on_device(probe, k.device, kernels):     # gated on the device until fitted
        pin_one(k, pos, w, probe.fc1.bias, probe.fc2.weight, probe.fc2.bias, probe.gate(k.device, *threshold),
                bank.t["anchor_p"][rows], bank.t["anchors"][rows])
        return
    if A == 0 or not probe.fitted:
        return
    base, lo, hi = threshold
    thr = probe_threshold(pos[:, 0, -1] + 1, base, lo, hi)[:, None, None]             # (B, 1, 1)
    p = probe.predict(k).to(k.device)                                                # (B, H, T)
    # a decode token (T == 1) is at a sequence's length, never in its left padding
    keep = p > thr if T == 1 else (p > thr) & (pos >= first[:, None, None])
    p = torch.where(keep, p, -1.0)
    if T > A:
        p, i = p.topk(A, dim=2)
        pos = pos.gather(2, i)
    merge(bank.t["anchor_p"][rows], bank.t["anchors"][rows], p, pos)
