"""Planted-structure KV workloads: needles, topic anchors and topic shifts, with known answers.

Keys are Gaussian noise; some tokens are *planted*:

- **anchors of a topic**: ``k = noise + anchor_strength * u`` for the topic's dense unit direction
  u (per KV head). Queries of that topic are ``q = query_strength * u + noise``, so exact attention
  puts its mass on the topic's anchors, while the per-block min/max bound barely notices them (the
  lift is spread thinly over every dimension and drowned by the per-dimension maxima of a block):
  only pinning them as anchors keeps them selected.
- **needles**: ``k = needle_strength * w`` for a needle's own direction w; a needle query
  ``q = query_strength * w + noise`` matches it, and the lift is large per dimension, so the
  query-aware block bound finds it.
- a **topic shift** starts a new segment whose anchors follow another direction; queries follow.

Values carry an optional offset per segment (``value_offset``), which changes how well value
blocks quantize without changing attention. Tensors are float32 in the engine's layout:
k, v (B, Hkv, T, D), q (B, Hq, T, D). Every layer gets the same planted data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Segment:
    """One appended run of tokens: k, v (Hkv, T, D) and planted positions (relative to its start)."""
    k: torch.Tensor
    v: torch.Tensor
    topic: str | None
    anchors: list[int] = field(default_factory=list)
    needles: dict[int, int] = field(default_factory=dict)  # needle id -> position


@dataclass
class PlantedWorkload:
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    seed: int = 0
    anchor_strength: float = 8.0
    needle_strength: float = 20.0
    query_strength: float = 8.0
    query_noise: float = 0.5

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("num_q_heads must be a multiple of num_kv_heads")
        self.gen = torch.Generator().manual_seed(self.seed)
        self.topics: dict[str, torch.Tensor] = {}
        self.needle_dirs: dict[int, torch.Tensor] = {}

    # -- directions ----------------------------------------------------------------------------
    def _unit(self) -> torch.Tensor:
        u = torch.randn(self.num_kv_heads, self.head_dim, generator=self.gen)
        return u / u.norm(dim=-1, keepdim=True)

    def topic(self, name: str) -> torch.Tensor:
        """The topic's direction per KV head, (Hkv, D) unit vectors (created on first use)."""
        if name not in self.topics:
            self.topics[name] = self._unit()
        return self.topics[name]

    def needle(self, needle_id: int) -> torch.Tensor:
        if needle_id not in self.needle_dirs:
            self.needle_dirs[needle_id] = self._unit()
        return self.needle_dirs[needle_id]

    # -- tokens --------------------------------------------------------------------------------
    def noise(self, T: int, value_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Unplanted tokens: k, v (Hkv, T, D)."""
        shape = (self.num_kv_heads, T, self.head_dim)
        return torch.randn(shape, generator=self.gen), torch.randn(shape, generator=self.gen) + value_offset

    def segment(self, T: int, topic: str | None = None, anchors: int = 0, needles: tuple[int, ...] = (),
                value_offset: float = 0.0, margin: int = 0) -> Segment:
        """T tokens with ``anchors`` tokens of ``topic`` and the given needles at random positions
        in [0, T - margin) (keep ``margin`` >= the window so that they are outside it)."""
        k, v = self.noise(T, value_offset)
        span = T - margin
        if anchors + len(needles) > span:
            raise ValueError(f"cannot plant {anchors + len(needles)} tokens in {span} positions")
        pos = torch.randperm(span, generator=self.gen)[: anchors + len(needles)].tolist()
        seg = Segment(k, v, topic)
        if anchors:
            u = self.topic(topic)
            for p in pos[:anchors]:
                k[:, p] += self.anchor_strength * u
            seg.anchors = sorted(pos[:anchors])
        for nid, p in zip(needles, pos[anchors:]):
            k[:, p] = self.needle_strength * self.needle(nid)
            seg.needles[nid] = p
        return seg

    def _query(self, direction: torch.Tensor) -> torch.Tensor:
        g = self.num_q_heads // self.num_kv_heads
        base = self.query_strength * direction.repeat_interleave(g, 0)                  # (Hq, D)
        return base + self.query_noise * torch.randn(base.shape, generator=self.gen)

    def topic_query(self, topic: str) -> torch.Tensor:
        """(Hq, D): a query that attends to the topic's anchors."""
        return self._query(self.topic(topic))

    def needle_query(self, needle_id: int) -> torch.Tensor:
        return self._query(self.needle(needle_id))


def run_prefill(engine, seq_ids: list[int], k: torch.Tensor, v: torch.Tensor,
                q: torch.Tensor | None = None) -> None:
    """One step appending k, v (B, Hkv, T, D) at every layer (and attending q (B, Hq, T, D))."""
    engine.begin_step()
    for layer in range(engine.num_layers):
        engine.append(layer, seq_ids, k, v)
        if q is not None:
            engine.attend(layer, seq_ids, q)
    engine.end_step()


def run_decode(engine, seq_ids: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One decode step: append k, v (B, Hkv, 1, D) and attend q (B, Hq, 1, D) at every layer.

    Returns the last layer's output (B, Hq, 1, D), a copy (HiSparseEngine.attend's output of a
    decode graph is the graph's buffer, which the next step overwrites).
    """
    engine.begin_step()
    out = None
    for layer in range(engine.num_layers):
        engine.append(layer, seq_ids, k, v)
        out = engine.attend(layer, seq_ids, q)
    engine.end_step()
    return out if out is None else out.clone()
