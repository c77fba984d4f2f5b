"""The terminal view: rates and ratios over a short window, coloured by the health thresholds.

:func:`derive` is pure (two snapshots in, numbers out); :class:`LiveView` keeps a few seconds of
history per target and renders either a table (TTY, redrawn in place) or one summary line.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, TextIO

from . import thresholds as th
from .catalogue import RATIO
from .segment import Histogram, Snapshot
from .targets import Target

WINDOW_S = 5.0


@dataclass(frozen=True, slots=True)
class Derived:
    """Key health numbers of one target over a window; None where the window had no traffic."""

    anchor_hit_rate: float | None
    hot_buffer_hit_rate: float | None
    prefetch_efficiency: float | None
    block_recycle_rate: float | None  # recycles per second over active blocks
    active_blocks: float | None
    free_blocks: float | None
    pending_blocks: float | None
    step_p50_s: float | None
    step_p99_s: float | None
    tokens_per_s: float | None


class Diagnosis(Protocol):
    """What the live view asks of a per-target diagnosis (easymats.report.live.LiveDiagnosis)."""

    def feed_snapshot(self, snap: Snapshot, target: str, t: float | None = None) -> None: ...

    def urgent(self, now: float | None = None) -> str | None: ...


def _sum(snap: Snapshot, name: str) -> float | None:
    vals = [s.value for s in snap.series if s.name == name and not isinstance(s.value, Histogram)]
    return float(sum(vals)) if vals else None


def _ratio(old: Snapshot, new: Snapshot, key: str) -> float | None:
    r = RATIO[key]
    n0, n1, d0, d1 = _sum(old, r.numerator), _sum(new, r.numerator), _sum(old, r.denominator), _sum(new, r.denominator)
    if n0 is None or n1 is None or d0 is None or d1 is None or n1 < n0:
        return None  # no traffic, or a counter reset (restart) inside the window
    return r.of(n1 - n0, d1 - d0)


def histogram_quantile(q: float, h: Histogram) -> float | None:
    """Prometheus-style quantile from non-cumulative bucket counts (linear within a bucket)."""
    total = h.count
    if total <= 0:
        return None
    rank = q * total
    acc = 0.0
    lower = 0.0
    for bound, c in zip(h.bounds + (math.inf,), h.counts):
        if acc + c >= rank and c > 0:
            if math.isinf(bound):
                return lower  # as Prometheus: the highest finite bound
            return lower + (bound - lower) * (rank - acc) / c
        acc += c
        lower = bound
    return lower


def _hist_delta(old: Snapshot, new: Snapshot, name: str) -> Histogram | None:
    a, b = old.get(name), new.get(name)
    if not isinstance(a, Histogram) or not isinstance(b, Histogram) or a.bounds != b.bounds:
        return None
    counts = tuple(y - x for x, y in zip(a.counts, b.counts))
    if any(c < 0 for c in counts):
        return None
    return Histogram(b.bounds, counts, b.sum - a.sum)


def derive(old: Snapshot, new: Snapshot, dt: float) -> Derived:
    """Health numbers between two snapshots of one target taken ``dt`` seconds apart."""
    rec = RATIO["block_recycle_rate"]
    active = new.get(rec.denominator, **rec.denominator_labels)
    recycle = None
    r0, r1 = _sum(old, rec.numerator), _sum(new, rec.numerator)
    if dt > 0 and r0 is not None and r1 is not None and r1 >= r0 and isinstance(active, float):
        recycle = rec.of((r1 - r0) / dt, active)
    steps = _hist_delta(old, new, "hisparse_step_duration_seconds")
    t0, t1 = _sum(old, "hisparse_tokens_total"), _sum(new, "hisparse_tokens_total")
    tps = (t1 - t0) / dt if dt > 0 and t0 is not None and t1 is not None and t1 >= t0 else None
    free = new.get("hisparse_kv_blocks", state="free")
    pending = new.get("hisparse_kv_blocks", state="pending_recycle")
    return Derived(
        anchor_hit_rate=_ratio(old, new, "anchor_hit_rate"),
        hot_buffer_hit_rate=_ratio(old, new, "hot_buffer_hit_rate"),
        prefetch_efficiency=_ratio(old, new, "prefetch_efficiency"),
        block_recycle_rate=recycle,
        active_blocks=active if isinstance(active, float) else None,
        free_blocks=free if isinstance(free, float) else None,
        pending_blocks=pending if isinstance(pending, float) else None,
        step_p50_s=histogram_quantile(0.5, steps) if steps else None,
        step_p99_s=histogram_quantile(0.99, steps) if steps else None,
        tokens_per_s=tps,
    )


def recycle_health(d: Derived) -> str:
    """Slow recycling only matters while blocks wait in pending_recycle."""
    if not d.pending_blocks:
        return "ok" if d.block_recycle_rate is not None else "unknown"
    return th.health("block_recycle_rate", d.block_recycle_rate if d.block_recycle_rate is not None else 0.0)


_COLOURS = {"ok": "\033[32m", "warn": "\033[33m", "bad": "\033[31m", "unknown": ""}
_RESET = "\033[0m"
# C0 and C1 control characters and DEL: what a terminal acts on instead of showing.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160))}


def shown(text: str) -> str:
    """``text`` with every control character escaped (``\\x1b``): target names and errors come from
    the runtimes, and an escape sequence in one must not drive the operator's terminal."""
    return text.translate(_CONTROLS)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.2f}"


