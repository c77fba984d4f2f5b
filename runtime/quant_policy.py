"""Bit-width policies for per-block host KV quantization (VTQ).

A *unit* is one block of one layer and KV head, keys or values: (T, D) values quantized with one
scale and zero point. Policies see units batched as (N, T, D) on any device and return bits per
unit (on the host). The error-budget ones measure on the units' device with the PyTorch reference
arithmetic (fake_quantize_blocks: no packing), so a GPU engine measures on the GPU and host and
device decide alike (only float reduction order differs); the seed rule's histograms run on the host.

Error of asymmetric uniform quantization at b bits on a unit with value range r: the step is
Delta = r / (2^b - 1); every element is off by at most Delta / 2 (hard bound), and for values
spread over many levels the rounding error is ~uniform, so RMS error ~ Delta / sqrt(12). On a
Gaussian unit of n values (r ~ 2 * 3.3 sigma for n = 1024) the relative error
||x - x_hat|| / ||x|| is therefore ~ r / ((2^b - 1) * sqrt(12) * sigma): about 0.13 (4 bits),
0.062 (5), 0.030 (6) and 0.0075 (8). tests/test_quant_policy.py checks these bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hi_sparse.kernels import dequantize_blocks, fake_quantize_blocks, quantize_blocks

from .config import QUANT_BITS as BITS  # the widths the catalogue counts blocks by

HIST_BINS = 32


def relative_error(x: torch.Tensor, x_hat: torch.Tensor, reuse: bool = False) -> torch.Tensor:
    """||x - x_hat|| / ||x|| per unit. x, x_hat: (N, T, D) -> (N,) fp32. ``reuse``: x_hat is an
    fp32 temporary of the caller's, overwritten with the difference (a seal's quantization of a
    group of layers makes ~40 MB of them a width: no second copy, and x is read in its own dtype)."""
    diff = x_hat.sub_(x) if reuse and x_hat.dtype == torch.float32 else x_hat.float() - x.float()
    num = torch.linalg.vector_norm(diff.flatten(1), dim=1)
    den = torch.linalg.vector_norm(x.flatten(1), dim=1, dtype=torch.float32).clamp_min(1e-12)
    return num / den


# Which values share a scale and zero point in the host pool (kernels/quant.py): keys per channel
# of a unit (a few channels carry most of a key's range; one scale per unit spends the levels on
# them), values per token (docs/quality/README.md has the measurement on SmolLM2).
LAYOUT = {"k": "channel", "v": "token"}


def quantize_roundtrip(x: torch.Tensor, bits: int,
                       layout: str = "block") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize units x (N, T, D) at ``bits`` in ``layout``; returns (packed, scale, zero, relative
    error (N,) of each unit: the per-block error the catalogue's histogram counts)."""
    packed, scale, zero = quantize_blocks(x, bits, layout)
    x_hat = dequantize_blocks(packed, scale, zero, bits, x.shape[-1], dtype=torch.float32, layout=layout)
    return packed, scale, zero, relative_error(x, x_hat, reuse=True)


def peak_separation(x: torch.Tensor) -> torch.Tensor:
    """Distance between the two main peaks of each unit's value histogram, in units of its range.

    x: (N, T, D) -> (N,) in [0, 1]; 0 when the distribution is unimodal. A second peak counts when
    it is at least 20 % as tall as the first and the valley between them dips below 60 % of it.
    """
    n = x.shape[0]
    v = x.float().flatten(1)
    lo, hi = v.amin(1, keepdim=True), v.amax(1, keepdim=True)
    u = (v - lo) / (hi - lo).clamp_min(1e-12)
    idx = (u * (HIST_BINS - 1e-3)).long().clamp(0, HIST_BINS - 1)
    hist = torch.zeros(n, HIST_BINS).scatter_add_(1, idx, torch.ones_like(u))
    # light smoothing so that sampling noise does not make spurious peaks
    h = torch.nn.functional.conv1d(hist[:, None], torch.tensor([[[0.25, 0.5, 0.25]]]), padding=1)[:, 0]
    left = torch.nn.functional.pad(h, (1, 0), value=-1.0)[:, :-1]
    right = torch.nn.functional.pad(h, (0, 1), value=-1.0)[:, 1:]
    is_peak = (h >= left) & (h > right) & (h > 0)
    heights = torch.where(is_peak, h, torch.full_like(h, -1.0))
    top_h, top_i = heights.topk(2, dim=1)
    a, b = top_i.min(1).values, top_i.max(1).values
    pos = torch.arange(HIST_BINS)[None]
    between = (pos > a[:, None]) & (pos < b[:, None])
    valley = torch.where(between, h, torch.full_like(h, float("inf"))).amin(1)
    second = top_h[:, 1]
    bimodal = (second >= 0.2 * top_h[:, 0]) & (valley < 0.6 * second) & (second > 0)
    sep = (b - a).float() / (HIST_BINS - 1)
    return torch.where(bimodal, sep, torch.zeros_like(sep))


