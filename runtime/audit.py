"""Audit and recalibration decisions: exact attention as the ground truth for the selection.

The audit computes exact attention of one query head over the whole visible context and asks how
many of the true top-m tokens the selection held (anchor hits / lookups). Measured, not
estimated. The recalibration controller decides when anchors and the probe are refreshed: on
schedule (tokens since the last one), on request (control file or API), or on drift (audited hit
rate over the last audits below a floor).
"""

from __future__ import annotations

from collections import deque

import torch


def attention_probs(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact softmax attention weights. q (..., D), keys (L, D), visible (L,) bool -> (..., L) fp32."""
    s = (q.float() @ keys.float().T) * scale
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, dim=-1)


def audit_hits(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, selected: torch.Tensor,
               top_m: int, scale: float) -> tuple[int, int]:
    """(lookups, hits): true top-m tokens of one query q (D,) and how many are in ``selected`` (K,)."""
    p = attention_probs(q, keys, visible, scale)
    m = min(top_m, int(visible.sum()))
    if m == 0:
        return 0, 0
    top = p.topk(m).indices
    hits = int(torch.isin(top, selected[selected >= 0]).sum())
    return m, hits


def attention_mass(queries: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float,
                   weights: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean attention weight each token received: queries (Q, D), keys (L, D),
    weights (Q,) or None (uniform) -> (L,) fp32."""
    p = attention_probs(queries, keys, visible, scale)
    if weights is None:
        return p.mean(0)
    w = weights.float().to(p.device)
    return (p * w[:, None]).sum(0) / w.sum()


def distillation_target(mass: torch.Tensor, n_visible: int, gain: float = 100.0) -> torch.Tensor:
    """Probe targets from attention mass: 0 at or below the uniform share 1/n, 1 at ``gain`` times
    it, log-linear between (attention mass spans orders of magnitude). mass (..., L) -> (..., L)."""
    ratio = (mass * max(n_visible, 1)).clamp_min(1e-30)
    return (ratio.log() / torch.log(torch.tensor(gain))).clamp(0.0, 1.0)


class RecalibrationController:
    """Pure decision logic; the engine performs the recalibration and calls :meth:`done`."""

    def __init__(self, every_tokens: int, drift_floor: float, drift_window: int) -> None:
        self.every = every_tokens
        self.floor = drift_floor
        self.window = drift_window
        self.tokens_since = 0
        self.calibrated = False
        self.requested: str | None = None
        self.history: deque[tuple[int, int]] = deque(maxlen=drift_window)

    def on_tokens(self, n: int) -> None:
        self.tokens_since += n

    def on_audit(self, lookups: int, hits: int) -> None:
        if lookups:
            self.history.append((lookups, hits))

    def request(self, reason: str = "request") -> None:
        self.requested = reason

    def audited_rate(self) -> float | None:
        look = sum(lk for lk, _ in self.history)
        return None if not look else sum(h for _, h in self.history) / look

    def due(self, ready: bool) -> str | None:
        """The reason to recalibrate now, or None. ``ready``: there is context and queries to use."""
        if not ready:
            return None
        if self.requested:
            return self.requested
        rate = self.audited_rate()
        if len(self.history) == self.window and rate is not None and rate < self.floor:
            return "drift"
        if not self.calibrated or self.tokens_since >= self.every:
            return "schedule"
        return None

    def done(self) -> None:
        self.tokens_since = 0
        self.calibrated = True
        self.requested = None
        self.history.clear()  # judge drift on audits of the new anchors only