class LiveView:
    """Keeps WINDOW_S of snapshots per target and renders the table or the summary line."""

    def __init__(self, window_s: float = WINDOW_S, colour: bool = True,
                 diagnosis_factory: Callable[[], Diagnosis] | None = None):
        """``diagnosis_factory()`` makes one live diagnosis per target (default: the report's
        LiveDiagnosis with its two-minute horizon); the table shows its most urgent finding."""
        self.window_s = window_s
        self._diagnosis_factory = diagnosis_factory
        self.colour = colour
        self._hist: dict[int, collections.deque[tuple[float, Snapshot]]] = {}
        self._diagnosis: dict[int, Diagnosis] = {}  # per target: the report's rules over the live run

    def _diagnose(self, tg: Target, snap: Snapshot, now: float) -> None:
        diag = self._diagnosis.get(id(tg))
        if diag is None:
            if self._diagnosis_factory is not None:
                diag = self._diagnosis_factory()
            else:
                from .report.live import LiveDiagnosis  # the rules of `easymats report`
                diag = LiveDiagnosis()
            self._diagnosis[id(tg)] = diag
        diag.feed_snapshot(snap, tg.name, now)

    def urgent(self, targets: Iterable[Target]) -> list[str]:
        """One line per target with a current finding (the most urgent one; it names the target)."""
        lines = []
        for tg in targets:
            diag = self._diagnosis.get(id(tg))
            line = diag.urgent() if diag is not None else None
            if line:
                lines.append(line)
        return lines

    def observe(self, targets: Iterable[Target], now: float) -> None:
        for tg in targets:
            snap = tg.snapshot
            if snap is None:
                continue
            q = self._hist.setdefault(id(tg), collections.deque())
            if not q or q[-1][1] is not snap:
                q.append((now, snap))
                self._diagnose(tg, snap, now)
            while len(q) > 2 and q[0][0] < now - self.window_s:
                q.popleft()

    def derived(self, tg: Target) -> Derived | None:
        q = self._hist.get(id(tg))
        if not q or len(q) < 2:
            return None
        (t0, a), (t1, b) = q[0], q[-1]
        return derive(a, b, t1 - t0)

    def _c(self, text: str, state: str) -> str:
        if not self.colour or not _COLOURS.get(state):
            return text
        return f"{_COLOURS[state]}{text}{_RESET}"

    def table(self, targets: list[Target]) -> str:
        head = (f"{'target':<16} {'pid':>7} {'up':>3} {'anchor':>7} {'hotbuf':>7} {'prefetch':>8} "
                f"{'recycle/s':>9} {'active':>7} {'free':>7} {'pending':>7} {'p50 ms':>7} "
                f"{'p99 ms':>7} {'tok/s':>8}")
        lines = [head]
        for tg in targets:
            d = self.derived(tg)
            up = self._c("yes" if tg.up else "no", "ok" if tg.up else "bad")
            name = shown(tg.name)[:16]
            if d is None:
                lines.append(f"{name:<16} {tg.pid:>7} {up:>3}  (waiting for a second sample)"
                             if tg.up else f"{name:<16} {tg.pid:>7} {up:>3}  {shown(tg.error or '')}")
                continue
            anchor_health = th.health("anchor_hit_rate", d.anchor_hit_rate)
            hot_health = th.health("hot_buffer_hit_rate", d.hot_buffer_hit_rate)
            prefetch_health = th.health("prefetch_efficiency", d.prefetch_efficiency)
            lines.append(
                f"{name:<16} {tg.pid:>7} {up:>3} "
                f"{self._c(f'{_pct(d.anchor_hit_rate):>7}', anchor_health)} "
                f"{self._c(f'{_pct(d.hot_buffer_hit_rate):>7}', hot_health)} "
                f"{self._c(f'{_pct(d.prefetch_efficiency):>8}', prefetch_health)} "
                f"{self._c(f'{_pct(d.block_recycle_rate):>9}', recycle_health(d))} "
                f"{_num(d.active_blocks):>7} {_num(d.free_blocks):>7} {_num(d.pending_blocks):>7} "
                f"{_ms(d.step_p50_s):>7} {_ms(d.step_p99_s):>7} {_num(d.tokens_per_s):>8}")
        return "\n".join(lines)

    def summary_line(self, targets: list[Target], now_str: str) -> str:
        parts = []
        for tg in targets:
            d = self.derived(tg)
            if not tg.up or d is None:
                parts.append(f"{shown(tg.name)}: {'up' if tg.up else 'down'}")
                continue
            parts.append(f"{shown(tg.name)}: anchor={_pct(d.anchor_hit_rate)} hotbuf={_pct(d.hot_buffer_hit_rate)} "
                         f"prefetch={_pct(d.prefetch_efficiency)} recycle={_pct(d.block_recycle_rate)}/s "
                         f"active={_num(d.active_blocks)} free={_num(d.free_blocks)} "
                         f"pending={_num(d.pending_blocks)} p99={_ms(d.step_p99_s)}ms "
                         f"tok/s={_num(d.tokens_per_s)}")
        return f"{now_str} " + (" | ".join(parts) if parts else "no targets")

    def draw(self, out: TextIO, targets: list[Target], title: str = "") -> None:
        """Redraw the table in place (cursor home, clear screen)."""
        urgent = "".join(f"\n{self._c('! ' + shown(line), 'bad')}" for line in self.urgent(targets))
        out.write("\033[H\033[2J" + (shown(title) + "\n" if title else "") + self.table(targets) + urgent + "\n")
        out.flush()
