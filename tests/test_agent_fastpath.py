"""The agent's fast paths give exactly what the general paths give.

The sampler formats sample lines and peaks straight from a snapshot's raw values area (with
per-layout templates and histogram texts reused while unchanged), and the segment reader builds
``Snapshot.series`` only on demand. These tests drive a real segment through layout changes,
unchanged and changing histograms, and non-finite values, and compare every line with the
general path (``Target.log_line``) and every lazily built snapshot with the documented fields.
"""

from __future__ import annotations

import json
import math
import os
import time

from helpers_logformat import validate_line

from easymats import telemetry
from easymats.segment import Histogram, SegmentReader, Series, Snapshot
from easymats.targets import Target


def _slow(tg: Target, t: float) -> dict:
    line = json.loads(json.dumps(tg.log_line(t, 0.0002), default=list))
    line["metrics"] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                       for k, v in line["metrics"].items()}
    return line


def test_sample_text_equals_general_path_across_layout_changes(segment_dir):
    seg = telemetry.open_segment(name="fast", labels={"model": "m"})
    try:
        c = seg.counter("hisparse_tokens_total", phase="decode")
        h = seg.histogram("hisparse_quant_block_relative_error")
        active = seg.gauge("hisparse_kv_blocks", state="active")
        tg = Target(os.getpid(), seg.path, peak_window_s=15)
        lines = []
        for i in range(12):
            c.inc(1)
            active.set(10 + (i % 3))
            if i % 4 == 0:  # the histogram stays unchanged over most lines: its text is reused
                h.observe(0.004 * (i + 1))
            if i == 5:  # a new series: a new layout generation mid-run
                seg.gauge("hisparse_hot_buffer_resident_tokens").set(77)
                seg.gauge("hisparse_kv_memory_bytes", tier="device", kind="data").set(4096.0)
            if i == 8:
                active.set(float("nan"))  # the general path takes over for this line
            seg.publish()
            went_down, err = tg.sample(time.time())
            assert not went_down and err is None
            t = 1795990000.5 + i
            text = tg.log_json(t, 0.0002)
            fast = json.loads(text)
            assert fast == _slow(tg, t), i
            assert validate_line(fast) == []
            lines.append(fast)
        assert lines[0]["metrics"]['hisparse_quant_block_relative_error'] == \
            lines[3]["metrics"]['hisparse_quant_block_relative_error']
        assert "hisparse_hot_buffer_resident_tokens" in lines[6]["metrics"]
        assert lines[8]["metrics"]['hisparse_kv_blocks{state="active"}'] is None
        # peaks come from the raw values: active blocks peaked at 12 (NaN pushes nothing larger)
        assert tg.peaks["easymats_kv_active_blocks_max"] == 12.0
        assert tg.peaks["easymats_device_kv_bytes_max"] == 4096.0
        tg.close()
    finally:
        seg.close()


def test_lazy_series_match_the_values_area(segment_dir):
    seg = telemetry.open_segment(name="lazy", labels={})
    try:
        seg.counter("hisparse_tokens_total", phase="prefill").inc(5)
        hist = seg.histogram("hisparse_step_duration_seconds")
        hist.observe(0.002)
        hist.observe(0.3)
        seg.publish()
        with SegmentReader(seg.path) as r:
            a, b = r.read(), r.read()
        assert a.values is not None and a.value_slots is not None
        assert a == b and a.series is not b.series  # equal, each with its own series list
        s = {x.name: x for x in a.series}
        assert s["hisparse_tokens_total"].value == 5.0
        assert s["hisparse_tokens_total"].labels == {"phase": "prefill"}
        h = s["hisparse_step_duration_seconds"].value
        assert isinstance(h, Histogram) and h.count == 2 and math.isclose(h.sum, 0.302)
        a.series[0].labels["phase"] = "changed"  # a caller's change stays in its own snapshot
        assert b.series[0].labels == {"phase": "prefill"}
        for x, (slot, buckets) in zip(a.series, a.value_slots):
            if buckets == 0:
                assert a.values[slot] == x.value
        # a snapshot built from series (tests, tools) keeps working without a values area
        built = Snapshot("p", 1, "t", {}, 0, 0, 0, 0, 0, 0, [Series("x", "gauge", "", {}, 1.0)])
        assert built.values is None and built.series[0].value == 1.0 and built.get("x") == 1.0
    finally:
        seg.close()
