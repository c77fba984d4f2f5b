"""Prometheus /metrics: a collector that reads the agent's latest samples at scrape time.

Nothing is copied into prometheus_client metric objects on a timer: each scrape builds fresh
families from the targets' latest snapshots, so what Prometheus sees is exactly what the last
100 ms sample saw, plus the peaks over the trailing window that the samples in between caught.
Every name comes from the catalogue; a runtime series with a name the catalogue does not define
(or with the wrong type) is dropped with one warning.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol, Sequence

from . import __version__, catalogue

# /metrics over HTTP lives with the server (formatting here is pure); re-exported for callers.
from .httpserve import serve_metrics as serve  # noqa: F401
from .logwriter import LogWriter, escape_label_value
from .nvml import NvmlSnapshot
from .segment import Histogram, Series, Snapshot
from .sources import passthrough
from .targets import Target

if TYPE_CHECKING:
    from prometheus_client.core import Metric


class Collector(Protocol):
    """What :meth:`AgentRegistry.register` takes: a prometheus_client collector with ``describe()``
    (registering reads nothing); an optional ``version()`` lets /metrics reuse its body."""

    def describe(self) -> Iterable[Metric]: ...

    def collect(self) -> Iterable[Metric]: ...


log = logging.getLogger("easymats.exporter")


# How long one rendering of /metrics may be served again to other scrapers, at most.
RENDER_REUSE_S = 0.25


class LagHistogram:
    """The agent's own sample-lag histogram (easymats_sample_lag_seconds); thread-safe."""

    def __init__(self, bounds: Sequence[float] = catalogue.SAMPLE_LAG_BUCKETS):
        self.bounds = tuple(bounds)
        self.counts = [0.0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        i = 0
        for b in self.bounds:
            if value <= b:
                break
            i += 1
        with self._lock:
            self.counts[i] += 1
            self.sum += value

    def snapshot(self) -> Histogram:
        with self._lock:
            return Histogram(self.bounds, tuple(self.counts), self.sum)


def _family(spec: catalogue.MetricSpec) -> "Metric":
    # prometheus_client (and the http.server, ssl and email modules it imports: ~12 MB of RSS)
    # is imported only by the slow collector protocol; /metrics is served from render_text.
    from prometheus_client.core import Metric

    if spec.type == catalogue.COUNTER:
        base = spec.name[:-len("_total")] if spec.name.endswith("_total") else spec.name
        typ = "counter"
    elif spec.type == catalogue.HISTOGRAM:
        base, typ = spec.name, "histogram"
    else:  # gauges and info metrics (a gauge whose value is 1, name kept as *_info)
        base, typ = spec.name, "gauge"
    unit = spec.unit if spec.unit and base.endswith("_" + spec.unit) else ""
    return Metric(base, spec.help, typ, unit)


def _add(fam: "Metric", spec: catalogue.MetricSpec, labels: dict[str, str], value: float | Histogram) -> None:
    if spec.type == catalogue.HISTOGRAM:
        assert isinstance(value, Histogram)
        for bound, cum in value.cumulative():
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            fam.add_sample(spec.name + "_bucket", {**labels, "le": le}, cum)
        fam.add_sample(spec.name + "_count", labels, value.count)
        fam.add_sample(spec.name + "_sum", labels, value.sum)
    else:  # counters, gauges and info metrics: one number each
        assert not isinstance(value, Histogram)
        fam.add_sample(spec.name, labels, float(value))


class AgentCollector:
    """prometheus_client collector over the agent's targets, GPU readings and own health.

    Two renderings of the same families: :meth:`collect` (the collector protocol, for any
    prometheus_client registry) and :meth:`render_text`, the fast path /metrics serves. The fast
    path caches each target's rendered series names and labels per segment layout, so a scrape
    only formats numbers (prometheus_client re-validates and re-escapes every label of every
    sample at every scrape: ~10 us per sample, 50 ms for 64 targets).
    """

    def __init__(self, targets: Callable[[], Iterable[Target]], lag: LagHistogram,
                 gpu: Callable[[], NvmlSnapshot | None], peak_window_s: float, *,
                 log: Callable[[], LogWriter | None] = lambda: None,
                 sample_max_age_s: float | None = None,
                 version: Callable[[], object] | None = None):
        self._targets = targets
        self._version = version
        self._lag = lag
        self._gpu = gpu
        self._peak_window_s = peak_window_s
        self._log = log
        # A target is up only if it was sampled this recently: should the sampler ever stop,
        # /metrics says every target is down rather than serving its last values as healthy.
        self._sample_max_age_s = sample_max_age_s
        self._warned: set[str] = set()
        self.last_render_s = 0.0

    def version(self) -> object:
        """Changes whenever what :meth:`render_text` would give changes (None: unknown)."""
        return None if self._version is None else self._version()

    def describe(self) -> list["Metric"]:
        # Registering must not read anything: describe every name this collector can export.
        return [_family(spec) for spec in catalogue.CATALOGUE.values()
                if spec.source == catalogue.RUNTIME or spec.name not in _NOT_OURS]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def _agent_series(self, targets: list[Target], gpu: NvmlSnapshot | None
                      ) -> Iterator[tuple[str, dict[str, str], float | Histogram]]:
        """Every series except the runtimes' own: (catalogue name, labels, value)."""
        yield "easymats_build_info", {"version": __version__}, 1.0
        yield "easymats_sample_lag_seconds", {}, self._lag.snapshot()
        yield "easymats_peak_window_seconds", {}, self._peak_window_s
        log = self._log()
        if log is not None:
            yield "easymats_log_failing", {}, 0.0 if log.failing is None else 1.0
            yield "easymats_log_dropped_lines_total", {}, float(log.dropped_lines)
        now = time.monotonic()
        max_age = self._sample_max_age_s
        for tg in targets:
            tl = {"target": tg.name}
            fresh = max_age is None or (tg.sample_mono is not None and now - tg.sample_mono <= max_age)
            yield "easymats_target_up", tl, 1.0 if tg.up and fresh else 0.0
            yield "easymats_target_info", {"target": tg.name, "pid": str(tg.pid), "labels": ",".join(
                f"{k}={v}" for k, v in sorted(tg.labels.items()))}, 1.0
            yield "easymats_samples_total", tl, float(tg.samples)
            yield "easymats_sample_errors_total", tl, float(tg.errors)
            yield "easymats_segment_read_retries_total", tl, float(tg.retries)
            yield "easymats_target_sample_seconds_total", tl, tg.sample_seconds
            yield "easymats_target_over_budget", tl, 1.0 if tg.over_budget else 0.0
            engine_series = getattr(tg, "engine_series", None)  # engine targets (easymats/sources)
            if engine_series is not None:
                yield from engine_series()
            snap = tg.snapshot
            if snap is not None:
                yield "easymats_target_heartbeat_timestamp_seconds", tl, snap.heartbeat_unix_ns / 1e9
            for name, value in tg.peaks.items():
                yield name, tl, value
            p = tg.process
            if p is not None:
                yield "easymats_process_cpu_seconds_total", tl, p.cpu_seconds
                yield "easymats_process_resident_memory_bytes", tl, float(p.rss_bytes)
            if gpu is not None and not tg.gone:
                for g in gpu.for_pid(tg.pid):
                    gl = {"target": tg.name, "gpu": g.gpu}
                    if g.memory_bytes is not None:
                        yield "easymats_process_gpu_memory_bytes", gl, g.memory_bytes
                    if g.utilization_ratio is not None:
                        yield "easymats_process_gpu_utilization_ratio", gl, g.utilization_ratio
        if gpu is not None:
            for d in gpu.gpus:
                dl = {"gpu": d.gpu, "uuid": d.uuid}
                if d.utilization_ratio is not None:
                    yield "easymats_gpu_utilization_ratio", dl, d.utilization_ratio
                if d.memory_used_bytes is not None:
                    yield "easymats_gpu_memory_used_bytes", dl, d.memory_used_bytes
                if d.memory_total_bytes is not None:
                    yield "easymats_gpu_memory_total_bytes", dl, d.memory_total_bytes

    def _exportable(self, tg: Target, s: Series) -> bool:
        spec = catalogue.CATALOGUE.get(s.name)
        if spec is None or spec.source != catalogue.RUNTIME:
            self._warn_once(s.name, f"target {tg.name}: series {s.name} is not a runtime metric in the "
                            "easymats catalogue; dropped from /metrics")
            return False
        if spec.type != s.type or "target" in s.labels:
            self._warn_once(s.name, f"target {tg.name}: series {s.name} has type {s.type} (catalogue: "
                            f"{spec.type}) or a 'target' label; dropped from /metrics")
            return False
        return True

    def collect(self) -> Iterator["Metric"]:
        t0 = time.perf_counter()
        fams: dict[str, "Metric"] = {}

        def emit(name: str, labels: dict[str, str], value: float | Histogram) -> None:
            spec = catalogue.CATALOGUE[name]
            fam = fams.get(name)
            if fam is None:
                fam = fams[name] = _family(spec)
            _add(fam, spec, labels, value)

        targets = list(self._targets())
        for name, labels, value in self._agent_series(targets, self._gpu()):
            emit(name, labels, value)
        for tg in targets:
            snap = tg.snapshot
            if snap is None:
                continue
            for s in snap.series:
                if self._exportable(tg, s):
                    emit(s.name, {**s.labels, "target": tg.name}, s.value)
        self.last_render_s = time.perf_counter() - t0
        # Engine series no table maps, under the engine's own names (easymats/sources/passthrough).
        return iter([*fams.values(), *passthrough.families(targets)])

    # -- the fast text path ------------------------------------------------------------------------
    def _runtime_lines(self, tg: Target, snap: Snapshot) -> list[tuple[int, str, tuple[str, ...]]]:
        """(series index, family name, rendered sample prefixes) for a target's layout, cached."""
        key = (snap.layout_generation, len(snap.series), tg.name)
        cached = tg.exposition_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        out = []
        for i, s in enumerate(snap.series):
            if not self._exportable(tg, s):
                continue
            labels = {**s.labels, "target": tg.name}
            if s.type == catalogue.HISTOGRAM:
                assert isinstance(s.value, Histogram)
                prefixes = tuple(f"{s.name}_bucket{_labels_text({**labels, 'le': _le(b)})} "
                                 for b in s.value.bounds + (math.inf,))
                prefixes += (f"{s.name}_count{_labels_text(labels)} ", f"{s.name}_sum{_labels_text(labels)} ")
            else:
                prefixes = (f"{s.name}{_labels_text(labels)} ",)
            out.append((i, s.name, prefixes))
        tg.exposition_cache = (key, out)
        return out

    def render_text(self) -> str:
        """The text exposition format (0.0.4) of everything :meth:`collect` yields."""
        t0 = time.perf_counter()
        groups: dict[str, list[str]] = {}
        targets = list(self._targets())
        for name, labels, value in self._agent_series(targets, self._gpu()):
            lines = groups.setdefault(name, [])
            if isinstance(value, Histogram):
                lines.extend(_histogram_lines(name, _labels_dict_prefixes(name, labels, value.bounds), value))
            else:
                lines.append(f"{name}{_labels_text(labels)} {_fv(value)}\n")
        for tg in targets:
            snap = tg.snapshot
            if snap is None:
                continue
            series = snap.series
            for i, name, prefixes in self._runtime_lines(tg, snap):
                group = groups.get(name)
                if group is None:
                    group = groups[name] = []
                value = series[i].value
                if isinstance(value, Histogram):
                    group.extend(_histogram_lines(name, prefixes, value))
                else:
                    group.append(f"{prefixes[0]}{_fv(value)}\n")
        parts = []
        for name, lines in groups.items():
            parts.append(_HEADERS[name])
            parts.extend(lines)
        # Engine series no table maps, under the engine's own names (easymats/sources/passthrough).
        parts.append(passthrough.render(targets, _fv))
        self.last_render_s = time.perf_counter() - t0
        return "".join(parts)


def _fv(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (math.inf, -math.inf):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _le(bound: float) -> str:
    return "+Inf" if bound == math.inf else repr(float(bound))


def _labels_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in labels.items()) + "}"


def _labels_dict_prefixes(name: str, labels: dict[str, str], bounds: tuple[float, ...]) -> tuple[str, ...]:
    return tuple(f"{name}_bucket{_labels_text({**labels, 'le': _le(b)})} " for b in bounds + (math.inf,)) + (
        f"{name}_count{_labels_text(labels)} ", f"{name}_sum{_labels_text(labels)} ")


def _histogram_lines(name: str, prefixes: tuple[str, ...], h: Histogram) -> list[str]:
    out = []
    acc = 0.0
    n = len(h.counts)
    for i in range(n):
        acc += h.counts[i]
        out.append(f"{prefixes[i]}{_fv(acc)}\n")
    out.append(f"{prefixes[n]}{_fv(acc)}\n")
    out.append(f"{prefixes[n + 1]}{_fv(h.sum)}\n")
    return out


def _header(spec: catalogue.MetricSpec) -> str:
    typ = {"counter": "counter", "histogram": "histogram"}.get(spec.type, "gauge")
    doc = spec.help.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {spec.name} {doc}\n# TYPE {spec.name} {typ}\n"


_HEADERS = {name: _header(spec) for name, spec in catalogue.CATALOGUE.items()}


# Agent metrics that other parts of easymats own (the webhook registers its own collector).
_NOT_OURS = {"easymats_webhook_requests_total", "easymats_recalibration_requests_total",
             "easymats_webhook_write_failures_total"}


class AgentRegistry:
    """The agent's collector, and beside it collectors other parts register (the webhook).

    :meth:`render` is what /metrics serves: the agent collector's fast text path, then every
    other collector through prometheus_client's own formatter. ``generate_latest(registry)``
    gives the same families the slow way (:meth:`collect`). Not a prometheus_client
    ``CollectorRegistry``: that would import prometheus_client into every agent process, for
    nothing the fast path needs.
    """

    def __init__(self, agent_collector: AgentCollector):
        self.agent_collector = agent_collector
        self.extras: list[Collector] = []
        self._lock = threading.Lock()
        self._render_lock = threading.Lock()
        self._cached: tuple[object, float, bytes] | None = None  # (version, monotonic time, body)

    def register(self, collector: Collector) -> None:
        """Add a collector; ValueError if it describes a family already exported here."""
        names = {m.name for m in collector.describe()}
        with self._lock:
            taken = set(catalogue.CATALOGUE) - _NOT_OURS
            for other in self.extras:
                taken |= {m.name for m in other.describe()}
            clash = {n for n in names if n in taken or f"{n}_total" in taken}
            if clash:
                raise ValueError(f"duplicated metric families: {sorted(clash)}")
            self.extras.append(collector)

    def collect(self) -> Iterator["Metric"]:
        yield from self.agent_collector.collect()
        for c in list(self.extras):
            yield from c.collect()

    def _version(self, extras: list[Collector]) -> object:
        """What the body depends on, or None when some collector cannot say (no caching)."""
        parts = [self.agent_collector.version()]
        for c in extras:
            version = getattr(c, "version", None)
            parts.append(version() if version is not None else None)
        return None if None in parts else tuple(parts)

    def render(self) -> bytes:
        """The /metrics body. Many scrapers at once share one rendering: the body is reused while
        nothing it depends on changed (no sampler tick, NVML reading or webhook call since), and
        never longer than :data:`RENDER_REUSE_S`, so a staleness check always runs again soon."""
        extras = list(self.extras)
        with self._render_lock:
            version = self._version(extras)
            now = time.monotonic()
            cached = self._cached
            if (version is not None and cached is not None and cached[0] == version
                    and now - cached[1] < RENDER_REUSE_S):
                return cached[2]
            text = self.agent_collector.render_text()
            if extras:
                from prometheus_client import generate_latest

                text += generate_latest(_Collectors(extras)).decode("utf-8")
            body = text.encode("utf-8")
            self._cached = (version, now, body)
            return body


class _Collectors:
    def __init__(self, collectors: list):
        self.collectors = collectors

    def collect(self) -> Iterator[Metric]:
        for c in self.collectors:
            yield from c.collect()


def make_registry(collector: AgentCollector) -> AgentRegistry:
    return AgentRegistry(collector)
