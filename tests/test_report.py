"""easymats report: reading logs, deriving rates, accumulating in bounded memory, diagnosing.

Scenario logs come from tests/helpers_logs.py and are checked against the agent's own log-line
validator, so a scenario cannot drift from docs/log-format.md."""

from __future__ import annotations

import json
import math
import os
import random
import sys
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

sys.path.insert(0, os.path.dirname(__file__))
import helpers_logs as H  # noqa: E402
from helpers_logformat import validate_line  # noqa: E402

from easymats import thresholds  # noqa: E402
from easymats.report import reader  # noqa: E402
from easymats.report.accum import Downsampler, Episodes, Sketch  # noqa: E402
from easymats.report.analyse import Analysis  # noqa: E402
from easymats.report.derive import Deriver, histogram_quantile  # noqa: E402
from easymats.report.findings import RuleConfig, diagnose_all  # noqa: E402


def analyse_file(path: str, **kw) -> tuple[Analysis, reader.ReadStats]:
    stats = reader.ReadStats()
    a = Analysis().feed_all(reader.iter_records(reader.log_files(path), stats, **kw)).finish()
    return a, stats


# -- reader ------------------------------------------------------------------------------------------

def test_rotated_files_oldest_first_and_bad_lines_counted(tmp_path):
    recs = list(H.scenario_records("healthy", 6.0))
    samples = [r for r in recs if r["kind"] == "sample"]
    base = tmp_path / "run.log"
    # run.log.2 (oldest) .. run.log (newest), each starting with a header as the agent writes them
    chunks = [samples[:20], samples[20:40], samples[40:]]
    for path, chunk in zip([f"{base}.2", f"{base}.1", str(base)], chunks):
        with open(path, "w") as f:
            f.write(json.dumps(H.header(chunk[0]["t"])) + "\n")
            for r in chunk:
                f.write(json.dumps(dict(r, future_key={"x": 1})) + "\n")
            if path.endswith(".1"):
                f.write('{"v": 1, "kind": "hologram", "t": 1.0}\n')  # unknown kind: ignored
                f.write("not json at all\n")  # garbage: skipped and counted
    with open(base, "a") as f:
        f.write('{"v": 1, "kind": "sample", "t": 17959')  # cut by a crash: the last line of a file
    (tmp_path / "run.log.old").write_text("x")  # not a rotation suffix
    files = reader.log_files(str(base))
    assert [os.path.basename(p) for p in files] == ["run.log.2", "run.log.1", "run.log"]
    stats = reader.ReadStats()
    got = [r for r in reader.iter_records(files, stats) if r["kind"] == "sample"]
    assert [r["t"] for r in got] == [r["t"] for r in samples]  # every sample once, in time order
    assert stats.skipped == 2 and stats.headers == 3 and stats.ignored == 1
    assert stats.skipped_where[0] == "run.log.1:23"  # header, 20 samples, unknown kind, garbage


def test_missing_log_is_a_clear_error(tmp_path):
    with pytest.raises(reader.LogError, match="no such log: .*easymats --output"):
        reader.log_files(str(tmp_path / "nope.log"))


def test_time_and_target_filters(tmp_path):
    a = list(H.scenario_records("healthy", 20.0, target="decode-0"))
    b = list(H.scenario_records("slow_recycle", 20.0, target="decode-1", pid=5555))
    merged = sorted((r for r in a + b if r["kind"] != "header"), key=lambda r: r["t"])
    path = str(tmp_path / "run.log")
    H.write_lines(path, [a[0], *merged])
    t0 = H.T0
    stats = reader.ReadStats()
    got = list(reader.iter_records([path], stats, target="decode-1", t_from=t0 + 5, t_to=t0 + 10))
    samples = [r for r in got if r["kind"] == "sample"]
    assert samples and all(r["target"] == "decode-1" and t0 + 5 <= r["t"] <= t0 + 10 for r in samples)
    assert len(samples) == pytest.approx(51, abs=1)


