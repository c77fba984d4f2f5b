"""Generate the Grafana dashboards with grafana-foundation-sdk: dashboards/hisparse.json (one
node's HiSparse health in detail), dashboards/fleet.json (a fleet overview, worst targets first)
and both as a ConfigMap for Grafana's dashboard sidecar in deploy/kubernetes/.

    python dashboards/build.py            # rewrite the three files
    python dashboards/build.py --check    # exit 1 if one is stale or a query names a metric
                                          # that the catalogue or the recording rules lack

Threshold lines come from :mod:`easymats.thresholds` (the same numbers the alert rules use) and
the ratio panels query the recording rules of ``alerts/build.py``, so a panel and the alert on it
show the same number. Every detail query filters on the ``job``, ``node``, ``instance`` and
``target`` variables; the fleet board reads only what a global Prometheus federates (the node and
target level rules, alerts/build.py FEDERATE_MATCH) and filters on cluster, namespace, node and
instance. Its node table links each node to the detail board.
Needs the ``dashboards`` extra: grafana-foundation-sdk==1769699379!11.6.0 (schemaVersion 41).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from alerts import build as rules, promql  # noqa: E402
from easymats import catalogue, thresholds as T  # noqa: E402
from easymats.catalogue import RATIO  # noqa: E402

DASHBOARD_PATH = os.path.join(ROOT, "dashboards", "hisparse.json")
FLEET_PATH = os.path.join(ROOT, "dashboards", "fleet.json")
CONFIGMAP_PATH = os.path.join(ROOT, "deploy", "kubernetes", "grafana-dashboards.yaml")
UID = "hisparse-health"
FLEET_UID = "hisparse-fleet"
DS = "${datasource}"
# Label filters of every query: agent-level series (no target label) use AGENT_SEL. A series
# without a node label (one box, no fleet) matches node=~".*" too.
AGENT_SEL = 'job=~"$job", node=~"$node", instance=~"$instance"'
SEL = AGENT_SEL + ', target=~"$target"'
RI = "$__rate_interval"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    instant: bool = False
    # Drawn as a plain line, never stacked: a limit or a peak over a stacked panel of parts.
    unstacked: bool = False


@dataclass(frozen=True)
class Line:
    """A threshold line: below ``value`` is bad for "min", above it for "max"."""
    value: float
    direction: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    line: Line | None = None
    stacked: bool = False
    bars: bool = False
    ratio: bool = False  # 0..1 axis
    kind: str = "timeseries"  # or "table"
    width: int = 8
    # Tables: the column to sort by and whether descending (worst first), and per-column links
    # (column, title, url with Grafana's ${__data.fields.<column>}).
    sort: tuple[str, bool] | None = None
    links: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[PanelSpec, ...] = field(default_factory=tuple)


def _q(expr: str, legend: str = "{{target}}", unstacked: bool = False) -> Query:
    return Query(expr, legend, unstacked=unstacked)


RECALIBRATION_ANNOTATION = (f"sum by (target, reason) (increase(hisparse_recalibrations_total{{{SEL}}}[{RI}])) > 0")

ROWS: tuple[Row, ...] = (
    Row("Selection health", (
        PanelSpec(RATIO["anchor_hit_rate"].title,
                  "The share of the audited exact attention (a sampled layer and head) that fell on the "
                  "tokens the selection held (audit_measure=top_m: of the true top-m tokens). Below the "
                  "line for the alert's duration, the runtime is asked "
                  "to recalibrate; recalibrations are drawn as annotations.",
                  "percentunit", (_q(f"{RATIO['anchor_hit_rate'].record}{{{SEL}}}"),),
                  line=Line(T.ANCHOR_HIT_RATE_MIN, "min"), ratio=True),
        PanelSpec("Recalibrations by reason",
                  "Recalibrations of anchors and probe: schedule (every recalibrate_every tokens), "
                  "request (the webhook or easymats recalibrate) and drift (the runtime's own floor).",
                  "short", (_q(f"sum by (target, reason) (increase(hisparse_recalibrations_total{{{SEL}}}[{RI}]))",
                               "{{target}} {{reason}}"),), bars=True),
        PanelSpec("Anchors and probe threshold",
                  "Anchor tokens pinned by the importance probe, and the probe's current threshold.",
                  "short", (_q(f"sum by (target) (hisparse_anchors{{{SEL}}})", "{{target}} anchors"),
                            _q(f"max by (target) (hisparse_anchor_threshold_ratio{{{SEL}}})",
                               "{{target}} threshold"))),
    )),
    Row("Hot buffer and prefetch", (
        PanelSpec(RATIO["hot_buffer_hit_rate"].title,
                  "Selected tokens already resident in the device hot buffer. Low: most of each selection "
                  "is copied from host every step.",
                  "percentunit", (_q(f"{RATIO['hot_buffer_hit_rate'].record}{{{SEL}}}"),),
                  line=Line(T.HOT_BUFFER_HIT_RATE_MIN, "min"), ratio=True),
        PanelSpec(RATIO["prefetch_efficiency"].title,
                  "Prefetched tokens that a selection hit before eviction.",
                  "percentunit", (_q(f"{RATIO['prefetch_efficiency'].record}{{{SEL}}}"),),
                  line=Line(T.PREFETCH_EFFICIENCY_MIN, "min"), ratio=True),
        PanelSpec("Hot buffer occupancy",
                  "Token slots holding a token, slots in all, and the peak the 100 ms samples saw.",
                  "short", (_q(f"sum by (target) (hisparse_hot_buffer_resident_tokens{{{SEL}}})",
                               "{{target}} resident"),
                            _q(f"sum by (target) (hisparse_hot_buffer_capacity_tokens{{{SEL}}})",
                               "{{target}} capacity"),
                            _q(f"max by (target) (easymats_hot_buffer_resident_tokens_max{{{SEL}}})",
                               "{{target}} peak (100 ms samples)"))),
        PanelSpec("Swap-in and backup traffic",
                  "Host-to-device bytes into the hot buffer, and device-to-host backup of new KV.",
                  "Bps", (_q(f"sum by (target) (rate(hisparse_swap_in_bytes_total{{{SEL}}}[{RI}]))",
                             "{{target}} swap-in"),
                          _q(f"sum by (target) (rate(hisparse_backup_bytes_total{{{SEL}}}[{RI}]))",
                             "{{target}} backup"))),
    )),
    Row("KV blocks", (
        PanelSpec("KV blocks by state",
                  "Host KV blocks active, free and waiting in pending_recycle (stacked: the pool's "
                  "current size), the peak of active blocks between scrapes, and the pool's limit "
                  "(host_pool_blocks; absent for a pool that grows on demand, which has none).",
                  "short", (_q(f"sum by (target, state) (hisparse_kv_blocks{{{SEL}}})", "{{target}} {{state}}"),
                            _q(f"max by (target) (easymats_kv_active_blocks_max{{{SEL}}})",
                               "{{target}} peak active (100 ms samples)", unstacked=True),
                            _q(f"max by (target) (hisparse_kv_blocks_limit{{{SEL}}}) > 0",
                               "{{target}} limit", unstacked=True)), stacked=True),
        PanelSpec(RATIO["block_recycle_rate"].title,
                  "Blocks returned to the free pool per second, as a share of active blocks. Only a "
                  "problem while blocks wait in pending_recycle.",
                  "percentunit", (_q(f"{RATIO['block_recycle_rate'].record}{{{SEL}}}"),),
                  line=Line(T.BLOCK_RECYCLE_RATE_MIN, "min")),
        PanelSpec("Free blocks",
                  "Headroom of the host KV pool against its limit: (limit - active - pending_recycle) "
                  "/ limit. A pool that grows on demand has no limit and no line here.",
                  "percentunit", (_q(f"{rules.FREE_BLOCKS_RATIO}{{{SEL}}}"),),
                  line=Line(T.KV_FREE_BLOCKS_RATIO_MIN, "min"), ratio=True),
        PanelSpec("Block lifecycle",
                  "Blocks allocated, recycled, reclaimed within their grace period, and overwritten by "
                  "streaming mode, per second.",
                  "ops", (_q(f"sum by (target) (rate(hisparse_kv_block_allocations_total{{{SEL}}}[{RI}]))",
                             "{{target}} allocated"),
                          _q(f"sum by (target) (rate(hisparse_kv_block_recycles_total{{{SEL}}}[{RI}]))",
                             "{{target}} recycled"),
                          _q(f"sum by (target) (rate(hisparse_kv_block_reclaims_total{{{SEL}}}[{RI}]))",
                             "{{target}} reclaimed"),
                          _q(f"sum by (target) (rate(hisparse_kv_block_evictions_total{{{SEL}}}[{RI}]))",
                             "{{target}} evicted"))),
        PanelSpec(RATIO["block_density"].title,
                  "Selected tokens per token in the blocks selection touched: low density means block "
                  "loads carry many unused tokens (a smaller cache_block_size helps).",
                  "percentunit", (_q(f"{RATIO['block_density'].record}{{{SEL}}}"),), ratio=True),
    )),
    Row("Quantization", (
        PanelSpec("Quantization error quantiles",
                  "Quantiles of the per-block relative error ||x - q(x)|| / ||x|| of quantized host blocks.",
                  "short", (_q(f"{rules.QUANT_ERROR_QUANTILE}{{{SEL}}}", "{{target}} p{{quantile}}"),),
                  line=Line(T.QUANT_ERROR_P99_MAX, "max")),
        PanelSpec("Quantized blocks by bit width",
                  "Host KV blocks quantized per second, by the bit width the policy chose.",
                  "ops", (_q(f"sum by (target, bits) (rate(hisparse_quant_blocks_total{{{SEL}}}[{RI}]))",
                             "{{target}} INT{{bits}}"),), stacked=True),
    )),
    Row("Memory and context", (
        PanelSpec("KV memory by tier and kind",
                  "KV bytes on the device and host tiers, data and metadata (page tables), with the "
                  "device peak the 100 ms samples saw.",
                  "bytes", (_q(f"sum by (target, tier, kind) (hisparse_kv_memory_bytes{{{SEL}}})",
                               "{{target}} {{tier}} {{kind}}"),
                            _q(f"max by (target) (easymats_device_kv_bytes_max{{{SEL}}})",
                               "{{target}} device peak (100 ms samples)"))),
        PanelSpec("Context held",
                  "Tokens held in the KV cache and live sequences.",
                  "short", (_q(f"sum by (target) (hisparse_context_tokens{{{SEL}}})", "{{target}} tokens"),
                            _q(f"sum by (target) (hisparse_sequences{{{SEL}}})", "{{target}} sequences"))),
        PanelSpec("Runtime and configuration",
                  "Version, model, device and HiSparse settings of each target.",
                  "short", (Query(f"max by (target, version, model, device) (hisparse_runtime_info{{{SEL}}})",
                                  "", instant=True),
                            Query(f"max by (target, window_size, global_tokens, block_size, top_k, "
                                  f"device_buffer_tokens, host_kv_bits) (hisparse_config_info{{{SEL}}})",
                                  "", instant=True)), kind="table"),
    )),
    Row("Latency and throughput", (
        PanelSpec("Decode step latency",
                  "Quantiles of the decode step latency inside the runtime.",
                  "s", (_q(f"{rules.STEP_QUANTILE}{{{SEL}}}", "{{target}} p{{quantile}}"),)),
        PanelSpec("Tokens per second",
                  "Prefill and decode tokens processed per second.",
                  "short", (_q(f"sum by (target, phase) (rate(hisparse_tokens_total{{{SEL}}}[{RI}]))",
                               "{{target}} {{phase}}"),)),
    )),
    Row("GPU and process", (
        PanelSpec("GPU utilization",
                  "Whole-GPU utilization and the target process's SM share (NVML; absent without a GPU).",
                  "percentunit", (_q(f"max by (gpu) (easymats_gpu_utilization_ratio{{{AGENT_SEL}}})", "GPU {{gpu}}"),
                                  _q(f"sum by (target, gpu) (easymats_process_gpu_utilization_ratio{{{SEL}}})",
                                     "{{target}} on GPU {{gpu}}")), ratio=True),
        PanelSpec("GPU memory",
                  "GPU memory used and in all (NVML), and what the target process holds.",
                  "bytes", (_q(f"max by (gpu) (easymats_gpu_memory_used_bytes{{{AGENT_SEL}}})", "GPU {{gpu}} used"),
                            _q(f"max by (gpu) (easymats_gpu_memory_total_bytes{{{AGENT_SEL}}})", "GPU {{gpu}} total"),
                            _q(f"sum by (target, gpu) (easymats_process_gpu_memory_bytes{{{SEL}}})",
                               "{{target}} on GPU {{gpu}}"))),
        PanelSpec("Process CPU",
                  "CPU cores the target process uses (1 = one core busy).",
                  "short", (_q(f"sum by (target) (rate(easymats_process_cpu_seconds_total{{{SEL}}}[{RI}]))",
                               "{{target}}"),)),
        PanelSpec("Process resident memory",
                  "Resident memory of the target process (host KV blocks live here).",
                  "bytes", (_q(f"sum by (target) (easymats_process_resident_memory_bytes{{{SEL}}})"),)),
    )),
    Row("easymats agent", (
        PanelSpec("Targets up",
                  "1 while the agent reads the target's segment at every sample, 0 when it cannot.",
                  "short", (_q(f"max by (target) (easymats_target_up{{{SEL}}})"),)),
        PanelSpec("Heartbeat age",
                  "Seconds since the target last published; a runtime that hangs keeps its segment but "
                  "stops its heartbeat.",
                  "s", (_q(f"max by (target) (time() - easymats_target_heartbeat_timestamp_seconds{{{SEL}}})"),)),
        PanelSpec("Sampling lag",
                  "Quantiles of how late the agent's sampling ticks ran against their schedule.",
                  "s", (_q(f"{rules.LAG_QUANTILE}{{{AGENT_SEL}}}", "{{instance}} p{{quantile}}"),),
                  line=Line(T.SAMPLE_LAG_P99_MAX_S, "max")),
        PanelSpec("Samples, errors and retries",
                  "Samples per second, failed samples, and segment reads retried because a publish was "
                  "in progress.",
                  "ops", (_q(f"sum by (target) (rate(easymats_samples_total{{{SEL}}}[{RI}]))", "{{target}} samples"),
                          _q(f"sum by (target) (rate(easymats_sample_errors_total{{{SEL}}}[{RI}]))",
                             "{{target}} errors"),
                          _q(f"sum by (target) (rate(easymats_segment_read_retries_total{{{SEL}}}[{RI}]))",
                             "{{target}} retries"))),
        PanelSpec("Webhook and recalibration requests",
                  "Alertmanager webhook calls by HTTP status, and recalibration requests written to each "
                  "target's control file.",
                  "short", (_q(f"sum by (code) (increase(easymats_webhook_requests_total{{{AGENT_SEL}}}[{RI}]))",
                               "webhook {{code}}"),
                            _q(f"sum by (target) (increase(easymats_recalibration_requests_total{{{SEL}}}[{RI}]))",
                               "{{target}} requests")), bars=True),
    )),
)


# -- the fleet board: what a global Prometheus federates ---------------------------------------------
FLEET_NODE_SEL = 'cluster=~"$cluster", node=~"$node"'
FLEET_SEL = FLEET_NODE_SEL + ', namespace=~"$namespace", instance=~"$instance"'
CLUSTER_SEL = 'cluster=~"$cluster"'
WORST = 10
# A node's row links to the detail board for that node, over the same time range.
NODE_LINK = ("node", "Open this node in HiSparse health",
             f"/d/{UID}/hisparse-health?var-node=${{__data.fields.node}}&${{__url_time_range}}")


def _worst(title: str, description: str, unit: str, expr: str, desc: bool) -> PanelSpec:
    return PanelSpec(title, description, unit, (Query(expr, "", instant=True),), kind="table",
                     sort=("Value", desc), links=(NODE_LINK,))


FLEET_ROWS: tuple[Row, ...] = (
    Row("Fleet", (
        PanelSpec("Anchor hit rate by cluster",
                  "Audited anchor hits over lookups, summed over every node of the cluster before "
                  "dividing (a fleet-wide rule on the global Prometheus).",
                  "percentunit", (_q(f"{rules.cluster_ratio(rules.ANCHOR_HIT_RATIO)}{{{CLUSTER_SEL}}}",
                                     "{{cluster}}"),),
                  line=Line(T.ANCHOR_HIT_RATE_MIN, "min"), ratio=True),
        PanelSpec("Targets up",
                  "Runtime targets whose segment the agents read, all targets, and nodes reporting.",
                  "short", (_q(f"{rules.CLUSTER_TARGETS_UP}{{{CLUSTER_SEL}}}", "{{cluster}} up"),
                            _q(f"{rules.CLUSTER_TARGETS}{{{CLUSTER_SEL}}}", "{{cluster}} targets"),
                            _q(f"{rules.CLUSTER_NODES}{{{CLUSTER_SEL}}}", "{{cluster}} nodes"))),
        PanelSpec("Tokens per second",
                  "Prefill and decode tokens processed per second over the cluster.",
                  "short", (_q(f"{rules.CLUSTER_TOKENS}{{{CLUSTER_SEL}}}", "{{cluster}}"),)),
    )),
    Row("Worst targets first", (
        _worst("Lowest anchor hit rate",
               f"The {WORST} targets whose selection holds the least of the audited attention.",
               "percentunit", f"bottomk({WORST}, {rules.ANCHOR_HIT_RATIO}{{{FLEET_SEL}}})", desc=False),
        _worst("Highest sampling lag",
               f"The {WORST} agents whose sampling ticks run latest (p99): they miss peaks.",
               "s", f'topk({WORST}, {rules.LAG_QUANTILE}{{quantile="0.99", {FLEET_SEL}}})', desc=True),
        _worst("Recently restarted",
               f"Counter resets of each target's token counter over {rules.RESTART_WINDOW}: runtimes "
               "that restarted, most restarts first.",
               "short", f"topk({WORST}, {rules.RESTARTS}{{{FLEET_SEL}}})", desc=True),
        _worst("Targets down",
               "Targets whose segment the agent cannot read (0) first: the runtime exited, hung or "
               "broke its segment.",
               "short", f"bottomk({WORST}, easymats_target_up{{{FLEET_SEL}}})", desc=False),
    )),
    Row("Nodes", (
        PanelSpec("Nodes, lowest anchor hit rate first",
                  "One row per node: anchor and hot buffer hit rates over its targets, targets up of "
                  "all, tokens per second. The node name opens the node in HiSparse health.",
                  "short", (Query(f"{rules.node_ratio(rules.ANCHOR_HIT_RATIO)}{{{FLEET_NODE_SEL}}}", "", instant=True),
                            Query(f"{rules.node_ratio(rules.HOT_BUFFER_RATIO)}{{{FLEET_NODE_SEL}}}", "", instant=True),
                            Query(f"{rules.NODE_TARGETS_UP}{{{FLEET_NODE_SEL}}}", "", instant=True),
                            Query(f"{rules.NODE_TARGETS}{{{FLEET_NODE_SEL}}}", "", instant=True),
                            Query(f"{rules.NODE_TOKENS}{{{FLEET_NODE_SEL}}}", "", instant=True)),
                  kind="table", width=24, sort=("Value #A", False), links=(NODE_LINK,)),
        PanelSpec("Anchor hit rate by node",
                  "Each node's anchor hit rate over its targets (a node-level rule at the edge).",
                  "percentunit", (_q(f"{rules.node_ratio(rules.ANCHOR_HIT_RATIO)}{{{FLEET_NODE_SEL}}}",
                                     "{{cluster}} {{node}}"),),
                  line=Line(T.ANCHOR_HIT_RATE_MIN, "min"), ratio=True, width=12),
        PanelSpec("Targets up by node",
                  "Targets read per node, against the targets the node's agent knows.",
                  "short", (_q(f"{rules.NODE_TARGETS_UP}{{{FLEET_NODE_SEL}}}", "{{cluster}} {{node}} up"),
                            _q(f"{rules.NODE_TARGETS}{{{FLEET_NODE_SEL}}}", "{{cluster}} {{node}} targets")),
                  width=12),
    )),
)


def _threshold_steps(line: Line) -> list:
    from grafana_foundation_sdk.models.dashboard import Threshold

    if line.direction == "min":  # red below the floor, green from it up
        return [Threshold(color="red", value=None), Threshold(color="green", value=line.value)]
    return [Threshold(color="green", value=None), Threshold(color="red", value=line.value)]


def _panel(spec: PanelSpec, panel_id: int):
    from grafana_foundation_sdk.builders import common as cb, dashboard, prometheus, table, timeseries
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, DynamicConfigValue, ThresholdsMode

    ds = DataSourceRef(type_val="prometheus", uid=DS)
    if spec.kind == "table":
        p = table.Panel()
    else:
        p = timeseries.Panel().legend(cb.VizLegendOptions().show_legend(True)
                                      .display_mode(common.LegendDisplayMode.LIST)
                                      .placement(common.LegendPlacement.BOTTOM))
        if spec.line is not None:
            p = (p.thresholds(dashboard.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE)
                              .steps(_threshold_steps(spec.line)))
                 .thresholds_style(cb.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.DASHED)))
        if spec.stacked:
            p = p.stacking(cb.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(30)
        if spec.bars:
            p = p.draw_style(common.GraphDrawStyle.BARS).fill_opacity(60)
        if spec.ratio:
            p = p.min(0).max(1)
    p = (p.id(panel_id).title(spec.title).description(spec.description).datasource(ds)
         .unit(spec.unit).height(8).span(spec.width))
    if spec.kind == "table":
        p = _table_options(p, spec)
    for i, q in enumerate(spec.queries):
        target = prometheus.Dataquery().expr(q.expr).ref_id(chr(ord("A") + i)).datasource(ds)
        if q.instant:
            target = target.instant().format(_table_format())
        else:
            target = target.legend_format(q.legend)
        p = p.with_target(target)
        if q.unstacked and spec.stacked:
            p = p.override_by_query(chr(ord("A") + i), [
                DynamicConfigValue(id_val="custom.stacking", value={"mode": "none", "group": "A"}),
                DynamicConfigValue(id_val="custom.fillOpacity", value=0),
                DynamicConfigValue(id_val="custom.lineWidth", value=2),
                DynamicConfigValue(id_val="custom.lineStyle", value={"fill": "dash", "dash": [10, 10]}),
            ])
    marker = not_provided_query(spec) if any("$target" in q.expr for q in spec.queries) else None
    if marker is not None:
        p = p.description(spec.description + _not_provided_note(spec))
        target = prometheus.Dataquery().expr(marker.expr).ref_id(NOT_PROVIDED_REF).datasource(ds)
        if marker.instant:  # a table lists the missing metrics as rows
            p = p.with_target(target.instant().format(_table_format()))
        else:  # a legend entry says it; no line is drawn for it
            p = p.with_target(target.legend_format(marker.legend))
            p = p.override_by_query(NOT_PROVIDED_REF, [DynamicConfigValue(
                id_val="custom.hideFrom", value={"legend": False, "tooltip": False, "viz": True})])
    return p


def _table_options(p, spec: PanelSpec):
    """Merge several instant queries into one row per label set, hide the time column, sort
    worst first and link columns."""
    from grafana_foundation_sdk.builders import common as cb
    from grafana_foundation_sdk.models.dashboard import DataTransformerConfig, DynamicConfigValue

    if len(spec.queries) > 1:
        p = p.with_transformation(DataTransformerConfig(id_val="merge", options={}))
    p = p.with_transformation(DataTransformerConfig(id_val="organize", options={
        "excludeByName": {"Time": True, "__name__": True}}))
    if spec.sort is not None:
        p = p.sort_by([cb.TableSortByFieldState().display_name(spec.sort[0]).desc(spec.sort[1])])
    for column, title, url in spec.links:
        p = p.override_by_name(column, [DynamicConfigValue(id_val="links", value=[{"title": title, "url": url}])])
    return p


def _table_format():
    from grafana_foundation_sdk.models.prometheus import PromQueryFormat

    return PromQueryFormat.TABLE


# -- "not provided": engine targets (vLLM, SGLang; docs/engines.md) lack some catalogue metrics ----
# A panel that draws runtime metrics per target also asks which of them a target's serving engine
# cannot provide: such a target appears in the legend as "<metric> not provided by vllm" instead
# of leaving the panel silently empty, and the description names the engine revisions that lack
# them. Only per-target panels (their queries filter on $target) get it.

# refId of the query that names, per target, the metrics its engine cannot provide.
NOT_PROVIDED_REF = "NP"


def _derived() -> dict[str, str]:
    """Agent series that exist only when a runtime metric does (peaks of a gauge; recalibration
    requests need the control channel that the recalibrations counter stands for)."""
    from easymats.targets import PEAK_SOURCES

    return {**{peak: src for peak, (src, _) in PEAK_SOURCES.items()},
            "easymats_recalibration_requests_total": "hisparse_recalibrations_total"}


def runtime_metrics_of(expr: str) -> list[str]:
    """The runtime catalogue metrics a query draws, through recording rules and peak gauges."""
    records = {r.record: r.expr for r in rules.recording_rules()}
    derived = _derived()
    out: list[str] = []
    todo = promql.metric_names(expr)
    while todo:
        name = todo.pop(0)
        if name in records:
            todo.extend(promql.metric_names(records.pop(name)))
            continue
        name = derived.get(name, name)
        for suffix in ("_bucket", "_sum", "_count"):  # a histogram's parts name the histogram
            base = name[:-len(suffix)] if name.endswith(suffix) else None
            if base and getattr(catalogue.CATALOGUE.get(base), "type", None) == catalogue.HISTOGRAM:
                name = base
        spec = catalogue.CATALOGUE.get(name)
        if spec is not None and spec.source == catalogue.RUNTIME and name not in out:
            out.append(name)
    return out


def not_provided_query(spec: PanelSpec) -> Query | None:
    """The panel's "not provided" query: its runtime metrics that a target's engine lacks."""
    metrics = [m for q in spec.queries for m in runtime_metrics_of(q.expr)]
    if not metrics:
        return None
    pattern = "|".join(dict.fromkeys(metrics))
    return Query(f'max by (target, engine, metric) (easymats_target_not_provided_info{{{SEL}, metric=~"{pattern}"}})',
                 "{{target}}: {{metric}} not provided by {{engine}}", instant=spec.kind == "table")


def _not_provided_note(spec: PanelSpec) -> str:
    from easymats.sources import maps as engine_maps

    metrics = {m for q in spec.queries for m in runtime_metrics_of(q.expr)}
    lacking = [m.key for m in engine_maps.ENGINE_MAPS if metrics & set(m.not_provided())]
    if not lacking:
        return ""
    return (f" Not provided by {', '.join(lacking)}: those targets are listed as \"not provided\" "
            "(docs/engines.md).")


def _variable(name: str, label: str, query: str):
    from grafana_foundation_sdk.builders import dashboard
    from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh, VariableSort

    return (dashboard.QueryVariable(name).label(label).query(query)
            .datasource(DataSourceRef(type_val="prometheus", uid=DS))
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(".*"))


VARIABLE_QUERIES = {
    "job": "label_values(easymats_build_info, job)",
    "node": 'label_values(easymats_build_info{job=~"$job"}, node)',
    "instance": 'label_values(easymats_build_info{job=~"$job", node=~"$node"}, instance)',
    "target": f"label_values(easymats_target_up{{{AGENT_SEL}}}, target)",
}
FLEET_VARIABLE_QUERIES = {
    "cluster": f"label_values({rules.NODE_TARGETS}, cluster)",
    "namespace": 'label_values(easymats_target_up{cluster=~"$cluster"}, namespace)',
    "node": f"label_values({rules.NODE_TARGETS}{{cluster=~\"$cluster\"}}, node)",
    "instance": (f'label_values(up{{job="{rules.AGENT_JOB}", cluster=~"$cluster", namespace=~"$namespace", '
                 'node=~"$node"}, instance)'),
}


def _board(title: str, uid: str, description: str, variables: dict[str, str], rows: tuple[Row, ...],
           annotation: str | None = None, link_to: tuple[str, str] | None = None) -> dict:
    from grafana_foundation_sdk.builders import dashboard
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DashboardLinkType, DataSourceRef

    d = (dashboard.Dashboard(title).uid(uid).description(description + " Generated by "
                                                          "dashboards/build.py; do not edit by hand.")
         .tags(["hisparse", "easymats"]).time("now-1h", "now").refresh("30s")
         .tooltip(DashboardCursorSync.CROSSHAIR).readonly())
    d = d.with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    for name, query in variables.items():
        d = d.with_variable(_variable(name, name.capitalize(), query))
    d = d.annotation(dashboard.AnnotationQuery().name("Annotations & Alerts").built_in(1).type("dashboard")
                     .datasource(DataSourceRef(type_val="grafana", uid="-- Grafana --"))
                     .enable(True).hide(True).icon_color("rgba(0, 211, 255, 1)"))
    if annotation:
        d = d.annotation(dashboard.AnnotationQuery().name("Recalibrations")
                         .datasource(DataSourceRef(type_val="prometheus", uid=DS))
                         .enable(True).icon_color("purple").expr(annotation))
    if link_to:
        d = d.link(dashboard.DashboardLink(link_to[0]).type(DashboardLinkType.LINK).url(link_to[1])
                   .keep_time(True).include_vars(False).target_blank(False).as_dropdown(False)
                   .icon("dashboard").tooltip(link_to[0]))
    panel_id = 1
    for row in rows:
        d = d.with_row(dashboard.Row(row.title).id(panel_id))
        panel_id += 1
        for spec in row.panels:
            d = d.with_panel(_panel(spec, panel_id))
            panel_id += 1
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(d.build()))


def build_dashboard() -> dict:
    """The detail dashboard (one node or box) as a JSON-ready dict."""
    return _board("HiSparse health", UID,
                  "HiSparse KV-cache runtime health as seen by easymats: selection, hot buffer, "
                  "blocks, quantization, memory, latency, GPU and the agent itself.",
                  VARIABLE_QUERIES, ROWS, annotation=RECALIBRATION_ANNOTATION,
                  link_to=("HiSparse fleet", f"/d/{FLEET_UID}/hisparse-fleet"))


def build_fleet_dashboard() -> dict:
    """The fleet overview (on a global Prometheus) as a JSON-ready dict."""
    return _board("HiSparse fleet", FLEET_UID,
                  "Every cluster, node and target from the federated node- and target-level rules: "
                  "fleet-wide rates, the worst targets first, one row per node linking to its detail.",
                  FLEET_VARIABLE_QUERIES, FLEET_ROWS,
                  link_to=("HiSparse health", f"/d/{UID}/hisparse-health"))


def configmap(boards: dict[str, dict]) -> dict:
    """The dashboards as one ConfigMap that Grafana's dashboard sidecar loads (label grafana_dashboard)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "hisparse-grafana-dashboards",
                         "labels": {"grafana_dashboard": "1", "app.kubernetes.io/name": "easymats",
                                    "app.kubernetes.io/part-of": "hisparse"}},
            "data": {name: render(board) for name, board in boards.items()}}


