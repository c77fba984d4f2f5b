"""How many series easymats exports: the most the catalogue allows, and a count of a real /metrics.

Every runtime label in the catalogue lists its allowed values, so the series one runtime target
can export is a fixed number (:func:`series_per_target`): tests/test_cardinality.py bounds it and
checks it against a real scrape, and docs/scaling.md multiplies it out for a fleet. Labels whose
values are not listed are identity labels: ``target`` (one per runtime, the unit counted here),
``gpu``/``uuid`` (one per device) and the info metrics' description labels (one series each).
"""

from __future__ import annotations

from collections import Counter

from . import catalogue

# Agent series whose labels are identities, not dimensions: each yields one series per target,
# per GPU or per (target, GPU), never more.
PER_GPU_LABELS = frozenset({"gpu", "uuid"})
# Status codes the webhook answers with (easymats/webhook.py): easymats_webhook_requests_total{code}.
WEBHOOK_CODES = ("200", "400", "401", "404", "413", "500", "503")


def series_of(spec: catalogue.MetricSpec, gpus: int = 1) -> int:
    """Series one metric can produce for one target (or one agent, for agent-level metrics)."""
    if spec.type == catalogue.HISTOGRAM:
        per_labelset = len(spec.buckets) + 1 + 2  # buckets with +Inf, _count, _sum
    else:
        per_labelset = 1
    if spec.type == catalogue.INFO:
        return per_labelset
    n = 1
    for label in spec.labels:
        if label == "target":
            continue
        if label in PER_GPU_LABELS:
            if label == "gpu":  # uuid names the same device as gpu: no extra series
                n *= gpus
            continue
        if label == "code":
            n *= len(WEBHOOK_CODES)
            continue
        values = spec.label_values.get(label)
        if not values:
            raise ValueError(f"{spec.name}: label {label!r} lists no values: its series cannot be "
                             "bounded (add label_values to the catalogue)")
        n *= len(values)
    return per_labelset * n


def series_per_target(gpus_per_target: int = 1) -> int:
    """The most series one runtime target adds to /metrics: its runtime metrics and the agent's
    per-target metrics (process and per-process GPU series on ``gpus_per_target`` devices)."""
    total = 0
    for spec in catalogue.CATALOGUE.values():
        if spec.detail:
            continue  # opt-in (HiSparseConfig.layer_metrics): see detail_series_per_target
        if spec.name in catalogue.ENGINE_TARGET_ONLY:
            continue  # only a vLLM/SGLang target has these, and it has no runtime series
        if spec.source == catalogue.RUNTIME or "target" in spec.labels:
            total += series_of(spec, gpus_per_target)
    return total


def detail_series_per_target(layers: int) -> int:
    """What the opt-in per-layer detail adds to one target of a ``layers``-layer model."""
    return layers * sum(1 for spec in catalogue.CATALOGUE.values() if spec.detail)


def series_per_agent(gpus: int) -> int:
    """The series an agent exports whatever its targets: its own health, the node's GPUs, webhook."""
    return sum(series_of(spec, gpus) for spec in catalogue.agent_metrics() if "target" not in spec.labels)


def series_per_node(targets: int, gpus: int, gpus_per_target: int = 1) -> int:
    return series_per_agent(gpus) + targets * series_per_target(gpus_per_target)


def count_by_target(text: str) -> Counter[str]:
    """Series of a /metrics body by their ``target`` label ("" for the agent's own)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            counts[sample.labels.get("target", "")] += 1
    return counts


def label_names(text: str) -> set[str]:
    """Every label name used in a /metrics body."""
    from prometheus_client.parser import text_string_to_metric_families

    return {name for family in text_string_to_metric_families(text)
            for sample in family.samples for name in sample.labels}
