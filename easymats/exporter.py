"""Prometheus /metrics: a collector that reads the agent's latest samples at scrape time.

Nothing is copied into prometheus_client metric objects on a timer: each scrape builds fresh
families from the targets' latest snapshots, so what Prometheus sees is exactly what the last
100 ms sample saw, plus the peaks over the trailing window that the samples in between caught.
Every name comes from the catalogue; a runtime series with a name the catalogue does not define
(or with the wrong type) is dropped with one warning.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry

from . import __version__, catalogue
from .nvml import NvmlSnapshot
from .segment import Histogram
from .targets import Target

log = logging.getLogger("easymats.exporter")


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


def _family(spec: catalogue.MetricSpec) -> Metric:
    if spec.type == catalogue.COUNTER:
        base = spec.name[:-len("_total")] if spec.name.endswith("_total") else spec.name
        typ = "counter"
    elif spec.type == catalogue.HISTOGRAM:
        base, typ = spec.name, "histogram"
    else:  # gauges and info metrics (a gauge whose value is 1, name kept as *_info)
        base, typ = spec.name, "gauge"
    unit = spec.unit if spec.unit and base.endswith("_" + spec.unit) else ""
    return Metric(base, spec.help, typ, unit)


def _add(fam: Metric, spec: catalogue.MetricSpec, labels: dict[str, str], value: float | Histogram) -> None:
    if spec.type == catalogue.COUNTER:
        fam.add_sample(spec.name, labels, float(value))  # type: ignore[arg-type]
    elif spec.type == catalogue.HISTOGRAM:
        assert isinstance(value, Histogram)
        for bound, cum in value.cumulative():
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            fam.add_sample(spec.name + "_bucket", {**labels, "le": le}, cum)
        fam.add_sample(spec.name + "_count", labels, value.count)
        fam.add_sample(spec.name + "_sum", labels, value.sum)
    else:
        fam.add_sample(spec.name, labels, float(value))  # type: ignore[arg-type]


class AgentCollector:
    """prometheus_client collector over the agent's targets, GPU readings and own health."""

    def __init__(self, targets: Callable[[], Iterable[Target]], lag: LagHistogram,
                 gpu: Callable[[], NvmlSnapshot | None], peak_window_s: float):
        self._targets = targets
        self._lag = lag
        self._gpu = gpu
        self._peak_window_s = peak_window_s
        self._warned: set[str] = set()
        self.last_render_s = 0.0

    def describe(self) -> list[Metric]:
        # Registering must not read anything: describe every name this collector can export.
        return [_family(spec) for spec in catalogue.CATALOGUE.values()
                if spec.source == catalogue.RUNTIME or spec.name not in _NOT_OURS]

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

    def collect(self) -> Iterator[Metric]:
        t0 = time.perf_counter()
        fams: dict[str, Metric] = {}

        def emit(name: str, labels: dict[str, str], value: float | Histogram) -> None:
            spec = catalogue.CATALOGUE[name]
            fam = fams.get(name)
            if fam is None:
                fam = fams[name] = _family(spec)
            _add(fam, spec, labels, value)

        emit("easymats_build_info", {"version": __version__}, 1.0)
        emit("easymats_sample_lag_seconds", {}, self._lag.snapshot())
        emit("easymats_peak_window_seconds", {}, self._peak_window_s)
        targets = list(self._targets())
        gpu = self._gpu()
        for tg in targets:
            tl = {"target": tg.name}
            emit("easymats_target_up", tl, 1.0 if tg.up else 0.0)
            emit("easymats_target_info", {"target": tg.name, "pid": str(tg.pid),
                                          "labels": ",".join(f"{k}={v}" for k, v in sorted(tg.labels.items()))}, 1.0)
            emit("easymats_samples_total", tl, float(tg.samples))
            emit("easymats_sample_errors_total", tl, float(tg.errors))
            emit("easymats_segment_read_retries_total", tl, float(tg.retries))
            snap = tg.snapshot
            if snap is not None:
                emit("easymats_target_heartbeat_timestamp_seconds", tl, snap.heartbeat_unix_ns / 1e9)
                for s in snap.series:
                    spec = catalogue.CATALOGUE.get(s.name)
                    if spec is None or spec.source != catalogue.RUNTIME:
                        self._warn_once(s.name, f"target {tg.name}: series {s.name} is not a runtime "
                                        "metric in the easymats catalogue; dropped from /metrics")
                        continue
                    if spec.type != s.type or "target" in s.labels:
                        self._warn_once(s.name, f"target {tg.name}: series {s.name} has type {s.type} "
                                        f"(catalogue: {spec.type}) or a 'target' label; dropped")
                        continue
                    emit(s.name, {**s.labels, **tl}, s.value)
            for name, value in tg.peaks.items():
                emit(name, tl, value)
            p = tg.process
            if p is not None:
                emit("easymats_process_cpu_seconds_total", tl, p.cpu_seconds)
                emit("easymats_process_resident_memory_bytes", tl, float(p.rss_bytes))
            if gpu is not None and not tg.gone:
                for g in gpu.for_pid(tg.pid):
                    gl = {"target": tg.name, "gpu": g.gpu}
                    if g.memory_bytes is not None:
                        emit("easymats_process_gpu_memory_bytes", gl, g.memory_bytes)
                    if g.utilization_ratio is not None:
                        emit("easymats_process_gpu_utilization_ratio", gl, g.utilization_ratio)
        if gpu is not None:
            for d in gpu.gpus:
                dl = {"gpu": d.index, "uuid": d.uuid}
                if d.utilization_ratio is not None:
                    emit("easymats_gpu_utilization_ratio", dl, d.utilization_ratio)
                if d.memory_used_bytes is not None:
                    emit("easymats_gpu_memory_used_bytes", dl, d.memory_used_bytes)
                if d.memory_total_bytes is not None:
                    emit("easymats_gpu_memory_total_bytes", dl, d.memory_total_bytes)
        self.last_render_s = time.perf_counter() - t0
        return iter(fams.values())


# Agent metrics that other parts of easymats own (the webhook registers its own collector).
_NOT_OURS = {"easymats_webhook_requests_total", "easymats_recalibration_requests_total"}


def make_registry(collector: AgentCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def serve(registry: CollectorRegistry, host: str, port: int):
    """Start the threaded /metrics server; returns (server, thread). OSError if it cannot bind."""
    from prometheus_client import start_http_server

    return start_http_server(port, addr=host, registry=registry)
