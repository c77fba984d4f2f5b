"""The few lines ``easymats demo`` prints at the end, computed from its JSON Lines log.

Pure: log lines (dicts, docs/log-format.md) in, text out. Rates and ratios come from counter
deltas between a target's first and last samples, as the recording rules compute them; the
anchor hit rate is also shown over time windows so the topic-shift dip and the recalibration
that restores it are visible.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from . import catalogue


@dataclass(slots=True)
class TargetSeries:
    """Samples of one target: (unix time, metrics) in log order."""

    name: str
    pid: int | None = None
    samples: list[tuple[float, dict[str, Any]]] = field(default_factory=list)


def read_log(path: str) -> Iterator[dict[str, Any]]:
    """Lines of a JSON Lines log; a torn last line (killed writer) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def collect(lines: Iterable[dict[str, Any]]) -> dict[str, TargetSeries]:
    """Sample lines with metrics, grouped by target name."""
    out: dict[str, TargetSeries] = {}
    for line in lines:
        if line.get("kind") != "sample" or not line.get("metrics"):
            continue
        ts = out.setdefault(line["target"], TargetSeries(line["target"], line.get("pid")))
        ts.samples.append((float(line["t"]), line["metrics"]))
    return out


def _total(metrics: dict[str, Any], name: str) -> float:
    """Sum of a scalar metric over its label sets (``name`` or ``name{...}`` keys)."""
    total = 0.0
    for key, value in metrics.items():
        if (key == name or key.startswith(name + "{")) and isinstance(value, (int, float)):
            total += value
    return total


def _delta(ts: TargetSeries, name: str) -> float:
    return _total(ts.samples[-1][1], name) - _total(ts.samples[0][1], name)


def _rate(ts: TargetSeries, key: str) -> float | None:
    """A catalogue ratio of two counters over the whole series."""
    r = catalogue.RATIO[key]
    return r.of(_delta(ts, r.numerator), _delta(ts, r.denominator))


def _max(ts: TargetSeries, key: str) -> float:
    return max((float(m.get(key) or 0.0) for _, m in ts.samples), default=0.0)


def windowed_hit_rate(ts: TargetSeries, min_lookups: float) -> list[tuple[float, float]]:
    """(seconds since the first sample, anchor hit rate) over consecutive windows of samples
    holding at least ``min_lookups`` audited lookups each.

    Windows count audits, not seconds, so a dip that lasts a few audits shows on a fast machine
    (where it takes a fraction of a second) as well as on a slow one.
    """
    if not ts.samples:
        return []
    t0 = ts.samples[0][0]
    out = []
    start_m = ts.samples[0][1]
    for t, m in ts.samples[1:]:
        lookups = _total(m, "hisparse_anchor_lookups_total") - _total(start_m, "hisparse_anchor_lookups_total")
        if lookups < min_lookups:
            continue
        hits = _total(m, "hisparse_anchor_hits_total") - _total(start_m, "hisparse_anchor_hits_total")
        out.append((t - t0, hits / lookups))
        start_m = m
    return out


# Why a real model trips a threshold in a one-minute demo, where the reason is known.
THRESHOLD_NOTES = {
    "prefetch_efficiency": "the next-ranked blocks are a guess; on real text only about half are used "
                           "the next step (docs/BENCHMARKS.md, quality on a real model)",
    "hot_buffer_hit_rate": "a short run is mostly cold start: every prompt's tokens are new",
    "anchor_hit_rate": "a topic shift just happened, or the probe has not been refit yet",
}


