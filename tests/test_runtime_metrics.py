"""Every runtime metric of the catalogue moves through a workload that exercises it.

Read from the real telemetry segment with the agent's reader (easymats.segment.SegmentReader):
prefill and decode, a topic shift (drift), a control-file request, a second sequence freed,
resumed within grace (reclaim) and freed again past it (recycle), a bounded streaming host pool
(evictions), and a budget quantization policy that picks every bit width.
"""

import time

import pytest
import torch

from easymats import catalogue, telemetry
from easymats.segment import Histogram, SegmentReader, control_path
from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.metrics import DEVICE_COUNTERS, DeviceCounters, RuntimeMetrics
from hi_sparse.workloads import PlantedWorkload, run_decode, run_prefill

HQ, HKV, D = 4, 2, 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Runtime metrics that do not move during a run by their nature (configuration, not activity).
CONSTANT_BY_NATURE = {"hisparse_kv_blocks_limit"}


def _key(series):
    return series.name, tuple(sorted(series.labels.items()))


def _value(v):
    return (v.count, v.sum) if isinstance(v, Histogram) else v


def test_no_runtime_metric_stays_constant(segment_dir):
    seg = telemetry.open_segment("metrics-test", labels={"model": "planted"})
    cfg = HiSparseConfig(max_seq_len=4096, cache_block_size=16, window_size=16, global_tokens=8, top_k=64,
                         host_kv_bits="budget", quant_error_budget=0.02, host_pool_blocks=36, streaming=True,
                         audit_every=2, audit_top_m=8, audit_measure="top_m", drift_floor=0.8, drift_window=2,
                         recycle_grace_s=0.5,
                         publish_interval_s=0.0, gauge_interval_s=0.0, prefetch_blocks=2)
    eng = HiSparseEngine(cfg, 2, HQ, HKV, D, segment=seg, model_name="planted")
    reader = SegmentReader(seg.path)
    seen: dict[tuple, set] = {}

    def sample():
        for s in reader.read().series:
            seen.setdefault(_key(s), set()).add(_value(s.value))

    sample()
    wl = PlantedWorkload(HKV, HQ, D, seed=5)
    (a,) = eng.add_sequences(1)
    # four prompt segments whose value offsets make the budget policy pick 8, 6, 5 and 4 bits
    for offset in (0.0, 1.5, 3.5, 8.0):
        s = wl.segment(64, topic="A", anchors=2, value_offset=offset)
        run_prefill(eng, [a], s.k[None], s.v[None])
        sample()
    tail = wl.segment(64, topic="A", anchors=2, margin=20)
    qa = torch.stack([wl.topic_query("A") for _ in range(8)], 1)[None]
    run_prefill(eng, [a], tail.k[None], tail.v[None], qa)
    sample()

    def decode(topic, steps):
        for _ in range(steps):
            k, v = wl.noise(1)
            run_decode(eng, [a], wl.topic_query(topic)[None, :, None], k[None], v[None])
            sample()

    decode("A", 6)
    shift = wl.segment(64, topic="B", anchors=4, margin=20)
    run_prefill(eng, [a], shift.k[None], shift.v[None])
    decode("B", 8)                                        # drift
    ctl = telemetry.ControlFile.open_existing(control_path(seg.path))
    req = ctl.request("recalibrate", reason="test", requester="pytest")
    for _ in range(50):                                   # the runtime polls at most every 50 ms
        decode("B", 1)
        if ctl.acked()[0] == req:
            break
        time.sleep(0.01)
    assert ctl.acked()[0] == req                          # request, acknowledged
    (b,) = eng.add_sequences(1)
    s = wl.segment(40)
    run_prefill(eng, [b], s.k[None], s.v[None])
    sample()
    eng.free_sequences([b])
    sample()
    assert eng.resume_sequence(b)                         # within grace: blocks reclaimed
    sample()
    eng.free_sequences([b])
    time.sleep(0.55)
    decode("B", 1)                                        # grace over: recycled
    big = wl.segment(300)                                 # more than the free blocks: streaming evicts
    run_prefill(eng, [a], big.k[None], big.v[None])
    sample()
    decode("B", 3)
    eng.close()

    runtime = [m for m in catalogue.runtime_metrics() if m.type != catalogue.INFO]
    for spec in runtime:
        keys = [k for k in seen if k[0] == spec.name]
        assert keys, f"{spec.name} never published"
        if spec.name in CONSTANT_BY_NATURE:
            continue  # checked for its configured value below instead
        for k in keys:
            assert len(seen[k]) >= 2, f"{k} stayed at {seen[k]}"
    # The pool's limit is configuration, constant like an info metric: it must be the
    # configured host_pool_blocks in every snapshot, never the pool's current size or 0.
    assert seen[("hisparse_kv_blocks_limit", ())] == {36.0}
    # each allowed label value appears (every bit width, every recalibration reason, every state)
    for spec in runtime:
        for label, allowed in spec.label_values.items():
            got = {dict(k[1])[label] for k in seen if k[0] == spec.name}
            assert got == set(allowed), (spec.name, label, got)
    st = eng.stats
    assert st.recalibrations["schedule"] >= 1 and st.recalibrations["drift"] >= 1
    assert st.recalibrations["request"] == 1
    assert all(st.quant_blocks[b] > 0 for b in (4, 5, 6, 8)), st.quant_blocks
    assert st.block_evictions > 0 and st.block_reclaims > 0 and st.block_recycles > 0
    seg.close()


