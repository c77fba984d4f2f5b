"""The mapping tables: every HiSparse metric of both vLLM revisions and SGLang is covered, and the
expositions that prometheus_client (the library both engines use) writes map as the tables say."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from easymats import catalogue
from easymats.sources import maps
from easymats.sources.scrape import parse_exposition
from easymats.sources.translate import Family, Sample, translate

# The HiSparse series each vLLM revision exports (docs/engines.md; shared/REFERENCES.md section 2),
# as sample names in the exposition (prometheus_client adds _total to counters).
VLLM_COUNTERS = {"vllm:hisparse_cache_hits_total", "vllm:hisparse_cache_misses_total",
                 "vllm:hisparse_host_to_device_bytes_total"}
VLLM_HISTOGRAMS = {f"vllm:hisparse_host_block_{h}_seconds_{s}" for h in ("lifetime", "idle_before_evict", "reuse_gap")
                   for s in ("bucket", "sum", "count")}
VLLM_A_GAUGES = {"vllm:hisparse_host_blocks_used", "vllm:hisparse_host_blocks_total",
                 "vllm:hisparse_host_blocks_usage", "vllm:hisparse_pending_spills"}
VLLM_B_GAUGES = {"vllm:hisparse_host_cache_usage_perc", "vllm:hisparse_pending_page_transfers"}
SGLANG_HISPARSE = {"sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens",
                   "sglang:hicache_backup_bytes_total", "sglang:load_back_bytes_total",
                   "sglang:hisparse_host_pool_free_tokens", "sglang:hisparse_host_pool_total_tokens",
                   "sglang:hisparse_host_pool_pinned_tokens", "sglang:hisparse_host_pool_evictable_tokens",
                   "sglang_log:gpu_tokens", "sglang_log:cpu_tokens", "sglang_log:gpu_token_usage",
                   "sglang_log:cpu_token_usage"}


def test_tables_name_only_catalogue_series_and_feed_counters_from_counters():
    assert maps.check_maps() == []


def test_check_maps_catches_mistakes():
    bad = maps.EngineMap("x", "r", "t", "s", rules=(
        maps.rule('hisparse_kv_blocks{state="gone"}', "x:a"),
        maps.rule("hisparse_hot_buffer_hits_total", "x:a_total - x:b_total"),
        maps.rule("hisparse_nonsense", "x:a")), why_not={"hisparse_nope": "?"})
    problems = "\n".join(maps.check_maps([bad]))
    assert "state='gone'" in problems and "counter must be a sum" in problems
    assert "hisparse_nonsense" in problems and "hisparse_nope" in problems


@pytest.mark.parametrize("emap, names", [
    (maps.VLLM_A, VLLM_COUNTERS | VLLM_HISTOGRAMS | VLLM_A_GAUGES),
    (maps.VLLM_B, VLLM_COUNTERS | VLLM_HISTOGRAMS | VLLM_B_GAUGES),
    (maps.SGLANG, SGLANG_HISPARSE),
], ids=["vllm-a", "vllm-b", "sglang"])
def test_every_hisparse_series_of_each_revision_is_mapped_or_passed_through_and_logged(emap, names):
    assert names <= emap.hisparse_samples(), sorted(names - emap.hisparse_samples())


def test_not_provided_is_the_catalogue_minus_the_rules_with_a_reason_each():
    for emap in maps.ENGINE_MAPS:
        runtime = {m.name for m in catalogue.runtime_metrics()}
        assert set(emap.not_provided()) == runtime - emap.provided_metrics()
        for metric in emap.not_provided():
            assert maps.why_not(emap, metric)
    # What a user reads first: vLLM gives hot-buffer hit rate and swap-in, nobody gives anchors.
    assert "hisparse_hot_buffer_hits_total" in maps.VLLM_A.provided_metrics()
    assert "hisparse_kv_blocks" in maps.VLLM_A.provided_metrics()
    assert "hisparse_kv_blocks" not in maps.VLLM_B.provided_metrics()
    assert all("hisparse_anchor_hits_total" in m.not_provided() for m in maps.ENGINE_MAPS)


def test_parse_way_and_its_errors():
    terms = maps.parse_way('a:x_total + b{mode="decode", k="v"} - c')
    assert [(t.sample, t.match, t.sign) for t in terms] == [
        ("a:x_total", (), 1), ("b", (("k", "v"), ("mode", "decode")), 1), ("c", (), -1)]
    for bad in ("", "a b", 'a{mode=decode}', "a +"):
        with pytest.raises(ValueError):
            maps.parse_way(bad)


def _vllm_exposition(revision: str, engines: int = 2) -> list[Family]:
    reg = CollectorRegistry()
    lab = ["model_name", "engine"]
    hits = Counter("vllm:hisparse_cache_hits", "h", lab, registry=reg)
    misses = Counter("vllm:hisparse_cache_misses", "m", lab, registry=reg)
    h2d = Counter("vllm:hisparse_host_to_device_bytes", "b", lab, registry=reg)
    Gauge("vllm:num_requests_running", "r", lab, registry=reg).labels("m", "0").set(3)
    Counter("vllm:generation_tokens", "g", lab, registry=reg).labels("m", "0").inc(40)
    for e in range(engines):
        hits.labels("m", str(e)).inc(60)
        misses.labels("m", str(e)).inc(40)
        h2d.labels("m", str(e)).inc(4096)
    if revision == "a":
        Gauge("vllm:hisparse_host_blocks_used", "u", lab, registry=reg).labels("m", "0").set(6)
        Gauge("vllm:hisparse_host_blocks_total", "t", lab, registry=reg).labels("m", "0").set(8)
        Gauge("vllm:hisparse_host_blocks_usage", "p", lab, registry=reg).labels("m", "0").set(0.75)
        Gauge("vllm:hisparse_pending_spills", "s", lab, registry=reg).labels("m", "0").set(3)
    else:
        Gauge("vllm:hisparse_host_cache_usage_perc", "p", lab, registry=reg).labels("m", "0").set(0.75)
        Gauge("vllm:hisparse_pending_page_transfers", "s", lab, registry=reg).labels("m", "0").set(3)
    Histogram("vllm:hisparse_host_block_lifetime_seconds", "l", lab, buckets=[1, 10],
              registry=reg).labels("m", "0").observe(5)
    return parse_exposition(generate_latest(reg).decode())


def _series(tr) -> dict[str, float]:
    return {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items())): s.value for s in tr.series}


def _mapped(revision: str):
    """(chosen map, translation, {series: value}) of a vLLM stand-in exposition."""
    fams = _vllm_exposition(revision)
    emap = maps.choose(s.name for f in fams for s in f.samples)
    tr = translate(emap, fams)
    return emap, tr, _series(tr)


def test_vllm_revision_a_maps_hits_lookups_swap_in_and_the_host_pool():
    emap, tr, got = _mapped("a")
    assert emap is maps.VLLM_A
    # Summed over vLLM's data-parallel engines (the `engine` label): 2 x 60 hits of 2 x 100 rows.
    assert got["hisparse_hot_buffer_hits_total"] == 120
    assert got["hisparse_hot_buffer_lookups_total"] == 200
    assert got["hisparse_swap_in_bytes_total"] == 8192
    assert got["hisparse_kv_blocks,state=active"] == 6 and got["hisparse_kv_blocks,state=free"] == 2
    assert got["hisparse_kv_blocks_limit"] == 8
    assert got["hisparse_sequences"] == 3 and got["hisparse_tokens_total,phase=decode"] == 40
    types = {s.name: s.type for s in tr.series}
    assert types["hisparse_hot_buffer_lookups_total"] == "counter" and types["hisparse_kv_blocks"] == "gauge"
    passed = {f.name for f in tr.passthrough}
    # Mapped series (and their _created twins) are consumed; the rest passes through.
    assert "vllm:hisparse_cache_hits" not in passed and "vllm:hisparse_cache_hits_created" not in passed
    assert {"vllm:hisparse_host_blocks_usage", "vllm:hisparse_pending_spills",
            "vllm:hisparse_host_block_lifetime_seconds"} <= passed
    assert 'vllm:hisparse_pending_spills{engine="0",model_name="m"}' in tr.logged
    assert not any(k.startswith("vllm:num_requests") for k in tr.logged)  # not a HiSparse series


def test_vllm_revision_b_maps_the_counters_and_passes_the_usage_ratio_through():
    emap, tr, got = _mapped("b")
    assert emap is maps.VLLM_B
    assert got["hisparse_hot_buffer_hits_total"] == 120 and got["hisparse_hot_buffer_lookups_total"] == 200
    assert not any(k.startswith("hisparse_kv_blocks") for k in got)
    assert {"vllm:hisparse_host_cache_usage_perc", "vllm:hisparse_pending_page_transfers"} <= {
        f.name for f in tr.passthrough}


def test_a_vllm_without_host_tier_gauges_gets_the_common_rules():
    fams = [f for f in _vllm_exposition("b") if "usage_perc" not in f.name and "page_transfers" not in f.name]
    assert maps.choose(s.name for f in fams for s in f.samples) is maps.VLLM_BASE


def test_sglang_replicas_are_taken_once_and_data_parallel_ranks_summed():
    def fam(name, samples, typ="gauge"):
        return Family(name, typ, "", [Sample(name, lab, v) for lab, v in samples])
    tp0, tp1 = {"tp_rank": "0", "dp_rank": "0"}, {"tp_rank": "1", "dp_rank": "0"}
    dp1 = {"tp_rank": "0", "dp_rank": "1"}
    fams = [fam("sglang:hicache_host_used_tokens", [(tp0, 100), (tp1, 100), (dp1, 50)]),
            fam("sglang:hicache_host_total_tokens", [(tp0, 1000), (tp1, 1000), (dp1, 1000)]),
            fam("sglang:num_running_reqs", [(tp0, 4), (tp1, 4)]),
            fam("sglang_log:running_reqs", [({}, 7)]),
            fam("sglang_log:gpu_tokens", [({}, 4096)])]
    emap = maps.choose(s.name for f in fams for s in f.samples)
    assert emap is maps.SGLANG
    tr = translate(emap, fams)
    got = _series(tr)
    assert got["hisparse_kv_blocks,state=active"] == 150
    assert got["hisparse_kv_blocks_limit"] == 2000 and got["hisparse_kv_blocks,state=free"] == 1850
    assert got["hisparse_sequences"] == 4  # the metric wins over the log: the first complete way
    assert tr.used["hisparse_sequences"] == 0
    assert got["hisparse_hot_buffer_resident_tokens"] == 4096
    assert "sglang_log:running_reqs" in {f.name for f in tr.passthrough}  # not consumed: passed through


def test_a_later_way_is_used_when_the_first_is_incomplete():
    fams = [Family("sglang_log:cpu_tokens", "gauge", "", [Sample("sglang_log:cpu_tokens", {}, 77)]),
            Family("sglang:hisparse_host_pool_free_tokens", "gauge", "",
                   [Sample("sglang:hisparse_host_pool_free_tokens", {}, 23)])]
    tr = translate(maps.SGLANG, fams)
    got = _series(tr)
    # hicache gauges absent; the unverified host-pool gauge lacks its total: the log gives active.
    assert got["hisparse_kv_blocks,state=active"] == 77 and tr.used['hisparse_kv_blocks{state="active"}'] == 2
    assert got["hisparse_kv_blocks,state=free"] == 23
    assert "hisparse_kv_blocks_limit" not in got


def test_an_unknown_engine_passes_everything_through_and_maps_nothing():
    fams = parse_exposition("# TYPE other_thing gauge\nother_thing 1\n")
    assert maps.choose(s.name for f in fams for s in f.samples) is None
    tr = translate(None, fams)
    assert tr.series == [] and [f.name for f in tr.passthrough] == ["other_thing"]


def test_an_engine_family_never_shadows_a_catalogue_one():
    fams = parse_exposition("# TYPE hisparse_sequences gauge\nhisparse_sequences 9\nvllm:x 1\n")
    tr = translate(maps.VLLM_BASE, fams)
    assert [f.name for f in tr.passthrough] == ["vllm:x"]


def test_ls_engines_says_what_each_engine_provides_and_cannot_provide():
    from click.testing import CliRunner

    from easymats.cli import main

    res = CliRunner().invoke(main, ["ls", "--engines"])
    assert res.exit_code == 0, res.output
    blocks = res.output.split("\n\n")
    for emap in maps.ENGINE_MAPS:
        block = next(b for b in blocks if b.startswith(emap.key + ":"))
        for series in emap.provided():
            assert f"provides {series} = " in block
        for metric in emap.not_provided():
            assert f"NOT PROVIDED {metric}: {maps.why_not(emap, metric)}" in block
        assert maps.DEFAULT_WHY not in block  # every gap has its own reason


def test_docs_engines_states_every_mapping_of_the_tables():
    import os

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "engines.md"),
              encoding="utf-8") as f:
        doc = f.read()
    for emap in maps.ENGINE_MAPS:
        assert f"`{emap.revision}`" in doc or emap.engine == "sglang", emap.key
        for r in emap.rules:
            assert f"`{r.series}`" in doc, r.series
            for term in (t for way in r.ways for t in way):
                if not term.sample.startswith(maps.LOG_PREFIX):
                    assert term.sample in doc, (r.series, term.sample)


def test_engine_only_agent_series_are_exactly_what_an_engine_target_adds(tmp_path):
    from easymats.sources.target import log_target
    from easymats.targets import Target

    (tmp_path / "x.log").write_text("")
    tg = log_target(str(tmp_path / "x.log"), peak_window_s=15.0, timeout_s=0.08)
    try:
        assert {name for name, _, _ in tg.engine_series()} == catalogue.ENGINE_TARGET_ONLY
    finally:
        tg.close()
    assert not hasattr(Target, "engine_series")  # a native target never exports them


def test_every_easymats_package_is_in_the_distribution():
    """A package missing from pyproject's list works in the editable install and is absent from a
    real one (`pip install easymats`): easymats.sources is imported by the agent itself."""
    import os
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {os.path.relpath(d, root).replace(os.sep, ".") for d, _, files in os.walk(os.path.join(root, "easymats"))
             if "__init__.py" in files}
    assert found <= listed, sorted(found - listed)
