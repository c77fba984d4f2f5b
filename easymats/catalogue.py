"""The metric catalogue: every metric the project exports, in one place.

The runtime writes these names into its telemetry segment, the agent exports them on /metrics,
and the dashboards and alert rules are checked against them. A name that is not here is an error
wherever it is used.

Conventions (https://prometheus.io/docs/practices/naming/): base units, ``_total`` only on
counters, ``_ratio`` for 0..1 gauges, ``_bytes`` and ``_seconds`` for sizes and durations, no label
names inside metric names, and only bounded labels (never a pid or a sequence id).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

COUNTER = "counter"
GAUGE = "gauge"
HISTOGRAM = "histogram"
INFO = "info"  # a gauge whose value is always 1 and whose labels carry the information
TYPES = (COUNTER, GAUGE, HISTOGRAM, INFO)

RUNTIME = "runtime"  # written by a runtime into its segment
AGENT = "agent"  # produced by the easymats agent itself


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    type: str
    unit: str  # "" for dimensionless counts; otherwise a base unit: seconds, bytes, ratio
    help: str
    labels: tuple[str, ...] = ()
    # For bounded labels, the values that are allowed; labels not listed here accept any value.
    label_values: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    buckets: tuple[float, ...] = ()  # upper bounds of a histogram, ascending, without +Inf
    source: str = RUNTIME
    # Detail metrics scale with the model (one series per layer): a runtime publishes them only
    # when asked (HiSparseConfig.layer_metrics); the default catalogue and its series budget
    # (easymats/cardinality.py) leave them out.
    detail: bool = False


def _m(name: str, type_: str, help_: str, unit: str = "", labels: Iterable[str] = (),
       label_values: Mapping[str, tuple[str, ...]] | None = None,
       buckets: tuple[float, ...] = (), source: str = RUNTIME, detail: bool = False) -> MetricSpec:
    return MetricSpec(name=name, type=type_, unit=unit, help=help_, labels=tuple(labels),
                      label_values=dict(label_values or {}), buckets=buckets, source=source,
                      detail=detail)


QUANT_ERROR_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
STEP_DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                         0.1, 0.25, 0.5, 1.0, 2.5)
SAMPLE_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)

QUANT_BITS = ("4", "5", "6", "8")                      # widths a host KV block may be quantized at
RECALIBRATION_REASONS = ("schedule", "request", "drift")  # why the runtime recalibrated

_RUNTIME_METRICS = (
    _m("hisparse_tokens_total", COUNTER, "Tokens processed by the runtime, by phase.",
       labels=("phase",), label_values={"phase": ("prefill", "decode")}),
    _m("hisparse_sequences", GAUGE, "Live sequences held by the KV cache."),
    _m("hisparse_context_tokens", GAUGE, "Tokens held in the KV cache over all live sequences."),
    _m("hisparse_anchor_lookups_total", COUNTER,
       "Audited queries (exact attention of a sampled layer and head); with audit_measure=top_m, "
       "their true top-m tokens."),
    _m("hisparse_anchor_hits_total", COUNTER,
       "Share of each audited query's exact attention that fell on tokens the selection held, "
       "summed (with audit_measure=top_m: the true top-m tokens it held); anchor hit rate = "
       "hits / lookups."),
    _m("hisparse_anchors", GAUGE, "Anchor tokens pinned by the importance probe."),
    _m("hisparse_anchor_threshold_ratio", GAUGE,
       "Current importance-probe threshold (probability, 0..1).", unit="ratio"),
    _m("hisparse_recalibrations_total", COUNTER, "Recalibrations of anchors and probe, by reason.",
       labels=("reason",), label_values={"reason": RECALIBRATION_REASONS}),
    _m("hisparse_kv_blocks", GAUGE, "KV blocks in the host pool, by state (seed: kv_cache_active_blocks).",
       labels=("state",), label_values={"state": ("active", "free", "pending_recycle")}),
    _m("hisparse_kv_blocks_limit", GAUGE,
       "Most KV blocks the host pool may hold (host_pool_blocks); 0 when the pool grows on demand "
       "without a configured limit."),
    _m("hisparse_kv_block_allocations_total", COUNTER, "KV blocks taken from the free pool."),
    _m("hisparse_kv_block_recycles_total", COUNTER,
       "KV blocks returned to the free pool after their recycle grace period."),
    _m("hisparse_kv_block_reclaims_total", COUNTER,
       "KV blocks reclaimed from pending recycle within their grace period."),
    _m("hisparse_kv_block_evictions_total", COUNTER,
       "KV blocks overwritten by streaming mode when the bounded host pool was full."),
    _m("hisparse_kv_tokens_loaded_total", COUNTER,
       "Tokens in the blocks that selection touched (denominator of block density)."),
    _m("hisparse_kv_tokens_used_total", COUNTER, "Tokens selected for attention (numerator of block density)."),
    _m("hisparse_hot_buffer_lookups_total", COUNTER, "Selected tokens looked up in the device hot buffer."),
    _m("hisparse_hot_buffer_hits_total", COUNTER, "Selected tokens found resident in the device hot buffer."),
    _m("hisparse_hot_buffer_resident_tokens", GAUGE, "Token slots of the hot buffers that hold a token."),
    _m("hisparse_hot_buffer_capacity_tokens", GAUGE, "Token slots of the hot buffers in all."),
    _m("hisparse_prefetch_issued_total", COUNTER, "Tokens loaded into the hot buffer ahead of need."),
    _m("hisparse_prefetch_used_total", COUNTER, "Prefetched tokens that a selection hit before eviction."),
    _m("hisparse_swap_in_bytes_total", COUNTER, "Bytes copied host to device into the hot buffer.",
       unit="bytes"),
    _m("hisparse_backup_bytes_total", COUNTER, "Bytes of new KV backed up device to host.", unit="bytes"),
    _m("hisparse_kv_memory_bytes", GAUGE, "KV cache memory by tier and kind.", unit="bytes",
       labels=("tier", "kind"),
       label_values={"tier": ("device", "host"), "kind": ("data", "metadata")}),
    _m("hisparse_quant_blocks_total", COUNTER, "Host KV blocks quantized, by bit width.",
       labels=("bits",), label_values={"bits": QUANT_BITS}),
    _m("hisparse_quant_block_relative_error", HISTOGRAM,
       "Relative error ||x - q(x)|| / ||x|| of each quantized block.", buckets=QUANT_ERROR_BUCKETS),
    _m("hisparse_step_duration_seconds", HISTOGRAM, "Decode step latency inside the runtime.",
       unit="seconds", buckets=STEP_DURATION_BUCKETS),
    _m("hisparse_audit_lookups_total", COUNTER,
       "hisparse_anchor_lookups_total by layer (detail: only with layer_metrics=True).",
       labels=("layer",), detail=True),
    _m("hisparse_audit_hits_total", COUNTER,
       "hisparse_anchor_hits_total by layer (detail: only with layer_metrics=True).",
       labels=("layer",), detail=True),
    _m("hisparse_runtime_info", INFO, "Runtime version, model and compute device.",
       labels=("version", "model", "device")),
    _m("hisparse_config_info", INFO, "HiSparse configuration.",
       labels=("window_size", "global_tokens", "block_size", "top_k", "device_buffer_tokens",
               "host_kv_bits")),
)

_AGENT_METRICS = (
    _m("easymats_target_up", GAUGE, "1 when the target's segment was read at the last sample.",
       labels=("target",), source=AGENT),
    _m("easymats_target_info", INFO, "Target identity: declared name, pid and segment labels.",
       labels=("target", "pid", "labels"), source=AGENT),
    _m("easymats_target_heartbeat_timestamp_seconds", GAUGE,
       "Unix time of the target's last publish.", unit="seconds", labels=("target",), source=AGENT),
    _m("easymats_samples_total", COUNTER, "Samples taken of a target.", labels=("target",), source=AGENT),
    _m("easymats_sample_errors_total", COUNTER, "Samples of a target that failed to read.",
       labels=("target",), source=AGENT),
    _m("easymats_segment_read_retries_total", COUNTER,
       "Segment reads retried because a publish was in progress.", labels=("target",), source=AGENT),
    _m("easymats_target_sample_seconds_total", COUNTER,
       "Time the sampler spent reading a target's source, all samples together.", unit="seconds",
       labels=("target",), source=AGENT),
    _m("easymats_target_over_budget", GAUGE,
       "1 while a target's segment holds more series, or its live values span more bytes, than one "
       "target may cost per sample (4096 series, 1 MiB); it is then not sampled (up 0).",
       labels=("target",), source=AGENT),
    _m("easymats_sample_lag_seconds", HISTOGRAM,
       "How late each sampling tick ran against its schedule.", unit="seconds",
       buckets=SAMPLE_LAG_BUCKETS, source=AGENT),
    _m("easymats_peak_window_seconds", GAUGE,
       "Width of the trailing window over which the *_max gauges take their maximum.",
       unit="seconds", source=AGENT),
    _m("easymats_kv_active_blocks_max", GAUGE,
       "Maximum of hisparse_kv_blocks{state=\"active\"} over the trailing peak window, from every sample.",
       labels=("target",), source=AGENT),
    _m("easymats_hot_buffer_resident_tokens_max", GAUGE,
       "Maximum of hisparse_hot_buffer_resident_tokens over the trailing peak window.",
       labels=("target",), source=AGENT),
    _m("easymats_device_kv_bytes_max", GAUGE,
       "Maximum of device-tier KV bytes (data + metadata) over the trailing peak window.",
       unit="bytes", labels=("target",), source=AGENT),
    _m("easymats_process_cpu_seconds_total", COUNTER, "CPU time of the target process.",
       unit="seconds", labels=("target",), source=AGENT),
    _m("easymats_process_resident_memory_bytes", GAUGE, "Resident memory of the target process.",
       unit="bytes", labels=("target",), source=AGENT),
    _m("easymats_gpu_utilization_ratio", GAUGE, "GPU utilization (NVML), 0..1.", unit="ratio",
       labels=("gpu", "uuid"), source=AGENT),
    _m("easymats_gpu_memory_used_bytes", GAUGE, "GPU memory in use (NVML).", unit="bytes",
       labels=("gpu", "uuid"), source=AGENT),
    _m("easymats_gpu_memory_total_bytes", GAUGE, "GPU memory in all (NVML).", unit="bytes",
       labels=("gpu", "uuid"), source=AGENT),
    _m("easymats_process_gpu_memory_bytes", GAUGE, "GPU memory used by the target process (NVML).",
       unit="bytes", labels=("target", "gpu"), source=AGENT),
    _m("easymats_process_gpu_utilization_ratio", GAUGE, "SM utilization of the target process (NVML), 0..1.",
       unit="ratio", labels=("target", "gpu"), source=AGENT),
    _m("easymats_webhook_requests_total", COUNTER, "Webhook requests received, by HTTP status code.",
       labels=("code",), source=AGENT),
    _m("easymats_recalibration_requests_total", COUNTER,
       "Recalibration requests written to a target's control file.", labels=("target",), source=AGENT),
    _m("easymats_webhook_write_failures_total", COUNTER,
       "Recalibration requests the webhook could not write into a target's control file (answered "
       "503, so Alertmanager retries).", labels=("target",), source=AGENT),
    _m("easymats_build_info", INFO, "easymats version.", labels=("version",), source=AGENT),
    # Engine targets (vLLM, SGLang; easymats/sources): what the target is, and what it cannot give.
    _m("easymats_target_source_info", INFO,
       "What a target is read from: engine, naming revision, how (via: scrape, pid, log) and its "
       "control channel (none: recalibration alerts page instead of calling the webhook).",
       labels=("target", "engine", "revision", "via", "control"), source=AGENT),
    _m("easymats_target_not_provided_info", INFO,
       "A runtime catalogue metric the target's engine cannot provide (docs/engines.md).",
       labels=("target", "engine", "metric"), source=AGENT),
    _m("easymats_log_failing", GAUGE,
       "1 while the agent cannot write its log (--output): full disk, file size limit, I/O error. "
       "Sampling and /metrics go on; the lines are dropped and the log is retried every few seconds.",
       source=AGENT),
    _m("easymats_log_dropped_lines_total", COUNTER,
       "Log lines the agent could not write because the log was failing.", source=AGENT),
)

CATALOGUE: dict[str, MetricSpec] = {m.name: m for m in _RUNTIME_METRICS + _AGENT_METRICS}

# Per-target agent series that only engine targets (vLLM, SGLang: easymats/sources) have; a native
# HiSparse target never exports them (series counts per runtime target leave them out).
ENGINE_TARGET_ONLY = frozenset({"easymats_target_source_info", "easymats_target_not_provided_info"})


@dataclass(frozen=True, slots=True)
class Ratio:
    """A health ratio the runtime's counters define (never exported as a gauge: computed where it is
    shown, from the counters, like a recording rule). ``numerator`` is a counter; the ratio is the
    increase of the numerator over the increase of the ``denominator`` counter within a window, or,
    with ``per_gauge``, the numerator's rate per second over the denominator gauge's current value
    (labels ``denominator_labels``)."""
    key: str
    title: str
    numerator: str
    denominator: str
    record: str                     # the Prometheus recording rule that computes it (alerts/)
    per_gauge: bool = False
    denominator_labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def unit(self) -> str:
        return "per_s" if self.per_gauge else "ratio"

    def of(self, numerator: float, denominator: float) -> float | None:
        """The ratio of two increases (or of a rate and a gauge), None where it is undefined."""
        return numerator / denominator if denominator > 0 else None


# Every ratio, in display order; the runtime, the agent, the report, the dashboards and the alert
# rules all take them from here.
RATIOS = (
    Ratio("anchor_hit_rate", "Anchor hit rate", "hisparse_anchor_hits_total", "hisparse_anchor_lookups_total",
          "target:hisparse_anchor_hits_per_lookups:ratio_rate5m"),
    Ratio("prefetch_efficiency", "Prefetch efficiency", "hisparse_prefetch_used_total",
          "hisparse_prefetch_issued_total", "target:hisparse_prefetch_used_per_issued:ratio_rate5m"),
    Ratio("hot_buffer_hit_rate", "Hot buffer hit rate", "hisparse_hot_buffer_hits_total",
          "hisparse_hot_buffer_lookups_total", "target:hisparse_hot_buffer_hits_per_lookups:ratio_rate5m"),
    Ratio("block_density", "Block density", "hisparse_kv_tokens_used_total", "hisparse_kv_tokens_loaded_total",
          "target:hisparse_kv_tokens_used_per_loaded:ratio_rate5m"),
    Ratio("block_recycle_rate", "Block recycle rate", "hisparse_kv_block_recycles_total", "hisparse_kv_blocks",
          "target:hisparse_kv_block_recycles_per_active_block:ratio_rate5m", per_gauge=True,
          denominator_labels={"state": "active"}),
)
RATIO = {r.key: r for r in RATIOS}


class UnknownMetricError(KeyError):
    """A metric name or label set that the catalogue does not define."""

    def __str__(self) -> str:  # KeyError quotes its message; this one reads as a sentence
        return str(self.args[0]) if self.args else ""


def get(name: str) -> MetricSpec:
    """The spec for ``name``; raises UnknownMetricError naming the closest defined names."""
    try:
        return CATALOGUE[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, CATALOGUE, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise UnknownMetricError(
            f"unknown metric {name!r}: it is not in the easymats catalogue (easymats/catalogue.py).{hint}"
        ) from None


def check_labels(spec: MetricSpec, labels: Mapping[str, str]) -> None:
    """Raise UnknownMetricError unless ``labels`` has exactly the spec's label names and allowed values."""
    if set(labels) != set(spec.labels):
        raise UnknownMetricError(
            f"metric {spec.name} takes labels {sorted(spec.labels) or 'none'}, got {sorted(labels) or 'none'}"
        )
    for key, allowed in spec.label_values.items():
        if str(labels[key]) not in allowed:
            raise UnknownMetricError(
                f"metric {spec.name}: label {key}={labels[key]!r} is not one of {', '.join(allowed)}"
            )


def runtime_metrics(detail: bool = False) -> list[MetricSpec]:
    """The runtime metrics of the default catalogue; with ``detail`` also the opt-in detail ones."""
    return [m for m in CATALOGUE.values() if m.source == RUNTIME and (detail or not m.detail)]


def agent_metrics() -> list[MetricSpec]:
    return [m for m in CATALOGUE.values() if m.source == AGENT]
