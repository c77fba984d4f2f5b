"""Planted structure, measured by the engine's own audit (exact attention), never asserted by fiat.

Needles: query-aware selection must find them (recall >= 0.95). Topic anchors: pinned after the
first recalibration; a topic shift drops the audited anchor hit rate; a recalibration (requested,
through the real control file, or on drift) restores it.
"""

import time

import pytest
import torch

from easymats import telemetry
from easymats.segment import control_path
from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.kernels import two_level_pays
from hi_sparse.key_bounds import n_super
from hi_sparse.workloads import PlantedWorkload, run_decode, run_prefill

L, HQ, HKV, D = 1, 4, 2, 32

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make(seed=1, **over):
    # these tests are about finding planted tokens: the audit counts the true top-m (needle recall);
    # a recalibration in the step, so that its effect shows from the next step on
    kw = dict(max_seq_len=8192, cache_block_size=32, window_size=32, global_tokens=12, top_k=128,
              audit_every=1, audit_top_m=8, audit_measure="top_m", drift_floor=0.0, telemetry=False,
              prefetch_blocks=1, background_recalibration=False)
    kw.update(over)
    wl = PlantedWorkload(HKV, HQ, D, seed=seed)
    eng = HiSparseEngine(HiSparseConfig(**kw), L, HQ, HKV, D)
    return wl, eng, eng.add_sequences(1)


def _n_super(eng):
    c = eng.cfg
    return n_super(c.top_k, c.window_size, c.global_tokens, c.select_block, c.prefetch_units)


def topic_queries(wl, topic, n):
    """(1, Hq, n, D) prefill queries for the last n prompt tokens."""
    return torch.stack([wl.topic_query(topic) for _ in range(n)], 1)[None]


def audited_rate(eng, wl, ids, query, steps):
    """Decode ``steps`` noise tokens with ``query()``; hit rate over the audits of those steps."""
    before = eng.stats
    lookups0, hits0 = before.anchor_lookups, before.anchor_hits
    for _ in range(steps):
        k, v = wl.noise(1)
        run_decode(eng, ids, query()[None, :, None], k[None], v[None])
    after = eng.stats
    lookups = after.anchor_lookups - lookups0
    assert lookups > 0
    return (after.anchor_hits - hits0) / lookups


@pytest.mark.parametrize("bits,group", [(None, 16), ("auto", 16), (None, 2)], ids=["bf-one-level", "auto-one-level",
                                                                              "two-level"])