def _one_sequence_engine(name: str, seed: int):
    """A one-layer engine publishing at every call into its own segment, a reader of that segment,
    a planted workload and one sequence: (segment, engine, reader, workload, sequence id)."""
    seg = telemetry.open_segment(name, labels={"model": "planted"})
    cfg = HiSparseConfig(max_seq_len=4096, cache_block_size=16, window_size=16, global_tokens=8, top_k=64,
                         publish_interval_s=0.0)
    eng = HiSparseEngine(cfg, 1, HQ, HKV, D, segment=seg, model_name="planted")
    (a,) = eng.add_sequences(1)
    return seg, eng, SegmentReader(seg.path), PlantedWorkload(HKV, HQ, D, seed=seed), a


def test_pool_limit_is_zero_for_a_pool_that_grows_on_demand(segment_dir):
    """Without host_pool_blocks the pool grows: its size is published, but no limit (0)."""
    seg, eng, reader, wl, a = _one_sequence_engine("limit-test", seed=3)
    sizes = set()
    for _ in range(3):                                    # 3 x 400 tokens: the pool grows twice or more
        s = wl.segment(400)
        run_prefill(eng, [a], s.k[None], s.v[None])
        snap = reader.read()
        assert snap.get("hisparse_kv_blocks_limit") == 0.0
        sizes.add(sum(snap.get("hisparse_kv_blocks", state=st) for st in ("active", "free", "pending_recycle")))
    assert len(sizes) >= 2, sizes                         # it did grow, and the limit stayed 0
    eng.close()
    seg.close()


def test_an_infinite_publish_interval_publishes_nothing_until_set_back(segment_dir):
    """engine.publisher.interval_s (the e2e benchmark's telemetry-off phases set it to inf):
    counters keep counting in the engine, the segment keeps its last snapshot, and the first
    publish after setting it back catches up."""
    seg, eng, reader, wl, a = _one_sequence_engine("pause-test", seed=4)

    def prefill_tokens():
        return reader.read().get("hisparse_tokens_total", phase="prefill")

    s = wl.segment(64)
    run_prefill(eng, [a], s.k[None], s.v[None])
    assert prefill_tokens() == 64
    eng.publisher.interval_s = float("inf")
    run_prefill(eng, [a], s.k[None], s.v[None])
    assert prefill_tokens() == 64 and eng.stats.tokens_prefill == 128
    eng.publisher.interval_s = 0.0
    run_prefill(eng, [a], s.k[None], s.v[None])
    assert prefill_tokens() == 192
    eng.close()
    seg.close()


