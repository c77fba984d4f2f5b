"""Declarative mapping tables: which engine series give which catalogue metric, per engine revision.

Each :class:`EngineMap` is one engine at one naming revision. A :class:`Rule` says how one
catalogue series is computed from the engine's samples: one or more *ways*, tried in order, each a
sum and difference of engine samples written as PromQL-like terms::

    Rule('hisparse_kv_blocks{state="free"}',
         "vllm:hisparse_host_blocks_total - vllm:hisparse_host_blocks_used")

The first way whose every term is present wins; a rule with no complete way gives no series (the
engine did not report it at this sample). Terms sum over the engine's own labels (vLLM's
``engine`` index of data-parallel engines, SGLang's ``dp_rank``), except the engine's *replica*
labels (SGLang's ``tp_rank``...): series that differ only there are copies of one value, and one
of them is taken. A catalogue metric that no rule of the map produces is **not provided** by that
engine revision: ``easymats ls --engines``, docs/engines.md and the dashboards say so.

Counters map only onto counters (a sum of counters is a counter: lookups = hits + misses), so
ratios come from counters through the recording rules as for a native runtime. Gauges may be
differences of gauges (free = total - used). Names come from the engines' sources; the revision
and file each table was read from are in ``source``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

from .. import catalogue

# --- terms ----------------------------------------------------------------------------------------

_TERM = re.compile(r'\s*([+-])?\s*([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s*')
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True, slots=True)
class Term:
    """One engine sample name with label equality matchers, added (+1) or subtracted (-1)."""

    sample: str
    match: tuple[tuple[str, str], ...] = ()
    sign: int = 1


def _labels(text: str | None, where: str) -> tuple[tuple[str, str], ...]:
    if not text:
        return ()
    inner, out, pos = text[1:-1], [], 0
    while pos < len(inner):
        m = _MATCHER.match(inner, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"{where}: cannot read the label matchers {text!r} (write name=\"value\", ...)")
        out.append((m.group(1), m.group(2)))
        pos = m.end()
    return tuple(sorted(out))


def parse_way(text: str) -> tuple[Term, ...]:
    """``"a + b{x=\\"y\\"} - c"`` -> its terms. ValueError naming the problem."""
    terms: list[Term] = []
    pos = 0
    while pos < len(text):
        m = _TERM.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot read the mapping {text!r} at {text[pos:]!r}")
        if terms and m.group(1) is None:
            raise ValueError(f"mapping {text!r}: terms are joined by + or -")
        terms.append(Term(m.group(2), _labels(m.group(3), text), -1 if m.group(1) == "-" else 1))
        pos = m.end()
    if not terms:
        raise ValueError("an empty mapping")
    return tuple(terms)


def parse_series(text: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``'name{a="x"}'`` -> (name, sorted labels)."""
    terms = parse_way(text)
    if len(terms) != 1 or terms[0].sign != 1:
        raise ValueError(f"{text!r} is not one series")
    return terms[0].sample, terms[0].match


@dataclass(frozen=True)
class Rule:
    """One catalogue series (``metric`` with fixed ``labels``) from the first complete way."""

    metric: str
    labels: tuple[tuple[str, str], ...]
    ways: tuple[tuple[Term, ...], ...]
    note: str = ""

    @property
    def series(self) -> str:
        if not self.labels:
            return self.metric
        return self.metric + "{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}"

    def samples(self) -> set[str]:
        """Every engine sample name any way of this rule reads."""
        return {t.sample for way in self.ways for t in way}


def rule(series: str, *ways: str, note: str = "") -> Rule:
    metric, labels = parse_series(series)
    if not ways:
        raise ValueError(f"rule {series}: give at least one way")
    return Rule(metric, labels, tuple(parse_way(w) for w in ways), note)