def test_parse_time_forms():
    assert reader.parse_time("1795990000.5", None) == 1795990000.5
    assert reader.parse_time("+5m", 100.0) == 400.0
    assert reader.parse_time("+2h", 0.0) == 7200.0
    assert reader.parse_time("2026-11-29T22:00:00Z", None) == reader.parse_time("2026-11-29T22:00:00", None)
    with pytest.raises(ValueError, match="unix seconds, an ISO time"):
        reader.parse_time("yesterday", None)


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12),
       st.sampled_from(["a", "reason", "tier_x"]))
@settings(max_examples=60, deadline=None)
def test_series_key_round_trip(value, label):
    key = reader.series_key("hisparse_x_total", {label: value, "b": "q\"\\"})
    assert reader.parse_key(key) == ("hisparse_x_total", {label: value, "b": "q\"\\"})


# -- accumulators ------------------------------------------------------------------------------------

def test_sketch_quantiles_within_two_percent():
    rng = random.Random(3)
    values = [rng.lognormvariate(0, 1.5) for _ in range(20000)] + [0.0] * 100
    sk = Sketch()
    for v in values:
        sk.add(v)
    values.sort()
    for q in (0.5, 0.9, 0.99):
        exact = values[int(q * (len(values) - 1))]
        assert sk.quantile(q) == pytest.approx(exact, rel=0.02)
    assert sk.max == values[-1] and len(sk._pos) < 2000


def test_sketch_quantiles_of_values_near_the_largest_float_are_those_values():
    """A bucket's midpoint past float's range (hypothesis found rss_bytes 1.76e308): the quantile is
    the largest value seen, or the smallest for negatives, not an OverflowError."""
    sk = Sketch()
    for v in (1.7637650858193227e308, -1.7e308, 1.0):
        sk.add(v)
    assert sk.quantile(1.0) == 1.7637650858193227e308 and sk.quantile(0.0) == -1.7e308
    assert sk.quantile(0.5) == pytest.approx(1.0, rel=0.02)


def test_downsampler_is_bounded_and_keeps_extremes():
    ds = Downsampler(n=100, width=0.1)
    for i in range(50000):  # 5000 s at 10 Hz
        ds.add(1000.0 + i * 0.1, math.sin(i / 300) + (5.0 if i == 31337 else 0.0))
    pts = ds.points()
    assert len(pts) <= 100
    assert max(b.hi for b in pts) == pytest.approx(5.0 + math.sin(31337 / 300))
    assert sum(b.n for b in pts) == 50000


def test_episodes_measure_time_and_worst():
    ep = Episodes(threshold=0.65, below=True)
    for i in range(100):
        t = i * 0.1
        ep.add(t, 0.5 if 2.0 <= t < 5.0 else 0.9, 0.1)
    ep.close()
    assert ep.total_s == pytest.approx(3.0, abs=0.11) and ep.worst == 0.5
    assert ep.longest.duration == pytest.approx(3.0, abs=0.11)


# -- derive ------------------------------------------------------------------------------------------

def _sample(t, pid=1, hits=0.0, lookups=0.0, **extra):
    m = {"hisparse_anchor_hits_total": hits, "hisparse_anchor_lookups_total": lookups}
    m.update(extra)
    return {"v": 1, "kind": "sample", "t": t, "target": "x", "pid": pid, "up": True, "lag_s": 0.0, "metrics": m}


def test_ratio_is_rate_over_rate_in_the_window():
    d = Deriver(window_s=2.0)
    out = None
    for i in range(41):  # hits grow by 3 and lookups by 4 per 0.1 s, then a burst of misses
        lookups = 4.0 * i + (40.0 if i > 30 else 0.0)
        out = d.feed(_sample(i * 0.1, hits=3.0 * i, lookups=lookups))
    # window = last 2 s = 20 ticks: hits +60, lookups +80 +40
    assert out.values["anchor_hit_rate"] == pytest.approx(60 / 120)


def test_counter_reset_and_new_pid_are_restarts():
    d = Deriver(window_s=2.0)
    for i in range(10):
        assert d.feed(_sample(i * 0.1, hits=10.0 * i, lookups=10.0 * i)).restart is None
    r = d.feed(_sample(1.0, hits=1.0, lookups=2.0))
    assert r.restart is not None and r.restart.why == "counter reset"
    assert "anchor_hit_rate" not in r.values  # no rate across two processes
    r = d.feed(_sample(1.1, pid=2, hits=5.0, lookups=5.0))
    assert r.restart is not None and r.restart.why == "pid" and (r.restart.old_pid, r.restart.new_pid) == (1, 2)


