"""Sampling a live process for ``easymats doctor``: segment snapshots as log-format records.

Uses :class:`easymats.segment.SegmentReader` directly (no dependency on the agent's internals), so
``doctor`` judges exactly what a log of the same window would have shown.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

from easymats import segment
from easymats.segment import Histogram, SegmentError, Snapshot

from .reader import series_key


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


def open_readers(pid: int, directory: str | None = None) -> list[tuple[str, segment.SegmentReader]]:
    """(target name, reader) for every segment of ``pid``; LiveError when there is none."""
    if pid <= 0:
        raise LiveError(f"--pid {pid} is not a process id")
    d = directory or segment.segment_dir()
    if not os.path.exists(f"/proc/{pid}"):
        raise LiveError(f"no process with pid {pid} (is it still running?)")
    paths = segment.segments_for_pid(pid, d)
    if not paths:
        raise LiveError(f"pid {pid} has no telemetry segment in {d}: is it a HiSparse process with telemetry "
                        "enabled? (set EASYMATS_SEGMENT_DIR if the runtime publishes elsewhere)")
    readers = []
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


def sample(readers: list[tuple[str, segment.SegmentReader]], window_s: float,
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
