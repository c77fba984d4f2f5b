"""The /metrics collector against a real segment (published by this test process)."""

from __future__ import annotations

import logging
import os
import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from easymats import catalogue, telemetry
from easymats.exporter import AgentCollector, LagHistogram, make_registry
from easymats.nvml import GpuReading, NvmlSnapshot, ProcessGpuReading
from easymats.segment import Series
from easymats.targets import Target


@pytest.fixture
def seg():
    s = telemetry.open_segment(name="decode-0", labels={"model": "m"})
    yield s
    s.close()


def render(targets, gpu=None, lag=None, window=15.0):
    col = AgentCollector(lambda: targets, lag or LagHistogram(), lambda: gpu, window)
    text = generate_latest(make_registry(col)).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return fams, text, col


def samples(fams, name):
    return [(s.labels, s.value) for f in fams.values() for s in f.samples if s.name == name]


def test_every_exported_name_is_in_the_catalogue_and_labelled_by_target(seg):
    seg.counter("hisparse_tokens_total", phase="decode").inc(7)
    seg.gauge("hisparse_kv_blocks", state="active").set(12)
    for v in (0.0005, 0.003, 0.003, 7.0):
        seg.histogram("hisparse_step_duration_seconds").observe(v)
    seg.info("hisparse_runtime_info", version="1", model="m", device="cpu")
    seg.publish()
    tg = Target(os.getpid(), seg.path, peak_window_s=15)
    tg.sample(time.time())
    tg.read_process()
    fams, text, col = render([tg])
    for name, fam in fams.items():
        full = name + "_total" if fam.type == "counter" else name
        assert full in catalogue.CATALOGUE, full
    assert samples(fams, "hisparse_tokens_total") == [({"phase": "decode", "target": "decode-0"}, 7.0)]
    assert samples(fams, "hisparse_kv_blocks") == [({"state": "active", "target": "decode-0"}, 12.0)]
    buckets = {lab["le"]: v for lab, v in samples(fams, "hisparse_step_duration_seconds_bucket")}
    assert buckets["0.0005"] == 1 and buckets["0.0025"] == 1 and buckets["0.005"] == 3
    assert buckets["2.5"] == 3 and buckets["+Inf"] == 4
    assert samples(fams, "hisparse_step_duration_seconds_count")[0][1] == 4
    info = samples(fams, "easymats_target_info")
    assert info == [({"target": "decode-0", "pid": str(os.getpid()), "labels": "model=m"}, 1.0)]
    assert samples(fams, "hisparse_runtime_info")[0][0]["target"] == "decode-0"
    assert samples(fams, "easymats_process_cpu_seconds_total")[0][1] > 0
    assert col.last_render_s > 0


def test_unknown_series_dropped_with_one_warning(seg, caplog):
    seg.gauge("hisparse_sequences").set(1)
    seg.publish()
    tg = Target(os.getpid(), seg.path, peak_window_s=15)
    tg.sample(time.time())
    # A non-conforming runtime (another language's writer) could publish any name.
    tg.snapshot.series.append(Series("made_up_metric", "gauge", "", {}, 3.0))
    with caplog.at_level(logging.WARNING, logger="easymats.exporter"):
        col = AgentCollector(lambda: [tg], LagHistogram(), lambda: None, 15.0)
        reg = make_registry(col)
        generate_latest(reg)
        text = generate_latest(reg).decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert "made_up_metric" not in text
    assert samples(fams, "hisparse_sequences")[0][1] == 1.0
    assert len([r for r in caplog.records if "made_up_metric" in r.getMessage()]) == 1


def test_peaks_survive_any_number_of_scrapes_and_expire_after_window(seg):
    g = seg.gauge("hisparse_kv_blocks", state="active")
    dev = seg.gauge("hisparse_kv_memory_bytes", tier="device", kind="data")
    meta = seg.gauge("hisparse_kv_memory_bytes", tier="device", kind="metadata")
    seg.gauge("hisparse_kv_memory_bytes", tier="host", kind="data").set(1e9)
    tg = Target(os.getpid(), seg.path, peak_window_s=0.3)
    for v in (10, 50, 20):
        g.set(v)
        dev.set(v * 100)
        meta.set(5)
        seg.publish()
        tg.sample(time.time())
    for _ in range(3):  # several scrapers: nobody resets the peak
        fams, _, _ = render([tg], window=0.3)
        assert samples(fams, "easymats_kv_active_blocks_max") == [({"target": "decode-0"}, 50.0)]
        assert samples(fams, "easymats_device_kv_bytes_max")[0][1] == 5005.0  # device tier only
    assert samples(fams, "hisparse_kv_blocks")[0][1] == 20.0
    assert samples(fams, "easymats_peak_window_seconds")[0][1] == 0.3
    assert not samples(fams, "easymats_hot_buffer_resident_tokens_max"), "absent when its source is"
    time.sleep(0.35)
    seg.publish()
    tg.sample(time.time())
    fams, _, _ = render([tg], window=0.3)
    assert samples(fams, "easymats_kv_active_blocks_max")[0][1] == 20.0


