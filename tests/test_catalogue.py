"""The metric catalogue follows Prometheus naming and holds every metric of DESIGN section 5."""

import math
import re

import pytest

from easymats import catalogue
from easymats.catalogue import COUNTER, GAUGE, HISTOGRAM, INFO

SPECS = list(catalogue.CATALOGUE.values())
IDS = [s.name for s in SPECS]

UNITS = {"": None, "seconds": "seconds", "bytes": "bytes", "ratio": "ratio"}
# Peak gauges are named after the series they take the maximum of, then "_max"
# (easymats_device_kv_bytes_max): the unit stays next to the quantity it measures.
AGGREGATION_SUFFIXES = ("_max",)
# Labels that name the subject a metric is about may repeat in its name: easymats_target_up{target}
# is Prometheus' own `up` idiom, easymats_gpu_utilization_ratio{gpu} the per-device idiom.
SUBJECT_LABELS = {"target", "gpu"}

# DESIGN section 5: name -> (type, label names, allowed values of bounded labels).
DESIGN_5 = {
    "hisparse_tokens_total": (COUNTER, {"phase": {"prefill", "decode"}}),
    "hisparse_sequences": (GAUGE, {}),
    "hisparse_context_tokens": (GAUGE, {}),
    "hisparse_anchor_lookups_total": (COUNTER, {}),
    "hisparse_anchor_hits_total": (COUNTER, {}),
    "hisparse_anchors": (GAUGE, {}),
    "hisparse_anchor_threshold_ratio": (GAUGE, {}),
    "hisparse_recalibrations_total": (COUNTER, {"reason": {"schedule", "request", "drift"}}),
    "hisparse_kv_blocks": (GAUGE, {"state": {"active", "free", "pending_recycle"}}),
    "hisparse_kv_block_allocations_total": (COUNTER, {}),
    "hisparse_kv_block_recycles_total": (COUNTER, {}),
    "hisparse_kv_block_reclaims_total": (COUNTER, {}),
    "hisparse_kv_tokens_loaded_total": (COUNTER, {}),
    "hisparse_kv_tokens_used_total": (COUNTER, {}),
    "hisparse_hot_buffer_lookups_total": (COUNTER, {}),
    "hisparse_hot_buffer_hits_total": (COUNTER, {}),
    "hisparse_prefetch_issued_total": (COUNTER, {}),
    "hisparse_prefetch_used_total": (COUNTER, {}),
    "hisparse_swap_in_bytes_total": (COUNTER, {}),
    "hisparse_backup_bytes_total": (COUNTER, {}),
    "hisparse_kv_memory_bytes": (GAUGE, {"tier": {"device", "host"}, "kind": {"data", "metadata"}}),
    "hisparse_quant_blocks_total": (COUNTER, {"bits": {"4", "5", "6", "8"}}),
    "hisparse_quant_block_relative_error": (HISTOGRAM, {}),
    "hisparse_step_duration_seconds": (HISTOGRAM, {}),
    "hisparse_runtime_info": (INFO, {"version": None, "model": None, "device": None}),
    "hisparse_config_info": (INFO, {"window_size": None, "global_tokens": None, "block_size": None,
                                    "top_k": None, "device_buffer_tokens": None, "host_kv_bits": None}),
}


def tokens(name: str) -> list[str]:
    return name.split("_")


def contains_tokens(name: str, part: str) -> bool:
    """True when ``part``'s underscore-separated words occur contiguously in ``name``."""
    hay, needle = tokens(name), tokens(part)
    return any(hay[i:i + len(needle)] == needle for i in range(len(hay) - len(needle) + 1))