def test_recalibrations_counted_by_reason():
    d = Deriver()
    key = 'hisparse_recalibrations_total{reason="request"}'
    assert d.feed(_sample(0.0, **{key: 2.0})).recalibrations == {}
    assert d.feed(_sample(0.1, **{key: 3.0})).recalibrations == {"request": 1.0}


def test_histogram_quantile_interpolates():
    assert histogram_quantile(0.5, [1.0, 2.0], [0, 10, 0]) == pytest.approx(1.5)
    assert histogram_quantile(0.99, [1.0, 2.0], [0, 0, 5]) == 2.0
    assert histogram_quantile(0.5, [1.0], [0, 0]) is None


# -- scenarios -----------------------------------------------------------------------------------------

SCENARIO_S = 240.0


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """name -> (Analysis, ReadStats) of each constructed run, written to a file and read back."""
    d = tmp_path_factory.mktemp("scenarios")
    out = {}
    for name in H.SCENARIOS:
        path = str(d / f"{name}.log")
        recs = list(H.scenario_records(name, SCENARIO_S))
        for r in recs[:50] + recs[-50:] + [r for r in recs if r["kind"] != "sample"]:
            assert validate_line(r) == [], (name, r.get("kind"), validate_line(r))
        H.write_lines(path, recs)
        out[name] = analyse_file(path)
    return out


EXPECTED = {
    "slow_recycle": "slow_recycle", "poor_prefetch": "poor_prefetch", "anchor_decay": "anchor_decay",
    "metadata_growth": "metadata_growth", "pool_exhaustion": "pool_exhaustion",
    "target_restart": "target_restart",
}


def test_healthy_run_has_no_findings(scenarios):
    a, stats = scenarios["healthy"]
    assert stats.samples == SCENARIO_S * 10 and stats.skipped == 0
    assert diagnose_all(a.targets) == []
    run = a.targets["decode-0"]
    assert run.sketches["anchor_hit_rate"].quantile(0.5) == pytest.approx(0.86, abs=0.01)
    assert run.sketches["prefetch_efficiency"].quantile(0.5) == pytest.approx(0.93, abs=0.01)


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_each_scenario_produces_its_finding(scenarios, scenario):
    a, _ = scenarios[scenario]
    found = diagnose_all(a.targets)
    assert [f.rule for f in found] == [EXPECTED[scenario]], [(f.rule, f.evidence) for f in found]
    f = found[0]
    assert f.target == "decode-0" and f.evidence and f.change
    assert "UTC" in f.evidence[0]  # says when


def test_findings_carry_measured_evidence(scenarios):
    (f,) = diagnose_all(scenarios["slow_recycle"][0].targets)
    # the scenario recycles 1 %/s of active blocks while 30 wait, for the whole run
    assert f.worst == pytest.approx(0.01, rel=0.1) and f.threshold == thresholds.BLOCK_RECYCLE_RATE_MIN
    assert f.duration_s == pytest.approx(SCENARIO_S, abs=2)
    assert "cache_block_size (now 512) e.g. 256" in f.change
    (f,) = diagnose_all(scenarios["anchor_decay"][0].targets)
    assert "90.0% in the first half" in f.evidence[0] and "recalibrate_every" in f.change
    (f,) = diagnose_all(scenarios["target_restart"][0].targets)
    assert "pid 4242 -> 5242" in f.evidence[0] and "down 3." in f.evidence[0]
    assert f.start_t == pytest.approx(H.T0 + SCENARIO_S / 2, abs=4)
    (f,) = diagnose_all(scenarios["metadata_growth"][0].targets)
    assert "from 2.00 MiB to 8.00 MiB" in f.evidence[0] and 'metadata_device="cpu"' in f.change