@dataclass(frozen=True)
class FixedBits:
    """Every unit at the same bit width."""
    bits: int

    def choose(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[0]
        return torch.full((n,), self.bits, dtype=torch.int64), torch.full((n,), self.bits, dtype=torch.int64)


@dataclass(frozen=True)
class SeedBimodalPolicy:
    """The seed rule: a key block whose values are bimodal with peak separation > ``separation``
    is split INT6 (keys) / INT4 (values); otherwise both are INT5.

    Both branches spend 5 bits per value on average; a bimodal key block wastes levels in the gap
    between its peaks, so its keys take the extra bit (keys drive selection and the softmax) and
    its values give one back.
    """
    separation: float = 0.15

    def choose(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (N, T, D) units of one block each -> (k_bits (N,), v_bits (N,)) int64."""
        split = peak_separation(k.cpu()) > self.separation
        kb = torch.where(split, 6, 5).long()
        vb = torch.where(split, 4, 5).long()
        return kb, vb


# "auto": the error-budget policy over 4-6 bits (rows sized at 6 bits) with this default budget:
# on SmolLM2's K/V key units take 5 bits and value units 6 (5.5 bits per value on average; 1.003x
# the unquantized host's perplexity at top_k 512, where 0.05, 4.8 bits, and the seed rule's 5
# bits cost 1.011x): docs/BENCHMARKS.md "auto by measured error"
AUTO_WIDTHS = (4, 5, 6)
AUTO_ERROR_BUDGET = 0.03
BUDGET_ERROR_BUDGET = 0.02   # "budget" (4-8 bits)
ADAPTIVE = ("auto", "budget", "seed")   # host_kv_bits values whose width varies by unit


@dataclass(frozen=True)
class ErrorBudgetPolicy:
    """The fewest bits of ``widths`` whose relative error stays within ``budget``; else the widest.

    Keys and values are measured each in their own layout, so the budget spends bits where the
    error is: on SmolLM2 a value unit's error is about twice a key unit's at the same width, and
    values are where perplexity follows the bits (docs/BENCHMARKS.md "auto by measured error")."""
    budget: float = BUDGET_ERROR_BUDGET
    widths: tuple[int, ...] = BITS

    def choose_on_device(self, x: torch.Tensor, layout: str) -> torch.Tensor:
        """Units x (N, T, D) in ``layout`` -> their widths (N,) int64 on x's device, with no host
        sync (a CUDA graph of the seal holds it)."""
        chosen = torch.full((x.shape[0],), self.widths[-1], dtype=torch.int64, device=x.device)
        for b in reversed(self.widths[:-1]):       # the narrowest within the budget wins
            err = relative_error(x, fake_quantize_blocks(x, b, layout), reuse=True)
            chosen = torch.where(err <= self.budget, b, chosen)
        return chosen

    def choose(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.choose_on_device(k, LAYOUT["k"]).cpu(), self.choose_on_device(v, LAYOUT["v"]).cpu()


def make_policy(host_kv_bits, budget: float | None = None):
    """The policy for a ``HiSparseConfig.host_kv_bits`` value, or None for no quantization; budget
    None takes the policy's default."""
    if host_kv_bits is None:
        return None
    if host_kv_bits == "auto":
        return ErrorBudgetPolicy(AUTO_ERROR_BUDGET if budget is None else budget, AUTO_WIDTHS)
    if host_kv_bits == "budget":
        return ErrorBudgetPolicy(BUDGET_ERROR_BUDGET if budget is None else budget)
    if host_kv_bits == "seed":
        return SeedBimodalPolicy()
    return FixedBits(int(host_kv_bits))


def max_bits(host_kv_bits) -> int:
    """Widest bit width the policy can choose (sizes the packed host rows)."""
    if host_kv_bits in ("auto", "seed"):
        return 6
    if host_kv_bits == "budget":
        return 8
    return int(host_kv_bits)