def base_name(name: str) -> str:
    """The name without ``_total`` and an aggregation suffix: where the unit must come last."""
    if name.endswith("_total"):
        name = name[: -len("_total")]
    for suffix in AGGREGATION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_name_is_prefixed_lower_snake_case(spec):
    assert re.fullmatch(r"(hisparse|easymats)_[a-z][a-z0-9]*(_[a-z0-9]+)*", spec.name), spec.name
    assert spec.name == catalogue.CATALOGUE[spec.name].name
    assert spec.source == (catalogue.RUNTIME if spec.name.startswith("hisparse_") else catalogue.AGENT)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_type_and_unit_are_known(spec):
    assert spec.type in catalogue.TYPES
    assert spec.unit in UNITS, f"{spec.name}: unit {spec.unit!r} is not a base unit (seconds, bytes, ratio)"


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_total_suffix_iff_counter(spec):
    if spec.type == COUNTER:
        assert spec.name.endswith("_total"), f"counter {spec.name} must end in _total"
    else:
        # promtool's rule: the _total suffix is the counter's; "total" inside a gauge name
        # (easymats_gpu_memory_total_bytes, like node_memory_MemTotal_bytes) is a plain word.
        assert not spec.name.endswith("_total"), f"{spec.type} {spec.name} must not end in _total"
        assert not base_name(spec.name).endswith("_total")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_unit_suffix_iff_unit(spec):
    base = base_name(spec.name)
    for unit in ("seconds", "bytes", "ratio"):
        if spec.unit == unit:
            assert base.endswith("_" + unit), f"{spec.name} (unit {unit}) must end in _{unit}"
        else:
            assert unit not in tokens(spec.name), f"{spec.name} says {unit} but its unit is {spec.unit!r}"
    for wrong in ("milliseconds", "ms", "us", "microseconds", "kb", "mb", "mib", "gib", "percent", "pct"):
        assert wrong not in tokens(spec.name), f"{spec.name}: use base units (seconds, bytes, ratio)"


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_ratio_unit_only_on_gauges(spec):
    if spec.unit == "ratio":
        assert spec.type == GAUGE, f"{spec.name}: a ratio is a gauge (rates of counters make ratios)"


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_info_suffix_iff_info_type(spec):
    assert spec.name.endswith("_info") == (spec.type == INFO), spec.name
    if spec.type == INFO:
        assert spec.labels, f"info metric {spec.name} carries its information in labels"


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_no_label_names_or_values_inside_metric_names(spec):
    for label in spec.labels:
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", label), f"{spec.name}: label {label!r}"
        assert not label.startswith("__"), "double-underscore labels are reserved by Prometheus"
        assert label not in ("le", "quantile"), f"{spec.name}: label {label} is reserved"
        if label not in SUBJECT_LABELS:
            assert not contains_tokens(spec.name, label), f"{spec.name} repeats its label {label}"
    for label, values in spec.label_values.items():
        assert label in spec.labels, f"{spec.name}: values given for an undeclared label {label}"
        assert values and len(set(values)) == len(values), f"{spec.name}: label {label} values"
        for value in values:
            if not value.isdigit():
                assert not contains_tokens(spec.name, value), f"{spec.name} spells its label value {value}"


def test_no_metric_spells_out_another_metrics_label_value():
    """hisparse_kv_blocks_active would duplicate hisparse_kv_blocks{state="active"}."""
    names = set(catalogue.CATALOGUE)
    for spec in SPECS:
        stem = tokens(spec.name)
        for values in spec.label_values.values():
            for value in values:
                for i in range(1, len(stem) + 1):
                    spelled = "_".join(stem[:i] + [value] + stem[i:])
                    assert spelled not in names, f"{spelled} duplicates {spec.name}{{...={value!r}}}"


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_help_text(spec):
    assert spec.help.strip() and "\n" not in spec.help, f"{spec.name} needs one line of help"


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_histogram_buckets(spec):
    if spec.type != HISTOGRAM:
        assert spec.buckets == (), f"{spec.name}: only histograms have buckets"
        return
    b = spec.buckets
    assert 1 <= len(b) <= 64
    assert all(math.isfinite(x) for x in b), "+Inf is implicit"
    assert all(x < y for x, y in zip(b, b[1:])), f"{spec.name}: buckets must be strictly ascending"
    assert b[0] >= 0
    assert "le" not in spec.labels


def test_every_design_5_metric_is_defined_as_designed():
    for name, (type_, labels) in DESIGN_5.items():
        spec = catalogue.get(name)
        assert spec.type == type_, name
        assert set(spec.labels) == set(labels), name
        for label, allowed in labels.items():
            if allowed is not None:
                assert set(spec.label_values[label]) == allowed, (name, label)
        assert spec.source == catalogue.RUNTIME


def test_units_of_design_5_metrics():
    assert catalogue.get("hisparse_swap_in_bytes_total").unit == "bytes"
    assert catalogue.get("hisparse_kv_memory_bytes").unit == "bytes"
    assert catalogue.get("hisparse_step_duration_seconds").unit == "seconds"
    assert catalogue.get("hisparse_anchor_threshold_ratio").unit == "ratio"


