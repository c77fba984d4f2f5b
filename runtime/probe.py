"""TLIF importance probe: a tiny MLP from a token's key to the probability it is an anchor.

Two Linear layers and a GELU, under 15K parameters. It is fit by distillation: the targets are
the attention mass that tokens actually received from recent queries (normalised so that the
``recalibrate_topk`` heaviest tokens have target 1). Until its first fit it scores nothing, so an
unfit probe pins no anchors. The threshold grows with context: there are more tokens to choose
from, so each must be more certainly important:
``threshold_base * (context_len / 131072) ** 0.25``, clamped to [threshold_min, threshold_max].
"""

from __future__ import annotations

import torch
from torch import nn

MAX_PARAMS = 15_000


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
        self.requires_grad_(False)

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

    def fit(self, keys: torch.Tensor, targets: torch.Tensor, steps: int = 100, lr: float = 0.05) -> float:
        """Distil: keys (N, D), soft targets (N,) in [0, 1]. Returns the final loss."""
        x = keys.float().to(self.fc1.weight.device)   # the probe lives on its layer's device
        y = targets.float().to(x.device).clamp(0, 1)
        # positives are rare: weight them so they are not drowned by the negatives
        pos = (y > 0.5).float()
        w = 1.0 + pos * max(1.0, float((1 - pos).sum() / pos.sum().clamp_min(1)))
        params = list(self.parameters())
        m1 = [torch.zeros_like(p) for p in params]
        m2 = [torch.zeros_like(p) for p in params]
        b1, b2, eps = 0.9, 0.999, 1e-8
        loss = torch.tensor(0.0)
        self.requires_grad_(True)
        with torch.enable_grad():
            # a few lines of Adam by hand: torch.optim pulls in torch._dynamo (seconds to import)
            for t in range(1, steps + 1):
                loss = nn.functional.binary_cross_entropy_with_logits(self._logits(x), y, weight=w)
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    for p, g, a, b in zip(params, grads, m1, m2):
                        a.mul_(b1).add_(g, alpha=1 - b1)
                        b.mul_(b2).addcmul_(g, g, value=1 - b2)
                        p.sub_(lr * (a / (1 - b1 ** t)) / ((b / (1 - b2 ** t)).sqrt() + eps))
        self.requires_grad_(False)
        self.fitted = True
        return float(loss.detach())
