"""The audit: exact attention as the ground truth for the selection.

Exact attention of one query head over the whole visible context; of the true top-m tokens, how
many the selection held gives anchor hits / lookups. Measured, not estimated.
"""

from __future__ import annotations

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
