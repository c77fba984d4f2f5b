"""A batch decodes like its sequences one at a time: same selections, outputs, counts and anchors.

There is one decode path; a batch of one is a batch. Two engines get the same random K/V/Q: one
appends and attends for the whole batch per call, the other for one sequence per call. The
contexts are longer than top_k so selection, lookup, prefetch and swap-in all run; a
recalibration in the middle fits the probes so that decode tokens are scored as anchors too.
Batches of sequences of different lengths, with short contexts, in rows out of order, and
through CUDA graphs (gpu-marked) decode the same way.
"""

import pytest
import torch

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

L, HQ, HKV, D = 2, 4, 2, 16


def _engines(bits, group, device="cpu", dtype=torch.float32, **kw):
    cfg = dict(max_seq_len=1024, cache_block_size=8, window_size=8, global_tokens=4, top_k=24,
               device_buffer_tokens=40, host_kv_bits=bits, bound_group=group, audit_every=5,
               telemetry=False, prefetch_blocks=1, recalibrate_every=10 ** 6, recalibrate_topk=8,
               recalibration_lag=1)       # the engines compared land a recalibration on the same step
    cfg.update(kw)
    return [HiSparseEngine(HiSparseConfig(**cfg), L, HQ, HKV, D, device=device, dtype=dtype) for _ in range(2)]


def _run(eng, ids, K, V, Q, lo, hi, alone=False):
    """One step over every layer: the whole batch per call, or (alone) one sequence per call."""
    calls = [[i] for i in range(len(ids))] if alone else [list(range(len(ids)))]
    outs = []
    eng.begin_step()
    for layer in range(L):
        parts = []
        for rows in calls:
            sub = [ids[r] for r in rows]
            eng.append(layer, sub, K[layer, rows, :, lo:hi], V[layer, rows, :, lo:hi])
            parts.append(eng.attend(layer, sub, Q[layer, rows, :, lo:hi]))
        outs.append(torch.cat(parts))
    eng.end_step()
    return outs


def _graphs(eng):
    return [b.runner.graphs for b in eng._decoder._batches.values() if b.runner.graphs]


@pytest.mark.parametrize("bits,group", [(None, 1), (None, 2), (4, 2), ("budget", 1), ("auto", 2)],
                         ids=["bf-one-level", "bf-two-level", "int4-two-level", "budget", "auto-two-level"])
def test_a_batch_decodes_like_each_sequence_alone(bits, group):
    _compare(bits, group, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group,meta", [(None, 2, "cpu"), (4, 2, "device"), ("budget", 1, "cpu")])
def test_a_batch_decodes_like_each_sequence_alone_on_cuda(bits, group, meta):
    """On CUDA the batch backs new tokens up into the pinned pool from the GPU (no host sync)."""
    _compare(bits, group, "cuda", torch.bfloat16, 2e-2, metadata_device=meta, decode_graphs=False)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [None, 4, "auto"])
def test_decode_through_cuda_graphs_equals_each_sequence_alone(bits):
    """decode_graphs=True: each layer's batch step is captured once per shape key and replayed
    (mixed bit widths too: their dequantization reads the units' bits on the device)."""
    batched = _compare(bits, 2, "cuda", torch.bfloat16, 2e-2, decode_graphs=True)
    assert _graphs(batched)