def test_query_aware_selection_finds_needles(bits, group):
    wl, eng, ids = make(global_tokens=0, audit_top_m=1, host_kv_bits=bits, metadata_device="device",
                        bound_group=group)
    needles = tuple(range(16))
    seg = wl.segment(4096, needles=needles, margin=64)
    run_prefill(eng, ids, seg.k[None], seg.v[None])
    before, hits_before = eng.stats.anchor_lookups, eng.stats.anchor_hits
    for nid in needles:
        k, v = wl.noise(1)
        run_decode(eng, ids, wl.needle_query(nid)[None, :, None], k[None], v[None])
        assert eng.recent_audits[-1].lookups == 1
    st = eng.stats
    lookups = st.anchor_lookups - before
    recall = (st.anchor_hits - hits_before) / lookups
    assert lookups == len(needles)
    assert recall >= 0.95, recall
    # 128 blocks of 32: super-blocks of 2 blocks pay off (the refined set is under a quarter)
    assert two_level_pays(-(-eng.seq_len(ids[0]) // 32), group, _n_super(eng)) == (group == 2)
    # the needle positions themselves were selected (the audit's top-1 was the needle)
    sel = eng.selection(0, ids[0])
    assert seg.needles[needles[-1]] in sel.flatten().tolist()


def _shifted(**over):
    wl, eng, ids = make(**over)
    seg = wl.segment(2048, topic="A", anchors=8, margin=64)
    run_prefill(eng, ids, seg.k[None], seg.v[None], topic_queries(wl, "A", 8))
    assert eng.stats.recalibrations["schedule"] == 1  # first fit once sparsity starts
    pinned = set(eng.seqs[ids[0]].anchors[0].flatten().tolist())
    assert set(seg.anchors) <= pinned  # recalibration pinned every planted anchor
    rate_a = audited_rate(eng, wl, ids, lambda: wl.topic_query("A"), 8)
    segb = wl.segment(512, topic="B", anchors=8, margin=64)
    run_prefill(eng, ids, segb.k[None], segb.v[None])
    return wl, eng, ids, rate_a


def test_topic_shift_drops_hit_rate_and_requested_recalibration_restores_it():
    wl, eng, ids, rate_a = _shifted()
    rate_shift = audited_rate(eng, wl, ids, lambda: wl.topic_query("B"), 8)
    eng.request_recalibration()
    audited_rate(eng, wl, ids, lambda: wl.topic_query("B"), 1)  # the step that recalibrates
    rate_after = audited_rate(eng, wl, ids, lambda: wl.topic_query("B"), 8)
    assert rate_a >= 0.95
    assert rate_shift <= rate_a - 0.3, (rate_a, rate_shift)
    assert rate_after >= 0.95 and rate_after >= rate_shift + 0.3, (rate_shift, rate_after)
    assert eng.stats.recalibrations == {"schedule": 1, "request": 1, "drift": 0}


def test_drift_below_floor_triggers_recalibration():
    wl, eng, ids, rate_a = _shifted(drift_floor=0.8, drift_window=2)
    rate = audited_rate(eng, wl, ids, lambda: wl.topic_query("B"), 8)
    assert eng.stats.recalibrations["drift"] >= 1
    assert audited_rate(eng, wl, ids, lambda: wl.topic_query("B"), 6) >= 0.95
    assert rate < 0.95


def test_control_file_request_is_counted_and_acknowledged(segment_dir):
    seg = telemetry.open_segment("planted")
    wl = PlantedWorkload(HKV, HQ, D, seed=3)
    eng = HiSparseEngine(HiSparseConfig(max_seq_len=8192, cache_block_size=32, window_size=32,
                                        global_tokens=8, top_k=128, audit_every=4, drift_floor=0.0,
                                        background_recalibration=False),
                         L, HQ, HKV, D, segment=seg)
    ids = eng.add_sequences(1)
    s = wl.segment(512, topic="A", anchors=4, margin=64)
    run_prefill(eng, ids, s.k[None], s.v[None], topic_queries(wl, "A", 8))
    agent_side = telemetry.ControlFile.open_existing(control_path(seg.path))
    req = agent_side.request("recalibrate", reason="EasymatsAnchorHitRateLow", requester="test")
    for _ in range(50):  # the runtime polls the control file at most every 50 ms
        k, v = wl.noise(1)
        run_decode(eng, ids, wl.topic_query("A")[None, :, None], k[None], v[None])
        if agent_side.acked()[0] == req:
            break
        time.sleep(0.01)
    assert agent_side.acked()[0] == req and agent_side.acked()[2] == 0
    assert eng.stats.recalibrations["request"] == 1
    eng.close()
    seg.close()


def test_a_request_while_a_requested_one_runs_is_answered_by_it(segment_dir):
    """In the background (the default), a second request (Alertmanager repeats an alert that is
    still firing) that arrives while the first one's recalibration runs starts no second one: that
    one's landing acknowledges the latest, and one is counted."""
    seg = telemetry.open_segment("planted")
    wl = PlantedWorkload(HKV, HQ, D, seed=3)
    eng = HiSparseEngine(HiSparseConfig(max_seq_len=8192, cache_block_size=32, window_size=32,
                                        global_tokens=8, top_k=128, audit_every=4, drift_floor=0.0,
                                        recalibration_lag=40), L, HQ, HKV, D, segment=seg)
    ids = eng.add_sequences(1)
    s = wl.segment(512, topic="A", anchors=4, margin=64)
    run_prefill(eng, ids, s.k[None], s.v[None], topic_queries(wl, "A", 8))
    agent_side = telemetry.ControlFile.open_existing(control_path(seg.path))

    def decode_until(done, steps=200):
        for _ in range(steps):   # the runtime polls the control file at most every 50 ms
            k, v = wl.noise(1)
            run_decode(eng, ids, wl.topic_query("A")[None, :, None], k[None], v[None])
            if done():
                return
            time.sleep(0.01)
        raise AssertionError("not reached")
    decode_until(lambda: eng.stats.recalibrations["schedule"] == 1)      # the prefill's first fit
    first = agent_side.request("recalibrate", reason="HiSparseAnchorHitRateLow", requester="test")
    decode_until(lambda: eng._recal_job is not None and eng._recal_job.reason == "request")
    second = agent_side.request("recalibrate", reason="HiSparseAnchorHitRateLow", requester="test")
    decode_until(lambda: agent_side.acked()[0] == second)
    assert first != second and agent_side.acked()[2] == 0
    decode_until(lambda: eng._recal_job is None and eng._recal_deferred is None, steps=1)
    for _ in range(45):          # past another lag: nothing more was started
        k, v = wl.noise(1)
        run_decode(eng, ids, wl.topic_query("A")[None, :, None], k[None], v[None])
    assert eng.stats.recalibrations["request"] == 1 and eng._recal_job is None
    eng.close()
    seg.close()


def test_super_block_bounds_stay_equal_to_a_fresh_fold_while_decoding():
    """Two-level bounds are kept up to date incrementally (appends, block boundaries, growth)."""
    from hi_sparse.kernels import superblock_bounds
    wl, eng, ids = make(global_tokens=0, bound_group=3, max_seq_len=16384)
    seg = wl.segment(4000, needles=(0,), margin=64)
    run_prefill(eng, ids, seg.k[None], seg.v[None])
    s = eng.seqs[ids[0]]
    for step in range(300):      # 4000 -> 4300 tokens: crosses blocks of 32 and a capacity doubling
        k, v = wl.noise(1)
        run_decode(eng, ids, wl.needle_query(0)[None, :, None], k[None], v[None])
        if step in (0, 150, 299):
            assert s.smin[0] is not None
            want_lo, want_hi = superblock_bounds(s.kmin[0], s.kmax[0], 3)
            assert torch.equal(s.smin[0], want_lo) and torch.equal(s.smax[0], want_hi)
    assert all(two_level_pays(-(-n // 32), 3, _n_super(eng)) for n in (4001, 4300))  # every step scored two-level


def test_the_first_fit_probe_pins_new_tokens_of_the_topic():
    """What the probe is for: after the first recalibration (after the prefill, every layer's probe
    fitted in one batched fit) it scores decode tokens as they arrive, and new tokens of the
    topic the queries attend to are pinned as anchors without another recalibration."""
    wl, eng, ids = make(global_tokens=12)
    seg = wl.segment(2048, topic="A", anchors=8, margin=64)
    run_prefill(eng, ids, seg.k[None], seg.v[None], topic_queries(wl, "A", 8))
    assert eng.stats.recalibrations["schedule"] == 1 and eng.probes[0].fitted
    first = eng.seq_len(ids[0])
    planted = []
    for t in range(24):
        k, v = wl.noise(1)
        if t % 6 == 3:                                       # 4 new tokens of topic A among noise
            k[:, 0] += wl.anchor_strength * wl.topic("A")
            planted.append(first + t)
        run_decode(eng, ids, wl.topic_query("A")[None, :, None], k[None], v[None])
    assert eng.stats.recalibrations["schedule"] == 1          # no recalibration since the prefill
    pinned = set(eng.seqs[ids[0]].anchors[0].flatten().tolist())
    # (the probe, distilled from 8 planted tokens per head, scores one of the 4 below the
    # threshold in both heads: its noise component points away from the topic)
    assert len(set(planted) & pinned) >= 3, (planted, sorted(pinned))
    noise = set(range(first, first + 24)) - set(planted)
    assert not noise & pinned                                 # the noise tokens were not pinned


def test_an_audit_of_a_batch_is_one_audit_to_the_drift_window():
    """``drift_window`` counts audits whatever the batch: one audit of B sequences adds their
    lookups and hits together. (Counted per sequence, a window of 4 audits was judged on one
    audit of 24 sequences, and drift recalibrated every ~48 steps on the H200 at batch 24.)"""
    wl = PlantedWorkload(HKV, HQ, D, seed=5)
    eng = HiSparseEngine(HiSparseConfig(max_seq_len=4096, cache_block_size=32, window_size=32, global_tokens=8,
                                        top_k=64, audit_every=1, audit_top_m=8, audit_measure="top_m",
                                        drift_floor=0.0, drift_window=4, telemetry=False,
                                        background_recalibration=False), L, HQ, HKV, D)
    ids = eng.add_sequences(4)
    segs = [wl.segment(512, topic="A", anchors=4, margin=64) for _ in ids]
    run_prefill(eng, ids, torch.stack([s.k for s in segs]), torch.stack([s.v for s in segs]),
                torch.stack([topic_queries(wl, "A", 8)[0] for _ in ids]))
    assert not eng.recal.history                            # the prompt's recalibration cleared it
    for _ in range(3):
        k, v = zip(*(wl.noise(1) for _ in ids))
        q = torch.stack([wl.topic_query("A")[:, None] for _ in ids])
        run_decode(eng, ids, q, torch.stack(k), torch.stack(v))
    assert len(eng.recal.history) == 3                      # three audits of four sequences each
    steps = sorted({a.step for a in eng.recent_audits})
    assert len(steps) == 3 and len(eng.recent_audits) == 12
    for (lookups, hits), step in zip(eng.recal.history, steps):
        per_seq = [a for a in eng.recent_audits if a.step == step]
        assert lookups == sum(a.lookups for a in per_seq) > 0 and hits == sum(a.hits for a in per_seq)
    eng.close()
