"""The cardinality budget: series per runtime target, from the catalogue and from real scrapes.

docs/scaling.md multiplies these numbers out for 1,000 nodes; a change that makes one target
export more than SERIES_PER_TARGET_BUDGET series fails here and must update that page.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from helpers_prometheus import stop  # noqa: E402
from helpers_targets import free_port, start_target  # noqa: E402

from easymats import cardinality, catalogue  # noqa: E402

# The budget per runtime target with the default catalogue on one GPU (docs/scaling.md): the
# catalogue allows 82 today. A per-layer label on one counter of a 32-layer model alone would
# add 31 series and fail: per-layer detail is behind an option (HiSparseConfig.layer_metrics,
# catalogue entries marked `detail`) and outside this budget.
SERIES_PER_TARGET_BUDGET = 90
# An agent's own series on an 8-GPU node (health, lag histogram, per-GPU NVML, webhook codes).
SERIES_PER_AGENT_BUDGET = 50
# Label names that would multiply series by model shape or by traffic: never in the default.
UNBOUNDED_LABELS = {"layer", "head", "kv_head", "sequence", "seq", "request", "request_id", "token"}


def test_catalogue_series_per_target_are_within_budget():
    assert cardinality.series_per_target(gpus_per_target=1) <= SERIES_PER_TARGET_BUDGET
    assert cardinality.series_per_agent(gpus=8) <= SERIES_PER_AGENT_BUDGET
    # 8 targets on an 8-GPU node: what docs/scaling.md starts from.
    assert cardinality.series_per_node(8, 8) <= 8 * SERIES_PER_TARGET_BUDGET + SERIES_PER_AGENT_BUDGET


def test_every_runtime_label_is_bounded_and_none_is_per_layer():
    for spec in catalogue.CATALOGUE.values():
        if spec.detail:  # opt-in per-layer detail, outside the default budget
            assert spec.labels == ("layer",) and spec.source == catalogue.RUNTIME, spec.name
            continue
        assert not set(spec.labels) & UNBOUNDED_LABELS, spec.name
        if spec.source == catalogue.RUNTIME and spec.type != catalogue.INFO:
            assert set(spec.labels) <= set(spec.label_values), (spec.name, "label without its values")
    assert catalogue.runtime_metrics() == [s for s in catalogue.runtime_metrics(detail=True) if not s.detail]


@pytest.mark.parametrize("layer_metrics", [False, True])
def test_per_layer_detail_only_behind_the_option(segment_dir, layer_metrics):
    """A real engine publishes per-layer audit series only with layer_metrics=True: 2 per layer,
    adding up to the layer-wide counters; by default not one series has a layer label."""
    import torch

    from easymats import telemetry
    from easymats.segment import SegmentReader
    from hi_sparse.config import HiSparseConfig
    from hi_sparse.engine import HiSparseEngine
    from hi_sparse.workloads import PlantedWorkload, run_decode, run_prefill

    torch.set_num_threads(1)
    layers, hq, hkv, d = 3, 4, 2, 32
    seg = telemetry.open_segment("detail-test")
    cfg = HiSparseConfig(max_seq_len=4096, cache_block_size=16, window_size=16, global_tokens=8, top_k=48,
                         audit_every=1, audit_top_m=8, publish_interval_s=0.0, layer_metrics=layer_metrics)
    eng = HiSparseEngine(cfg, layers, hq, hkv, d, segment=seg, model_name="planted")
    wl = PlantedWorkload(hkv, hq, d, seed=3)
    ids = eng.add_sequences(1)
    s = wl.segment(256, topic="A", anchors=4, margin=32)
    run_prefill(eng, ids, s.k[None], s.v[None])
    for _ in range(6):
        k, v = wl.noise(1)
        run_decode(eng, ids, wl.topic_query("A")[None, :, None], k[None], v[None])
    snap = SegmentReader(seg.path).read()
    eng.close()
    seg.close()
    per_layer = {(x.name, x.labels["layer"]): x.value for x in snap.series if "layer" in x.labels}
    totals = {x.name: x.value for x in snap.series if x.name in ("hisparse_anchor_lookups_total",
                                                                  "hisparse_anchor_hits_total")}
    if not layer_metrics:
        assert per_layer == {}
        return
    assert len(per_layer) == 2 * layers == cardinality.detail_series_per_target(layers)
    for name, total in (("hisparse_audit_lookups_total", "hisparse_anchor_lookups_total"),
                        ("hisparse_audit_hits_total", "hisparse_anchor_hits_total")):
        assert sum(v for (n, _), v in per_layer.items() if n == name) == totals[total] > 0


def test_an_unbounded_label_is_refused():
    spec = catalogue.MetricSpec("hisparse_x_total", catalogue.COUNTER, "", "x", labels=("layer",))
    with pytest.raises(ValueError, match="label_values"):
        cardinality.series_of(spec)
    wide = catalogue.MetricSpec("hisparse_x_total", catalogue.COUNTER, "", "x", labels=("layer",),
                                label_values={"layer": tuple(str(i) for i in range(32))})
    assert cardinality.series_per_target(1) + cardinality.series_of(wide) > SERIES_PER_TARGET_BUDGET


def _agent(port: int, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from easymats.cli import main; main()", "--keep-serving",
                             "--quiet", "--interval", "0.1", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=log)


def _scrape_until(port: int, targets: set[str], procs: list[subprocess.Popen], timeout: float = 60.0,
                  settle: int = 3) -> str:
    """The /metrics body once every target shows and its series count held for ``settle`` scrapes."""
    deadline = time.monotonic() + timeout
    last, same = None, 0
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args} exited with {p.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            time.sleep(0.3)
            continue
        counts = cardinality.count_by_target(text)
        if targets <= set(counts):
            key = tuple(sorted(counts.items()))
            same = same + 1 if key == last else 0
            last = key
            if same >= settle:
                return text
        time.sleep(0.5)
    raise AssertionError(f"no stable /metrics with targets {sorted(targets)} within {timeout:g} s")


def test_a_full_target_exports_exactly_what_the_catalogue_allows(tmp_path):
    """The reference writer publishing every runtime series: the count the catalogue predicts
    (no GPU here, and the per-target webhook counters only after a request)."""
    port = free_port()
    target, _ = start_target("decode-0", rate=20, duration=0, extra=["--full"])
    agent = _agent(port, open(tmp_path / "agent.log", "w"))
    try:
        text = _scrape_until(port, {"decode-0"}, [target, agent])
    finally:
        stop([agent, target])
    counts = cardinality.count_by_target(text)
    expected = cardinality.series_per_target(gpus_per_target=0) - sum(
        cardinality.series_of(catalogue.get(name))
        for name in ("easymats_recalibration_requests_total", "easymats_webhook_write_failures_total"))
    assert counts["decode-0"] == expected
    assert counts[""] <= cardinality.series_per_agent(gpus=0)
    assert not cardinality.label_names(text) & UNBOUNDED_LABELS


def test_the_real_runtime_stays_within_the_budget(tmp_path):
    """Two hi_sparse engines (python -m hi_sparse.demo --synthetic, CPU: the real runtime on a
    random-weight model, which starts in seconds; the series do not depend on the weights) scraped
    through the agent: series per target counted from the real /metrics, printed for
    docs/scaling.md."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runtime = subprocess.Popen([sys.executable, "-m", "hi_sparse.demo", "--duration", "120", "--device", "cpu",
                                "--synthetic"],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "demo.log", "w"), env=env)
    agent = _agent(port, open(tmp_path / "agent.log", "w"))
    try:
        text = _scrape_until(port, {"demo-generate", "demo-longctx"}, [runtime, agent], timeout=90)
    finally:
        stop([agent, runtime])
    counts = cardinality.count_by_target(text)
    bound = cardinality.series_per_target(gpus_per_target=0)
    for name in ("demo-generate", "demo-longctx"):
        assert 0.9 * bound <= counts[name] <= bound <= SERIES_PER_TARGET_BUDGET, (name, counts)
    assert not cardinality.label_names(text) & UNBOUNDED_LABELS
    print(f"\nseries per target from the real runtime's /metrics: {dict(counts)} "
          f"(catalogue bound {bound} without GPU, {cardinality.series_per_target(1)} on one GPU)")
