"""Bounded-memory accumulators for one pass over a run of any length.

- :class:`Sketch`: quantiles with ~1 % relative error from log-spaced buckets (DDSketch idea); its
  size depends on the value range, not on the number of values.
- :class:`Downsampler`: a fixed number of time buckets holding min / max / mean; when the run
  outgrows them, neighbouring buckets merge and the bucket width doubles.
- :class:`Episodes`: spans where a series is past its threshold: total time, the longest span and
  the worst value, keeping a bounded list of spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_log = math.log


class Sketch:
    """Quantiles of a stream of finite floats (relative accuracy ``alpha``)."""

    __slots__ = ("_gamma_log", "_pos", "_neg", "zeros", "count", "min", "max")

    def __init__(self, alpha: float = 0.01):
        self._gamma_log = math.log((1 + alpha) / (1 - alpha))
        self._pos: dict[int, int] = {}
        self._neg: dict[int, int] = {}
        self.zeros = 0
        self.count = 0
        self.min = math.inf
        self.max = -math.inf

    def add(self, v: float) -> None:
        # The hot path of a report (every derived value of every sample): plain comparisons only.
        if v != v or v in (math.inf, -math.inf):
            return
        self.count += 1
        if v < self.min:
            self.min = v
        if v > self.max:
            self.max = v
        if -1e-12 < v < 1e-12:
            self.zeros += 1
            return
        if v > 0:
            side = self._pos
        else:
            side, v = self._neg, -v
        k = math.ceil(_log(v) / self._gamma_log)
        side[k] = side.get(k, 0) + 1

    def _value(self, k: int) -> float:
        g = self._gamma_log
        try:
            return 2 * math.exp(k * g) / (1 + math.exp(g))  # the bucket's midpoint in relative terms
        except OverflowError:       # the top bucket of values near float's largest (1.8e308)
            return math.inf         # the callers clamp it to the largest value seen

    def quantile(self, q: float) -> float | None:
        if not self.count:
            return None
        rank = q * (self.count - 1)
        seen = 0
        for k in sorted(self._neg, reverse=True):
            seen += self._neg[k]
            if seen > rank:
                return max(self.min, -self._value(k))
        seen += self.zeros
        if seen > rank:
            return 0.0
        for k in sorted(self._pos):
            seen += self._pos[k]
            if seen > rank:
                return min(self.max, self._value(k))
        return self.max


@dataclass(slots=True)
class Bucket:
    t: float  # start of the bucket
    lo: float
    hi: float
    total: float
    n: int

    @property
    def mean(self) -> float:
        return self.total / self.n


class Downsampler:
    """At most ``n`` buckets over time; each keeps min, max and mean of what fell in it."""

    __slots__ = ("n", "width", "t0", "buckets")

    def __init__(self, n: int = 600, width: float = 0.1):
        self.n = n
        self.width = width
        self.t0: float | None = None
        self.buckets: dict[int, Bucket] = {}

    def add(self, t: float, v: float) -> None:
        if v != v or v in (math.inf, -math.inf):
            return
        t0 = self.t0
        if t0 is None:
            t0 = self.t0 = t
        i = int((t - t0) // self.width) if t >= t0 else 0
        while i >= self.n:
            self._halve(t0)
            i = int((t - t0) // self.width)
        b = self.buckets.get(i)
        if b is None:
            self.buckets[i] = Bucket(t0 + i * self.width, v, v, v, 1)
        else:
            if v < b.lo:
                b.lo = v
            if v > b.hi:
                b.hi = v
            b.total += v
            b.n += 1

    def _halve(self, t0: float) -> None:
        merged: dict[int, Bucket] = {}
        for i in sorted(self.buckets):
            b = self.buckets[i]
            j = i // 2
            m = merged.get(j)
            if m is None:
                merged[j] = Bucket(t0 + j * 2 * self.width, b.lo, b.hi, b.total, b.n)
            else:
                m.lo, m.hi, m.total, m.n = min(m.lo, b.lo), max(m.hi, b.hi), m.total + b.total, m.n + b.n
        self.buckets = merged
        self.width *= 2

    def points(self) -> list[Bucket]:
        return [self.buckets[i] for i in sorted(self.buckets)]


@dataclass(slots=True)
class Span:
    start: float
    end: float
    worst: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class Episodes:
    """Spans where ``bad(v)`` held; a span ends at the first good sample or a gap."""

    threshold: float
    below: bool  # True: values below the threshold are bad
    max_spans: int = 200
    spans: list[Span] = field(default_factory=list)
    dropped: int = 0
    total_s: float = 0.0
    longest: Span | None = None
    worst: float | None = None
    _open: Span | None = None

    def bad(self, v: float) -> bool:
        return v < self.threshold if self.below else v > self.threshold

    def add(self, t: float, v: float | None, dt: float) -> None:
        """A sample at ``t`` that covers ``dt`` seconds; ``v`` None = unknown (keeps a span open)."""
        if v is None:
            if self._open is not None:
                self._open.end = t
            return
        if not self.bad(v):
            self.close()
            return
        self.total_s += dt
        if self.worst is None or (v < self.worst if self.below else v > self.worst):
            self.worst = v
        if self._open is None:
            self._open = Span(t - dt, t, v)
        else:
            self._open.end = t
            if v < self._open.worst if self.below else v > self._open.worst:
                self._open.worst = v

    def close(self) -> None:
        s = self._open
        if s is None:
            return
        self._open = None
        if self.longest is None or s.duration > self.longest.duration:
            self.longest = s
        if len(self.spans) < self.max_spans:
            self.spans.append(s)
        else:
            self.dropped += 1

    def longer_than(self, seconds: float) -> list[Span]:
        """Closed spans, and the open one (a live run is judged before it ends), of ``seconds`` or more."""
        spans = self.spans + ([self._open] if self._open is not None else [])
        return [s for s in spans if s.duration >= seconds]
