"""Rates and ratios from the cumulative counters of one target, over a sliding time window.

The runtime exports counters, never ratios (easymats/catalogue.py); like a Prometheus recording
rule, a ratio here is the increase of its numerator over the increase of its denominator within
the window (``rate(a[w]) / rate(b[w])``). A counter that goes backwards, or a new pid under the same target
name, is a restart: the window starts afresh so no rate spans two processes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping

from .. import catalogue
from .reader import parse_key, series_key

_RATES = tuple(r for r in catalogue.RATIOS if not r.per_gauge)   # increase over increase
_RECYCLE = catalogue.RATIO["block_recycle_rate"]                  # a rate per active block
# Counters a ratio or rate is built from (the ratios' by metric name), by the exact key the log uses.
_COUNTERS = tuple(dict.fromkeys([(n, series_key(n)) for r in _RATES for n in (r.numerator, r.denominator)] + [
    ("recycles", series_key(_RECYCLE.numerator)),
    ("decode_tokens", series_key("hisparse_tokens_total", {"phase": "decode"})),
    ("evictions", series_key("hisparse_kv_block_evictions_total")),
]))
_CI = {name: i for i, (name, _) in enumerate(_COUNTERS)}
_COUNTER_KEYS = tuple(k for _, k in _COUNTERS)
_HISTOGRAMS = (
    ("step", series_key("hisparse_step_duration_seconds")),
    ("quant_error", series_key("hisparse_quant_block_relative_error")),
)
_RECAL = "hisparse_recalibrations_total"
K_ACTIVE = series_key(_RECYCLE.denominator, dict(_RECYCLE.denominator_labels))
K_FREE = series_key("hisparse_kv_blocks", {"state": "free"})
K_PENDING = series_key("hisparse_kv_blocks", {"state": "pending_recycle"})
K_LIMIT = series_key("hisparse_kv_blocks_limit")  # 0: the pool grows on demand (no limit)
K_META_DEVICE = series_key("hisparse_kv_memory_bytes", {"kind": "metadata", "tier": "device"})
K_DATA_DEVICE = series_key("hisparse_kv_memory_bytes", {"kind": "data", "tier": "device"})
K_CONTEXT = series_key("hisparse_context_tokens")

RATE_WINDOW_S = 10.0
MIN_SPAN_S = 0.5  # a ratio over less than this is noise


@dataclass(frozen=True, slots=True)
class SeriesSpec:
    key: str  # also the name of its threshold in easymats.thresholds, where it has one
    title: str
    unit: str  # "ratio" (0..1), "per_s", "bytes", "seconds", "blocks", "tokens"


# The derived series the report summarises and plots, in display order.
SERIES = tuple(SeriesSpec(r.key, r.title, r.unit) for r in catalogue.RATIOS) + (
    SeriesSpec("kv_free_blocks_ratio", "Free blocks / pool limit", "ratio"),
    SeriesSpec("active_blocks", "Active blocks", "blocks"),
    SeriesSpec("pool_blocks", "Pool size", "blocks"),
    SeriesSpec("pool_limit_blocks", "Pool limit", "blocks"),
    SeriesSpec("pending_blocks", "Blocks pending recycle", "blocks"),
    SeriesSpec("device_metadata_bytes", "Device KV metadata", "bytes"),
    SeriesSpec("device_data_bytes", "Device KV data", "bytes"),
    SeriesSpec("context_tokens", "Context", "tokens"),
    SeriesSpec("decode_tokens_per_s", "Decode tokens/s", "per_s"),
    SeriesSpec("step_p99_seconds", "Step latency p99", "seconds"),
    SeriesSpec("quant_error_p99", "Quantization error p99", "ratio"),
    SeriesSpec("sample_lag_p99_seconds", "Sampling lag p99", "seconds"),
    SeriesSpec("rss_bytes", "Process RSS", "bytes"),
)
SPECS = {s.key: s for s in SERIES}


@dataclass(slots=True)
class Restart:
    t: float
    old_pid: int | None
    new_pid: int | None
    why: str  # "pid" (new pid) or "counter reset"


@dataclass(slots=True)
class Derived:
    """What one sample adds: derived values (absent = undefined), recalibrations, a restart."""

    t: float
    pid: int | None
    up: bool
    values: dict[str, float] = field(default_factory=dict)
    recalibrations: dict[str, float] = field(default_factory=dict)  # reason -> count since last sample
    restart: Restart | None = None
    anchor_hits: float = 0.0  # increase since the previous sample (same process)
    anchor_lookups: float = 0.0
    evictions: float = 0.0  # streaming-mode block overwrites since the previous sample
    pool_grew: bool = False  # a pool without a logged limit grew: it grows on demand


def _num(v: Any) -> float:
    t = type(v)
    return float(v) if t is float or t is int else math.nan


def histogram_quantile(q: float, bounds: list[float], counts: list[float]) -> float | None:
    """Quantile from non-cumulative bucket counts (last = +Inf), interpolating in the bucket."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, acc = q * total, 0.0
    for i, c in enumerate(counts):
        if acc + c >= rank and c > 0:
            if i >= len(bounds):
                return bounds[-1] if bounds else None  # in +Inf: report the highest finite bound
            lo = bounds[i - 1] if i > 0 else 0.0
            return lo + (bounds[i] - lo) * (rank - acc) / c
        acc += c
    return bounds[-1] if bounds else None


