"""One pass over a run: per target accumulators, markers and the state the rules judge.

Memory is bounded whatever the length of the run: every per-target structure here is either a
fixed-size accumulator (:mod:`.accum`) or a capped list of markers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from easymats import thresholds

from .accum import Downsampler, Episodes, Sketch
from .derive import RATE_WINDOW_S, SERIES, Derived, Deriver, config_of, info_labels

MAX_MARKERS = 500
PLOT_POINTS = 600
DOC_BINS = 32


@dataclass(slots=True)
class Recal:
    t: float
    reason: str
    count: float


@dataclass(slots=True)
class RestartMark:
    t: float
    old_pid: int | None
    new_pid: int | None
    why: str  # "pid", "counter reset", "event"
    down_s: float | None = None  # time between the old process's last sample and this one
    detail: str = ""


@dataclass(slots=True)
class DocResult:
    """One document (a run of growing context) judged for anchor hit-rate decay."""

    start_t: float
    end_t: float
    length: float  # context tokens at its end (or seconds, when the log has no context gauge)
    unit: str  # "tokens" or "s"
    first_rate: float
    second_rate: float
    below_from: float | None  # position where the second half first went below the threshold
    below_from_t: float | None
    below_s: float  # time the second half spent below the threshold


class DocumentTracker:
    """Anchor hits and lookups binned by position in the current document (bounded bins).

    A document ends when the context shrinks below half its peak (a new prompt) or the process
    restarts. Bins double in width as the document grows, so memory stays at ``DOC_BINS``.
    """

    def __init__(self, limit: float):
        self.limit = limit
        self.results: list[DocResult] = []
        self.documents = 0
        self._reset(None)

    def _reset(self, t: float | None) -> None:
        self.start_t = t
        self.end_t = t
        self.peak = 0.0
        self.width = 64.0
        self.bins: dict[int, list[float]] = {}  # i -> [hits, lookups, first_t, last_t, below_s]
        self.use_time: bool | None = None  # decided by the first sample: context tokens if logged, else time

    def add(self, d: Derived, dt: float) -> None:
        ctx = d.values.get("context_tokens")
        start_t = self.start_t
        if start_t is None:
            self._reset(d.t)
            start_t = d.t
            self.use_time = ctx is None
            self.width = 1.0 if self.use_time else 64.0
        if ctx is not None and not self.use_time and self.peak > 0 and ctx < 0.5 * self.peak:
            self.finish()
            self._reset(d.t)
            self.use_time = False
        pos = (d.t - start_t) if self.use_time else (ctx or 0.0)  # a document restarted here counts tokens
        self.peak = max(self.peak, pos)
        self.end_t = d.t
        if d.anchor_lookups <= 0 and "anchor_hit_rate" not in d.values:
            return
        i = int(pos // self.width)
        while i >= DOC_BINS:
            merged: dict[int, list[float]] = {}
            for j, b in self.bins.items():
                m = merged.setdefault(j // 2, [0.0, 0.0, b[2], b[3], 0.0])
                m[0] += b[0]
                m[1] += b[1]
                m[2] = min(m[2], b[2])
                m[3] = max(m[3], b[3])
                m[4] += b[4]
            self.bins = merged
            self.width *= 2
            i = int(pos // self.width)
        b = self.bins.setdefault(i, [0.0, 0.0, d.t, d.t, 0.0])
        b[0] += d.anchor_hits
        b[1] += d.anchor_lookups
        b[3] = d.t
        rate = d.values.get("anchor_hit_rate")
        if rate is not None and rate < self.limit:
            b[4] += dt

    def restart(self, t: float) -> None:
        self.finish()
        self._reset(None)

    def finish(self) -> None:
        if self.start_t is None or not self.bins:
            return
        self.documents += 1
        half = self.peak / 2
        first = [b for i, b in self.bins.items() if (i + 1) * self.width <= half]
        second = [b for i, b in self.bins.items() if i * self.width >= half]
        h1, l1 = sum(b[0] for b in first), sum(b[1] for b in first)
        h2, l2 = sum(b[0] for b in second), sum(b[1] for b in second)
        if l1 < 20 or l2 < 20:  # too few audits to judge either half
            return
        below_from = below_from_t = None
        for i in sorted(self.bins):
            b = self.bins[i]
            if i * self.width >= half and b[1] > 0 and b[0] / b[1] < self.limit:
                below_from, below_from_t = i * self.width, b[2]
                break
        self.results.append(DocResult(
            start_t=self.start_t, end_t=self.end_t or self.start_t, length=self.peak,
            unit="s" if self.use_time else "tokens", first_rate=h1 / l1, second_rate=h2 / l2,
            below_from=below_from, below_from_t=below_from_t, below_s=sum(b[4] for b in second)))
        if len(self.results) > MAX_MARKERS:
            # keep the documents with the largest drop; the rest only count
            self.results.sort(key=lambda r: r.second_rate - r.first_rate)
            del self.results[MAX_MARKERS:]


@dataclass(slots=True)
class Trend:
    """A gauge within one process: first/last/peak and a 16-bucket outline to judge growth."""

    pid: int | None
    first_t: float
    first: float
    last_t: float = 0.0
    last: float = 0.0
    peak: float = 0.0
    outline: Downsampler = field(default_factory=lambda: Downsampler(16, 0.1))

    def add(self, t: float, v: float) -> None:
        self.last_t, self.last = t, v
        self.peak = max(self.peak, v)
        self.outline.add(t, v)

    def quarter_means(self) -> list[float]:
        """Mean of each quarter of the process's time (fewer when it was short)."""
        pts = self.outline.points()
        if len(pts) < 4:
            return []
        span = (pts[-1].t - pts[0].t) or 1.0
        sums = [[0.0, 0] for _ in range(4)]
        for b in pts:
            q = min(3, int(4 * (b.t - pts[0].t) / span))
            sums[q][0] += b.total
            sums[q][1] += b.n
        return [t / n for t, n in sums if n]

    @property
    def growth(self) -> float:
        q = self.quarter_means()
        return q[-1] - q[0] if len(q) == 4 else 0.0


