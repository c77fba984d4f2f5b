"""Runtime metrics: one live metric object per catalogue series, bound once, counted into directly.

:class:`RuntimeMetrics` binds every runtime series of the catalogue (easymats/catalogue.py) when the
engine starts: to the segment's own metric objects when the engine publishes (publishing copies
them into shared memory), to standalone ones otherwise. The runtime counts into them where events
happen. Per-token counts of the decode step are summed on the device (:class:`DeviceCounters`)
and read back in one batch when the metrics are published or read, never per kernel.

Gauges are set when the metrics are published or read (:class:`Gauges`): the cheap ones every
time, the ones that cost a device reduction per layer or a walk over every tensor (anchors,
hot-buffer residency, memory) at most every ``gauge_interval_s``. ``engine.stats`` is a
:meth:`RuntimeMetrics.snapshot`: plain values for tests and benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product
from typing import TYPE_CHECKING, Any

import torch

from easymats import catalogue, telemetry

from .probe import probe_threshold

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .config import HiSparseConfig
    from .host_pool import HostPool
    from .layers import KVShape, LayerRows
    from .page_table import PageTable
    from .sequences import SequenceTable

# The decode step's per-token counts, in the order DeviceCounters.add takes them.
DEVICE_COUNTERS = ("hot_buffer_lookups", "hot_buffer_hits", "prefetch_used", "kv_tokens_used",
                   "kv_tokens_loaded", "prefetch_issued", "swap_in_bytes")

# stats field -> (catalogue name, labels): the series without a label to enumerate
SCALARS: dict[str, tuple[str, dict[str, str]]] = {
    "tokens_prefill": ("hisparse_tokens_total", {"phase": "prefill"}),
    "tokens_decode": ("hisparse_tokens_total", {"phase": "decode"}),
    "sequences": ("hisparse_sequences", {}),
    "context_tokens": ("hisparse_context_tokens", {}),
    "anchor_lookups": ("hisparse_anchor_lookups_total", {}),
    "anchor_hits": ("hisparse_anchor_hits_total", {}),
    "anchors": ("hisparse_anchors", {}),
    "anchor_threshold": ("hisparse_anchor_threshold_ratio", {}),
    "blocks_active": ("hisparse_kv_blocks", {"state": "active"}),
    "blocks_free": ("hisparse_kv_blocks", {"state": "free"}),
    "blocks_pending": ("hisparse_kv_blocks", {"state": "pending_recycle"}),
    "blocks_limit": ("hisparse_kv_blocks_limit", {}),   # host_pool_blocks; 0: the pool grows on demand
    "block_allocations": ("hisparse_kv_block_allocations_total", {}),
    "block_recycles": ("hisparse_kv_block_recycles_total", {}),
    "block_reclaims": ("hisparse_kv_block_reclaims_total", {}),
    "block_evictions": ("hisparse_kv_block_evictions_total", {}),
    "kv_tokens_loaded": ("hisparse_kv_tokens_loaded_total", {}),
    "kv_tokens_used": ("hisparse_kv_tokens_used_total", {}),
    "hot_buffer_lookups": ("hisparse_hot_buffer_lookups_total", {}),
    "hot_buffer_hits": ("hisparse_hot_buffer_hits_total", {}),
    "hot_buffer_resident": ("hisparse_hot_buffer_resident_tokens", {}),
    "hot_buffer_capacity": ("hisparse_hot_buffer_capacity_tokens", {}),
    "prefetch_issued": ("hisparse_prefetch_issued_total", {}),
    "prefetch_used": ("hisparse_prefetch_used_total", {}),
    "swap_in_bytes": ("hisparse_swap_in_bytes_total", {}),
    "backup_bytes": ("hisparse_backup_bytes_total", {}),
}
# stats field -> catalogue name: one series per combination of its allowed label values
BY_LABEL = {"recalibrations": "hisparse_recalibrations_total", "quant_blocks": "hisparse_quant_blocks_total",
            "memory": "hisparse_kv_memory_bytes"}
HISTOGRAMS = {"quant_error": "hisparse_quant_block_relative_error", "step_duration": "hisparse_step_duration_seconds"}


def _check_coverage() -> None:
    """Every runtime series of the catalogue has a field here (a new one must be counted)."""
    bound = {name for name, _ in SCALARS.values()} | set(BY_LABEL.values()) | set(HISTOGRAMS.values())
    missing = {m.name for m in catalogue.runtime_metrics() if m.type != catalogue.INFO} - bound
    if missing:
        raise RuntimeError(f"bug: runtime metrics {sorted(missing)} are in the catalogue but not bound in "
                           "hi_sparse.metrics")


_check_coverage()


def _key(value: str) -> Any:
    """A label value as the stats dicts key it: bit widths as ints, the rest as strings."""
    return int(value) if value.isdigit() else value


def _keys(labels: dict[str, str]) -> Any:
    values = tuple(_key(v) for v in labels.values())
    return values[0] if len(values) == 1 else values


class RuntimeMetrics:
    """Every runtime series as a live metric object: ``metrics.backup_bytes.inc(n)``,
    ``metrics.recalibrations["drift"]``, ``metrics.quant_blocks[4]``,
    ``metrics.memory[("device", "data")]``, ``metrics.step_duration.observe(s)``."""

    def __init__(self, segment: telemetry.Segment | None, detail_layers: int = 0) -> None:
        """detail_layers: also bind the opt-in per-layer audit series (HiSparseConfig.layer_metrics)
        for that many layers; 0 keeps the default series budget (docs/scaling.md)."""
        self.segment = segment
        self.audit_lookups = [self._bind("hisparse_audit_lookups_total", {"layer": str(i)})
                              for i in range(detail_layers)]
        self.audit_hits = [self._bind("hisparse_audit_hits_total", {"layer": str(i)})
                           for i in range(detail_layers)]
        for name, (metric, labels) in SCALARS.items():
            setattr(self, name, self._bind(metric, labels))
        for name, metric in BY_LABEL.items():
            spec = catalogue.get(metric)
            combos = product(*(spec.label_values[label] for label in spec.labels))
            setattr(self, name, {_keys(dict(zip(spec.labels, c))): self._bind(metric, dict(zip(spec.labels, c)))
                                 for c in combos})
        for name, metric in HISTOGRAMS.items():
            setattr(self, name, self._bind(metric, {}))

    def _bind(self, name: str, labels: dict[str, str]):
        spec = catalogue.get(name)
        if self.segment is not None:
            return getattr(self.segment, spec.type)(name, **labels)
        catalogue.check_labels(spec, labels)
        if spec.type == catalogue.HISTOGRAM:
            return telemetry.Histogram(spec.buckets)
        return telemetry.Counter() if spec.type == catalogue.COUNTER else telemetry.Gauge()

    def info(self, runtime_labels: dict[str, str], config_labels: dict[str, str]) -> None:
        if self.segment is not None:
            self.segment.info("hisparse_runtime_info", **runtime_labels)
            self.segment.info("hisparse_config_info", **config_labels)

    def snapshot(self) -> Stats:
        """Plain values of every series now (counters and counts as ints; the threshold and the
        audited hits, a sum of attention shares, as floats)."""
        out = Stats()
        for name in SCALARS:
            value = getattr(self, name).value
            setattr(out, name, value if name in ("anchor_threshold", "anchor_hits") else int(value))
        for name in BY_LABEL:
            setattr(out, name, {k: int(m.value) for k, m in getattr(self, name).items()})
        for name in HISTOGRAMS:
            h = getattr(self, name)
            copy = telemetry.Histogram(h.bounds)
            copy.counts, copy.sum = list(h.counts), h.sum
            setattr(out, name, copy)
        return out


@dataclass
class Stats:
    """A snapshot of the runtime's metrics (:meth:`RuntimeMetrics.snapshot`); fields as in
    SCALARS, BY_LABEL and HISTOGRAMS."""
    recalibrations: dict[str, int] = field(default_factory=dict)
    quant_blocks: dict[int, int] = field(default_factory=dict)
    memory: dict[tuple[str, str], int] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:      # the SCALARS and HISTOGRAMS fields, set by snapshot
        raise AttributeError(f"no runtime metric field {name!r}: see hi_sparse.metrics.SCALARS")


class ReadBack:
    """Values of a device tensor read back without stalling the device: on CUDA the copy goes
    into pinned host memory in stream order, and :meth:`take` hands the values over once it has
    landed (a step later, typically), so publishing never waits for the GPU; on the CPU it is a
    plain read. ``take(wait=True)`` waits (exact reads: ``engine.stats``, the last publish)."""

    def __init__(self, device: torch.device, n: int, dtype: torch.dtype = torch.int64) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(n, dtype=dtype, pin_memory=self.cuda)
        self.event: Any = None
        self.values: list | None = None         # landed, not yet taken (the CPU path)

    @property
    def pending(self) -> bool:
        return self.event is not None or self.values is not None

    def ready(self) -> bool:
        """A started read has landed (take would not wait)."""
        return self.values is not None or (self.event is not None and bool(self.event.query()))

    def start(self, values: torch.Tensor) -> None:
        """Start reading ``values`` (n,) back; the caller may change it right after (stream order)."""
        if not self.cuda:
            self.values = values.tolist()
            return
        with torch.cuda.device(self.device):
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def take(self, wait: bool) -> list | None:
        """The values of the last :meth:`start` once landed (None while in flight and not
        ``wait``, or when nothing was started); each start's values are taken once."""
        if self.values is not None:
            vals, self.values = self.values, None
            return vals
        if self.event is None or (not wait and not self.event.query()):
            return None
        self.event.synchronize()
        self.event = None
        return self.host.tolist()