def test_gpu_metrics_absent_without_nvml_present_with_readings(seg):
    seg.publish()
    tg = Target(os.getpid(), seg.path, peak_window_s=15)
    tg.sample(time.time())
    fams, text, _ = render([tg], gpu=None)
    assert "easymats_gpu_" not in text and "process_gpu" not in text
    gpu = NvmlSnapshot(time.time(), (GpuReading("0", "GPU-abc", 0.5, 2e9, 8e9),),
                       (ProcessGpuReading("0", os.getpid(), 1.5e9, 0.25), ProcessGpuReading("0", 1, 1e6, None)))
    fams, text, _ = render([tg], gpu=gpu)
    assert samples(fams, "easymats_gpu_memory_used_bytes") == [({"gpu": "0", "uuid": "GPU-abc"}, 2e9)]
    assert samples(fams, "easymats_gpu_utilization_ratio")[0][1] == 0.5
    assert samples(fams, "easymats_process_gpu_memory_bytes") == [({"target": "decode-0", "gpu": "0"}, 1.5e9)]
    assert samples(fams, "easymats_process_gpu_utilization_ratio")[0][1] == 0.25


def test_describe_reads_nothing():
    def boom():
        raise AssertionError("describe() must not read targets")
    col = AgentCollector(boom, LagHistogram(), boom, 15.0)
    names = {m.name for m in col.describe()}
    assert "easymats_target_up" in names and "hisparse_kv_blocks" in names
    make_registry(col)  # registering calls describe only


def test_lag_histogram_buckets():
    h = LagHistogram()
    for v in (0.0001, 0.003, 2.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.count == 3 and snap.counts[0] == 1 and snap.counts[-1] == 1


def families(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_fast_text_path_equals_prometheus_client_rendering(seg):
    seg.counter("hisparse_tokens_total", phase="decode").inc(3)
    seg.gauge("hisparse_kv_blocks", state="active").set(5)
    seg.histogram("hisparse_quant_block_relative_error").observe(0.03)
    seg.info("hisparse_runtime_info", version='1"x\\', model="a\nb", device="cpu")
    seg.publish()
    tg = Target(os.getpid(), seg.path, peak_window_s=15)
    tg.sample(time.time())
    tg.read_process()
    lag = LagHistogram()
    lag.observe(0.001)
    gpu = NvmlSnapshot(time.time(), (GpuReading("0", "GPU-1", 0.5, 1.0, 2.0),), ())
    col = AgentCollector(lambda: [tg], lag, lambda: gpu, 15.0)
    reg = make_registry(col)
    fast = reg.render().decode()
    slow = generate_latest(reg).decode()
    assert families(fast) == families(slow)
    assert len(families(fast)) > 30
    # The cache is keyed by layout: a series added later appears in the next scrape.
    seg.gauge("hisparse_sequences").set(2)
    seg.publish()
    tg.sample(time.time())
    assert families(reg.render().decode())[("hisparse_sequences", (("target", "decode-0"),))] == 2.0


def test_extra_collectors_are_served_beside_the_agent(seg):
    from prometheus_client.core import CounterMetricFamily

    class Extra:
        def describe(self):
            return []

        def collect(self):
            fam = CounterMetricFamily("easymats_webhook_requests", "x", labels=["code"])
            fam.add_metric(["200"], 3)
            yield fam

    col = AgentCollector(lambda: [], LagHistogram(), lambda: None, 15.0)
    reg = make_registry(col)
    reg.register(Extra())
    text = reg.render().decode()
    assert families(text)[("easymats_webhook_requests_total", (("code", "200"),))] == 3.0
    assert ("easymats_build_info", (("version", "0.1.0"),)) in families(text)