@pytest.mark.gpu
def test_graphs_captured_before_the_probe_is_fitted_score_anchors_after():
    """A short prompt (context <= top_k): the append is graph-captured before the first
    calibration fits the probe (it waits for context > top_k); from then on new tokens must be
    scored as anchors as eager steps do, not skipped by replays of the unfitted capture."""
    torch.manual_seed(11)
    B, P, steps = 3, 12, 40
    N = P + steps
    K, V, Q = (torch.randn(L, B, h, N, D).to("cuda", torch.bfloat16) for h in (HKV, HKV, HQ))
    # (the fit lands on the step after the first calibration's launch, the same in both engines)
    kw = dict(threshold_min=0.01, threshold_base=0.01, threshold_max=0.01, recalibration_lag=1)
    graphed = HiSparseEngine(HiSparseConfig(**_cfg(decode_graphs=True, **kw)), L, HQ, HKV, D, device="cuda",
                             dtype=torch.bfloat16)
    eager = HiSparseEngine(HiSparseConfig(**_cfg(decode_graphs=False, **kw)), L, HQ, HKV, D, device="cuda",
                           dtype=torch.bfloat16)
    ids = [e.add_sequences(B) for e in (graphed, eager)]
    for e, i in zip((graphed, eager), ids):
        _run(e, i, K, V, Q, 0, P)
    changes, previous, kept = 0, None, set()
    for t in range(P, N):
        fitted = eager.probes[0].fitted          # before this step: its anchor changes are the decode's
        kept |= {key[:2] for key in _append_keys(graphed)}
        outs = [_run(e, i, K, V, Q, t, t + 1) for e, i in zip((graphed, eager), ids)]
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        anchors = [torch.stack([e.seqs[s].anchors[layer] for s in i]) for layer in range(L) for e, i in
                   zip((graphed, eager), ids)]
        for x, y in zip(anchors[::2], anchors[1::2]):
            assert torch.equal(x, y), t
        if fitted:
            changes += not all(torch.equal(x, y) for x, y in zip(anchors[1::2], previous))
        previous = anchors[1::2]
    assert _graphs(graphed)
    assert changes > 0             # decode tokens did become anchors after the fit
    # the appends' graphs, captured before the fit and after, were keyed alike but for the buffers'
    # addresses: the kernel reads the fit from the device (probe.gate), not the key (before, the
    # fit changed the key: an eager step and a capture)
    assert kept == {(1, None)}, kept


def _append_keys(eng) -> list:
    return [key for b in eng._decoder._batches.values() for slot, (key, _) in b.runner.graphs.items()
            if slot[1] == "append"]


def _cfg(**kw):
    cfg = dict(max_seq_len=1024, cache_block_size=8, window_size=8, global_tokens=4, top_k=24,
               device_buffer_tokens=40, bound_group=1, audit_every=5, telemetry=False, prefetch_blocks=1,
               recalibrate_every=10 ** 6, recalibrate_topk=8)
    cfg.update(kw)
    return cfg


def test_a_graph_key_names_whether_the_probe_is_fitted_unless_the_kernel_reads_it(monkeypatch):
    """What a captured step depends on includes the probe's fitted state (CPU: the key alone),
    except where the decode token's pin is the kernel, which reads it from the device."""
    eng, _ = _engines(None, 1)
    key = eng._decoder.graph_key
    before = [key(layer, None) for layer in eng.layers]
    assert [key(layer, None) for layer in eng.layers] == before and not eng.probes[0].fitted
    eng.probes[0].fit(torch.randn(16, D), torch.rand(16), steps=2)     # weights change in place
    assert key(eng.layers[0], None) != before[0] and key(eng.layers[1], None) == before[1]
    monkeypatch.setenv("HISPARSE_FORCE_TRITON", "1")       # the kernel path (interpreted on the CPU)
    eng, _ = _engines(None, 1)
    key = eng._decoder.graph_key
    before = [key(layer, None) for layer in eng.layers]
    with monkeypatch.context() as torch_fit:                # the fit's own kernel would need the interpreter
        torch_fit.delenv("HISPARSE_FORCE_TRITON")
        eng.probes[0].fit(torch.randn(16, D), torch.rand(16), steps=2)
    assert eng.probes[0].fitted and [key(layer, None) for layer in eng.layers] == before


def test_a_cpu_step_runs_its_bodies_eagerly():
    """On the CPU nothing is captured, whatever decode_graphs says."""
    eng, _ = _engines(None, 1, decode_graphs=True)
    ids = eng.add_sequences(2)
    x = torch.randn(L, 2, HKV, 40, D)
    _run(eng, ids, x, x, torch.randn(L, 2, HQ, 40, D), 0, 39)
    _run(eng, ids, x, x, torch.randn(L, 2, HQ, 40, D), 39, 40)
    batches = list(eng._decoder._batches.values())
    assert batches and all(b.runner.no_graphs and not b.runner.graphs for b in batches)