@dataclass
class TargetRun:
    name: str
    window_s: float
    pids: list[int] = field(default_factory=list)
    first_t: float | None = None
    last_t: float | None = None
    samples: int = 0
    down_samples: int = 0
    covered_s: float = 0.0
    config: dict[str, str] | None = None
    runtime: dict[str, str] | None = None
    sketches: dict[str, Sketch] = field(default_factory=dict)
    plots: dict[str, Downsampler] = field(default_factory=dict)
    episodes: dict[str, Episodes] = field(default_factory=dict)
    recals: list[Recal] = field(default_factory=list)
    recal_counts: dict[str, float] = field(default_factory=dict)
    restarts: list[RestartMark] = field(default_factory=list)
    downs: list[tuple[float, str]] = field(default_factory=list)
    evictions: float = 0.0  # streaming-mode overwrites: a full pool is then by design
    pool_grew: bool = False  # a pool without a logged limit grew on demand: "free" then means nothing
    trends: list[Trend] = field(default_factory=list)  # device metadata bytes, per process
    docs: DocumentTracker = field(init=False)  # set by Analysis._target, with the run
    _deriver: Deriver = field(init=False)
    _last_up_t: float | None = None
    _prev_t: float | None = None

    @property
    def duration_s(self) -> float:
        return (self.last_t - self.first_t) if self.first_t is not None and self.last_t is not None else 0.0


def _limits() -> dict[str, thresholds.Threshold]:
    return dict(thresholds.BY_NAME)


