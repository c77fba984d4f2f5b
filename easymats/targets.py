"""One sampled target: its source, latest snapshot, peaks, process and GPU readings, health.

A :class:`Target` is the same whatever it samples: a :class:`easymats.source.Source` (a telemetry
segment, :class:`easymats.segment_source.SegmentSource`, or another kind) gives snapshots or a
:class:`easymats.source.SourceError`; the target turns that into up or down with a reason, counts
samples, errors and the time they cost, keeps the peak windows, and formats the log line. A
target without a source samples only its process (a watched pid with no readable segment).

The sampler thread is the only writer of a :class:`Target`; the /metrics collector and the live
view read it from other threads. Every field is replaced whole (one reference assignment), so a
reader sees each value consistent even if two fields come from neighbouring ticks.
"""

from __future__ import annotations

import collections
import json
import math
import operator
import time
from typing import Any, Sequence

from . import procinfo
from .logwriter import LOG_VERSION, json_safe, series_key
from .nvml import ProcessGpuReading
from .procmetrics import ProcessProbe, ProcessReading
from .segment_source import SegmentSource
from .source import Histogram, Snapshot, Source, SourceError

NO_SEGMENT = "no telemetry segment"


class PeakWindow:
    """Maximum over a trailing time window, O(1) amortised per sample (monotonic deque). Times
    are monotonic seconds: a wall clock stepped back would keep a peak for as long as the step.

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

    def peek(self) -> float | None:
        """The maximum as of the last push (which already dropped what left the window)."""
        return self._q[0][1] if self._q else None

    def max(self, now: float | None = None) -> float | None:
        q = self._q
        if now is not None:
            self._expire(now)
        return q[0][1] if q else None


# easymats peak gauge -> (runtime gauge, labels to match); matching series are summed per sample
# (device KV bytes = data + metadata of the device tier).
PEAK_SOURCES: dict[str, tuple[str, dict[str, str]]] = {
    "easymats_kv_active_blocks_max": ("hisparse_kv_blocks", {"state": "active"}),
    "easymats_hot_buffer_resident_tokens_max": ("hisparse_hot_buffer_resident_tokens", {}),
    "easymats_device_kv_bytes_max": ("hisparse_kv_memory_bytes", {"tier": "device"}),
}


class Target:
    """A process the agent samples: through a source (its segment), or only its process.

    ``Target(pid, path)`` opens the segment at ``path`` (SegmentError if it is not a live one);
    ``Target(pid, source=...)`` samples any other :class:`Source`; ``Target(pid)`` has none and
    reports ``error`` (why there is no source) while sampling the process alone.
    """

    def __init__(self, pid: int, path: str | None = None, *, peak_window_s: float, source: Source | None = None,
                 error: str = NO_SEGMENT, stale_after_s: float | None = None, proc_root: str = procinfo.PROC_ROOT):
        if source is None and path:
            source = SegmentSource(path, proc_root=proc_root)
        self.source = source
        self.path = source.path if source is not None else None
        # The producing process: a segment's writer (normally the pid in its file name).
        self.pid = source.pid if source is not None and source.pid else pid
        self.named_pid = pid
        self.proc_root = proc_root
        self._stat_path = f"{proc_root}/{self.pid}/stat"
        self.name = source.name if source is not None else f"pid-{pid}"
        self.labels: dict[str, str] = dict(source.labels) if source is not None else {}
        self.start_ticks = procinfo.start_ticks(self.pid, proc_root) or 0
        self.up = False
        self.gone = False  # the process exited (or the pid was reused): sampling stopped for good
        self.error: str | None = None if source is not None else error
        self.error_kind: str | None = None  # the SourceError kind behind ``error``
        self.snapshot: Snapshot | None = None
        self.sample_t: float | None = None  # unix time of the last sample (for the log)
        self.sample_mono: float | None = None  # monotonic time of the last sample (for staleness)
        self.samples = 0
        self.errors = 0
        self.retries = 0
        self.sample_seconds = 0.0  # time spent reading the source, all samples together
        self.over_budget = False  # the source refused a read as costing more than a target may
        # Down when the heartbeat stands still this long while the process lives (None: never).
        self.stale_after_s = stale_after_s
        self._heartbeat: tuple[int, float] = (-1, time.monotonic())  # (last seen, when it changed)
        self.process: ProcessReading | None = None
        self.gpu: list[ProcessGpuReading] | None = None
        self.peak_window_s = peak_window_s
        self._peaks = {name: PeakWindow(peak_window_s) for name in PEAK_SOURCES}
        self.peaks: dict[str, float] = {}
        self._probe = ProcessProbe(self.pid)
        self._keys: tuple[int, int, list[str]] | None = None
        self.exposition_cache: tuple | None = None  # owned by the exporter's fast path
        self._peak_cache: tuple | None = None
        self._json_cache: tuple | None = None
        self._head: tuple[str, str, str] | None = None  # name, short and full line templates
        self._process_text: tuple[ProcessReading | None, str] = (None, ',"process":null')
        self._gpu_text: tuple[list | None, str] = (None, "")
        self.gpu_source: object = None  # the NVML snapshot self.gpu was taken from

    # -- sampling (sampler thread only) ------------------------------------------------------------
    def alive(self) -> bool:
        """The producing process is running (not a zombie, not a new process under its pid)."""
        if self.source is not None:
            return self.source.alive()
        return procinfo.running(self._stat_path, self.start_ticks)

    def read_process(self) -> None:
        reading = self._probe.read()
        if reading is not None:
            self.process = reading

    def sample(self, t: float, mono: float | None = None) -> tuple[bool, str | None]:
        """Take one sample at unix time ``t`` (monotonic ``mono``, default now). Returns
        (went_down, error). A dead process marks the target gone."""
        if self.gone:
            return False, self.error
        self.sample_mono = time.monotonic() if mono is None else mono
        snap: Snapshot | SourceError | None = None
        if self.source is not None:
            t0 = time.perf_counter()
            try:
                snap = self.source.read()
            except SourceError as exc:
                snap = exc
            self.sample_seconds += time.perf_counter() - t0
            self.over_budget = isinstance(snap, SourceError) and snap.kind == "over_budget"
        # A heartbeat that moved since the last sample proves the writer was alive moments ago;
        # only a still heartbeat (idle or exited writer) costs a /proc read.
        fresh = (isinstance(snap, Snapshot) and self.snapshot is not None
                 and snap.heartbeat_mono_ns != self.snapshot.heartbeat_mono_ns)
        if not fresh and not self.alive():
            if isinstance(snap, Snapshot):
                # The descriptor still reads the file after a clean exit unlinked it: the final
                # publish (made just before exit) is the last sample worth logging.
                self.snapshot = snap
                self.samples += 1
            self.gone, self.up = True, False
            self.sample_t = t
            self.error = f"process {self.pid} exited"
            if self.source is not None:
                # Its last snapshot stays on /metrics for the down retention; its descriptor need
                # not (a sidecar watching many short-lived runtimes would run out of them).
                self.source.close()
            return True, self.error
        self.sample_t = t
        if snap is None:
            return False, self.error
        if isinstance(snap, SourceError):
            self.errors += 1
            self.up, self.error, self.error_kind = False, str(snap), snap.kind
            return False, self.error
        self.samples += 1
        self.retries += snap.retries
        if self._stale(snap, self.sample_mono):
            return False, self.error
        self.snapshot, self.up, self.error, self.error_kind = snap, True, None, None
        # Raw slot values from a reader; from a snapshot built from series (not by a reader) the
        # slots are series indices, and the peak plan points at scalar series only.
        values: Sequence[Any] = snap.values if snap.values is not None else [s.value for s in snap.series]
        cached = self._peak_cache
        if (cached is None or cached[0] is not snap.value_slots or cached[1] != snap.layout_generation
                or cached[0] is None):
            cached = self._peak_plan(snap)
        peaks = {}
        mono = self.sample_mono  # peak windows are intervals: monotonic, whatever the wall clock does
        for name, window, slots in cached[2]:
            window.push(mono, values[slots[0]] if len(slots) == 1 else
                        sum([values[i] for i in slots]))
            peaks[name] = window.peek()
        self.peaks = peaks
        return False, None

    def _stale(self, snap: Snapshot, mono: float) -> bool:
        """True (and down, saying why) when the heartbeat has not moved for ``stale_after_s``.

        Judged on the agent's own monotonic clock from when the heartbeat was last seen to move,
        so neither the writer's clock nor a wall-clock jump matters."""
        seen, changed = self._heartbeat
        if snap.heartbeat_mono_ns != seen:
            self._heartbeat = (snap.heartbeat_mono_ns, mono)
            return False
        if self.stale_after_s is None or self.stale_after_s <= 0 or mono - changed <= self.stale_after_s:
            return False
        self.snapshot, self.up, self.error_kind = snap, False, "stale"
        self.error = (f"no publish for {mono - changed:.0f} s: process {self.pid} is alive but its heartbeat "
                      "stopped (stopped, hung, or a writer that does not publish while idle: the segment "
                      "contract asks for one publish a second)")
        return True

    def _peak_plan(self, snap: Snapshot) -> tuple:
        """(value slots, layout generation, [(peak name, window, slots feeding it)]), per layout."""
        found: dict[str, list[int]] = {name: [] for name in PEAK_SOURCES}
        slots = snap.value_slots
        for i, s in enumerate(snap.series):
            if s.type != "gauge":
                continue
            for name, (metric, labels) in PEAK_SOURCES.items():
                if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items()):
                    found[name].append(slots[i][0] if slots is not None else i)
        plan = (slots, snap.layout_generation,
                [(name, self._peaks[name], tuple(idx)) for name, idx in found.items() if idx])
        self._peak_cache = plan
        return plan

    def metric_keys(self, snap: Snapshot) -> list[str]:
        """Log keys of the snapshot's series, cached per layout generation."""
        cached = self._keys
        if cached is None or cached[0] != snap.layout_generation or cached[1] != len(snap.series):
            keys = [series_key(s.name, s.labels) for s in snap.series]
            self._keys = cached = (snap.layout_generation, len(snap.series), keys)
        return cached[2]

    def _metrics_json(self, snap: Snapshot) -> str | None:
        """The ``metrics`` object of a sample line as JSON text, from a per-layout template.

        Formatting floats dominates the cost of a log line, and ``json`` adds a Python call per
        float. Here the keys (and histogram bounds, fixed by the layout) are rendered once per
        layout into a %-template whose holes are the value slots in order, so a line is one
        C-level ``itemgetter`` over the raw values area and one ``%`` (``%r`` of a finite float is
        valid JSON, and the same text ``json`` writes). No Series or Histogram object is built.
        None means a value was NaN or infinite (JSON has neither), or the snapshot carries no raw
        values: the caller takes the general path.
        """
        values = snap.values
        if values is None or not math.isfinite(sum(values)):  # one C-level pass over every slot
            return None
        cached = self._json_cache
        if cached is None or cached[0] is not snap.value_slots or cached[1] != snap.layout_generation:
            cached = self._json_plan(snap)
        _, _, template, getter, hists = cached
        if hists:
            # A histogram whose counts and sum did not move since the last line keeps its text
            # (most histograms change far less often than the sample rate).
            texts = []
            for h in hists:
                block = values[h[0]:h[1]]
                if block != h[3]:
                    h[3], h[4] = block, h[2] % block
                texts.append(h[4])
            return template % getter(values + tuple(texts))
        return template % getter(values)

    def _json_plan(self, snap: Snapshot) -> tuple:
        """The per-layout template of :meth:`_metrics_json`: scalar holes (``%r``) take value
        slots, histogram holes (``%s``) take the histogram's cached text; the getter picks
        scalars first, then the texts, and the template refers to them by position."""
        values = snap.values
        assert values is not None and snap.value_slots is not None
        pieces: list[tuple[str, int]] = []  # (text before a hole, the hole's reference)
        scalar_slots: list[int] = []
        hists: list[list[Any]] = []  # [counts start, sum end (slice), format, last values, text]
        for k, s, (slot, b) in zip(self.metric_keys(snap), snap.series, snap.value_slots):
            k_json = json.dumps(k).replace("%", "%%")
            if isinstance(s.value, Histogram):
                fmt = ",".join(["%r"] * (b + 1)) + '],"sum":%r}'  # counts (b + 1), then sum
                pieces.append((k_json + ':{"bounds":' + json.dumps(s.value.bounds).replace("%", "%%")
                               + ',"counts":[', len(hists)))
                hists.append([slot + b, slot + 2 * b + 2, fmt, None, ""])
            else:
                pieces.append((k_json + ":", -1 - len(scalar_slots)))
                scalar_slots.append(slot)
        # Holes in template order; a %-template needs its arguments in that order too.
        order, parts = [], []
        for text, ref in pieces:
            if ref >= 0:
                parts.append(text + "%s")
                order.append(len(values) + ref)
            else:
                parts.append(text + "%r")
                order.append(scalar_slots[-1 - ref])
        template = "{" + ",".join(parts) + "}"
        getter = operator.itemgetter(*order) if len(order) > 1 else (
            (lambda vals, i=order[0]: (vals[i],)) if order else (lambda vals: ()))
        self._json_cache = plan = (snap.value_slots, snap.layout_generation, template, getter, hists)
        return plan

    def log_json(self, t: float, lag_s: float) -> str:
        """The ``sample`` line of docs/log-format.md as JSON text (no newline); parses to the
        same object as :meth:`log_line`."""
        snap = self.snapshot
        metrics = self._metrics_json(snap) if snap is not None else "{}"
        if metrics is None:
            return json.dumps(json_safe(self.log_line(t, lag_s)), separators=(",", ":"))
        head = self._head
        if head is None or head[0] != self.name:
            # Per target: name and pid are fixed text. The common line (a snapshot, no error) is
            # one %-format: t, up, lag_s, heartbeat_t, seq, then the process, GPU and metrics texts.
            start = (f'{{"v":{LOG_VERSION},"kind":"sample","t":%r,"target":'
                     f'{json.dumps(self.name).replace("%", "%%")},"pid":{self.pid},"up":%s,"lag_s":%r')
            self._head = head = (self.name, start, start + ',"heartbeat_t":%r,"seq":%d%s%s,"metrics":%s}')
        p = self.process
        if p is not self._process_text[0]:  # psutil/proc readings change once a second
            self._process_text = (p, ',"process":{"cpu_seconds":%r,"rss_bytes":%d}'
                                  % (float(p.cpu_seconds), p.rss_bytes) if p is not None else ',"process":null')
        g = self.gpu
        gpu_text = ""
        if g is not None:
            if g is not self._gpu_text[0]:  # a new NVML reading (once per --nvml-interval)
                self._gpu_text = (g, ',"gpu":' + json.dumps(json_safe(
                    [{"gpu": r.gpu, "memory_bytes": r.memory_bytes, "utilization_ratio": r.utilization_ratio}
                     for r in g]), separators=(",", ":")))
            gpu_text = self._gpu_text[1]
        up = "true" if self.up else "false"
        if snap is not None and not self.error:  # unix times and seqlock values are always finite
            return head[2] % (float(t), up, round(float(lag_s), 6), snap.heartbeat_unix_ns / 1e9, snap.seq,
                              self._process_text[1], gpu_text, metrics)
        parts = [head[1] % (float(t), up, round(float(lag_s), 6))]
        if snap is not None:
            parts.append(',"heartbeat_t":%r,"seq":%d' % (snap.heartbeat_unix_ns / 1e9, snap.seq))
        if self.error:
            parts.append(',"error":' + json.dumps(self.error))
        parts.append(self._process_text[1])
        parts.append(gpu_text)
        parts.append(',"metrics":' + metrics + "}")
        return "".join(parts)

    def log_line(self, t: float, lag_s: float, with_metrics: bool = True) -> dict[str, Any]:
        """The ``sample`` line of docs/log-format.md for the latest sample."""
        snap = self.snapshot
        line: dict[str, Any] = {"v": LOG_VERSION, "kind": "sample", "t": t, "target": self.name,
                                "pid": self.pid, "up": self.up, "lag_s": round(lag_s, 6)}
        if snap is not None:
            line["heartbeat_t"] = snap.heartbeat_unix_ns / 1e9
            line["seq"] = snap.seq
        if not with_metrics:
            pass
        elif snap is not None:
            line["metrics"] = {k: ({"bounds": v.bounds, "counts": v.counts, "sum": v.sum}
                                   if isinstance(v, Histogram) else v)
                               for k, v in zip(self.metric_keys(snap), [s.value for s in snap.series])}
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
        if self.source is not None:
            self.source.close()