@dataclass(frozen=True)
class EngineMap:
    """One engine at one naming revision."""

    engine: str  # vllm | sglang
    revision: str  # short id, shown in easymats_target_source_info and `easymats ls --engines`
    title: str
    source: str  # where the names were read: repository, file and commit or release
    rules: tuple[Rule, ...]
    # Sample names that only this revision exports: their presence selects it.
    detect: frozenset[str] = frozenset()
    # The engine's HiSparse series that map to nothing in the catalogue: passed through under the
    # engine's names on /metrics (as every unmapped series is) and, unlike the rest, also logged.
    hisparse_passthrough: frozenset[str] = frozenset()
    replica_labels: tuple[str, ...] = ()
    # Why a catalogue metric is not provided (metric name -> reason); the default reason applies
    # to the others.
    why_not: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.engine}/{self.revision}"

    def provided(self) -> list[str]:
        """Catalogue series this map can produce, in catalogue order."""
        return [r.series for r in self.rules]

    def provided_metrics(self) -> set[str]:
        return {r.metric for r in self.rules}

    def not_provided(self) -> list[str]:
        """Runtime catalogue metrics no rule of this map produces, in catalogue order."""
        have = self.provided_metrics()
        return [m.name for m in catalogue.runtime_metrics() if m.name not in have]

    def hisparse_samples(self) -> set[str]:
        """Every HiSparse-related engine sample name this map knows (mapped or passed through)."""
        out = set(self.hisparse_passthrough)
        for r in self.rules:
            out |= r.samples()
        return out


# --- vLLM -----------------------------------------------------------------------------------------

# Sample names: prometheus_client adds ``_total`` to a counter's name in the exposition.
_VLLM_SOURCE_STATS = "vllm-project/vllm vllm/distributed/kv_transfer/kv_connector/v1/hisparse/stats.py"
_VLLM_HISTOGRAMS = frozenset(
    f"vllm:hisparse_host_block_{h}_seconds{suffix}"
    for h in ("lifetime", "idle_before_evict", "reuse_gap")
    for suffix in ("_bucket", "_sum", "_count"))

_VLLM_COMMON = (
    rule('hisparse_tokens_total{phase="prefill"}', "vllm:prompt_tokens_total",
         note="prompt tokens the engine processed (vLLM counts prefix-cache hits in them)"),
    rule('hisparse_tokens_total{phase="decode"}', "vllm:generation_tokens_total"),
    rule("hisparse_sequences", "vllm:num_requests_running"),
    rule("hisparse_hot_buffer_hits_total", "vllm:hisparse_cache_hits_total",
         note="device hot-buffer hits, snapshotted from the GPU every 2,000 worker steps"),
    rule("hisparse_hot_buffer_lookups_total",
         "vllm:hisparse_cache_hits_total + vllm:hisparse_cache_misses_total",
         note="every selected row is a hit or a miss"),
    rule("hisparse_swap_in_bytes_total", "vllm:hisparse_host_to_device_bytes_total",
         note="bytes copied from host KV storage into the hot buffers"),
)

_VLLM_WHY = {
    "hisparse_anchor_lookups_total": "vLLM HiSparse has no anchors and no exact-attention audit",
    "hisparse_anchor_hits_total": "vLLM HiSparse has no anchors and no exact-attention audit",
    "hisparse_anchors": "vLLM HiSparse has no importance probe",
    "hisparse_anchor_threshold_ratio": "vLLM HiSparse has no importance probe",
    "hisparse_recalibrations_total": "no probe to recalibrate and no control channel",
    "hisparse_context_tokens": "vLLM exports pool usage ratios, not tokens held",
    "hisparse_kv_tokens_loaded_total": "vLLM exports no block density counters",
    "hisparse_kv_tokens_used_total": "vLLM exports no block density counters",
    "hisparse_hot_buffer_resident_tokens": "vLLM exports no hot-buffer occupancy",
    "hisparse_hot_buffer_capacity_tokens": "vLLM exports no hot-buffer size (2 x top-K rows per request by "
                                           "default)",
    "hisparse_prefetch_issued_total": "vLLM exports no prefetch counters",
    "hisparse_prefetch_used_total": "vLLM exports no prefetch counters",
    "hisparse_backup_bytes_total": "vLLM exports no device-to-host byte counter",
    "hisparse_quant_blocks_total": "vLLM does not quantize the host KV per block",
    "hisparse_quant_block_relative_error": "vLLM does not quantize the host KV per block",
    "hisparse_step_duration_seconds": "vLLM's latency histograms are per request at the API server, "
                                      "not per decode step inside the cache",
    "hisparse_runtime_info": "passed through as vLLM's own info series",
    "hisparse_config_info": "passed through as vllm:cache_config_info",
    **{f"hisparse_kv_block_{event}_total": "vLLM exports host pool levels, not block events"
       for event in ("allocations", "recycles", "reclaims", "evictions")},
}