def test_problem_in_one_target_only(tmp_path):
    a = list(H.scenario_records("healthy", 200.0, target="decode-0"))
    b = list(H.scenario_records("poor_prefetch", 200.0, target="decode-1", pid=5555))
    path = str(tmp_path / "run.log")
    H.write_lines(path, [a[0], *sorted((r for r in a + b if r["kind"] != "header"), key=lambda r: r["t"])])
    an, _ = analyse_file(path)
    assert [(f.target, f.rule) for f in diagnose_all(an.targets)] == [("decode-1", "poor_prefetch")]


def test_short_problem_is_not_a_finding(tmp_path):
    # 20 s of poor prefetch inside a 200 s run is below the rule's required duration (50 s)
    recs = list(H.scenario_records("healthy", 200.0))
    # counters are cumulative: halve the increase of "used" between +100 s and +120 s
    path = str(tmp_path / "run.log")
    bent = []
    lost = 0.0
    prev_issued = None
    for r in recs:
        if r["kind"] == "sample":
            m = dict(r["metrics"])
            issued = m["hisparse_prefetch_issued_total"]
            if prev_issued is not None and H.T0 + 100 <= r["t"] < H.T0 + 120:
                lost += 0.5 * (issued - prev_issued)
            prev_issued = issued
            m["hisparse_prefetch_used_total"] -= lost
            r = dict(r, metrics=m)
        bent.append(r)
    H.write_lines(path, bent)
    an, _ = analyse_file(path)
    run = an.targets["decode-0"]
    assert run.episodes["prefetch_efficiency"].total_s > 10  # the dip is seen ...
    assert diagnose_all(an.targets) == []  # ... but is too short to be a finding
    assert [f.rule for f in diagnose_all(an.targets, RuleConfig(min_duration_s=10))] == ["poor_prefetch"]


def _peak_traced(path: str) -> int:
    tracemalloc.start()
    try:
        analyse_file(path)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_log_size(tmp_path):
    src = str(tmp_path / "src.log")
    H.write_scenario(src, "healthy", 20.0)
    samples = H.read_samples(src)
    small, large = str(tmp_path / "small.log"), str(tmp_path / "large.log")
    s = H.stretch_log(samples, small, min_bytes=1 << 20)
    big = H.stretch_log(samples, large, min_bytes=5 << 20)
    assert big["lines"] >= 3.5 * s["lines"]
    a, stats = analyse_file(large)
    assert stats.skipped == 0 and diagnose_all(a.targets) == []  # stretched counters stay monotonic
    peak_small, peak_large = _peak_traced(small), _peak_traced(large)
    # 4x the lines: the peak may grow by the plot buckets' doubling slack, never in proportion
    assert peak_large < 1.5 * peak_small + (1 << 20), (peak_small, peak_large)


def test_live_diagnosis_names_the_most_urgent_problem():
    from easymats.report.live import LiveDiagnosis

    for scenario, expect in (("healthy", None), ("pool_exhaustion", "KV block pool nearly exhausted")):
        live = LiveDiagnosis(horizon_s=60.0)
        seen = []
        for i, rec in enumerate(H.scenario_records(scenario, 240.0)):
            live.feed(rec)
            if i % 100 == 0:
                seen.append(live.urgent(now=float(i)))
        if expect is None:
            assert set(seen) == {None}
        else:
            assert seen[0] is None and seen[-1] is not None and expect in seen[-1], seen[-1]
            assert "Enlarge the host pool" in seen[-1]


def _rewrite(records, fn):
    for r in records:
        if r["kind"] == "sample" and r.get("metrics"):
            r = dict(r, metrics=fn(r["t"] - H.T0, dict(r["metrics"])))
        yield r


def test_metadata_rule_ignores_cpu_runtimes_and_startup_steps(tmp_path):
    meta = reader.series_key("hisparse_kv_memory_bytes", {"kind": "metadata", "tier": "device"})
    gpu = reader.series_key("hisparse_runtime_info", {"device": "cuda:0", "model": "llama-tiny", "version": "0.1.0"})
    cpu = reader.series_key("hisparse_runtime_info", {"device": "cpu", "model": "llama-tiny", "version": "0.1.0"})

    def on_cpu(t, m):
        m[cpu] = m.pop(gpu)
        return m

    def step(t, m):  # allocated once at start-up, then flat: not growth
        m[meta] = 0.0 if t < 5 else float(6 << 20)
        return m

    for name, fn in (("cpu", on_cpu), ("step", step)):
        base = "metadata_growth" if name == "cpu" else "healthy"
        path = str(tmp_path / f"{name}.log")
        H.write_lines(path, _rewrite(H.scenario_records(base, 200.0), fn))
        an, _ = analyse_file(path)
        assert diagnose_all(an.targets) == [], name