class Analysis:
    """Feed records (dicts from :func:`reader.iter_records` or :mod:`.live`); read ``targets``."""

    def __init__(self, window_s: float = RATE_WINDOW_S, interval_s: float = 0.1,
                 plot_points: int = PLOT_POINTS):
        self.window_s = window_s
        self.interval_s = interval_s
        self.plot_points = plot_points
        self.limits = _limits()
        self.targets: dict[str, TargetRun] = {}
        self.agent_events: list[tuple[float, str, str]] = []

    def _target(self, name: str) -> TargetRun:
        run = self.targets.get(name)
        if run is None:
            run = TargetRun(name=name, window_s=self.window_s)
            run._deriver = Deriver(self.window_s)
            lim = self.limits.get("anchor_hit_rate")
            run.docs = DocumentTracker(lim.limit if lim else 0.65)
            for spec in SERIES:
                run.sketches[spec.key] = Sketch()
                run.plots[spec.key] = Downsampler(self.plot_points, self.interval_s)
                th = self.limits.get(spec.key)
                if th is not None:
                    run.episodes[spec.key] = Episodes(th.limit, th.direction == "min")
            self.targets[name] = run
        return run

    def feed_all(self, records: Iterable[Mapping[str, Any]]) -> "Analysis":
        for rec in records:
            self.feed(rec)
        return self

    def feed(self, rec: Mapping[str, Any]) -> None:
        kind = rec.get("kind")
        if kind == "event":
            self._event(rec)
        elif kind == "sample":
            self._sample(rec)

    def _event(self, rec: Mapping[str, Any]) -> None:
        t, ev, detail = float(rec["t"]), str(rec.get("event", "")), str(rec.get("detail", ""))
        if ev in ("agent_start", "agent_stop"):
            if len(self.agent_events) < MAX_MARKERS:
                self.agent_events.append((t, ev, detail))
            return
        if not isinstance(rec.get("target"), str):
            return
        run = self._target(rec["target"])
        pid = rec.get("pid") if isinstance(rec.get("pid"), int) else None
        if ev == "down" and len(run.downs) < MAX_MARKERS:
            run.downs.append((t, detail))
        elif ev == "restart":
            self._add_restart(run, RestartMark(t, run.pids[-1] if run.pids else None, pid, "event",
                                               detail=detail))

    def _add_restart(self, run: TargetRun, mark: RestartMark) -> None:
        if mark.down_s is None and run._last_up_t is not None:
            mark.down_s = max(0.0, mark.t - run._last_up_t)
        for old in run.restarts[-3:]:
            # The agent's restart event and the new pid seen in the next sample are one restart.
            same_pid = mark.new_pid is None or old.new_pid is None or old.new_pid == mark.new_pid
            if abs(old.t - mark.t) <= max(5.0, 5 * self.interval_s) and same_pid:
                old.t = min(old.t, mark.t)
                old.new_pid = old.new_pid or mark.new_pid
                old.old_pid = old.old_pid or mark.old_pid
                old.detail = old.detail or mark.detail
                if old.why == "event":
                    old.why = mark.why
                return
        if len(run.restarts) < MAX_MARKERS:
            run.restarts.append(mark)

    def _sample(self, rec: Mapping[str, Any]) -> None:
        run = self._target(str(rec["target"]))
        t = float(rec["t"])
        run.samples += 1
        if run.first_t is None:
            run.first_t = t
        run.last_t = t if run.last_t is None else max(run.last_t, t)
        gap_cap = max(1.0, 5 * self.interval_s)
        dt = min(max(0.0, t - run._prev_t), gap_cap) if run._prev_t is not None else self.interval_s
        run._prev_t = t
        d = run._deriver.feed(rec)
        if not d.up:
            run.down_samples += 1
            return
        pid = d.pid
        if pid is not None and (not run.pids or run.pids[-1] != pid):
            if pid not in run.pids:
                run.pids.append(pid)
        if d.restart is not None:
            self._add_restart(run, RestartMark(d.t, d.restart.old_pid, d.restart.new_pid, d.restart.why))
            run.docs.restart(t)
            for ep in run.episodes.values():
                ep.close()
        run._last_up_t = t
        run.covered_s += dt
        run.evictions += d.evictions
        run.pool_grew = run.pool_grew or d.pool_grew
        metrics = rec.get("metrics") or {}
        if run.config is None or d.restart is not None:
            run.config = config_of(metrics) or run.config
            run.runtime = info_labels(metrics, "hisparse_runtime_info") or run.runtime
        for reason, n in d.recalibrations.items():
            run.recal_counts[reason] = run.recal_counts.get(reason, 0.0) + n
            if len(run.recals) < MAX_MARKERS:
                run.recals.append(Recal(t, reason, n))
        values = d.values
        for key, v in values.items():
            if not math.isfinite(v):
                continue
            run.sketches[key].add(v)
            run.plots[key].add(t, v)
        waiting = values.get("pending_blocks", 0.0) > 0
        for key, ep in run.episodes.items():
            if key == "block_recycle_rate" and not waiting:
                ep.close()  # recycling is only slow while blocks wait for it
                continue
            ep.add(t, values.get(key), dt)
        run.docs.add(d, dt)
        meta = values.get("device_metadata_bytes")
        if meta is not None:
            tr = run.trends[-1] if run.trends else None
            if tr is None or (tr.pid != pid) or d.restart is not None:
                tr = Trend(pid, t, meta)
                run.trends.append(tr)
                if len(run.trends) > MAX_MARKERS:
                    run.trends.sort(key=lambda x: -x.growth)
                    del run.trends[MAX_MARKERS // 2:]
                    run.trends.append(tr)
            tr.add(t, meta)

    def finish(self) -> "Analysis":
        for run in self.targets.values():
            for ep in run.episodes.values():
                ep.close()
            run.docs.finish()
        return self
