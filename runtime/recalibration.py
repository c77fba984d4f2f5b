"""Recalibration: when to refresh anchors and the probe, and how, from exact attention mass.

When (:class:`RecalibrationController`, pure logic): on schedule (tokens since the last one, and
once at first when sparsity starts), on request (control file or API), or on drift (audited hit
rate over the last ``drift_window`` audits below ``drift_floor``).

How (:func:`score_tokens`, :func:`training_set`, :func:`pick_anchors`): recent decode queries
attend exactly over the context outside the window; the mass each token receives, weighted to
favour the newest queries, ranks the anchors and gives the probe's distillation targets.
"""

from __future__ import annotations

from collections import deque

import torch

from .audit import attention_mass

RECENCY_DECAY = 0.5  # weight per step of query age: after a topic shift the new topic wins fast


def distillation_target(mass: torch.Tensor, n_visible: int, gain: float = 100.0) -> torch.Tensor:
    """Probe targets from attention mass: 0 at or below the uniform share 1/n, 1 at ``gain`` times
    it, log-linear between (attention mass spans orders of magnitude). mass (..., L) -> (..., L)."""
    ratio = (mass * max(n_visible, 1)).clamp_min(1e-30)
    return (ratio.log() / torch.log(torch.tensor(gain))).clamp(0.0, 1.0)


class RecalibrationController:
    """Pure decision logic; the engine performs the recalibration and calls :meth:`done`.

    Drift is judged on the audits since the last recalibration. When a drift recalibration does
    not lift the rate above the floor (anchors cannot help: the workload has none), the next one
    waits twice as many audits (up to 64 x ``drift_window``), so drift never becomes a storm.
    """

    MAX_BACKOFF = 64

    def __init__(self, every_tokens: int, drift_floor: float, drift_window: int) -> None:
        self.every = every_tokens
        self.floor = drift_floor
        self.window = drift_window
        self.tokens_since = 0
        self.calibrated = False
        self.requested: str | None = None
        self.backoff = 1
        self.history: deque[tuple[int, int]] = deque(maxlen=drift_window * self.MAX_BACKOFF)

    def on_tokens(self, n: int) -> None:
        self.tokens_since += n

    def on_audit(self, lookups: int, hits: int) -> None:
        if lookups:
            self.history.append((lookups, hits))
            need = self.window * self.backoff
            rate = self.audited_rate(need)
            if len(self.history) >= need and rate is not None and rate >= self.floor:
                self.backoff = 1  # healthy over a whole judged window: judge promptly again

    def request(self, reason: str = "request") -> None:
        self.requested = reason

    def audited_rate(self, last: int | None = None) -> float | None:
        """Hits / lookups over the last ``last`` audits (all since the last recalibration if None)."""
        hist = list(self.history)[-last:] if last else self.history
        look = sum(lk for lk, _ in hist)
        return None if not look else sum(h for _, h in hist) / look

    def due(self, ready: bool) -> str | None:
        """The reason to recalibrate now, or None. ``ready``: there is context and queries to use."""
        if not ready:
            return None
        if self.requested:
            return self.requested
        need = self.window * self.backoff
        rate = self.audited_rate(need)
        if len(self.history) >= need and rate is not None and rate < self.floor:
            return "drift"
        if not self.calibrated or self.tokens_since >= self.every:
            return "schedule"
        return None

    def done(self, reason: str | None = None) -> None:
        if reason == "drift":
            self.backoff = min(self.MAX_BACKOFF, self.backoff * 2)
        self.tokens_since = 0
        self.calibrated = True
        self.requested = None
        self.history.clear()  # judge drift on audits of the new anchors only


def score_tokens(queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, window: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention mass per token and KV head from recent queries.

    queries (Q, Hkv, G, D) oldest first; keys (Hkv, n, D); visible (n,) bool. Returns
    (mass (Hkv, n) with tokens inside the window zeroed, targets (Hkv, n) in [0, 1], outside (n,)).
    """
    nq, H, G, D = queries.shape
    n = keys.shape[1]
    outside = visible & (torch.arange(n, device=keys.device) < n - window)
    w = (RECENCY_DECAY ** torch.arange(nq - 1, -1, -1, dtype=torch.float32)).repeat_interleave(G)
    mass = torch.stack([attention_mass(queries[:, h].reshape(-1, D), keys[h], visible, scale, w)
                        for h in range(H)])
    mass = torch.where(outside[None], mass, torch.zeros_like(mass))
    return mass, distillation_target(mass, int(visible.sum())), outside


def training_set(keys: torch.Tensor, mass: torch.Tensor, target: torch.Tensor, outside: torch.Tensor,
                 topk: int, negatives: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Probe training rows: per head the ``topk`` heaviest tokens and a sample of the rest.

    Returns (x (N, D), y (N,)) on the CPU.
    """
    cand = torch.nonzero(outside).squeeze(1).cpu()
    m = min(topk, cand.numel())
    top = mass.topk(m, dim=1).indices
    xs, ys = [], []
    for h in range(keys.shape[0]):
        neg = cand[torch.randperm(cand.numel(), generator=generator)[:negatives]].to(keys.device)
        idx = torch.cat([top[h], neg])
        xs.append(keys[h, idx])
        ys.append(target[h, idx])
    return torch.cat(xs).cpu(), torch.cat(ys).cpu()


def pick_anchors(mass: torch.Tensor, target: torch.Tensor, outside: torch.Tensor,
                 slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``slots`` heaviest tokens per head outside the window, -1 padded: (positions, scores),
    each (Hkv, slots). Scores are their targets, so a probe-picked token must beat them."""
    a = min(slots, int(outside.sum()))
    top = mass.topk(a, dim=1).indices
    score = target.gather(1, top)
    pad = slots - a
    return (torch.nn.functional.pad(top, (0, pad), value=-1),
            torch.nn.functional.pad(score, (0, pad), value=-1.0))