def threshold_findings(values: dict[str, float | None]) -> list[str]:
    """One line per quantity on the wrong side of its alert threshold (easymats.thresholds):
    the value, the limit (a floor or a ceiling), the alert it would feed, and a known reason."""
    from .thresholds import BY_NAME

    out = []
    for name, value in values.items():
        t = BY_NAME[name]
        if value is None or value != value:
            continue
        if (value < t.limit) if t.direction == "min" else (value > t.limit):
            kind = "floor" if t.direction == "min" else "ceiling"
            note = THRESHOLD_NOTES.get(name)
            out.append(f"  {name.replace('_', ' ')} {_pct(value)} is past its {kind} of {_pct(t.limit)} "
                       f"({t.alert} fires after {t.for_s / 60:.0f} min of this)" + (f": {note}" if note else ""))
    return out


HIT_RATE_WINDOW_LOOKUPS = 8  # eight attention-mass audits (one lookup each), one top-m audit (m = 8)
DEVICE_DATA = 'hisparse_kv_memory_bytes{kind="data",tier="device"}'
HOST_DATA = 'hisparse_kv_memory_bytes{kind="data",tier="host"}'


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def summarise_target(ts: TargetSeries) -> list[str]:
    if len(ts.samples) < 2:
        return [f"{ts.name}: {len(ts.samples)} sample(s), too few to summarise"]
    span = ts.samples[-1][0] - ts.samples[0][0]
    decode = _delta(ts, 'hisparse_tokens_total{phase="decode"}')
    prefill = _delta(ts, 'hisparse_tokens_total{phase="prefill"}')
    recal = {r: _delta(ts, f'hisparse_recalibrations_total{{reason="{r}"}}')
             for r in catalogue.RECALIBRATION_REASONS}
    quant = {b: _delta(ts, f'hisparse_quant_blocks_total{{bits="{b}"}}') for b in catalogue.QUANT_BITS}
    ratios = " | ".join(f"{catalogue.RATIO[k].title.lower()} {_pct(_rate(ts, k))}"
                        for k in ("anchor_hit_rate", "hot_buffer_hit_rate", "prefetch_efficiency", "block_density"))
    lines = [
        f"{ts.name} (pid {ts.pid}): {len(ts.samples)} samples over {span:.1f} s; "
        f"{prefill:.0f} prefill + {decode:.0f} decode tokens ({decode / span if span else 0:.0f} decode tokens/s)",
        f"  {ratios}",
        f"  blocks: {_delta(ts, 'hisparse_kv_block_allocations_total'):.0f} allocated, "
        f"{_delta(ts, 'hisparse_kv_block_recycles_total'):.0f} recycled, "
        f"{_delta(ts, 'hisparse_kv_block_reclaims_total'):.0f} reclaimed, "
        f"{_delta(ts, 'hisparse_kv_block_evictions_total'):.0f} evicted; "
        f"recalibrations: " + ", ".join(f"{v:.0f} {r}" for r, v in recal.items()),
        f"  KV memory peak: device {_bytes(_max(ts, DEVICE_DATA))}, host {_bytes(_max(ts, HOST_DATA))}; "
        f"quantized blocks: " + (", ".join(f"{v:.0f} x INT{b}" for b, v in quant.items() if v) or "none"),
    ]
    lines += threshold_findings({k: _rate(ts, k) for k in ("anchor_hit_rate", "prefetch_efficiency",
                                                           "hot_buffer_hit_rate")})
    rates = windowed_hit_rate(ts, HIT_RATE_WINDOW_LOOKUPS)
    if len(rates) >= 3:
        low_i = min(range(len(rates)), key=lambda i: rates[i][1])
        before = [r for _, r in rates[:low_i]]
        after = [r for _, r in rates[low_i + 1:]]
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        lines.append(f"  anchor hit rate over time: {_pct(mean(before))} before its lowest, "
                     f"{_pct(rates[low_i][1])} at {rates[low_i][0]:.0f} s, {_pct(mean(after))} after")
    return lines


def summarise(lines: Iterable[dict[str, Any]]) -> str:
    targets = collect(lines)
    if not targets:
        return "no samples with metrics were logged"
    out: list[str] = []
    for name in sorted(targets):
        out.extend(summarise_target(targets[name]))
    return "\n".join(out)