def render(board: dict) -> str:
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def render_configmap(cm: dict) -> str:
    return "# GENERATED by dashboards/build.py: do not edit by hand.\n" + rules.dump_yaml(cm)


def queries(board: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query in the dashboard: panels, annotations, variables."""
    for panel in board.get("panels", []):
        for t in panel.get("targets", []) or []:
            if t.get("refId") == NOT_PROVIDED_REF:
                continue  # answers for engine targets only: not_provided_queries()
            yield f"panel {panel.get('title')!r} {t.get('refId')}", t["expr"]
    for a in board.get("annotations", {}).get("list", []):
        if a.get("expr"):
            yield f"annotation {a.get('name')!r}", a["expr"]
    for v in board.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            yield f"variable {v['name']}", _label_values_selector(v["query"])


def with_all_variables(expr: str, rate_interval: str = "1m") -> str:
    """A query as Grafana sends it with every variable at "All" (``.*``): for tests and checks."""
    expr = expr.replace("$__rate_interval", rate_interval)
    names = set(VARIABLE_QUERIES) | set(FLEET_VARIABLE_QUERIES)
    for name in sorted(names, key=len, reverse=True):  # $namespace before $name-prefixes of it
        expr = expr.replace(f"${name}", ".*")
    return expr


def _label_values_selector(query) -> str:
    """label_values(<selector>, label) -> <selector>: the part that names a metric."""
    text = query if isinstance(query, str) else query.get("query", "")
    inner = text[text.index("(") + 1: text.rindex(",")] if text.startswith("label_values(") else text
    return inner.strip()


def not_provided_queries(board: dict) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of the panels' "not provided" queries, which name, per engine target, the
    metrics its engine cannot provide (and answer nothing for a native runtime)."""
    for panel in board.get("panels", []):
        for t in panel.get("targets", []) or []:
            if t.get("refId") == NOT_PROVIDED_REF:
                yield f"panel {panel.get('title')!r} {t.get('refId')}", t["expr"]


def problems(board: dict) -> list[str]:
    records = rules.recording_rule_names()
    out = []
    for where, expr in [*queries(board), *not_provided_queries(board)]:
        for name in promql.undefined_names(expr, catalogue.CATALOGUE, records):
            out.append(f"{where}: {name!r} is neither in easymats/catalogue.py nor a recording rule "
                       "in alerts/rules.yml")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the JSON is stale or names an unknown metric")
    parser.add_argument("--output", default=DASHBOARD_PATH)
    parser.add_argument("--fleet-output", default=FLEET_PATH)
    parser.add_argument("--configmap-output", default=CONFIGMAP_PATH)
    args = parser.parse_args(argv)
    try:
        board, fleet = build_dashboard(), build_fleet_dashboard()
    except ImportError as exc:
        print(f"dashboards/build.py: needs grafana-foundation-sdk (pip install -e '.[dashboards]'): {exc}",
              file=sys.stderr)
        return 2
    cm = configmap({os.path.basename(DASHBOARD_PATH): board, os.path.basename(FLEET_PATH): fleet})
    outputs = ((args.output, render(board), problems(board)),
               (args.fleet_output, render(fleet), problems(fleet)),
               (args.configmap_output, render_configmap(cm), []))
    return max(rules.write_or_check(path, text, issues, check=args.check, tool="dashboards/build.py")
               for path, text, issues in outputs)

if __name__ == "__main__":
    sys.exit(main())