def test_costly_gauges_refresh_at_their_own_interval(segment_dir):
    """Anchors, hot-buffer residency and memory are refreshed at most every gauge_interval_s when
    publishing (counters every time); 0 refreshes them at every publish."""
    seg = telemetry.open_segment("gauge-test", labels={"model": "planted"})
    cfg = HiSparseConfig(max_seq_len=4096, cache_block_size=16, window_size=16, global_tokens=8, top_k=64,
                         publish_interval_s=0.0, gauge_interval_s=3600.0)
    eng = HiSparseEngine(cfg, 1, HQ, HKV, D, segment=seg, model_name="planted")
    reader = SegmentReader(seg.path)
    (a,) = eng.add_sequences(1)
    wl = PlantedWorkload(HKV, HQ, D, seed=6)
    s = wl.segment(64)
    run_prefill(eng, [a], s.k[None], s.v[None])
    snap = reader.read()
    assert snap.get("hisparse_tokens_total", phase="prefill") == 64               # counters: every publish
    assert snap.get("hisparse_hot_buffer_resident_tokens") == 0                   # costly gauge: not yet
    eng.publisher.gauge_interval_s = 0.0
    run_prefill(eng, [a], s.k[None], s.v[None])
    assert reader.read().get("hisparse_hot_buffer_resident_tokens") == eng.stats.hot_buffer_resident > 0
    eng.close()
    seg.close()


def test_every_runtime_series_is_one_metric_object_with_or_without_a_segment(segment_dir):
    """The registry binds each runtime series of the catalogue once: the segment's own objects when
    publishing (what the runtime counts into is what the agent reads), standalone ones otherwise."""
    from hi_sparse.metrics import BY_LABEL, HISTOGRAMS, SCALARS, RuntimeMetrics

    seg = telemetry.open_segment("registry-test")
    bound, alone = RuntimeMetrics(seg), RuntimeMetrics(None)
    for name, (metric, labels) in SCALARS.items():
        assert getattr(bound, name) is getattr(seg, catalogue.get(metric).type)(metric, **labels), name
    expected = {m.name for m in catalogue.runtime_metrics() if m.type != catalogue.INFO}
    assert {m for m, _ in SCALARS.values()} | set(BY_LABEL.values()) | set(HISTOGRAMS.values()) == expected
    assert set(bound.recalibrations) == set(catalogue.RECALIBRATION_REASONS)
    assert set(bound.quant_blocks) == {int(b) for b in catalogue.QUANT_BITS}
    alone.backup_bytes.inc(5)
    alone.recalibrations["drift"].inc()
    alone.quant_error.observe(0.01)
    snap = alone.snapshot()
    assert snap.backup_bytes == 5 and snap.recalibrations["drift"] == 1 and sum(snap.quant_error.counts) == 1
    assert bound.snapshot().backup_bytes == 0
    seg.close()


def _counted(metrics) -> dict:
    st = metrics.snapshot()
    return {name: getattr(st, name) for name in DEVICE_COUNTERS}


def test_device_counters_flush_every_count_once():
    """A periodic flush (wait=False) and an exact one both add every count once and start over."""
    metrics = RuntimeMetrics(None)
    dc = DeviceCounters(torch.device("cpu"))
    dc.add(torch.tensor(3), 4)
    dc.flush_into(metrics, wait=False)
    dc.add(1, 1)
    dc.flush_into(metrics)
    dc.flush_into(metrics, wait=False)
    got = _counted(metrics)
    assert [got[n] for n in DEVICE_COUNTERS[:2]] == [4, 5] and not any(got[n] for n in DEVICE_COUNTERS[2:])
    assert int(dc.acc.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_device_counters_on_cuda_never_wait_for_the_gpu_and_lose_nothing():
    """A periodic flush returns while the GPU is busy (the counts land at a later flush); an
    exact flush then has every count, once."""
    metrics = RuntimeMetrics(None)
    dc = DeviceCounters(torch.device("cuda"))
    x = torch.randn(4096, 4096, device="cuda")
    total = 0
    for i in range(20):
        for _ in range(8):                      # ~tens of ms of GPU work queued ahead of the counts
            x = torch.tanh(x @ x)
        dc.add(i + 1)
        total += i + 1
        t0 = time.perf_counter()
        dc.flush_into(metrics, wait=False)
        assert time.perf_counter() - t0 < 0.005, "a periodic flush waited for the GPU"
    early = _counted(metrics)[DEVICE_COUNTERS[0]]
    assert early < total                        # some counts were still in flight
    dc.flush_into(metrics)
    assert _counted(metrics)[DEVICE_COUNTERS[0]] == total
    dc.flush_into(metrics)
    assert _counted(metrics)[DEVICE_COUNTERS[0]] == total
