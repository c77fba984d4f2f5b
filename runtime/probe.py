"""TLIF importance probe: a tiny MLP from a token's key to the probability it is an anchor.

Two Linear layers and a GELU, under 15K parameters. It is fit by distillation: the targets are
the attention mass that tokens actually received from recent queries (normalised so that the
``recalibrate_topk`` heaviest tokens have target 1). Until its first fit it scores nothing, so an
unfit probe pins no anchors. The threshold grows with context: there are more tokens to choose
from, so each must be more certainly important:
``threshold_base * (context_len / 131072) ** 0.25``, clamped to [threshold_min, threshold_max].
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator, Iterator
from typing import TypeVar

import torch
from torch import nn

from hi_sparse.kernels.probe import fit_grads

from .host_seal import to_device

MAX_PARAMS = 15_000
FIT_STEPS = 100           # Adam iterations of a probe's fit
T = TypeVar("T")
FLUSH_DENORMALS = True    # small_ops_on_cpu flushes them (benchmarks turn it off to compare)


def probe_threshold(context_len: int | torch.Tensor, base: float, lo: float, hi: float) -> float | torch.Tensor:
    """Anchor threshold at a context length: base at 128K, growing as its fourth root, within
    [lo, hi]. A tensor length (the graph-captured decode step's device scalar) gives a float64
    tensor, computed on the device."""
    if isinstance(context_len, torch.Tensor):
        # base * (n / 131072) ** 0.25 as one product under the root (fewer ops in the captured
        # step; base > 0); a length below 1 reads as 1 like the int form's
        at_least = probe_threshold(1, base, lo, hi)
        return ((context_len.double() * (base ** 4 / 131072)) ** 0.25).clamp(at_least, hi)
    return float(min(hi, max(lo, base * (max(context_len, 1) / 131072) ** 0.25)))


@functools.lru_cache(maxsize=16)
def threshold_constants(device: torch.device, base: float, lo: float, hi: float) -> torch.Tensor:
    """What the tensor form of :func:`probe_threshold` computes with, for a kernel (kernels/probe.py):
    (3,) fp64 on ``device``, base**4 / 131072, the threshold at length 1 and hi (made once per
    device and thresholds, before any graph capture reads them; copied there behind the queued
    work, not after it: a probe's first fit rewrites them in a step)."""
    return to_device(torch.tensor([base ** 4 / 131072, probe_threshold(1, base, lo, hi), hi], dtype=torch.float64),
                     torch.device(device))


class ImportanceProbe(nn.Module):
    """keys (N, D) -> anchor probability (N,). One per layer, shared by its KV heads."""

    def __init__(self, head_dim: int, seed: int = 0) -> None:
        super().__init__()
        hidden = max(4, min(64, (MAX_PARAMS - 1) // (head_dim + 2)))
        g = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(head_dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        self.act = nn.GELU()
        self.fitted = False
        self._gates: dict[tuple, torch.Tensor] = {}     # gate(): by device and thresholds
        self.requires_grad_(False)

    def gate(self, device: torch.device, base: float, lo: float, hi: float) -> torch.Tensor:
        """This probe's own :func:`threshold_constants` for the decode kernel (kernels/probe.py):
        until it is fitted, a threshold of 2, above any probability, so the kernel pins nothing;
        :func:`write_params` fills in the true ones in place. A captured step that pins new tokens
        then reads whether the probe is fitted from the device, and keeps its graph when it
        becomes so (before, the first recalibration changed the step's key: an eager step and a
        capture of ~25 steps each on the H200). Made at a layer's first pin (an eager step)."""
        at = (device, base, lo, hi)
        gate = self._gates.get(at)
        if gate is None:
            gate = self._gates[at] = threshold_constants(device, base, lo, hi).clone()
            if not self.fitted:
                gate[1:] = 2.0
        return gate

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def predict(self, keys: torch.Tensor) -> torch.Tensor:
        """keys (..., D) -> probabilities (...) fp32; zeros until the probe is fit."""
        if not self.fitted:
            return torch.zeros(keys.shape[:-1], dtype=torch.float32, device=keys.device)
        return torch.sigmoid(self._logits(keys.float().to(self.fc1.weight.device)))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x))).squeeze(-1)

    def fit(self, keys: torch.Tensor, targets: torch.Tensor, steps: int = FIT_STEPS, lr: float = 0.05) -> float:
        """Distil: keys (N, D), soft targets (N,) in [0, 1]. Returns the final loss."""
        return fit_probes([self], [(keys, targets)], steps, lr)[0]


def fit_probes(probes: list[ImportanceProbe], data: list[tuple[torch.Tensor, torch.Tensor]], steps: int = FIT_STEPS,
               lr: float = 0.05) -> list[float]:
    """Distil several probes of one shape on one device at once (a recalibration fits every
    layer's): probe i on keys (N_i, D) and soft targets (N_i,) in [0, 1]. The same training as
    one probe alone (weighted binary cross-entropy, Adam), as one batched loop with the gradients
    of the two layers written out: no autograd, and the per-op cost shared by the probes (on a
    CPU that cost, not the arithmetic, is what a fit of a few hundred rows spends). Returns each
    probe's final loss."""
    with small_ops_on_cpu(probes[0].fc1.weight.device):
        params, losses = fit_params(probes, data, steps, lr)
        write_params(probes, params)
        return losses.tolist()


@contextlib.contextmanager
def small_ops_on_cpu(device: torch.device) -> Iterator[None]:
    """The recalibration's small ops on a CPU (its scoring, the probes' fit): on one thread, with
    denormal floats flushed to zero (:data:`FLUSH_DENORMALS`) while it runs; nothing on a GPU.

    One thread: split over threads, ops of a few hundred rows wait on each other longer than they
    compute, and on a busy machine far longer (a 4-layer fit measured 13-20 s with 2 threads on the
    shared 2-core VM, 0.1 s with one). Denormals: a fitted probe's GELU derivative and its logits'
    gradients underflow below float32's smallest normal number (5 % of a layer's entries at the
    end of SmolLM2's fit), and x86 cores take ~100 cycles for each such number: a fit of SmolLM2's
    30 probes took 21 s on one thread, 5 s with them flushed (benchmarks/bench_recal_cpu.py). Values
    that small change nothing a probe or an anchor score is for. The setting is the thread's own
    (and restored after): the user's model never runs under it."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    flushed = FLUSH_DENORMALS and not _flushing() and torch.set_flush_denormal(True)
    if threads != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads != 1:
            torch.set_num_threads(threads)
        if flushed:
            torch.set_flush_denormal(False)


def _flushing() -> bool:
    """This thread flushes denormal floats already (a product below float32's normal range reads 0)."""
    return float(torch.tensor([1e-30]) * torch.tensor([1e-10])) == 0.0


def fit_params(probes: list[ImportanceProbe], data: list[tuple[torch.Tensor, torch.Tensor]], steps: int = FIT_STEPS,
               lr: float = 0.05) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`fit_probes`' training without touching the probes or waiting for the device: the
    fitted parameters stacked over the probes ((P, D, hidden), (P, hidden), (P, hidden), (P,)) and
    each probe's final loss (P,), for :func:`write_params` (a background recalibration computes
    them on a side stream and writes them at a step boundary)."""
    return to_the_end(fit_iterations(probes, data, steps, lr))


def to_the_end(slices: Generator[None, None, T]) -> T:
    """Run a generator of slices of work to its end: what it returns."""
    while True:
        try:
            next(slices)
        except StopIteration as end:
            return end.value


def row_weights(targets: torch.Tensor) -> torch.Tensor:
    """The fit's weight of each training row, targets (N,) in [0, 1]: positives (target > 0.5) are
    rare, so each weighs as many negatives as there are per positive (at least 1), not to be
    drowned by them. No host sync."""
    pos = (targets > 0.5).float()
    return 1.0 + pos * ((1 - pos).sum() / pos.sum().clamp_min(1)).clamp_min(1.0)


def fit_iterations(probes: list[ImportanceProbe], data: list[tuple[torch.Tensor, torch.Tensor]], steps: int = FIT_STEPS,
                   lr: float = 0.05) -> Generator[None, None, tuple[list[torch.Tensor], torch.Tensor]]:
    """:func:`fit_params` one training iteration at a time: each ``next`` runs one (the first
    also sets the training up) and the generator returns what fit_params does. A background
    recalibration on a CPU runs a few between decode steps (recal_job.py)."""
    P, dev = len(probes), probes[0].fc1.weight.device
    n = torch.tensor([len(y) for _, y in data], dtype=torch.float32)                   # (P,)
    n = to_device(n, dev)                                                               # no host sync
    width = max(len(y) for _, y in data)
    x = torch.zeros(P, width, probes[0].fc1.in_features, device=dev)
    y = torch.zeros(P, width, device=dev)
    w = torch.zeros(P, width, device=dev)                     # 0: padding rows (no gradient)
    for i, (keys, targets) in enumerate(data):
        m = len(targets)
        x[i, :m] = keys.float().to(dev)
        y[i, :m] = targets.float().to(dev).clamp(0, 1)
        w[i, :m] = row_weights(y[i, :m])
    wn = w / n[:, None]                                       # the weighted mean's factor per row
    # stacked parameters, (P, D, hidden), (P, hidden), (P, hidden), (P,); written back at the end
    params = [torch.stack([p.fc1.weight.T for p in probes]), torch.stack([p.fc1.bias for p in probes]),
              torch.stack([p.fc2.weight[0] for p in probes]), torch.stack([p.fc2.bias[0] for p in probes])]
    m1 = [torch.zeros_like(t) for t in params]
    m2 = [torch.zeros_like(t) for t in params]
    b1, b2, eps = 0.9, 0.999, 1e-8
    w1, c1, w2, c2 = params
    for t in range(1, steps + 1):
        grads, z = fit_grads(x, y, wn, w1, c1, w2, c2, want_z=t == steps)
        torch._foreach_mul_(m1, b1)
        torch._foreach_add_(m1, grads, alpha=1 - b1)
        torch._foreach_mul_(m2, b2)
        torch._foreach_addcmul_(m2, grads, grads, value=1 - b2)
        denom = torch._foreach_sqrt(m2)
        torch._foreach_div_(denom, (1 - b2 ** t) ** 0.5)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m1, denom, value=-lr / (1 - b1 ** t))
        if t < steps:
            yield
    assert z is not None                                      # the last iteration's logits
    losses = (nn.functional.binary_cross_entropy_with_logits(z, y, reduction="none") * wn).sum(1)
    return params, losses


def write_params(probes: list[ImportanceProbe], params: list[torch.Tensor]) -> None:
    """Parameters from :func:`fit_params` into the probes (in place: a captured step reads them
    where they are), which are fitted from then on."""
    w1, c1, w2, c2 = params
    with torch.no_grad():
        w1t = w1.transpose(1, 2).contiguous()               # (P, hidden, D): fc1.weight's layout
        dst, src = [], []
        # each probe's slices in one op per parameter (a host op each adds up at 32 probes)
        for p, *parts in zip(probes, w1t.unbind(0), c1.unbind(0), w2.split(1), c2.split(1)):
            dst += [p.fc1.weight, p.fc1.bias, p.fc2.weight, p.fc2.bias]
            src += parts
        torch._foreach_copy_(dst, src)                      # every probe's in a launch or two
        for p in probes:
            if not p.fitted:
                for at, gate in p._gates.items():
                    gate.copy_(threshold_constants(*at))
            p.fitted = True