class DeviceCounters:
    """Per-step counts kept as one small device tensor; read back in a batch, on a GPU without
    waiting for it (:class:`ReadBack`): counts of a read still in flight are added at a later
    flush, and counts made meanwhile wait in the tensor, so nothing is lost or counted twice."""

    def __init__(self, device: torch.device) -> None:
        self.acc = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64, device=device)
        self._read = ReadBack(self.acc.device, len(DEVICE_COUNTERS))

    def add(self, *values: torch.Tensor) -> None:
        """values in DEVICE_COUNTERS order (0-dim tensors or ints; the first len(values) counters)."""
        self.acc[:len(values)].add_(torch.stack([torch.as_tensor(v, device=self.acc.device).reshape(())
                                                 for v in values]))

    def flush_into(self, metrics: RuntimeMetrics, wait: bool = True) -> None:
        """Add the counts to the metrics and start again from zero. ``wait=False`` (a GPU, a
        periodic publish): add those of the previous read if it has landed and start the next
        one, never waiting for the device; ``wait=True``: every count made so far, exactly."""
        if self._read.pending:
            landed = self._read.take(wait)
            if landed is None:
                return                  # still in flight: the next flush takes it
            self._count(metrics, landed)
        self._read.start(self.acc)
        self.acc.zero_()                # after the copy, in stream order
        if wait or not self._read.cuda:
            self._count(metrics, self._read.take(True) or [])

    @staticmethod
    def _count(metrics: RuntimeMetrics, values: list) -> None:
        for name, v in zip(DEVICE_COUNTERS, values):
            if v:
                getattr(metrics, name).inc(v)


