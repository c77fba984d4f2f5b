"""One sampled process: its segment reader, latest snapshot, peaks, process and GPU readings.

The sampler thread is the only writer of a :class:`Target`; the /metrics collector and the live
view read it from other threads. Every field is replaced whole (one reference assignment), so a
reader sees each value consistent even if two fields come from neighbouring ticks.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from . import procinfo
from .logwriter import LOG_VERSION, metric_value, series_key
from .nvml import ProcessGpuReading
from .procmetrics import ProcessProbe, ProcessReading
from .segment import SegmentError, SegmentReader, Snapshot

# Reads retried while a publish is in flight; each is a few preads on tmpfs, so this bounds a
# target's read to well under a millisecond even against a writer publishing non-stop.
READ_RETRIES = 16


class PeakWindow:
    """Maximum over a trailing time window, O(1) amortised per sample (monotonic deque).

    Nothing is reset when it is read, so any number of scrapers, each scraping at an interval no
    longer than the window, sees every peak.
    """

    __slots__ = ("window_s", "_q")

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._q: collections.deque[tuple[float, float]] = collections.deque()

    def push(self, t: float, value: float) -> None:
        q = self._q
        while q and q[-1][1] <= value:
            q.pop()
        q.append((t, value))
        self._expire(t)

    def _expire(self, now: float) -> None:
        q = self._q
        while len(q) > 1 and q[0][0] < now - self.window_s:
            q.popleft()

    def max(self, now: float | None = None) -> float | None:
        q = self._q
        if now is not None:
            self._expire(now)
        return q[0][1] if q else None


def _active_blocks(snap: Snapshot) -> float | None:
    v = snap.get("hisparse_kv_blocks", state="active")
    return v if isinstance(v, float) else None


def _resident_tokens(snap: Snapshot) -> float | None:
    v = snap.get("hisparse_hot_buffer_resident_tokens")
    return v if isinstance(v, float) else None


def _device_kv_bytes(snap: Snapshot) -> float | None:
    vals = [s.value for s in snap.series
            if s.name == "hisparse_kv_memory_bytes" and s.labels.get("tier") == "device"]
    return float(sum(vals)) if vals else None  # type: ignore[arg-type]


# easymats peak gauge -> how to read the underlying value from one snapshot
PEAK_SOURCES = {
    "easymats_kv_active_blocks_max": _active_blocks,
    "easymats_hot_buffer_resident_tokens_max": _resident_tokens,
    "easymats_device_kv_bytes_max": _device_kv_bytes,
}


class Target:
    """A process the agent samples: through its segment, or (no segment) only its process."""

    def __init__(self, pid: int, path: str | None, *, peak_window_s: float,
                 proc_root: str = procinfo.PROC_ROOT):
        self.pid = pid
        self.path = path
        self.proc_root = proc_root
        self.reader: SegmentReader | None = None
        self.name = f"pid-{pid}"
        self.labels: dict[str, str] = {}
        self.start_ticks = procinfo.start_ticks(pid, proc_root) or 0
        self.up = False
        self.gone = False  # the process exited (or the pid was reused): sampling stopped for good
        self.error: str | None = None if path else "no telemetry segment"
        self.snapshot: Snapshot | None = None
        self.sample_t: float | None = None
        self.samples = 0
        self.errors = 0
        self.retries = 0
        self.process: ProcessReading | None = None
        self.gpu: list[ProcessGpuReading] | None = None
        self.peak_window_s = peak_window_s
        self._peaks = {name: PeakWindow(peak_window_s) for name in PEAK_SOURCES}
        self.peaks: dict[str, float] = {}
        self._probe = ProcessProbe(pid)
        self._keys: tuple[int, int, list[str]] | None = None
        if path:
            # SegmentError (stale, bad mode ...) propagates: the caller decides what it means.
            self.reader = SegmentReader(path, max_retries=READ_RETRIES, proc_root=proc_root)
            snap = self.reader.read()
            self.name, self.labels = snap.name, dict(snap.labels)
            self.start_ticks = snap.start_ticks or self.start_ticks

    # -- sampling (sampler thread only) ------------------------------------------------------------
    def alive(self) -> bool:
        """Running, not a zombie, and not a new process that reused the pid."""
        try:
            with open(f"{self.proc_root}/{self.pid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            return False
        # Fields after the command name (which may hold spaces and parentheses): state is first,
        # start time the 20th. A zombie has exited; its parent just has not reaped it yet.
        fields = data[data.rfind(b")") + 2:].split()
        if not fields or fields[0] in (b"Z", b"X", b"x"):
            return False
        try:
            now = int(fields[19])
        except (IndexError, ValueError):
            return False
        return not self.start_ticks or now == self.start_ticks

    def read_process(self) -> None:
        reading = self._probe.read()
        if reading is not None:
            self.process = reading

    def sample(self, t: float) -> tuple[bool, str | None]:
        """Take one sample. Returns (went_down, error). A dead process marks the target gone."""
        if self.gone:
            return False, self.error
        if not self.alive():
            if self.reader is not None:
                # The descriptor still reads the file even after a clean exit unlinked it: the
                # final publish (made just before exit) is the last sample worth logging.
                try:
                    self.snapshot = self.reader.read()
                    self.samples += 1
                except SegmentError:
                    pass
            self.gone, self.up = True, False
            self.sample_t = t
            self.error = f"process {self.pid} exited"
            return True, self.error
        self.sample_t = t
        if self.reader is None:
            return False, self.error
        try:
            snap = self.reader.read()
        except SegmentError as exc:
            self.errors += 1
            self.up, self.error = False, str(exc)
            return False, self.error
        self.samples += 1
        self.retries += snap.retries
        self.snapshot, self.up, self.error = snap, True, None
        for name, source in PEAK_SOURCES.items():
            value = source(snap)
            if value is not None:
                self._peaks[name].push(t, value)
        self.peaks = {n: v for n, w in self._peaks.items() if (v := w.max(t)) is not None}
        return False, None

    def metric_keys(self, snap: Snapshot) -> list[str]:
        """Log keys of the snapshot's series, cached per layout generation."""
        cached = self._keys
        if cached is None or cached[0] != snap.layout_generation or cached[1] != len(snap.series):
            keys = [series_key(s.name, s.labels) for s in snap.series]
            self._keys = cached = (snap.layout_generation, len(snap.series), keys)
        return cached[2]

    def log_line(self, t: float, lag_s: float) -> dict[str, Any]:
        """The ``sample`` line of docs/log-format.md for the latest sample."""
        snap = self.snapshot
        line: dict[str, Any] = {"v": LOG_VERSION, "kind": "sample", "t": t, "target": self.name,
                                "pid": self.pid, "up": self.up, "lag_s": round(lag_s, 6)}
        if snap is not None:
            line["heartbeat_t"] = snap.heartbeat_unix_ns / 1e9
            line["seq"] = snap.seq
            line["metrics"] = {k: metric_value(s.value)
                               for k, s in zip(self.metric_keys(snap), snap.series)}
        else:
            line["metrics"] = {}
        if self.error:
            line["error"] = self.error
        p = self.process
        line["process"] = {"cpu_seconds": p.cpu_seconds, "rss_bytes": p.rss_bytes} if p else None
        if self.gpu is not None:
            line["gpu"] = [{"gpu": g.gpu, "memory_bytes": g.memory_bytes,
                            "utilization_ratio": g.utilization_ratio} for g in self.gpu]
        return line

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def now_unix() -> float:
    return time.time()
