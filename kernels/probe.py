"""A decode token's anchor scoring in one launch (runtime/anchors.pin_new_tokens with one new
token per sequence is the reference): per (sequence, KV head) row, the importance probe on the
new key (fc1, exact GELU, fc2, sigmoid; fp32), the anchor threshold at the sequence's length
(``base * (n / 131072) ** 0.25`` within [at_least, hi], in fp64 as the reference's), and the merge
of the candidate into the row's anchors: the A most probable of the A anchors and the candidate,
most probable first (equal probabilities keep the anchors' order, the candidate last), an anchor
of probability < 0 holding -1. About twenty small launches of the reference become one.

Also a probe fit's iteration (runtime/probe.fit_iterations): the gradients of the weighted logistic
loss of P stacked probes over their training rows, forward and backward in one pass over the rows
(:func:`fit_grads`), in place of about twenty passes of torch ops over the (P, N, hidden)
activations; the Adam update stays in torch.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ._dispatch import check, kernel_module, use_triton


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


def reference_fit_grads(x: torch.Tensor, y: torch.Tensor, wn: torch.Tensor, w1: torch.Tensor, c1: torch.Tensor,
                        w2: torch.Tensor, c2: torch.Tensor, want_z: bool = True,
                        dots_in: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The gradients of sum_n wn * BCE(sigmoid(z), y) of P stacked probes, z = gelu(x @ w1 + c1) . w2 + c2,
    x (P, N, D), y and wn (P, N) (wn 0: a padding row), w1 (P, D, HID), c1 and w2 (P, HID), c2 (P,),
    fp32: ([dw1, dc1, dw2, dc2], z (P, N)). Op for op what runtime/probe.fit_iterations ran. z
    whatever ``want_z`` says (there for :func:`fit_grads`' signature: either may stand for the other).
    ``dots_in``: a rounding of the two dots' inputs (benchmarks/fit_tf32.py: the kernel's TF32)."""
    r = dots_in or (lambda t: t)
    h = torch.baddbmm(c1[:, None], r(x), r(w1))                          # (P, N, hidden)
    cdf = torch.special.ndtr(h)                                          # GELU(h) = h * cdf
    a = h * cdf
    z = torch.bmm(a, w2[:, :, None])[..., 0] + c2[:, None]               # (P, N) logits
    dz = (torch.sigmoid(z) - y) * wn                                      # d loss / d z
    # d GELU / dh = cdf + h * pdf, in 6 passes over (P, N, hidden), the products in place
    pdf = torch.exp(h.square().mul_(-0.5))                               # (2 pi) ** 0.5 * pdf
    dh = torch.addcmul(cdf, h, pdf, value=0.3989422804014327).mul_(dz[..., None]).mul_(w2[:, None])
    return [torch.bmm(r(x).transpose(1, 2), r(dh)), dh.sum(1), torch.bmm(dz[:, None], a)[:, 0], dz.sum(1)], z


def fit_grads(x: torch.Tensor, y: torch.Tensor, wn: torch.Tensor, w1: torch.Tensor, c1: torch.Tensor,
              w2: torch.Tensor, c2: torch.Tensor,
              want_z: bool = True) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """:func:`reference_fit_grads` (its shapes): on CUDA one Triton launch over the rows, each program
    summing its rows' gradients, and one sum over the programs (a fixed order: the same every run);
    its dots in TF32 (the keys are fp16 / bf16 values, exact in TF32), so about 1e-3 apart from the
    reference. z only with ``want_z`` (else None) on that path. No host sync."""
    P, N, D = x.shape
    HID = w1.shape[-1]
    check(y.shape == wn.shape == (P, N) and w1.shape == (P, D, HID) and c1.shape == w2.shape == (P, HID)
          and c2.shape == (P,), "fit_grads: x (P, N, D), y and wn (P, N), w1 (P, D, HID), c1 and w2 (P, HID), c2 (P,)")
    check(all(t.dtype == torch.float32 for t in (x, y, wn, w1, c1, w2, c2)), "fit_grads takes fp32 tensors")
    if not use_triton(x) or N == 0:
        return reference_fit_grads(x, y, wn, w1, c1, w2, c2)
    return kernel_module("_probe_triton").fit_grads(x, y, wn, w1, c1, w2, c2, want_z)