def test_full_pool_in_streaming_mode_is_not_an_oom(tmp_path):
    key = "hisparse_kv_block_evictions_total"

    def streaming(t, m):  # the bounded pool overwrites a block every second
        m[key] = float(int(t))
        return m

    path = str(tmp_path / "streaming.log")
    H.write_lines(path, _rewrite(H.scenario_records("pool_exhaustion", 200.0), streaming))
    an, _ = analyse_file(path)
    assert an.targets["decode-0"].evictions == pytest.approx(199, abs=1)
    assert diagnose_all(an.targets) == []


_LIMIT = "hisparse_kv_blocks_limit"
_FREE = reader.series_key("hisparse_kv_blocks", {"state": "free"})


def _growing_pool(t, m):
    """The pool grows on demand with the load: always 2 blocks free, under 5 % of its size."""
    m[_FREE] = 2
    m[_LIMIT] = 0.0
    return m


def _no_limit_gauge(fn=None):
    """A log from before hisparse_kv_blocks_limit existed (optionally rewritten by ``fn`` first)."""
    def rewrite(t, m):
        m = fn(t, m) if fn else m
        m.pop(_LIMIT, None)
        return m
    return rewrite


@pytest.mark.parametrize("case, rewrite, finds", [
    ("bounded pool at its limit", None, True),
    ("pool that grows on demand (limit 0)", _growing_pool, False),
    ("old log, pool of constant size", _no_limit_gauge(), True),
    ("old log, pool seen growing", _no_limit_gauge(_growing_pool), False),
])
def test_pool_exhaustion_is_judged_against_the_limit(tmp_path, case, rewrite, finds):
    """The constructed pool_exhaustion run fills a 400-block limit; the same load on a pool that
    grows on demand keeps its free share under 5 % of its size all along, and is no finding."""
    path = str(tmp_path / "pool.log")
    recs = H.scenario_records("pool_exhaustion", 200.0)
    H.write_lines(path, _rewrite(recs, rewrite) if rewrite else recs)
    an, _ = analyse_file(path)
    run = an.targets["decode-0"]
    found = [f for f in diagnose_all(an.targets) if f.rule == "pool_exhaustion"]
    assert bool(found) == finds, (case, found)
    if rewrite is _growing_pool:
        assert run.sketches["pool_blocks"].max > run.sketches["pool_blocks"].min  # it did grow
        assert run.sketches["kv_free_blocks_ratio"].count == 0  # no limit: nothing to judge against
    if case == "bounded pool at its limit":
        assert run.sketches["pool_limit_blocks"].max == 400
        assert any("of a 400-block limit (host_pool_blocks)" in e for e in found[0].evidence), found[0].evidence


def test_live_diagnosis_ignores_a_pool_that_grows_on_demand():
    from easymats.report.live import LiveDiagnosis

    live = LiveDiagnosis(horizon_s=60.0)
    for rec in _rewrite(H.scenario_records("pool_exhaustion", 240.0), _growing_pool):
        live.feed(rec)
    assert live.urgent(now=0.0) is None


def test_target_filter_with_a_name_json_may_escape(tmp_path):
    name = 'dé"code'
    recs = list(H.scenario_records("healthy", 3.0, target=name))
    for ensure_ascii in (True, False):
        path = tmp_path / f"u{ensure_ascii}.log"
        path.write_text("".join(json.dumps(r, ensure_ascii=ensure_ascii) + "\n" for r in recs), encoding="utf-8")
        stats = reader.ReadStats()
        got = [r for r in reader.iter_records([str(path)], stats, target=name) if r["kind"] == "sample"]
        assert len(got) == 30


_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=False),
                         st.text(max_size=5))
_metric_value = st.one_of(_json_scalar, st.fixed_dictionaries(
    {"bounds": st.lists(st.floats(0, 1), max_size=3), "counts": st.lists(_json_scalar, max_size=4),
     "sum": _json_scalar}))


