"""Runtime counters and their publication through an easymats telemetry segment.

The engine bumps plain fields of :class:`RuntimeStats` where each event happens (cheap Python
arithmetic; per-token counts arrive as device tensors and are summed on the device, then copied
back in one batch when published or read, never synchronising per kernel). :class:`Publisher`
mirrors them into the segment at most every ``interval_s``; without a segment it does nothing,
so telemetry off costs nothing beyond the counters tests read.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from easymats import catalogue, telemetry

DEVICE_COUNTERS = ("hot_buffer_lookups", "hot_buffer_hits", "prefetch_used", "kv_tokens_used",
                   "kv_tokens_loaded", "prefetch_issued", "swap_in_bytes")


def _hist(name: str) -> telemetry.Histogram:
    return telemetry.Histogram(catalogue.get(name).buckets)


@dataclass
class RuntimeStats:
    """Every runtime metric of the catalogue, as plain values (counters only go up)."""
    tokens_prefill: int = 0
    tokens_decode: int = 0
    sequences: int = 0
    context_tokens: int = 0
    anchor_lookups: int = 0
    anchor_hits: int = 0
    anchors: int = 0
    anchor_threshold: float = 0.0
    recalibrations: dict[str, int] = field(default_factory=lambda: {"schedule": 0, "request": 0, "drift": 0})
    blocks_active: int = 0
    blocks_free: int = 0
    blocks_pending: int = 0
    blocks_limit: int = 0  # host_pool_blocks; 0 for a pool that grows on demand (no limit)
    block_allocations: int = 0
    block_recycles: int = 0
    block_reclaims: int = 0
    block_evictions: int = 0
    kv_tokens_loaded: int = 0
    kv_tokens_used: int = 0
    hot_buffer_lookups: int = 0
    hot_buffer_hits: int = 0
    hot_buffer_resident: int = 0
    hot_buffer_capacity: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    swap_in_bytes: int = 0
    backup_bytes: int = 0
    memory: dict[tuple[str, str], int] = field(default_factory=dict)
    quant_blocks: dict[int, int] = field(default_factory=lambda: {4: 0, 5: 0, 6: 0, 8: 0})
    quant_error: telemetry.Histogram = field(
        default_factory=lambda: _hist("hisparse_quant_block_relative_error"))
    step_duration: telemetry.Histogram = field(
        default_factory=lambda: _hist("hisparse_step_duration_seconds"))


class DeviceCounters:
    """Per-step counts kept as one small device tensor; read back in a batch."""

    def __init__(self, device: torch.device) -> None:
        self.acc = torch.zeros(len(DEVICE_COUNTERS), dtype=torch.int64, device=device)

    def add(self, *values: torch.Tensor) -> None:
        """values in DEVICE_COUNTERS order (0-dim tensors or ints; the first len(values) counters)."""
        self.acc[:len(values)] += torch.stack([torch.as_tensor(v, device=self.acc.device).reshape(()) for v in values])

    def flush_into(self, stats: RuntimeStats) -> None:
        vals = self.acc.tolist()
        self.acc.zero_()
        for name, v in zip(DEVICE_COUNTERS, vals):
            setattr(stats, name, getattr(stats, name) + int(v))


def device_sum(counts: list[torch.Tensor]) -> int:
    """Sum of 0-dim counts that may live on several devices: one host read per device."""
    by_dev: dict[torch.device, list[torch.Tensor]] = {}
    for c in counts:
        by_dev.setdefault(c.device, []).append(c)
    return sum(int(torch.stack(cs).sum()) for cs in by_dev.values())


_COUNTERS = (  # (catalogue name, labels, stats field)
    ("hisparse_anchor_lookups_total", {}, "anchor_lookups"),
    ("hisparse_anchor_hits_total", {}, "anchor_hits"),
    ("hisparse_kv_block_allocations_total", {}, "block_allocations"),
    ("hisparse_kv_block_recycles_total", {}, "block_recycles"),
    ("hisparse_kv_block_reclaims_total", {}, "block_reclaims"),
    ("hisparse_kv_block_evictions_total", {}, "block_evictions"),
    ("hisparse_kv_tokens_loaded_total", {}, "kv_tokens_loaded"),
    ("hisparse_kv_tokens_used_total", {}, "kv_tokens_used"),
    ("hisparse_hot_buffer_lookups_total", {}, "hot_buffer_lookups"),
    ("hisparse_hot_buffer_hits_total", {}, "hot_buffer_hits"),
    ("hisparse_prefetch_issued_total", {}, "prefetch_issued"),
    ("hisparse_prefetch_used_total", {}, "prefetch_used"),
    ("hisparse_swap_in_bytes_total", {}, "swap_in_bytes"),
    ("hisparse_backup_bytes_total", {}, "backup_bytes"),
    ("hisparse_tokens_total", {"phase": "prefill"}, "tokens_prefill"),
    ("hisparse_tokens_total", {"phase": "decode"}, "tokens_decode"),
)
_GAUGES = (
    ("hisparse_sequences", {}, "sequences"),
    ("hisparse_context_tokens", {}, "context_tokens"),
    ("hisparse_anchors", {}, "anchors"),
    ("hisparse_anchor_threshold_ratio", {}, "anchor_threshold"),
    ("hisparse_kv_blocks", {"state": "active"}, "blocks_active"),
    ("hisparse_kv_blocks", {"state": "free"}, "blocks_free"),
    ("hisparse_kv_blocks", {"state": "pending_recycle"}, "blocks_pending"),
    ("hisparse_kv_blocks_limit", {}, "blocks_limit"),
    ("hisparse_hot_buffer_resident_tokens", {}, "hot_buffer_resident"),
    ("hisparse_hot_buffer_capacity_tokens", {}, "hot_buffer_capacity"),
)


class Publisher:
    """Mirrors RuntimeStats into a telemetry segment, rate-limited."""

    def __init__(self, segment: telemetry.Segment | None, interval_s: float, runtime_labels: dict[str, str],
                 config_labels: dict[str, str]) -> None:
        self.seg = segment
        self.interval_s = interval_s
        self.paused = False        # True: nothing is published until unpaused (the segment stays)
        self._next = 0.0
        self._bound: list = []
        if segment is None:
            return
        segment.info("hisparse_runtime_info", **runtime_labels)
        segment.info("hisparse_config_info", **config_labels)
        for name, labels, attr in _COUNTERS:
            self._bound.append(("c", segment.counter(name, **labels), attr, None))
        for name, labels, attr in _GAUGES:
            self._bound.append(("g", segment.gauge(name, **labels), attr, None))
        for reason in ("schedule", "request", "drift"):
            self._bound.append(("c", segment.counter("hisparse_recalibrations_total", reason=reason),
                                "recalibrations", reason))
        for bits in (4, 5, 6, 8):
            self._bound.append(("c", segment.counter("hisparse_quant_blocks_total", bits=str(bits)),
                                "quant_blocks", bits))
        for tier in ("device", "host"):
            for kind in ("data", "metadata"):
                self._bound.append(("g", segment.gauge("hisparse_kv_memory_bytes", tier=tier, kind=kind),
                                    "memory", (tier, kind)))
        self._qerr = segment.histogram("hisparse_quant_block_relative_error")
        self._step = segment.histogram("hisparse_step_duration_seconds")

    @property
    def enabled(self) -> bool:
        return self.seg is not None

    def due(self, force: bool = False) -> bool:
        if self.seg is None or (self.paused and not force):
            return False
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.interval_s
        return True

    def publish(self, stats: RuntimeStats) -> None:
        """Copy every value into the segment and publish one snapshot (call when :meth:`due`)."""
        if self.seg is None:
            return
        for kind, metric, attr, key in self._bound:
            value = getattr(stats, attr)
            if key is not None:
                value = value.get(key, 0)
            if kind == "c":
                if value > metric.value:
                    metric.inc(value - metric.value)
            else:
                metric.set(value)
        for dst, src in ((self._qerr, stats.quant_error), (self._step, stats.step_duration)):
            dst.counts[:] = src.counts
            dst.sum = src.sum
        self.seg.publish()

    def poll_control(self):
        return None if self.seg is None else self.seg.poll_control(min_interval_s=0.05)

    def ack(self, request, status: int = 0) -> None:
        if self.seg is not None:
            self.seg.ack(request, status)

    def close(self, owned: bool) -> None:
        if self.seg is not None and owned:
            self.seg.close()
        self.seg = None