VLLM_A = EngineMap(
    engine="vllm", revision="hisparse-host-blocks",
    title="vLLM Hybrid HiSparse, host pool in blocks (host_blocks_used/_total/_usage, pending_spills)",
    source=f"{_VLLM_SOURCE_STATS} @05b0e9a (metrics PRs #51335 / #53782)",
    rules=_VLLM_COMMON + (
        rule('hisparse_kv_blocks{state="active"}', "vllm:hisparse_host_blocks_used",
             note="host blocks backing live or cached prefixes (evictable cached blocks included)"),
        rule('hisparse_kv_blocks{state="free"}',
             "vllm:hisparse_host_blocks_total - vllm:hisparse_host_blocks_used"),
        rule("hisparse_kv_blocks_limit", "vllm:hisparse_host_blocks_total",
             note="host pool size, fixed at start-up (host_pool_gib)"),
    ),
    detect=frozenset({"vllm:hisparse_host_blocks_used", "vllm:hisparse_host_blocks_total",
                      "vllm:hisparse_host_blocks_usage", "vllm:hisparse_pending_spills"}),
    hisparse_passthrough=frozenset({"vllm:hisparse_host_blocks_usage", "vllm:hisparse_pending_spills"})
    | _VLLM_HISTOGRAMS,
    why_not={**_VLLM_WHY, "hisparse_kv_memory_bytes": "vLLM exports host blocks, not bytes per tier"},
)

VLLM_B = EngineMap(
    engine="vllm", revision="hisparse-usage-perc",
    title="vLLM Hybrid HiSparse, host pool as a ratio (host_cache_usage_perc, pending_page_transfers)",
    source=f"{_VLLM_SOURCE_STATS} (HiSparseKVConnectorStats with _HISPARSE_LEVEL_KEYS "
           "host_cache_usage_perc / pending_page_transfers)",
    rules=_VLLM_COMMON,
    detect=frozenset({"vllm:hisparse_host_cache_usage_perc", "vllm:hisparse_pending_page_transfers"}),
    hisparse_passthrough=frozenset({"vllm:hisparse_host_cache_usage_perc",
                                    "vllm:hisparse_pending_page_transfers"}) | _VLLM_HISTOGRAMS,
    why_not={**_VLLM_WHY,
             "hisparse_kv_blocks": "this revision exports only a usage ratio "
                                   "(vllm:hisparse_host_cache_usage_perc, passed through)",
             "hisparse_kv_blocks_limit": "this revision exports only a usage ratio",
             "hisparse_kv_memory_bytes": "vLLM exports host pool usage, not bytes per tier"},
)

# A vLLM without the HiSparse connector's host-tier gauges (HiSparse off, or not reported yet).
VLLM_BASE = EngineMap(
    engine="vllm", revision="no-host-tier",
    title="vLLM without HiSparse host-tier gauges (HiSparse off, or no host-tier report yet)",
    source="vllm-project/vllm vllm/v1/metrics/loggers.py",
    rules=_VLLM_COMMON,
    hisparse_passthrough=_VLLM_HISTOGRAMS,
    why_not=VLLM_B.why_not,
)

# --- SGLang ---------------------------------------------------------------------------------------

# The decode log line (SGLang PoolStats.get_decode_usage_msg_parts with HiSparse on) read by
# easymats.sources.decodelog, as samples under this prefix: it is easymats' name for what the log
# says, not a series SGLang exports.
LOG_PREFIX = "sglang_log:"