def test_no_pid_or_sequence_label_on_runtime_metrics():
    for spec in catalogue.runtime_metrics():
        for label in spec.labels:
            assert label not in ("pid", "sequence", "seq_id", "sequence_id", "request_id"), spec.name


def test_unknown_name_is_a_clear_error_with_a_suggestion():
    with pytest.raises(catalogue.UnknownMetricError) as err:
        catalogue.get("hisparse_hot_buffer_hit_total")
    msg = str(err.value)
    assert "hisparse_hot_buffer_hit_total" in msg and "hisparse_hot_buffer_hits_total" in msg
    assert "catalogue" in msg


def test_check_labels_names_the_allowed_values():
    spec = catalogue.get("hisparse_kv_blocks")
    catalogue.check_labels(spec, {"state": "free"})
    with pytest.raises(catalogue.UnknownMetricError, match="active, free, pending_recycle"):
        catalogue.check_labels(spec, {"state": "busy"})
    with pytest.raises(catalogue.UnknownMetricError, match="takes labels"):
        catalogue.check_labels(spec, {})
    with pytest.raises(catalogue.UnknownMetricError, match="takes labels"):
        catalogue.check_labels(spec, {"state": "free", "pid": "1"})


def test_runtime_and_agent_partition_the_catalogue():
    runtime = {s.name for s in catalogue.runtime_metrics(detail=True)}
    agent = {s.name for s in catalogue.agent_metrics()}
    assert runtime and agent and not runtime & agent
    assert runtime | agent == set(catalogue.CATALOGUE)


def _exposition_of_catalogue() -> bytes:
    """The whole catalogue as Prometheus text exposition, one sample per metric."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import CollectorRegistry

    class Everything:
        def collect(self):
            for spec in SPECS:
                names = list(spec.labels)
                values = [spec.label_values.get(n, ("x",))[0] for n in names]
                if spec.type == COUNTER:
                    family = CounterMetricFamily(spec.name, spec.help, labels=names)
                    family.add_metric(values, 1.0)
                elif spec.type == HISTOGRAM:
                    family = HistogramMetricFamily(spec.name, spec.help, labels=names)
                    family.add_metric(values, [(repr(b), 0.0) for b in spec.buckets] + [("+Inf", 1.0)], 0.5)
                else:  # gauges, and info metrics which are exported as gauges of value 1
                    family = GaugeMetricFamily(spec.name, spec.help, labels=names)
                    family.add_metric(values, 1.0)
                yield family

    registry = CollectorRegistry()
    registry.register(Everything())
    return generate_latest(registry)


def test_promtool_lints_the_whole_catalogue_clean():
    """Prometheus' own linter (the real promtool binary) agrees with the rules above."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: apt-get install -y --no-install-recommends prometheus (.ci/run does)"
    out = subprocess.run([promtool, "check", "metrics"], input=_exposition_of_catalogue(),
                         capture_output=True, timeout=60)
    problems = (out.stdout + out.stderr).decode()
    assert out.returncode == 0 and not problems.strip(), problems
    # The linter is live: a gauge named like a counter is reported.
    bad = b"# HELP x_total x\n# TYPE x_total gauge\nx_total 1\n"
    out = subprocess.run([promtool, "check", "metrics"], input=bad, capture_output=True, timeout=60)
    assert out.returncode != 0 and b"_total" in out.stdout + out.stderr


def test_every_ratio_is_built_from_catalogue_series_of_the_right_type():
    """The one table of ratios: numerators are counters; denominators counters, or a gauge series
    (with its labels) for a rate per unit of the gauge; each names the recording rule that computes
    it, and alerts/build.py emits exactly those rules."""
    from alerts import build as rules

    records = {r.record for r in rules.recording_rules()}
    assert [r.key for r in catalogue.RATIOS] == list(catalogue.RATIO)
    for r in catalogue.RATIOS:
        assert catalogue.get(r.numerator).type == catalogue.COUNTER, r.key
        den = catalogue.get(r.denominator)
        assert den.type == (catalogue.GAUGE if r.per_gauge else catalogue.COUNTER), r.key
        if den.labels:
            catalogue.check_labels(den, dict(r.denominator_labels))
        assert r.record in records, r.key
        assert r.of(3.0, 4.0) == 0.75 and r.of(3.0, 0.0) is None
