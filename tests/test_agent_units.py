"""Pure logic of the agent: peak windows, derived health numbers, thresholds, NVML absence."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import given, strategies as st

from easymats import thresholds as th
from easymats.liveview import LiveView, derive, histogram_quantile
from easymats.nvml import Nvml
from easymats.segment import Histogram, Series, Snapshot
from easymats.targets import PeakWindow


@given(st.lists(st.tuples(st.floats(0, 0.5), st.floats(-1e6, 1e6)), min_size=1, max_size=60),
       st.floats(0.1, 5))
def test_peak_window_equals_brute_force_max(steps, window):
    w = PeakWindow(window)
    t = 0.0
    seen = []
    for dt, v in steps:
        t += dt
        w.push(t, v)
        seen.append((t, v))
        inside = [x for (ts, x) in seen if ts >= t - window]
        assert w.max(t) == max(inside)


def snap(values: dict, hist: Histogram | None = None) -> Snapshot:
    series = []
    for key, v in values.items():
        name, _, lab = key.partition(":")
        labels = dict([lab.split("=")]) if lab else {}
        series.append(Series(name, "counter" if name.endswith("_total") else "gauge", "", labels, float(v)))
    if hist is not None:
        series.append(Series("hisparse_step_duration_seconds", "histogram", "seconds", {}, hist))
    return Snapshot("p", 1, "t", {}, 0, 0, 0, 0, 0, 0, series)


def test_derive_ratios_and_rates():
    b = (0.001, 0.01)
    old = snap({"hisparse_anchor_lookups_total": 100, "hisparse_anchor_hits_total": 90,
                "hisparse_prefetch_issued_total": 10, "hisparse_prefetch_used_total": 10,
                "hisparse_kv_block_recycles_total": 0, "hisparse_kv_blocks:state=active": 100,
                "hisparse_tokens_total:phase=decode": 0, "hisparse_tokens_total:phase=prefill": 50},
               Histogram(b, (0, 0, 0), 0))
    new = snap({"hisparse_anchor_lookups_total": 200, "hisparse_anchor_hits_total": 150,
                "hisparse_prefetch_issued_total": 10, "hisparse_prefetch_used_total": 10,
                "hisparse_kv_block_recycles_total": 20, "hisparse_kv_blocks:state=active": 100,
                "hisparse_kv_blocks:state=pending_recycle": 7,
                "hisparse_tokens_total:phase=decode": 40, "hisparse_tokens_total:phase=prefill": 50},
               Histogram(b, (50, 49, 1), 0.3))
    d = derive(old, new, 2.0)
    assert d.anchor_hit_rate == pytest.approx(0.6)
    assert d.prefetch_efficiency is None, "no prefetch traffic in the window: unknown, not 0 or 1"
    assert d.block_recycle_rate == pytest.approx(0.1)  # 20 recycles / 2 s / 100 active
    assert d.tokens_per_s == pytest.approx(20)
    assert d.pending_blocks == 7
    assert d.step_p50_s == pytest.approx(0.001)
    assert d.step_p99_s == pytest.approx(0.01)  # rank 99 of 100 ends the second bucket
    assert th.health("anchor_hit_rate", d.anchor_hit_rate) == "bad"


def test_counter_reset_in_window_is_unknown_not_negative():
    old = snap({"hisparse_anchor_lookups_total": 100, "hisparse_anchor_hits_total": 90})
    new = snap({"hisparse_anchor_lookups_total": 10, "hisparse_anchor_hits_total": 9})
    assert derive(old, new, 1.0).anchor_hit_rate is None


def test_histogram_quantile_matches_prometheus_interpolation():
    h = Histogram((1.0, 2.0, 4.0), (0, 10, 10, 0), 0)
    assert histogram_quantile(0.5, h) == pytest.approx(2.0)
    assert histogram_quantile(0.75, h) == pytest.approx(3.0)
    assert histogram_quantile(0.5, Histogram((1.0,), (0, 0), 0)) is None
    assert histogram_quantile(0.99, Histogram((1.0,), (0, 5), 0)) == 1.0


@pytest.mark.parametrize("name,value,state", [
    ("anchor_hit_rate", 0.64, "bad"), ("anchor_hit_rate", 0.66, "warn"), ("anchor_hit_rate", 0.9, "ok"),
    ("prefetch_efficiency", 0.8, "bad"), ("prefetch_efficiency", 0.95, "ok"),
    ("block_recycle_rate", 0.04, "bad"), ("quant_error_p99", 0.2, "bad"), ("quant_error_p99", 0.01, "ok"),
    ("anchor_hit_rate", None, "unknown"), ("anchor_hit_rate", math.nan, "unknown"),
])
def test_threshold_health(name, value, state):
    assert th.health(name, value) == state


def test_thresholds_match_the_issue():
    assert th.ANCHOR_HIT_RATE_MIN == 0.65 and th.ANCHOR_HIT_RATE_FOR_S == 300
    assert th.PREFETCH_EFFICIENCY_MIN == 0.85 and th.BLOCK_RECYCLE_RATE_MIN == 0.05


def test_nvml_absent_here_is_quiet_and_fast():
    n = Nvml()
    t0 = time.perf_counter()
    ok = n.available()
    if ok:
        pytest.skip("this machine has an NVIDIA driver; the absent path is tested on CI")
    assert time.perf_counter() - t0 < 0.5
    assert n.read() is None and n.why_unavailable
    n.close()


def test_live_view_renders_colours_and_waits_for_a_second_sample():
    class T:  # the view reads only these attributes of a Target
        def __init__(self, s):
            self.name, self.pid, self.up, self.error, self.snapshot = "d0", 1, True, None, s
    a = snap({"hisparse_anchor_lookups_total": 0, "hisparse_anchor_hits_total": 0})
    b = snap({"hisparse_anchor_lookups_total": 100, "hisparse_anchor_hits_total": 50})
    tg = T(a)
    v = LiveView()
    v.observe([tg], 0.0)
    assert "waiting" in v.table([tg])
    tg.snapshot = b
    v.observe([tg], 1.0)
    table = v.table([tg])
    assert "50.0%" in table and "\033[31m" in table  # anchor hit 50 % < 65 %: red
    assert "anchor=50.0%" in v.summary_line([tg], "00:00:00")


def test_live_view_shows_the_most_urgent_finding_of_a_real_target():
    """The live table ends with the report's most urgent finding for a target in trouble."""
    import io
    import time

    from helpers_targets import start_target

    from easymats.liveview import LiveView
    from easymats.report.live import LiveDiagnosis
    from easymats.targets import Target

    proc, path = start_target("decode-0", duration=6.0, extra=["--anchor-hit", "0.2"])
    view = LiveView(colour=False, diagnosis_factory=lambda: LiveDiagnosis(horizon_s=2.0, window_s=1.0))
    try:
        tg = Target(proc.pid, path, peak_window_s=15.0)
        t0 = time.time()
        while time.time() - t0 < 2.5:
            tg.sample(time.time())
            view.observe([tg], time.time())
            time.sleep(0.1)
        out = io.StringIO()
        view.draw(out, [tg])
    finally:
        proc.terminate()
        proc.wait()
    screen = out.getvalue()
    assert "! decode-0: Anchor hit rate is low" in screen, screen