class Gauges:
    """Sets the gauges (and flushes the device counters) from the engine's parts."""

    def __init__(self, metrics: RuntimeMetrics, cfg: HiSparseConfig, shape: KVShape, layers: list[LayerRows],
                 pool: BlockPool, pages: PageTable, host: HostPool, sequences: SequenceTable,
                 meta_device: torch.device) -> None:
        self.metrics, self.cfg, self.shape, self.layers = metrics, cfg, shape, layers
        self.pool, self.pages, self.host, self.sequences, self.meta_device = pool, pages, host, sequences, meta_device
        self.refreshed_at = float("-inf")
        self._residency: dict[torch.device, ReadBack] = {}

    def refresh(self, costly: bool = True, wait: bool = True) -> None:
        """Device counts and the cheap gauges; with ``costly`` also anchors and hot-buffer
        residency (a reduction per layer, read back per device) and memory by tier (a walk
        over every layer's tensors: ~1 ms of Python at 32 layers, more than the rest of a publish).
        ``wait=False`` (a periodic publish) never waits for a GPU: what it reads back lands in
        the metrics at a later refresh, a step later, typically."""
        m = self.metrics
        for counters in dict.fromkeys(layer.counters for layer in self.layers):
            counters.flush_into(m, wait)
        live = self.sequences.live.values()
        m.sequences.set(len(live))
        m.context_tokens.set(sum(s.length for s in live))
        ctx = max((s.length for s in live), default=0)
        m.anchor_threshold.set(probe_threshold(ctx, self.cfg.threshold_base, self.cfg.threshold_min,
                                               self.cfg.threshold_max))
        m.blocks_active.set(self.pool.num_active)
        m.blocks_free.set(self.pool.num_free)
        m.blocks_pending.set(self.pool.num_pending)
        # The limit, not the current size: a pool that grows on demand has none, so "free blocks"
        # of it say nothing about exhaustion (alerts and the report judge against this).
        m.blocks_limit.set(self.cfg.host_pool_blocks or 0)
        m.hot_buffer_capacity.set(len(live) * self.shape.num_layers * self.shape.num_kv_heads * self.shape.slots)
        self._take_residency(wait)
        if costly:
            self._start_residency()
            self._take_residency(wait)
            for key, value in self.memory_bytes().items():
                m.memory[key].set(value)
            self.refreshed_at = time.monotonic()

    def _start_residency(self) -> None:
        """Start reading back the anchors pinned and the hot-buffer slots held, one (2,) sum per
        device (whole banks: freed rows are reset, so they count only live sequences)."""
        if any(r.pending for r in self._residency.values()):
            return                      # the last one is still in flight
        by_dev: dict[torch.device, list[torch.Tensor]] = {}
        for layer in self.layers:
            anchors = (layer.bank.t["anchors"] >= 0).sum()
            by_dev.setdefault(anchors.device, []).append(
                torch.stack([anchors, (layer.hot.slot_token >= 0).sum().to(anchors.device)]))
        for dev, sums in by_dev.items():
            if dev not in self._residency:
                self._residency[dev] = ReadBack(dev, 2)
            self._residency[dev].start(torch.stack(sums).sum(0))

    def _take_residency(self, wait: bool) -> None:
        reads = [r for r in self._residency.values() if r.pending]
        if not reads or (not wait and not all(r.ready() for r in reads)):
            return
        landed = [r.take(True) or [0, 0] for r in reads]
        self.metrics.anchors.set(sum(v[0] for v in landed))
        self.metrics.hot_buffer_resident.set(sum(v[1] for v in landed))

    def memory_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes held by tier ('device'/'host') and kind ('data'/'metadata')."""
        dev_data = dev_meta = 0
        for layer in self.layers:
            data, meta = layer.memory_bytes()
            dev_data, dev_meta = dev_data + data, dev_meta + meta
        tables = sum(8 * len(self.pages.seqs[seq_id].blocks) for seq_id in self.sequences.live)
        host_data, host_meta = self.host.bytes()
        if self.meta_device.type == "cpu":
            host_meta += tables
        else:
            dev_meta += tables
        return {("device", "data"): dev_data, ("device", "metadata"): dev_meta,
                ("host", "data"): host_data, ("host", "metadata"): host_meta}


class Publisher:
    """Publishes the metrics into the segment at most every ``interval_s`` (0: at every call; a
    public knob: ``math.inf`` stops publishing, the segment keeping its last snapshot), with the
    costly gauges refreshed at most every ``gauge_interval_s``. Without a segment it does nothing."""

    def __init__(self, metrics: RuntimeMetrics, gauges: Gauges, interval_s: float, gauge_interval_s: float) -> None:
        self.metrics, self.gauges = metrics, gauges
        self.interval_s, self.gauge_interval_s = interval_s, gauge_interval_s
        self._last = float("-inf")

    def maybe_publish(self, force: bool = False, now: Callable[[], float] = time.monotonic,
                      settle: bool = False) -> None:
        """Publish unless the last publish was under ``interval_s`` ago. A periodic publish never
        waits for a GPU (counts still in flight land at the next one); ``settle`` (a request's end,
        after which the engine may idle) publishes now with every count made so far; ``force``
        too, with the costly gauges refreshed."""
        if self.metrics.segment is None:
            return
        t = now()
        if not (force or settle) and t - self._last < self.interval_s:
            return
        self._last = t
        self.gauges.refresh(costly=force or t - self.gauges.refreshed_at >= self.gauge_interval_s,
                            wait=force or settle)
        self.metrics.segment.publish()

    def close(self, owned: bool) -> None:
        """Publish a last snapshot and, if the engine opened the segment, remove it."""
        seg = self.metrics.segment
        if seg is None:
            return
        self.maybe_publish(force=True)
        if owned:
            seg.close()
        self.metrics.segment = None
