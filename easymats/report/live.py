"""Sampling a live process for ``easymats doctor``: segment snapshots as log-format records.

Uses :class:`easymats.segment.SegmentReader` directly (no dependency on the agent's internals), so
``doctor`` judges exactly what a log of the same window would have shown.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator, Protocol

from easymats import segment
from easymats.segment import Histogram, SegmentError, Snapshot

from .reader import series_key


class SnapshotReader(Protocol):
    """What live sampling reads: a segment's reader, or an engine target's
    (easymats.sources.target.LiveReader)."""

    @property
    def path(self) -> str: ...

    def read(self) -> Snapshot: ...

    def check_writer(self) -> None: ...

    def close(self) -> None: ...


class LiveError(Exception):
    """The process cannot be sampled; the message names the fix."""


def snapshot_record(snap: Snapshot, target: str, t: float, lag_s: float) -> dict[str, Any]:
    """One ``kind: sample`` record (docs/log-format.md) from a segment snapshot."""
    metrics: dict[str, Any] = {}
    for s in snap.series:
        v = s.value
        metrics[series_key(s.name, s.labels)] = (
            {"bounds": list(v.bounds), "counts": list(v.counts), "sum": v.sum} if isinstance(v, Histogram) else v)
    return {"v": 1, "kind": "sample", "t": t, "target": target, "pid": snap.pid, "up": True,
            "heartbeat_t": snap.heartbeat_unix_ns / 1e9, "seq": snap.seq, "lag_s": lag_s, "metrics": metrics}


def open_readers(pid: int, directory: str | None = None) -> list[tuple[str, SnapshotReader]]:
    """(target name, reader) for every segment of ``pid`` (or, without one, for the serving engine
    it is: SGLang's metric files, easymats/sources); LiveError when there is neither."""
    if pid <= 0:
        raise LiveError(f"--pid {pid} is not a process id")
    try:
        paths = segment.require_segments(pid, directory)
    except SegmentError as exc:
        if exc.kind == "not_found":
            from easymats.sources.target import LiveReader, pid_target

            tg = pid_target(pid, peak_window_s=15.0, timeout_s=0.08)
            if tg is not None:
                tg.reader.wait_first(1.0)
                return [(tg.name, LiveReader(tg))]
        raise LiveError(exc.detail) from None
    readers: list[tuple[str, SnapshotReader]] = []
    for p in paths:
        try:
            r = segment.SegmentReader(p)
            snap = r.read()
        except SegmentError as exc:
            raise LiveError(str(exc)) from None
        name = snap.name or str(pid)
        if any(n == name for n, _ in readers):
            name = f"{name}#{os.path.basename(p)}"
        readers.append((name, r))
    return readers


def sample(readers: list[tuple[str, SnapshotReader]], window_s: float,
           interval_s: float = 0.1) -> Iterator[dict[str, Any]]:
    """Records for ``window_s`` seconds at ``interval_s`` on a drift-free schedule.

    A target whose writer exits yields one ``up: false`` sample and a ``down`` event, then is
    dropped; sampling stops early when every target is gone.
    """
    live = list(readers)
    pids: dict[str, int | None] = {name: segment.pid_of_path(r.path) for name, r in readers}
    start = time.monotonic()
    k = 0
    while live:
        due = start + k * interval_s
        now = time.monotonic()
        if due - start > window_s + 1e-9:
            break
        if due > now:
            time.sleep(due - now)
        lag = max(0.0, time.monotonic() - due)
        t = time.time()
        for name, r in list(live):
            try:
                snap = r.read()
                pids[name] = snap.pid
                yield snapshot_record(snap, name, t, lag)
                if k % 10 == 9:
                    # A clean exit removes the segment; our fd still reads it. (An engine has none.)
                    if isinstance(r, segment.SegmentReader) and not os.path.exists(r.path):
                        raise SegmentError("not_found", r.path, "the segment was removed: the process closed "
                                           "its telemetry (it exited)")
                    r.check_writer()  # a crash leaves the segment behind: notice it
            except SegmentError as exc:
                if exc.kind == "busy":
                    continue
                yield {"v": 1, "kind": "sample", "t": t, "target": name, "pid": pids[name], "up": False,
                       "lag_s": lag, "error": str(exc), "metrics": {}}
                yield {"v": 1, "kind": "event", "t": t, "target": name, "pid": pids[name], "event": "down",
                       "detail": str(exc)}
                live.remove((name, r))
                r.close()
        k += 1


class LiveDiagnosis:
    """The diagnosis rules over the last minutes of a live run, for the agent's live view.

    Feed it the sample and event records the agent writes; :meth:`urgent` returns one line about
    the most urgent finding (or None). Two overlapping analyses, started ``horizon_s`` apart, give
    a trailing view in bounded memory: findings are judged on the older one, which covers between
    one and two horizons, and a condition must hold for half a horizon.
    """

    def __init__(self, horizon_s: float = 120.0, window_s: float = 10.0, interval_s: float = 0.1,
                 every_s: float = 1.0):
        from .analyse import Analysis

        self._new = lambda: Analysis(window_s=window_s, interval_s=interval_s, plot_points=8)
        self.horizon_s = horizon_s
        self.every_s = every_s
        self._runs: list[tuple[float, Any]] = []  # (start t, Analysis), oldest first
        self._cached: tuple[float, str | None] = (-1e18, None)

    def feed(self, rec: dict[str, Any]) -> None:
        t = float(rec.get("t", 0.0))
        if not self._runs or t - self._runs[-1][0] >= self.horizon_s:
            self._runs.append((t, self._new()))
            if len(self._runs) > 2:
                self._runs.pop(0)
        for _, a in self._runs:
            a.feed(rec)

    def feed_snapshot(self, snap: Snapshot, target: str, t: float | None = None) -> None:
        """Feed a segment snapshot directly (what the agent's live view holds)."""
        self.feed(snapshot_record(snap, target, time.time() if t is None else t, 0.0))

    def findings(self) -> list:
        from .findings import RuleConfig, diagnose_all

        if not self._runs:
            return []
        return diagnose_all(self._runs[0][1].targets, RuleConfig(min_duration_s=self.horizon_s / 2))

    def urgent(self, now: float | None = None) -> str | None:
        """One line for the most urgent finding; re-judged at most every ``every_s`` seconds."""
        from .findings import most_urgent

        now = time.monotonic() if now is None else now
        if now - self._cached[0] >= self.every_s:
            self._cached = (now, most_urgent(self.findings()))
        return self._cached[1]