def _compare(bits, group, device, dtype, tol, **kw):
    torch.manual_seed(7)
    B, P, steps = 3, 400 if group > 1 else 150, 20   # two-level pays from 4 x n_super x group blocks
    N = P + steps
    pads = [0, 5, 11]
    K, V, Q = (torch.randn(L, B, h, N, D).to(device, dtype) for h in (HKV, HKV, HQ))
    batched, alone = _engines(bits, group, device, dtype, **kw)
    ids = [e.add_sequences(B, pad_lengths=pads) for e in (batched, alone)]
    for e, i, a in zip((batched, alone), ids, (False, True)):
        _run(e, i, K, V, Q, 0, P, alone=a)
    for t in range(P, N):
        if t == P + 8:
            for e in (batched, alone):
                e.request_recalibration()
        outs = [_run(e, i, K, V, Q, t, t + 1, alone=a) for e, i, a in zip((batched, alone), ids, (False, True))]
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        for layer in range(L):
            for sa, sb in zip(*ids):
                assert torch.equal(batched.selection(layer, sa), alone.selection(layer, sb))
                assert torch.equal(batched.seqs[sa].anchors[layer], alone.seqs[sb].anchors[layer])
    sa_, sb_ = batched.stats, alone.stats
    for f in ("hot_buffer_lookups", "hot_buffer_hits", "prefetch_issued", "prefetch_used", "swap_in_bytes",
              "tokens_decode", "anchor_lookups", "anchor_hits", "backup_bytes", "kv_tokens_loaded"):
        assert getattr(sa_, f) == getattr(sb_, f), f
    assert sa_.hot_buffer_lookups > sa_.hot_buffer_hits > 0          # misses were swapped in
    assert batched.stats.anchors > 0                                 # the fitted probe pinned anchors
    return batched


@pytest.mark.parametrize("group", [1, 2], ids=["one-level", "two-level-for-the-longest"])
def test_sequences_of_different_lengths_and_short_contexts_decode_as_one_batch(group):
    """Lengths 400, 120 and 13 (shorter than top_k), paddings 0, 3 and 6, in one call per layer:
    the same outputs and selections as each sequence alone (with bound_group 2 only the longest
    holds enough blocks for two-level scoring; the others are scored one-level, as alone)."""
    torch.manual_seed(3)
    lengths, pads = [400, 120, 13], [0, 3, 6]
    batched, alone = _engines(None, group)
    K, V, Q = (torch.randn(L, 3, h, 410, D) for h in (HKV, HKV, HQ))
    for e in (batched, alone):
        for b, (n, pad) in enumerate(zip(lengths, pads)):
            sid = e.add_sequences(1, pad_lengths=[pad])
            _run(e, sid, K[:, b:b + 1], V[:, b:b + 1], Q[:, b:b + 1], 0, n)
    ids = [list(e.seqs) for e in (batched, alone)]
    for t in range(6):
        at = [n + t for n in lengths]
        kk, vv, qq = (torch.stack([X[:, b, :, p] for b, p in enumerate(at)], 1)[:, :, :, None] for X in (K, V, Q))
        outs = [_run(e, i, kk, vv, qq, 0, 1, alone=a) for e, i, a in zip((batched, alone), ids, (False, True))]
        for x, y in zip(*outs):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        for layer in range(L):
            for sa, sb in zip(*ids):
                assert torch.equal(batched.selection(layer, sa), alone.selection(layer, sb))
    short = batched.selection(0, ids[0][2])
    assert sorted(short[0][short[0] >= 0].tolist()) == list(range(6, 19))   # every visible token


