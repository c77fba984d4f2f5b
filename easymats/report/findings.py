"""Diagnosis rules: each a small function of one target's :class:`TargetRun` returning findings.

A finding says what is wrong, the evidence (when, for how long, how far past the threshold) and the
change to make. Thresholds come from :mod:`easymats.thresholds` (one place for "healthy"). A
condition must hold for the threshold's alert duration, shortened for short runs to a quarter of
the run (at least 30 s) so that a one-minute demo can still be judged; ``doctor`` passes its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from easymats import thresholds

from .accum import Episodes, Span
from .analyse import TargetRun

SEVERITY_ORDER = {"critical": 0, "warning": 1}
DECAY_MIN_DOC_TOKENS = 4096  # shorter documents are not "long": their halves are noise
METADATA_GROWTH_MIN = 0.25  # device metadata's last quarter above its first by a quarter ...
METADATA_GROWTH_MIN_BYTES = 1 << 20  # ... and by at least this much


@dataclass
class Finding:
    rule: str
    target: str
    severity: str  # "critical" | "warning"
    title: str
    evidence: list[str]
    change: str
    start_t: float | None = None
    duration_s: float = 0.0
    worst: float | None = None
    threshold: float | None = None
    extra: dict = field(default_factory=dict)

    def sort_key(self) -> tuple:
        return (SEVERITY_ORDER.get(self.severity, 9), -self.duration_s, self.start_t or 0.0)


@dataclass(frozen=True)
class RuleConfig:
    min_duration_s: float | None = None  # None: the threshold's alert duration, shortened for short runs
    short_run_fraction: float = 0.25
    short_run_floor_s: float = 30.0

    def required(self, th: thresholds.Threshold, run: TargetRun) -> float:
        if self.min_duration_s is not None:
            return self.min_duration_s
        return min(th.for_s, max(self.short_run_floor_s, self.short_run_fraction * run.covered_s))


# -- formatting helpers ----------------------------------------------------------------------------

def fmt_t(t: float | None, run: TargetRun | None = None) -> str:
    if t is None:
        return "?"
    try:
        s = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) + " UTC"
    except (OverflowError, OSError, ValueError):  # a time no calendar holds (a corrupt log)
        s = f"t={t:g}"
    if run is not None and run.first_t is not None:
        s += f" (+{fmt_s(t - run.first_t)})"
    return s


def fmt_s(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "ratio":
        return f"{v * 100:.1f} %"
    if unit == "per_s_pct":
        return f"{v * 100:.2f} %/s"
    if unit == "bytes":
        for u, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if abs(v) >= div:
                return f"{v / div:.2f} {u}"
        return f"{v:.0f} B"
    if unit == "seconds":
        return f"{v * 1000:.2f} ms" if v < 1 else f"{v:.2f} s"
    if unit == "per_s":
        return f"{v:.1f}/s"
    return f"{v:.4g}"


def _episode_evidence(run: TargetRun, ep: Episodes, spans: list[Span], what: str, unit: str,
                      required: float) -> list[str]:
    longest = max(spans, key=lambda s: s.duration)
    side = "below" if ep.below else "above"
    gap = (ep.threshold - longest.worst) if ep.below else (longest.worst - ep.threshold)
    far = f"{gap * 100:.1f} points" if unit in ("ratio", "per_s_pct") else fmt_value(gap, unit)
    lines = [
        f"{what} stayed {side} {fmt_value(ep.threshold, unit)} for {fmt_s(longest.duration)} from "
        f"{fmt_t(longest.start, run)}; worst {fmt_value(longest.worst, unit)} ({far} past the threshold).",
        f"In all {fmt_s(ep.total_s)} of {fmt_s(run.covered_s)} observed ({ep.total_s / max(run.covered_s, 1e-9):.0%}) "
        f"was {side} the threshold, in {len(spans)} span(s) of at least {fmt_s(required)}.",
    ]
    return lines


def _sustained(run: TargetRun, key: str, cfg: RuleConfig) -> tuple[Episodes, list[Span], float] | None:
    ep = run.episodes.get(key)
    th = thresholds.BY_NAME.get(key)
    if ep is None or th is None:
        return None
    required = cfg.required(th, run)
    spans = ep.longer_than(required)
    return (ep, spans, required) if spans else None


def _finding_from(run: TargetRun, rule: str, key: str, found: tuple[Episodes, list[Span], float],
                  severity: str, title: str, what: str, unit: str, change: str,
                  more: list[str] | None = None) -> Finding:
    ep, spans, required = found
    longest = max(spans, key=lambda s: s.duration)
    return Finding(rule=rule, target=run.name, severity=severity, title=title,
                   evidence=_episode_evidence(run, ep, spans, what, unit, required) + (more or []),
                   change=change, start_t=longest.start, duration_s=sum(s.duration for s in spans),
                   worst=ep.worst, threshold=ep.threshold)


def _cfg(run: TargetRun, key: str) -> str | None:
    return (run.config or {}).get(key)


# -- the rules ---------------------------------------------------------------------------------------

def slow_recycle(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    found = _sustained(run, "block_recycle_rate", cfg)
    if not found:
        return []
    bs = _cfg(run, "block_size")
    now = f"cache_block_size (now {bs})" if bs else "cache_block_size"
    smaller = f" e.g. {max(1, int(bs) // 2)}" if bs and bs.isdigit() and int(bs) > 1 else ""
    pend = run.sketches["pending_blocks"]
    more = [f"Blocks waited in pending_recycle meanwhile (up to {pend.max:.0f} blocks)."] if pend.count else []
    return [_finding_from(
        run, "slow_recycle", "block_recycle_rate", found, "warning",
        "Blocks recycle too slowly: blocks are too large",
        "Block recycle rate", "per_s_pct",
        f"Reduce {now}{smaller}: a large block stays referenced by some token long after the window "
        "left it, so it cannot be recycled.", more)]


def poor_prefetch(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    found = _sustained(run, "prefetch_efficiency", cfg)
    if not found:
        return []
    buf = _cfg(run, "device_buffer_tokens")
    now = f" (now {buf})" if buf else ""
    return [_finding_from(
        run, "poor_prefetch", "prefetch_efficiency", found, "warning",
        "Prefetched tokens are wasted: prefetch efficiency is low",
        "Prefetch efficiency", "ratio",
        f"Tune prefetch: prefetch fewer tokens ahead, or raise device_buffer_tokens{now} so prefetched "
        "tokens survive in the hot buffer until a selection uses them.")]


def anchor_decay(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    docs = run.docs
    lim = thresholds.BY_NAME["anchor_hit_rate"].limit
    # decay = a healthy first half and an unhealthy second half of a long document (a document
    # that is poor throughout is the anchor_low finding instead)
    bad = [r for r in docs.results if r.first_rate >= lim and r.second_rate < lim - 0.02
           and (r.unit != "tokens" or r.length >= DECAY_MIN_DOC_TOKENS)]
    if not bad:
        return []
    worst = min(bad, key=lambda r: r.second_rate - r.first_rate)
    unit = "tokens" if worst.unit == "tokens" else "s into the document"
    where = (f"; it first fell below {lim:.0%} at {worst.below_from:.0f} {unit} ({fmt_t(worst.below_from_t, run)})"
             if worst.below_from is not None else "")
    every, topk, glob = _cfg(run, "recalibrate_every"), _cfg(run, "recalibrate_topk"), _cfg(run, "global_tokens")
    return [Finding(
        rule="anchor_decay", target=run.name, severity="warning",
        title="Anchor hit rate decays in the second half of long documents",
        evidence=[
            f"Document from {fmt_t(worst.start_t, run)} to {fmt_t(worst.end_t)} "
            f"({worst.length:.0f} {worst.unit}): anchor hit rate {worst.first_rate:.1%} in the first half, "
            f"{worst.second_rate:.1%} in the second ({(lim - worst.second_rate) * 100:.1f} points below "
            f"{lim:.0%}){where}.",
            f"Second half below the threshold for {fmt_s(worst.below_s)}; {len(bad)} of {docs.documents} "
            "document(s) show this decay.",
        ],
        change="Use segmented recalibration: lower recalibrate_every"
               + (f" (now {every})" if every else "") + " so anchors are re-scored per segment, and give "
               "it more globals (recalibrate_topk" + (f", now {topk}" if topk else "")
               + "; global_tokens" + (f", now {glob}" if glob else "") + ").",
        start_t=worst.below_from_t or worst.start_t, duration_s=worst.below_s, worst=worst.second_rate,
        threshold=lim)]


def anchor_low(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    found = _sustained(run, "anchor_hit_rate", cfg)
    if not found:
        return []
    n = sum(run.recal_counts.values())
    by_reason = ", ".join(f"{k} {v:.0f}" for k, v in sorted(run.recal_counts.items()))
    more = [f"Recalibrations during the run: {n:.0f} ({by_reason})."
            if n else "No recalibration happened during the run."]
    return [_finding_from(
        run, "anchor_low", "anchor_hit_rate", found, "warning",
        "Anchor hit rate is low: selection misses the tokens that matter",
        "Anchor hit rate", "ratio",
        "Recalibrate (easymats recalibrate --pid PID, or let the HiSparseAnchorHitRateLow alert do it); "
        "if it keeps falling, raise global_tokens and lower recalibrate_every.", more)]


def metadata_growth(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    device = (run.runtime or {}).get("device", "")
    if device.startswith("cpu"):
        return []  # the compute device is the CPU: "device" metadata already lives in host memory
    grown = []
    for tr in run.trends:
        q = tr.quarter_means()
        # growing = every quarter of the process's life at least as high as the one before, and the
        # last clearly above the first (a one-off step at start-up is not growth)
        if len(q) == 4 and all(b >= a for a, b in zip(q, q[1:])) and q[3] - q[0] >= METADATA_GROWTH_MIN_BYTES \
                and q[3] - q[0] >= METADATA_GROWTH_MIN * q[0]:
            grown.append(tr)
    if not grown:
        return []
    tr = max(grown, key=lambda x: x.growth)
    q = tr.quarter_means()
    span = max(tr.last_t - tr.first_t, 1e-9)
    rel = f" (+{(q[3] - q[0]) / q[0]:.0%})" if q[0] > 0 else ""
    return [Finding(
        rule="metadata_growth", target=run.name, severity="warning",
        title="KV metadata on the device keeps growing",
        evidence=[
            f"Device-tier KV metadata grew from {fmt_value(tr.first, 'bytes')} to {fmt_value(tr.last, 'bytes')} "
            f"between {fmt_t(tr.first_t, run)} and {fmt_t(tr.last_t)} "
            f"({fmt_value(tr.growth / span * 4 / 3, 'bytes')}/s).",
            "Mean per quarter of the process's life: " + " -> ".join(fmt_value(x, "bytes") for x in q) + rel + "; "
            f"peak {fmt_value(tr.peak, 'bytes')} of device memory held by page tables and block state.",
        ],
        change='Move the metadata off the device: enable_hisparse_kv_cache(..., metadata_device="cpu").',
        start_t=tr.first_t, duration_s=tr.last_t - tr.first_t, worst=tr.peak,
        threshold=None, extra={"first": tr.first, "last": tr.last})]


def pool_exhaustion(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    """Headroom against the pool's limit (hisparse_kv_blocks_limit), as HiSparseKVBlocksExhausted.

    A pool that grows on demand has no limit (logged as 0, so no ratio is derived) and never
    yields this finding; nor does one seen growing in a log from before the limit gauge.
    """
    if run.evictions > 0:
        return []  # streaming mode overwrites blocks of a full bounded pool: full is its steady state
    if run.pool_grew:
        return []
    found = _sustained(run, "kv_free_blocks_ratio", cfg)
    if not found:
        return []
    act, lim = run.sketches["active_blocks"], run.sketches["pool_limit_blocks"]
    pool = lim if lim.count else run.sketches["pool_blocks"]
    what = "limit (host_pool_blocks)" if lim.count else "pool"
    more = ([f"Active blocks peaked at {act.max:.0f} of a {pool.max:.0f}-block {what}."]
            if act.count and pool.count else [])
    return [_finding_from(
        run, "pool_exhaustion", "kv_free_blocks_ratio", found, "critical",
        "KV block pool nearly exhausted: an OOM is coming",
        "Free blocks as a share of the pool's limit", "ratio",
        "Enlarge the host pool (raise host_pool_blocks if host memory allows) "
        "or enable streaming=True so a bounded pool overwrites unimportant blocks instead of failing.",
        more)]


def target_restart(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    if not run.restarts:
        return []
    lines = []
    for r in run.restarts[:5]:
        pids = f"pid {r.old_pid} -> {r.new_pid}" if r.old_pid or r.new_pid else "same pid"
        down = f", down {fmt_s(r.down_s)}" if r.down_s is not None else ""
        how = {"pid": "new pid", "counter reset": "counters reset", "event": "agent event"}.get(r.why, r.why)
        lines.append(f"Restart at {fmt_t(r.t, run)}: {pids} ({how}{down}){': ' + r.detail if r.detail else ''}.")
    if len(run.restarts) > 5:
        lines.append(f"... and {len(run.restarts) - 5} more restart(s).")
    first = run.restarts[0]
    return [Finding(
        rule="target_restart", target=run.name, severity="critical",
        title=f"Target restarted {len(run.restarts)} time(s)",
        evidence=lines,
        change="Investigate the crash: the target's stderr and exit status, and `dmesg` / the OOM killer "
               f"around {fmt_t(first.t)}; counters restarted from zero, so rates across it are not comparable.",
        start_t=first.t, duration_s=sum(r.down_s or 0.0 for r in run.restarts))]


def hot_buffer_thrashing(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    found = _sustained(run, "hot_buffer_hit_rate", cfg)
    if not found:
        return []
    buf = _cfg(run, "device_buffer_tokens")
    return [_finding_from(
        run, "hot_buffer_thrashing", "hot_buffer_hit_rate", found, "warning",
        "Hot buffer thrashes: most selected tokens are copied in every step",
        "Hot buffer hit rate", "ratio",
        "Raise device_buffer_tokens" + (f" (now {buf})" if buf else "") + " to at least 2 x top_k.")]


def quant_error_high(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    found = _sustained(run, "quant_error_p99", cfg)
    if not found:
        return []
    bits = _cfg(run, "host_kv_bits")
    return [_finding_from(
        run, "quant_error_high", "quant_error_p99", found, "warning",
        "Quantization error is high", "p99 of per-block relative error", "ratio",
        "Use more bits for host KV (host_kv_bits" + (f", now {bits}" if bits else "") + ", e.g. 8) or "
        "the error-budget bit-width policy.")]


def sampling_lag(run: TargetRun, cfg: RuleConfig) -> list[Finding]:
    found = _sustained(run, "sample_lag_p99_seconds", cfg)
    if not found:
        return []
    return [_finding_from(
        run, "sampling_lag", "sample_lag_p99_seconds", found, "warning",
        "The agent could not keep its sampling schedule", "Sampling lag p99", "seconds",
        "Give the agent CPU (it shares a core with the target?) or sample less often (--interval).")]


RULES: tuple[Callable[[TargetRun, RuleConfig], list[Finding]], ...] = (
    target_restart, pool_exhaustion, slow_recycle, poor_prefetch, anchor_decay, anchor_low,
    metadata_growth, hot_buffer_thrashing, quant_error_high, sampling_lag,
)


def diagnose(run: TargetRun, cfg: RuleConfig | None = None) -> list[Finding]:
    """Every rule's findings for one target, most urgent first."""
    cfg = cfg or RuleConfig()
    out: list[Finding] = []
    for rule in RULES:
        out.extend(rule(run, cfg))
    if any(f.rule == "anchor_decay" for f in out):
        out = [f for f in out if f.rule != "anchor_low"]  # the decay finding says it more precisely
    return sorted(out, key=Finding.sort_key)


def diagnose_all(targets: dict[str, TargetRun], cfg: RuleConfig | None = None) -> list[Finding]:
    out: list[Finding] = []
    for name in sorted(targets):
        out.extend(diagnose(targets[name], cfg))
    return sorted(out, key=Finding.sort_key)


def format_findings(findings: list[Finding]) -> str:
    """Findings as plain text, most urgent first."""
    if not findings:
        return "No findings: healthy."
    out = []
    for i, f in enumerate(findings, 1):
        out.append(f"{i}. [{f.severity}] {f.target}: {f.title}")
        out.extend(f"   - {line}" for line in f.evidence)
        out.append(f"   change: {f.change}")
    return "\n".join(out)


def most_urgent(findings: list[Finding]) -> str | None:
    """One line for the live view: the most urgent finding, or None."""
    if not findings:
        return None
    f = findings[0]
    return f"{f.target}: {f.title} -> {f.change.split(':')[0]}"
