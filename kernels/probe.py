"""A decode token's anchor scoring in one launch (runtime/anchors.pin_new_tokens with one new
token per sequence is the reference): per (sequence, KV head) row, the importance probe on the
new key (fc1, exact GELU, fc2, sigmoid; fp32), the anchor threshold at the sequence's length
(``base * (n / 131072) ** 0.25`` within [at_least, hi], in fp64 as the reference's), and the merge
of the candidate into the row's anchors: the A most probable of the A anchors and the candidate,
most probable first (equal probabilities keep the anchors' order, the candidate last), an anchor
of probability < 0 holding -1. About twenty small launches of the reference become one.
"""
from __future__ import annotations

import torch

from ._dispatch import check, kernel_module


def pin_one(k: torch.Tensor, pos: torch.Tensor, fc1_w: torch.Tensor, fc1_b: torch.Tensor, fc2_w: torch.Tensor,
            fc2_b: torch.Tensor, consts: torch.Tensor, anchor_p: torch.Tensor,
            anchors: torch.Tensor) -> None:
    """k (B, H, 1, D) new keys at positions pos (B, H, 1) (the same for every head); the probe's
    fc1 (HID, D) + (HID,), fc2 (1, HID) + (1,), fp32; consts: the threshold's (3,) fp64 constants
    (runtime/probe.threshold_constants); anchor_p (B, H, A)
    fp32 and anchors (B, H, A) int64, updated in place."""
    B, H, T, D = k.shape
    A = anchors.shape[-1]
    check(T == 1 and pos.shape == (B, H, 1), f"one new token per sequence: k {tuple(k.shape)}, pos {tuple(pos.shape)}")
    check(anchor_p.shape == anchors.shape == (B, H, A) and A > 0, "anchor_p and anchors must be (B, H, A), A > 0")
    check(fc1_w.shape[1] == D and fc2_w.numel() == fc1_w.shape[0], "the probe's shape must match the keys")
    kernel_module("_probe_triton").pin_one(k, pos, fc1_w, fc1_b, fc2_w.reshape(-1), fc2_b, consts, anchor_p,
                                           anchors)