def test_rows_out_of_order_move_together_and_decode_alike():
    """A batch whose sequences' rows are not consecutive in call order (ids reversed) is moved
    into consecutive rows first; it decodes like the same sequences called in row order."""
    torch.manual_seed(5)
    a, b = _engines(4, 1)
    K, V, Q = (torch.randn(L, 2, h, 70, D) for h in (HKV, HKV, HQ))
    ids_a, ids_b = a.add_sequences(2), b.add_sequences(2)
    _run(a, ids_a, K, V, Q, 0, 60)
    _run(b, ids_b, K, V, Q, 0, 60)
    rev = [1, 0]
    for t in range(60, 70):
        out_a = _run(a, ids_a[::-1], K[:, rev], V[:, rev], Q[:, rev], t, t + 1)
        out_b = _run(b, ids_b, K, V, Q, t, t + 1)
        for x, y in zip(out_a, out_b):
            torch.testing.assert_close(x, y[rev], atol=1e-5, rtol=1e-5)
    assert [a.seqs[i].row for i in ids_a[::-1]] == [0, 1]
    assert a.stats.hot_buffer_hits == b.stats.hot_buffer_hits > 0


@pytest.mark.parametrize("bits", [None, 4], ids=["bf", "int4"])
def test_forked_sequences_continue_like_independent_copies(bits):
    """fork_sequences: a prefilled sequence and two forks decode exactly like three sequences
    that were each prefilled with the same tokens (copies); the forks share the full host blocks
    and hold their own partly filled last block."""
    torch.manual_seed(11)
    P, steps = 150, 12
    K, V, Q = (torch.randn(L, 1, h, P + steps, D) for h in (HKV, HKV, HQ))
    forked, copies = _engines(bits, 1)
    src = forked.add_sequences(1)
    _run(forked, src, K, V, Q, 0, P)
    forked.request_recalibration()       # fitted probes and anchors are part of what is copied
    _run(forked, src, K, V, Q, P, P + 1)
    blocks_one = forked.pool.num_active
    ids_f = src + forked.fork_sequences(src[0], 2)
    assert blocks_one == -(-(P + 1) // 8) and (P + 1) % 8        # 18 full blocks and a partial one
    assert forked.pool.num_active == blocks_one + 2               # one private partial block per fork
    ids_c = copies.add_sequences(3)
    rep = lambda x: x.expand(-1, 3, -1, -1, -1)                   # noqa: E731
    _run(copies, ids_c, rep(K), rep(V), rep(Q), 0, P)
    copies.request_recalibration()
    _run(copies, ids_c, rep(K), rep(V), rep(Q), P, P + 1)
    copies.settle_recalibration()        # as the fork did: it commits one pending first
    before = forked.stats.hot_buffer_hits, copies.stats.hot_buffer_hits
    g = torch.Generator().manual_seed(5)   # the rows now diverge: different tokens per row
    for t in range(steps - 1):
        k, v, q = (torch.randn(L, 3, h, 1, D, generator=g) for h in (HKV, HKV, HQ))
        a = _run(forked, ids_f, k, v, q, 0, 1)
        b = _run(copies, ids_c, k, v, q, 0, 1)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert forked.stats.hot_buffer_hits - before[0] == copies.stats.hot_buffer_hits - before[1] > 0
    forked.free_sequences(ids_f[1:])          # the batch's state (graphs, buffers) goes with them
    assert not any(set(k[1]) & set(ids_f[1:]) for k in forked._decoder._batches)
    # whole-bank gauges count the live sequence only (freed rows are reset)
    left = forked.seqs[ids_f[0]]
    st = forked.stats
    assert st.hot_buffer_resident == sum(hb.resident() for hb in left.hot) > 0
    assert st.anchors == sum(int((a >= 0).sum()) for a in left.anchors) > 0


def test_fork_errors_name_the_fix():
    eng = _engines(None, 1)[0]
    sid = eng.add_sequences(1)[0]
    with pytest.raises(ValueError, match="copies must be >= 1"):
        eng.fork_sequences(sid, 0)
    with pytest.raises(ValueError, match="unknown sequence id 99"):
        eng.fork_sequences(99, 1)
    eng.append(0, [sid], torch.randn(1, HKV, 4, D), torch.randn(1, HKV, 4, D))
    with pytest.raises(ValueError, match="fork between forward passes"):
        eng.fork_sequences(sid, 1)
    with pytest.raises(ValueError, match="pass each sequence once per call"):
        eng.append(0, [sid, sid], torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D))