SGLANG = EngineMap(
    engine="sglang", revision="multiprocess",
    title="SGLang (prometheus_client multiprocess files or /metrics; HiCache; HiSparse decode log)",
    source="sgl-project/sglang python/sglang/srt/metrics/collector.py @00ae9c1 and "
           "observability/metrics_collector.py (HiCache series); decode log: "
           "managers/scheduler_runtime_checker_mixin.py PoolStats",
    rules=(
        rule('hisparse_tokens_total{phase="prefill"}', 'sglang:realtime_tokens_total{mode="prefill_compute"}',
             "sglang:prompt_tokens_total",
             note="tokens prefilled by compute (prefix-cache hits excluded where SGLang says so)"),
        rule('hisparse_tokens_total{phase="decode"}', 'sglang:realtime_tokens_total{mode="decode"}',
             "sglang:generation_tokens_total"),
        rule("hisparse_sequences", "sglang:num_running_reqs", f"{LOG_PREFIX}running_reqs"),
        rule("hisparse_context_tokens", "sglang:num_used_tokens",
             note="tokens held in the logical KV pool"),
        rule("hisparse_hot_buffer_resident_tokens", f"{LOG_PREFIX}gpu_tokens",
             note="'#gpu token' of the decode log: tokens in the device hot buffers"),
        # SGLang's HiSparse is token-granular (page_size 1): its host pool "blocks" are token slots.
        rule('hisparse_kv_blocks{state="active"}', "sglang:hicache_host_used_tokens",
             "sglang:hisparse_host_pool_total_tokens - sglang:hisparse_host_pool_free_tokens",
             f"{LOG_PREFIX}cpu_tokens",
             note="host pool token slots in use (HiCache gauges, else the decode log's '#cpu token')"),
        rule('hisparse_kv_blocks{state="free"}',
             "sglang:hicache_host_total_tokens - sglang:hicache_host_used_tokens",
             "sglang:hisparse_host_pool_free_tokens"),
        rule("hisparse_kv_blocks_limit", "sglang:hicache_host_total_tokens",
             "sglang:hisparse_host_pool_total_tokens"),
        rule("hisparse_backup_bytes_total", "sglang:hicache_backup_bytes_total",
             note="device-to-host write-back bytes of the HiCache host tier"),
        rule("hisparse_swap_in_bytes_total", "sglang:load_back_bytes_total",
             note="host-to-device load-back bytes of the HiCache host tier"),
    ),
    hisparse_passthrough=frozenset({
        f"{LOG_PREFIX}gpu_token_usage", f"{LOG_PREFIX}cpu_token_usage", f"{LOG_PREFIX}queue_reqs",
        f"{LOG_PREFIX}gen_throughput", "sglang:token_usage", "sglang:max_total_num_tokens",
        "sglang:hicache_backup_tokens_total", "sglang:load_back_tokens_total",
        "sglang:hicache_dropped_tokens_total", "sglang:hisparse_host_pool_pinned_tokens",
        "sglang:hisparse_host_pool_evictable_tokens", "sglang:hisparse_host_pool_wait_events",
        "sglang:hisparse_host_pool_wait_age_s"}),
    replica_labels=("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank"),
    why_not={
        "hisparse_anchor_lookups_total": "SGLang HiSparse selects with the DSA indexer: no anchors, no audit",
        "hisparse_anchor_hits_total": "SGLang HiSparse selects with the DSA indexer: no anchors, no audit",
        "hisparse_anchors": "SGLang HiSparse has no importance probe",
        "hisparse_anchor_threshold_ratio": "SGLang HiSparse has no importance probe",
        "hisparse_recalibrations_total": "no probe to recalibrate and no control channel",
        "hisparse_hot_buffer_lookups_total": "SGLang exports no hit or miss counters (the swap-in kernel "
                                             "can count misses; nothing upstream exports them)",
        "hisparse_hot_buffer_hits_total": "SGLang exports no hit or miss counters",
        "hisparse_hot_buffer_capacity_tokens": "the decode log gives usage to two decimals only",
        "hisparse_prefetch_issued_total": "SGLang HiSparse does not prefetch",
        "hisparse_prefetch_used_total": "SGLang HiSparse does not prefetch",
        "hisparse_kv_tokens_loaded_total": "SGLang HiSparse is token-granular: no block density",
        "hisparse_kv_tokens_used_total": "SGLang HiSparse is token-granular: no block density",
        "hisparse_kv_memory_bytes": "SGLang exports tokens, not bytes per tier",
        "hisparse_quant_blocks_total": "SGLang does not quantize the host KV per block",
        "hisparse_quant_block_relative_error": "SGLang does not quantize the host KV per block",
        "hisparse_step_duration_seconds": "SGLang's latency histograms are per request, not per step",
        "hisparse_kv_block_allocations_total": "SGLang exports host pool levels, not block events",
        "hisparse_kv_block_recycles_total": "SGLang exports host pool levels, not block events",
        "hisparse_kv_block_reclaims_total": "SGLang exports host pool levels, not block events",
        "hisparse_kv_block_evictions_total": "SGLang exports host pool levels, not block events "
                                             "(sglang:hicache_dropped_tokens_total is passed through)",
        "hisparse_runtime_info": "SGLang's own labels (model_name, engine_type) are on its series",
        "hisparse_config_info": "SGLang exports no HiSparse configuration",
    },
)

