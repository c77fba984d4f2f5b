"""Health thresholds: the one place where "healthy" is defined.

The agent's live view colours with these, the alert rules and dashboard threshold lines are
generated from them (issue 7), and ``easymats report`` judges logs by them (issue 8). Change a
number here and everything that shows health changes with it.

Each threshold is a plain module-level constant (ratios are 0..1, rates per second) so that other
modules can import exactly what they need; :data:`THRESHOLDS` lists them with their direction for
code that walks all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Anchor hit rate = rate(hisparse_anchor_hits_total) / rate(hisparse_anchor_lookups_total).
# Below this for ANCHOR_HIT_RATE_FOR_S the selection has lost the tokens that matter: recalibrate.
ANCHOR_HIT_RATE_MIN = 0.65
ANCHOR_HIT_RATE_FOR_S = 300.0

# Prefetch efficiency = rate(hisparse_prefetch_used_total) / rate(hisparse_prefetch_issued_total).
PREFETCH_EFFICIENCY_MIN = 0.85
PREFETCH_EFFICIENCY_FOR_S = 600.0

# Block recycle rate = rate(hisparse_kv_block_recycles_total) / hisparse_kv_blocks{state="active"},
# per second. Only unhealthy while blocks are waiting in pending_recycle.
BLOCK_RECYCLE_RATE_MIN = 0.05
BLOCK_RECYCLE_RATE_FOR_S = 600.0

# Hot buffer hit rate = rate(hisparse_hot_buffer_hits_total) / rate(hisparse_hot_buffer_lookups_total).
# Below this the hot buffer thrashes: most selected tokens are copied in every step.
HOT_BUFFER_HIT_RATE_MIN = 0.5
HOT_BUFFER_HIT_RATE_FOR_S = 600.0

# Headroom of the host pool against its limit, (limit - active - pending_recycle) / limit with
# limit = hisparse_kv_blocks_limit: below this the pool is about to run out. A pool that grows on
# demand has no limit (0) and is never judged by it.
KV_FREE_BLOCKS_RATIO_MIN = 0.05
KV_FREE_BLOCKS_FOR_S = 120.0

# p99 of hisparse_quant_block_relative_error above this: quantization is losing information.
QUANT_ERROR_P99_MAX = 0.1
QUANT_ERROR_FOR_S = 900.0

# p99 of easymats_sample_lag_seconds above this: the agent cannot keep its schedule.
SAMPLE_LAG_P99_MAX_S = 0.05
SAMPLE_LAG_FOR_S = 300.0

# A target whose easymats_target_up is 0 for this long pages.
TARGET_DOWN_FOR_S = 60.0

# An agent whose log (--output) cannot be written (easymats_log_failing 1) for this long warns:
# samples are being dropped from the high-resolution record.
LOG_FAILING_FOR_S = 300.0

# Recalibration requests the webhook could not write into a runtime's control file
# (easymats_webhook_write_failures_total), failing again within every 5 minutes for this long:
# Alertmanager's retries are not getting through.
WEBHOOK_WRITE_FAILING_FOR_S = 600.0

# Warning band: a ratio within this fraction above its floor is shown yellow, not green.
WARN_MARGIN = 0.05


@dataclass(frozen=True, slots=True)
class Threshold:
    name: str  # the quantity, as the live view and report call it
    limit: float
    direction: str  # "min": unhealthy below limit; "max": unhealthy above limit
    for_s: float
    alert: str  # the alert rule that fires on it (issue 7)


THRESHOLDS: tuple[Threshold, ...] = (
    Threshold("anchor_hit_rate", ANCHOR_HIT_RATE_MIN, "min", ANCHOR_HIT_RATE_FOR_S,
              "HiSparseAnchorHitRateLow"),
    Threshold("prefetch_efficiency", PREFETCH_EFFICIENCY_MIN, "min", PREFETCH_EFFICIENCY_FOR_S,
              "HiSparsePrefetchEfficiencyLow"),
    Threshold("block_recycle_rate", BLOCK_RECYCLE_RATE_MIN, "min", BLOCK_RECYCLE_RATE_FOR_S,
              "HiSparseBlockRecycleSlow"),
    Threshold("hot_buffer_hit_rate", HOT_BUFFER_HIT_RATE_MIN, "min", HOT_BUFFER_HIT_RATE_FOR_S,
              "HiSparseHotBufferThrashing"),
    Threshold("kv_free_blocks_ratio", KV_FREE_BLOCKS_RATIO_MIN, "min", KV_FREE_BLOCKS_FOR_S,
              "HiSparseKVBlocksExhausted"),
    Threshold("quant_error_p99", QUANT_ERROR_P99_MAX, "max", QUANT_ERROR_FOR_S,
              "HiSparseQuantErrorHigh"),
    Threshold("sample_lag_p99_seconds", SAMPLE_LAG_P99_MAX_S, "max", SAMPLE_LAG_FOR_S,
              "EasymatsSamplingLagHigh"),
)

BY_NAME = {t.name: t for t in THRESHOLDS}


def health(name: str, value: float | None) -> str:
    """"ok", "warn", "bad" or "unknown" for a value of the named quantity."""
    t = BY_NAME[name]
    if value is None or value != value:  # None or NaN: no traffic in the window
        return "unknown"
    if t.direction == "min":
        if value < t.limit:
            return "bad"
        return "warn" if value < t.limit * (1 + WARN_MARGIN) else "ok"
    if value > t.limit:
        return "bad"
    return "warn" if value > t.limit * (1 - WARN_MARGIN) else "ok"