@pytest.mark.parametrize("bits", [None, 4], ids=["bf", "int4"])
def test_forks_of_one_prompt_hold_one_copy_of_it_in_host_ram(bits):
    """24 forks of one prompt share its full host blocks (copy on write): the host pool holds one
    copy of the prompt plus each sequence's own partly filled and new blocks, within 1.2x one
    sequence; a fork writes none of the shared blocks (their bytes stay as they were)."""
    torch.manual_seed(3)
    P, forks, steps = 2003, 23, 3
    eng = _engines(bits, 1, max_seq_len=4096)[0]
    sid = eng.add_sequences(1)
    _run(eng, sid, *(torch.randn(L, 1, h, P, D) for h in (HKV, HKV, HQ)), 0, P)
    one = eng.pool.num_active
    assert one == -(-P // 8)
    shared = [b.block_id for b in eng.pages.seqs[sid[0]].blocks[:P // 8]]
    before = {name: t.clone() for name, t in eng.host.layers[0].items() if not name.endswith("_tail")}
    ids = sid + eng.fork_sequences(sid[0], forks)
    assert eng.pool.num_active == P // 8 + forks + 1                         # one copy + own partial blocks
    g = torch.Generator().manual_seed(4)
    for _ in range(steps):
        _run(eng, ids, *(torch.randn(L, forks + 1, h, 1, D, generator=g) for h in (HKV, HKV, HQ)), 0, 1)
    assert all(b.ref_cnt == forks + 1 for b in eng.pages.seqs[sid[0]].blocks[:P // 8])
    assert eng.pool.num_active / one <= 1.2                                  # 24 sequences of one prompt
    H = HKV
    for name, t in eng.host.layers[0].items():
        if name in before:
            per = H if name.endswith(("scale", "zero", "bits")) else H * 8
            idx = torch.tensor([b * per + i for b in shared for i in range(per)])
            assert torch.equal(t[idx], before[name][idx]), name
    eng.free_sequences(ids[1:])                                              # the source keeps them
    assert eng.pool.num_active == one and all(b.ref_cnt == 1 for b in eng.pages.seqs[sid[0]].blocks)


def test_streaming_eviction_leaves_blocks_that_forks_share():
    """A bounded pool in streaming mode overwrites only blocks one sequence holds: the prompt the
    forks share stays whole in every one of them, and they keep decoding."""
    torch.manual_seed(6)
    P, steps = 96, 60
    eng = _engines(None, 1, streaming=True, host_pool_blocks=12 + 2 * 6, global_tokens=0)[0]
    sid = eng.add_sequences(1)
    _run(eng, sid, *(torch.randn(L, 1, h, P, D) for h in (HKV, HKV, HQ)), 0, P)
    ids = sid + eng.fork_sequences(sid[0], 1)
    prompt = list(eng.pages.seqs[sid[0]].blocks)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        _run(eng, ids, *(torch.randn(L, 2, h, 1, D, generator=g) for h in (HKV, HKV, HQ)), 0, 1)
    assert eng.stats.block_evictions > 0
    for i in ids:
        assert eng.pages.seqs[i].blocks[:P // 8] == prompt                   # no hole in the shared prompt
        assert all(b.ref_cnt == 2 for b in prompt)


def test_a_fork_in_a_full_streaming_pool_evicts_no_block_it_shares():
    """The fork's own partly filled block comes from a full pool in streaming mode: eviction may
    take another sequence's old blocks, never the ones the fork is sharing (they are shared
    before that block is allocated)."""
    torch.manual_seed(8)
    P = 100                                                   # 12 full 8-token blocks and a partial one
    eng = _engines(None, 1, streaming=True, host_pool_blocks=2 * 13, global_tokens=0)[0]
    src, other = eng.add_sequences(1), eng.add_sequences(1)
    for sid in (src, other):
        _run(eng, sid, *(torch.randn(L, 1, h, P, D) for h in (HKV, HKV, HQ)), 0, P)
    prompt = list(eng.pages.seqs[src[0]].blocks)
    ids = src + eng.fork_sequences(src[0], 1)
    assert eng.stats.block_evictions > 0
    for i in ids:
        assert eng.pages.seqs[i].blocks[:P // 8] == prompt[:P // 8]          # no hole in the shared prompt
    g = torch.Generator().manual_seed(9)
    _run(eng, ids, *(torch.randn(L, 2, h, 1, D, generator=g) for h in (HKV, HKV, HQ)), 0, 1)


def test_a_batch_read_of_ragged_contexts_is_each_context_read_alone():
    """What the audit reads in one call for a whole batch (ContextReader.read_batch and
    visible_batch): each sequence's keys as a read of it alone, from a quantized pool (full
    blocks and the float tail); positions after its left padding and before its length visible."""
    torch.manual_seed(4)
    lengths, pads = [70, 29, 13], [0, 3, 6]
    eng, _ = _engines(4, 1)
    K, V, Q = (torch.randn(L, 3, h, 70, D) for h in (HKV, HKV, HQ))
    for b, (n, pad) in enumerate(zip(lengths, pads)):
        _run(eng, eng.add_sequences(1, pad_lengths=[pad]), K[:, b:b + 1], V[:, b:b + 1], Q[:, b:b + 1], 0, n)
    seqs, reader, layer = list(eng.seqs.values()), eng._recalibrator.reader, eng.layers[1]
    keys = reader.read_batch(seqs, layer, 72)
    visible = reader.visible_batch(seqs, layer, 72)
    assert keys.shape == (3, HKV, 72, D) and visible.shape == (3, 72)
    for b, (s, n, pad) in enumerate(zip(seqs, lengths, pads)):
        alone, _ = reader.read(s, layer, torch.arange(HKV)[:, None], torch.arange(n)[None])
        assert torch.equal(keys[b, :, :n], alone)
        assert torch.equal(reader.read_batch(seqs, layer, 72, head=1)[b, 0, :n], alone[1])
        assert visible[b].tolist() == [pad <= p < n for p in range(72)]


def test_a_recalibration_scores_alike_one_sequence_a_read_at_a_time_and_with_holes(monkeypatch):
    """A layer's sequences are scored together, as many at a time as keep the keys under
    SCORE_KEYS: one at a time (SCORE_KEYS 1) the anchors and fitted probes are the same, also for
    sequences that lost blocks to streaming mode (holes: their outside tokens are counted on the
    host) and of different lengths."""
    from hi_sparse import recalibration

    def run(score_keys):
        monkeypatch.setattr(recalibration, "SCORE_KEYS", score_keys)
        torch.manual_seed(12)
        eng = _engines(None, 1, streaming=True, host_pool_blocks=38, global_tokens=1, recalibrate_every=10 ** 6)[0]
        g = torch.Generator().manual_seed(13)
        ids = []
        for n in (120, 90, 60):
            sid = eng.add_sequences(1)
            _run(eng, sid, *(torch.randn(L, 1, h, n, D, generator=g) for h in (HKV, HKV, HQ)), 0, n)
            ids += sid
        for _ in range(12):
            _run(eng, ids, *(torch.randn(L, 3, h, 1, D, generator=g) for h in (HKV, HKV, HQ)), 0, 1)
        eng.request_recalibration()
        _run(eng, ids, *(torch.randn(L, 3, h, 1, D, generator=g) for h in (HKV, HKV, HQ)), 0, 1)
        assert eng.stats.recalibrations["request"] == 1
        holes = [eng.pages.seqs[i].holes for i in ids]
        anchors = [eng.seqs[i].anchors[layer].clone() for i in ids for layer in range(L)]
        return holes, anchors, [p.detach().clone() for probe in eng.probes for p in probe.parameters()]

    holes, anchors, probes = run(1 << 27)
    holes1, anchors1, probes1 = run(1)
    assert holes == holes1 and any(holes) and all(int((a >= 0).sum()) > 0 for a in anchors)
    assert all(torch.equal(a, b) for a, b in zip(anchors, anchors1))
    assert all(torch.equal(a, b) for a, b in zip(probes, probes1))