class Deriver:
    """Feed one target's samples in time order; get a :class:`Derived` per sample."""

    def __init__(self, window_s: float = RATE_WINDOW_S, min_span_s: float = MIN_SPAN_S):
        self.window_s = window_s
        self.min_span_s = min(min_span_s, window_s)
        self._win: deque[tuple[float, tuple[float, ...], tuple[tuple[float, ...], ...]]] = deque()
        self._bounds: dict[str, list[float]] = {}
        self._pid: int | None = None
        self._recal: dict[str, float] = {}
        self._lags: deque[tuple[float, float]] = deque()
        self._lag_p99: tuple[float, float] | None = None  # (computed at t, value): sorted once a second
        self._recal_keys: tuple[int, list[tuple[str, str]]] = (-1, [])  # (len(metrics), [(key, reason)])
        self._pool_max = 0.0  # largest pool size of this process (logs without the limit gauge)

    def _reset(self) -> None:
        self._win.clear()
        self._recal = {}
        self._pool_max = 0.0

    def feed(self, rec: Mapping[str, Any]) -> Derived:
        t = float(rec["t"])
        pid = rec.get("pid") if isinstance(rec.get("pid"), int) else None
        up = rec.get("up", True) is not False
        out = Derived(t=t, pid=pid, up=up)
        if not up:
            return out  # a down sample carries stale metrics: nothing to derive from it
        metrics: Mapping[str, Any] = rec.get("metrics") or {}
        get = metrics.get
        counters = tuple([_num(get(k)) for k in _COUNTER_KEYS])
        hists = self._histograms(metrics)
        recal = self._recalibrations(metrics)
        self._check_restart(out, counters, recal)
        self._deltas(out, counters, recal)
        self._win.append((t, counters, hists))
        while len(self._win) > 2 and t - self._win[1][0] >= self.window_s:
            self._win.popleft()
        self._window_values(out.values, t, counters, hists, metrics)
        self._levels(out, metrics)
        self._lag(out.values, t, _num(rec.get("lag_s")))
        proc = rec.get("process")
        if isinstance(proc, dict) and isinstance(proc.get("rss_bytes"), (int, float)):
            out.values["rss_bytes"] = float(proc["rss_bytes"])
        return out

    def _histograms(self, metrics: Mapping[str, Any]) -> tuple[tuple[float, ...], ...]:
        """Each histogram's counts (() where absent or incomplete); keeps their bounds."""
        hists = []
        for name, key in _HISTOGRAMS:
            h = metrics.get(key)
            if isinstance(h, dict) and isinstance(counts := h.get("counts"), list) and None not in counts:
                if name not in self._bounds or len(self._bounds[name]) + 1 != len(counts):
                    self._bounds[name] = [float(b) for b in h.get("bounds") or []]
                hists.append(tuple(counts))
            else:
                hists.append(())
        return tuple(hists)

    def _recalibrations(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Recalibrations so far by reason."""
        if self._recal_keys[0] != len(metrics):  # the series set changes rarely: scan keys only then
            found = []
            for key in metrics:
                if key.startswith(_RECAL):
                    parsed = parse_key(key)
                    if parsed and parsed[0] == _RECAL:
                        found.append((key, parsed[1].get("reason", "")))
            self._recal_keys = (len(metrics), found)
        recal: dict[str, float] = {}
        for key, reason in self._recal_keys[1]:
            value = _num(metrics.get(key))
            if not math.isnan(value):
                recal[reason] = value
        return recal

    def _check_restart(self, out: Derived, counters: tuple[float, ...], recal: dict[str, float]) -> None:
        """Restart: a new pid, or any cumulative value going backwards; starts the window over."""
        t, pid = out.t, out.pid
        if self._win:
            prev = self._win[-1][1]
            # A relative tolerance: float sums (e.g. replayed or re-aggregated counters) may wobble
            # in the last bits without the process having restarted.
            went_back = any(c < p - 1e-9 * abs(p) for c, p in zip(counters, prev)
                            if not (math.isnan(c) or math.isnan(p)))
            went_back = went_back or any(v < self._recal.get(r, 0.0) * (1 - 1e-9) for r, v in recal.items())
            if pid is not None and self._pid is not None and pid != self._pid:
                out.restart = Restart(t, self._pid, pid, "pid")
            elif went_back:
                out.restart = Restart(t, self._pid, pid, "counter reset")
            if out.restart:
                self._reset()
        elif pid is not None and self._pid is not None and pid != self._pid:
            out.restart = Restart(t, self._pid, pid, "pid")
            self._reset()
        if pid is not None:
            self._pid = pid

    def _deltas(self, out: Derived, counters: tuple[float, ...], recal: dict[str, float]) -> None:
        """What happened since the previous sample: recalibrations, audits, evictions."""
        if self._recal or self._win:
            for reason, total in recal.items():
                d = total - self._recal.get(reason, 0.0)
                if d > 0:
                    out.recalibrations[reason] = d
        self._recal = recal
        if self._win:
            prev = self._win[-1][1]
            for attr, name in (("anchor_hits", "hisparse_anchor_hits_total"),
                               ("anchor_lookups", "hisparse_anchor_lookups_total"), ("evictions", "evictions")):
                d = counters[_CI[name]] - prev[_CI[name]]
                if d > 0:
                    setattr(out, attr, d)

    def _window_values(self, v: dict[str, float], t: float, counters: tuple[float, ...],
                       hists: tuple[tuple[float, ...], ...], metrics: Mapping[str, Any]) -> None:
        """Ratios, rates and p99s over the rate window, once it spans min_span_s."""
        t0, c0, h0 = self._win[0]
        span = t - t0
        if span < self.min_span_s:
            return

        def ratio(num: str, den: str) -> float | None:
            dn = counters[_CI[num]] - c0[_CI[num]]
            dd = counters[_CI[den]] - c0[_CI[den]]
            if math.isnan(dn) or math.isnan(dd) or dd <= 0:
                return None
            return max(0.0, min(1.0, dn / dd))

        for rate in _RATES:
            r = ratio(rate.numerator, rate.denominator)
            if r is not None:
                v[rate.key] = r
        d_tok = counters[_CI["decode_tokens"]] - c0[_CI["decode_tokens"]]
        if not math.isnan(d_tok):
            v["decode_tokens_per_s"] = d_tok / span
        active = _num(metrics.get(K_ACTIVE))
        d_rec = counters[_CI["recycles"]] - c0[_CI["recycles"]]
        if not math.isnan(d_rec) and active > 0:
            v[_RECYCLE.key] = d_rec / span / active
        for i, (name, _) in enumerate(_HISTOGRAMS):
            h, old = hists[i], h0[i]
            if h and len(old) == len(h):
                delta = [a - b for a, b in zip(h, old)]
                q = histogram_quantile(0.99, self._bounds[name], delta)
                if q is not None:
                    v["step_p99_seconds" if name == "step" else "quant_error_p99"] = q

    def _levels(self, out: Derived, metrics: Mapping[str, Any]) -> None:
        """Gauges as they are: blocks, bytes, context, and the pool's free share."""
        v = out.values
        active, free, pending = (_num(metrics.get(k)) for k in (K_ACTIVE, K_FREE, K_PENDING))
        for key, value in (("active_blocks", active), ("pending_blocks", pending),
                           ("device_metadata_bytes", _num(metrics.get(K_META_DEVICE))),
                           ("device_data_bytes", _num(metrics.get(K_DATA_DEVICE))),
                           ("context_tokens", _num(metrics.get(K_CONTEXT)))):
            if not math.isnan(value):
                v[key] = value
        if math.isnan(pending) and not math.isnan(active) and not math.isnan(free):
            pending = 0.0  # a serving engine has no recycle grace (docs/engines.md), as the rule sums
        if any(math.isnan(x) for x in (active, free, pending)) or active + free + pending <= 0:
            return
        pool = active + free + pending
        v["pool_blocks"] = pool
        # Exhaustion is headroom against the pool's limit, like the alert's recording rule. A
        # pool that grows on demand (limit 0) has no limit: its free share of the current size
        # dips before every growth step and says nothing about running out, so no ratio.
        limit = _num(metrics.get(K_LIMIT))
        if limit > 0:
            v["pool_limit_blocks"] = limit
            v["kv_free_blocks_ratio"] = max(0.0, limit - active - pending) / limit
        elif math.isnan(limit):
            # A log from before the limit gauge: free / size, as then, unless the pool is seen
            # growing (then it grows on demand, and its finding is withdrawn: TargetRun.pool_grew).
            if self._pool_max and pool > self._pool_max:
                out.pool_grew = True
            self._pool_max = max(self._pool_max, pool)
            v["kv_free_blocks_ratio"] = free / pool

    def _lag(self, v: dict[str, float], t: float, lag: float) -> None:
        """The sampler's lag p99 over the window (sorted at most once a second)."""
        if math.isnan(lag):
            return
        self._lags.append((t, lag))
        while self._lags and t - self._lags[0][0] >= self.window_s:
            self._lags.popleft()
        if t - self._lags[0][0] >= self.min_span_s or len(self._lags) >= 10:
            if self._lag_p99 is None or t - self._lag_p99[0] >= 1.0 or t < self._lag_p99[0]:
                lags = sorted(x for _, x in self._lags)
                self._lag_p99 = (t, lags[min(len(lags) - 1, int(0.99 * len(lags)))])
            v["sample_lag_p99_seconds"] = self._lag_p99[1]


def info_labels(metrics: Mapping[str, Any], name: str) -> dict[str, str] | None:
    """The labels of the info metric ``name`` (e.g. hisparse_config_info) in a sample, if present."""
    for key in metrics:
        if key.startswith(name):
            parsed = parse_key(key)
            if parsed and parsed[0] == name:
                return parsed[1]
    return None


def config_of(metrics: Mapping[str, Any]) -> dict[str, str] | None:
    return info_labels(metrics, "hisparse_config_info")