@given(st.lists(st.one_of(
    st.binary(max_size=40),
    st.fixed_dictionaries({
        "v": st.sampled_from([1, 1, 2, "1"]), "kind": st.sampled_from(["sample", "event", "header", "x"]),
        "t": st.one_of(st.floats(1e9, 2e9), _json_scalar),
        "target": st.one_of(st.sampled_from(["a", "b"]), _json_scalar),
        "pid": _json_scalar, "up": _json_scalar, "lag_s": _json_scalar,
        "event": st.sampled_from(["restart", "down", "attach"]),
        "metrics": st.one_of(_json_scalar, st.dictionaries(
            st.sampled_from(["hisparse_anchor_hits_total", "hisparse_anchor_lookups_total",
                             'hisparse_kv_blocks{state="active"}', 'hisparse_kv_blocks{state="free"}',
                             'hisparse_kv_blocks{state="pending_recycle"}', "hisparse_step_duration_seconds",
                             'hisparse_recalibrations_total{reason="drift"}', "hisparse_config_info{a=",
                             'hisparse_kv_memory_bytes{kind="metadata",tier="device"}']), _metric_value)),
        "process": st.one_of(st.none(), st.fixed_dictionaries({"rss_bytes": _json_scalar}))}),
), max_size=40))
@settings(max_examples=150, deadline=None)
def test_any_log_content_is_read_without_crashing(tmp_path_factory, items):
    path = tmp_path_factory.mktemp("fuzz") / "run.log"
    with open(path, "wb") as f:
        for it in items:
            line = it.replace(b"\n", b" ") if isinstance(it, bytes) else json.dumps(it).encode()
            f.write(line + b"\n")
    a, stats = analyse_file(str(path))
    from easymats.report import html
    from easymats.report.findings import format_findings

    format_findings(diagnose_all(a.targets))
    html.render(title="t", stats=stats, targets=a.targets, findings=[], plots=[], window_s=10.0)
    assert stats.lines == len(items)


def test_rotated_files_outside_the_time_range_are_not_read(tmp_path):
    path = str(tmp_path / "run.log")
    H.write_scenario(path, "healthy", 60.0)
    files = H.rotate_file(path, 40_000)
    assert len(files) >= 4
    spans = [reader.file_span(f) for f in files]
    assert all(a <= b for a, b in spans) and all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))
    lo, hi = spans[1][1] + 0.05, spans[2][1] - 0.05  # inside the third file only
    stats = reader.ReadStats()
    got = [r for r in reader.iter_records(files, stats, t_from=lo, t_to=hi) if r["kind"] == "sample"]
    assert got and all(lo <= r["t"] <= hi for r in got)
    assert files[0] in stats.skipped_files and files[-1] in stats.skipped_files
    assert files[2] not in stats.skipped_files
    all_stats = reader.ReadStats()
    expected = [r for r in reader.iter_records(files, all_stats) if r["kind"] == "sample" and lo <= r["t"] <= hi]
    assert [r["t"] for r in got] == [r["t"] for r in expected]


def test_infinite_or_nan_times_and_values_are_handled(tmp_path):
    a = 'hisparse_kv_blocks{state=\\"active\\"}'
    path = tmp_path / "inf.log"
    path.write_text("\n".join([
        '{"v":1,"kind":"sample","t":1795990000.0,"target":"a","pid":1,"up":true,"lag_s":0,"metrics":{"%s":3}}' % a,
        '{"v":1,"kind":"sample","t":Infinity,"target":"a","pid":1,"up":true,"lag_s":0,"metrics":{"%s":3}}' % a,
        '{"v":1,"kind":"sample","t":NaN,"target":"a","pid":1,"up":true,"lag_s":0,"metrics":{}}',
        '{"v":1,"kind":"sample","t":1795990000.1,"target":"a","pid":1,"up":true,"lag_s":NaN,'
        '"metrics":{"%s":Infinity}}' % a,
    ]) + "\n")
    an, stats = analyse_file(str(path))
    assert stats.samples == 2 and stats.skipped == 2
    assert an.targets["a"].sketches["active_blocks"].max == 3