VLLM_MAPS = (VLLM_A, VLLM_B, VLLM_BASE)
ENGINE_MAPS: tuple[EngineMap, ...] = (VLLM_A, VLLM_B, VLLM_BASE, SGLANG)
DEFAULT_WHY = "the engine exports nothing with this meaning"


def choose(sample_names: Iterable[str]) -> EngineMap | None:
    """The map for an exposition with these sample names, or None when no engine is recognised.

    The engine is the one whose prefix most names carry; among vLLM revisions, the one whose
    revision-only names are present (a vLLM without them gets the common rules only).
    """
    names = set(sample_names)
    vllm = sum(1 for n in names if n.startswith("vllm:"))
    sglang = sum(1 for n in names if n.startswith(("sglang:", LOG_PREFIX)))
    if not vllm and not sglang:
        return None
    if sglang > vllm:
        return SGLANG
    for m in VLLM_MAPS:
        if m.detect & names:
            return m
    return VLLM_BASE


def wanted_samples(maps_: Iterable[EngineMap] = ENGINE_MAPS) -> frozenset[str]:
    """Every engine sample name a table reads, detects a revision by, or logs: what a 10 Hz read
    must parse. The rest of an exposition only passes through to /metrics (read at scrape time)."""
    out: set[str] = set()
    for m in maps_:
        out |= m.hisparse_samples() | m.detect
    return frozenset(out)


def why_not(emap: EngineMap, metric: str) -> str:
    return emap.why_not.get(metric, DEFAULT_WHY)


def check_maps(maps: Iterable[EngineMap] = ENGINE_MAPS) -> list[str]:
    """Problems in the tables: unknown catalogue names or labels, counters fed by gauges."""
    out = []
    for m in maps:
        seen = set()
        for r in m.rules:
            where = f"{m.key} {r.series}"
            try:
                spec = catalogue.get(r.metric)
                catalogue.check_labels(spec, dict(r.labels))
            except catalogue.UnknownMetricError as exc:
                out.append(f"{where}: {exc}")
                continue
            if spec.source != catalogue.RUNTIME:
                out.append(f"{where}: {r.metric} is not a runtime metric")
            if r.series in seen:
                out.append(f"{where}: mapped twice")
            seen.add(r.series)
            for way in r.ways:
                if spec.type == catalogue.COUNTER and any(
                        t.sign < 0 or not t.sample.endswith("_total") for t in way):
                    out.append(f"{where}: a counter must be a sum of engine counters (*_total)")
        for name in m.why_not:
            if name not in catalogue.CATALOGUE:
                out.append(f"{m.key}: why_not names {name!r}, which the catalogue lacks")
    return out
