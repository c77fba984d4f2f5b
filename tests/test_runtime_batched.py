"""The batched decode path (one set of kernels for a batch of sequences) against the reference
path (one sequence at a time): same selections, outputs, hot-buffer counts and anchors.

Both engines get the same random K/V/Q; the only difference is ``batch_decode``. The contexts
are longer than top_k so selection, lookup, prefetch and swap-in all run; a recalibration in the
middle fits the probes so that decode tokens are scored as anchors too.
"""

import warnings

import pytest
import torch

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

L, HQ, HKV, D = 2, 4, 2, 16


def _engines(bits, group, device="cpu", dtype=torch.float32, **kw):
    cfg = dict(max_seq_len=1024, cache_block_size=8, window_size=8, global_tokens=4, top_k=24,
               device_buffer_tokens=40, host_kv_bits=bits, bound_group=group, audit_every=5,
               telemetry=False, prefetch_blocks=1, recalibrate_every=10 ** 6, recalibrate_topk=8)
    cfg.update(kw)
    return [HiSparseEngine(HiSparseConfig(batch_decode=b, **cfg), L, HQ, HKV, D, device=device, dtype=dtype)
            for b in (True, False)]


def _run(eng, ids, K, V, Q, lo, hi):
    outs = []
    eng.begin_step()
    for layer in range(L):
        eng.append(layer, ids, K[layer, :, :, lo:hi], V[layer, :, :, lo:hi])
        outs.append(eng.attend(layer, ids, Q[layer, :, :, lo:hi]))
    eng.end_step()
    return outs


@pytest.mark.parametrize("bits,group", [(None, 1), (None, 2), (4, 2), ("budget", 1)],
                         ids=["bf-one-level", "bf-two-level", "int4-two-level", "budget"])
def test_batched_decode_equals_one_by_one(bits, group):
    _compare(bits, group, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits,group,meta", [(None, 2, "cpu"), (4, 2, "device"), ("budget", 1, "cpu")])
def test_batched_decode_equals_one_by_one_on_cuda(bits, group, meta):
    """On CUDA the batch backs new tokens up into the pinned pool from the GPU (no host sync)."""
    _compare(bits, group, "cuda", torch.bfloat16, 2e-2, metadata_device=meta, decode_graphs=False)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [None, 4])
def test_batched_decode_through_cuda_graphs_equals_one_by_one(bits):
    """decode_graphs=True: each layer's batch step is captured once per shape key and replayed."""
    batched = _compare(bits, 2, "cuda", torch.bfloat16, 2e-2, decode_graphs=True)
    assert any(st.graphs for st in batched._steps.values())


@pytest.mark.gpu
def test_graphs_captured_before_the_probe_is_fitted_score_anchors_after():
    """A short prompt (context <= top_k): the append is batched and graph-captured before the first
    calibration fits the probe (it waits for context > top_k); from then on new tokens must be
    scored as anchors as one by one does, not skipped by replays of the unfitted capture."""
    torch.manual_seed(11)
    B, P, steps = 3, 12, 40
    N = P + steps
    K, V, Q = (torch.randn(L, B, h, N, D).to("cuda", torch.bfloat16) for h in (HKV, HKV, HQ))
    batched, each = _engines(None, 1, "cuda", torch.bfloat16, decode_graphs=True, threshold_min=0.01,
                             threshold_base=0.01, threshold_max=0.01)
    ids = [e.add_sequences(B) for e in (batched, each)]
    for e, i in zip((batched, each), ids):
        _run(e, i, K, V, Q, 0, P)
    changes = 0
    for t in range(P, N):
        fitted = each.probes[0].fitted          # before this step: its anchor changes are the decode's
        outs = [_run(e, i, K, V, Q, t, t + 1) for e, i in zip((batched, each), ids)]
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        anchors = [torch.stack([e.seqs[s].anchors[layer] for s in i]) for layer in range(L) for e, i in
                   zip((batched, each), ids)]
        for x, y in zip(anchors[::2], anchors[1::2]):
            assert torch.equal(x, y), t
        if fitted:
            changes += not all(torch.equal(x, y) for x, y in zip(anchors[1::2], previous))
        previous = anchors[1::2]
    assert any(st.graphs for st in batched._steps.values())
    assert changes > 0             # decode tokens did become anchors after the fit


def _steps_of_two(device, dtype):
    """A function giving a new BatchStep (graphs on) of one engine's two sequences."""
    from hi_sparse.batch_step import BatchStep

    eng, _ = _engines(None, 1, device, dtype, decode_graphs=True)
    seqs = [eng.seqs[i] for i in eng.add_sequences(2)]
    return lambda: BatchStep(eng, seqs, torch.device(device))


@pytest.mark.gpu
def test_a_failed_capture_warns_with_its_cause_and_restores_the_stream():
    """A body that cannot be captured (a host read): the warning names the op's own error, the
    batch decodes on eagerly, and later work runs on the caller's stream again, not on the capture
    stream torch.cuda.graph leaves current when ending the capture raises."""
    new_step = _steps_of_two("cuda", torch.bfloat16)
    st = new_step()
    x = torch.arange(6.0, device="cuda")

    def body(layer, x):
        return (x * 2 + (x.sum().item() > 0),)       # .item() reads back: not capturable

    before = torch.cuda.current_stream()
    first = st.run(0, "attend", ("k",), 5, 1, body, x)                 # first sight: eager
    with pytest.warns(RuntimeWarning, match=r"capture .* failed \(\w*Error: [^\n]*capturing at batch_step\.py:"
                                            r"\d+ \(run\); then ending the capture: [^\n]*\); this batch"):
        second = st.run(0, "attend", ("k",), 5, 1, body, x)            # capture fails, eager again
    assert torch.cuda.current_stream() == before
    assert st.no_graphs and not st.graphs
    assert torch.equal(first[0], second[0]) and torch.equal(second[0], x * 2 + 1)
    third = st.run(0, "attend", ("k",), 5, 1, body, x)                 # eager from now on
    assert torch.equal(third[0], x * 2 + 1) and torch.cuda.current_stream() == before
    # nothing else in the process is left in capture mode: the GPU's random generator works (it
    # raises "Offset increment outside graph capture" otherwise) and a new capture replays
    assert torch.randn(4, device="cuda").isfinite().all()
    again = new_step()
    for step in range(3):
        y = again.run(0, "attend", ("k",), 5, 1, lambda layer, x: (x * 3,), x + step)
        assert torch.equal(y[0], (x + step) * 3)
    assert again.graphs and not again.no_graphs


@pytest.mark.gpu
def test_garbage_collected_during_a_capture_cannot_break_it():
    """What broke captures on freshly started machines: the cyclic collector ran inside a capture
    and freed an earlier engine's pinned pool (cudaHostUnregister) and graphs (cuGraphExecDestroy),
    calls a capture forbids. Here a pinned pool in a reference cycle becomes garbage inside the
    captured body, which then allocates enough objects for a collection to be due."""
    import gc
    import weakref

    from hi_sparse.host_pool import HostPool

    st = _steps_of_two("cuda", torch.bfloat16)()
    x = torch.arange(6.0, device="cuda")
    gc.collect()
    pool = HostPool(1, 1, D, 8, torch.float32, pin=True)
    pool.grow(blocks=4)                                   # pinned: freeing it unregisters its pages
    pool.cycle = pool
    holder, gone = [pool], weakref.ref(pool)
    del pool
    seen = []

    def body(layer, x):
        if torch.cuda.is_current_stream_capturing():
            holder.clear()                                # garbage now, collectable only by the GC
            seen.append(len([[] for _ in range(5 * gc.get_threshold()[0])]))   # a collection is due
        return (x * 3,)

    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # a failed capture warns: fail on it
        for step in range(3):
            y = st.run(0, "attend", ("k",), 5, 1, body, x + step)
            assert torch.equal(y[0], (x + step) * 3)
    assert seen and st.graphs and not st.no_graphs and gc.isenabled()
    gc.collect()
    assert gone() is None                                 # collected after the capture, unregistered


def test_a_graph_key_names_whether_the_probe_is_fitted():
    """What a captured step depends on includes the probe's fitted state (CPU: the key alone)."""
    st = _steps_of_two("cpu", torch.float32)()
    eng = st.eng
    before = [st.key(layer) for layer in range(L)]
    assert [st.key(layer) for layer in range(L)] == before and not eng.probes[0].fitted
    eng.probes[0].fit(torch.randn(16, D), torch.rand(16), steps=2)     # weights change in place
    assert st.key(0) != before[0] and st.key(1) == before[1]


def _compare(bits, group, device, dtype, tol, **kw):
    torch.manual_seed(7)
    B, P, steps = 3, 400 if group > 1 else 150, 20   # two-level pays from 4 x n_super x group blocks
    N = P + steps
    pads = [0, 5, 11]
    K, V, Q = (torch.randn(L, B, h, N, D).to(device, dtype) for h in (HKV, HKV, HQ))
    batched, each = _engines(bits, group, device, dtype, **kw)
    ids = [e.add_sequences(B, pad_lengths=pads) for e in (batched, each)]
    for e, i in zip((batched, each), ids):
        _run(e, i, K, V, Q, 0, P)
    for t in range(P, N):
        if t == P + 8:
            for e in (batched, each):
                e.request_recalibration()
        outs = [_run(e, i, K, V, Q, t, t + 1) for e, i in zip((batched, each), ids)]
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        for layer in range(L):
            for sa, sb in zip(*ids):
                # a batch pads to its widest row: the same tokens in the same order
                x, y = batched.selection(layer, sa), each.selection(layer, sb)
                assert x.shape[1] >= y.shape[1] and (x[:, y.shape[1]:] == -1).all()
                assert torch.equal(x[:, :y.shape[1]], y)
                assert torch.equal(batched.seqs[sa].anchors[layer], each.seqs[sb].anchors[layer])
    sa_, sb_ = batched.stats, each.stats
    for f in ("hot_buffer_lookups", "hot_buffer_hits", "prefetch_issued", "swap_in_bytes", "tokens_decode",
              "anchor_lookups", "anchor_hits"):
        assert getattr(sa_, f) == getattr(sb_, f), f
    # quantized pools: one by one rewrites a sequence's whole float tail block each token, the
    # batch writes only the new token's rows
    assert sa_.backup_bytes == sb_.backup_bytes if bits is None else sa_.backup_bytes < sb_.backup_bytes
    assert batched.batched_decodes == steps * L and each.batched_decodes == 0
    assert sa_.hot_buffer_lookups > sa_.hot_buffer_hits > 0          # misses were swapped in
    assert batched.stats.anchors > 0                                 # the fitted probe pinned anchors
    if group > 1:
        assert batched.two_level_scores > 0
    return batched


def test_mixed_lengths_and_rows_fall_back_to_one_by_one():
    """Sequences of different lengths (or short contexts) still decode, through the reference path."""
    torch.manual_seed(3)
    batched, each = _engines(None, 1)
    K, V, Q = torch.randn(L, 2, HKV, 200, D), torch.randn(L, 2, HKV, 200, D), torch.randn(L, 2, HQ, 200, D)
    for e in (batched, each):
        a = e.add_sequences(1)
        b = e.add_sequences(1)
        _run(e, a, K[:, :1], V[:, :1], Q[:, :1], 0, 120)
        _run(e, b, K[:, 1:], V[:, 1:], Q[:, 1:], 0, 90)
    ids = [list(e.seqs) for e in (batched, each)]
    for t in range(5):
        kk = torch.stack([K[:, 0, :, 120 + t], K[:, 1, :, 90 + t]], 1)[:, :, :, None]
        vv = torch.stack([V[:, 0, :, 120 + t], V[:, 1, :, 90 + t]], 1)[:, :, :, None]
        qq = torch.stack([Q[:, 0, :, 120 + t], Q[:, 1, :, 90 + t]], 1)[:, :, :, None]
        outs = [_run(e, i, kk, vv, qq, 0, 1) for e, i in zip((batched, each), ids)]
        for x, y in zip(*outs):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert batched.batched_decodes == 0


@pytest.mark.parametrize("bits", [None, 4], ids=["bf", "int4"])
def test_forked_sequences_continue_like_independent_copies(bits):
    """fork_sequences: a prefilled sequence and two forks decode exactly like three sequences
    that were each prefilled with the same tokens; each fork holds its own host blocks."""
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
    assert forked.pool.num_active == 3 * blocks_one
    ids_c = copies.add_sequences(3)
    rep = lambda x: x.expand(-1, 3, -1, -1, -1)                   # noqa: E731
    _run(copies, ids_c, rep(K), rep(V), rep(Q), 0, P)
    copies.request_recalibration()
    _run(copies, ids_c, rep(K), rep(V), rep(Q), P, P + 1)
    before = forked.stats.hot_buffer_hits, copies.stats.hot_buffer_hits
    g = torch.Generator().manual_seed(5)   # the rows now diverge: different tokens per row
    for t in range(steps - 1):
        k, v, q = (torch.randn(L, 3, h, 1, D, generator=g) for h in (HKV, HKV, HQ))
        a = _run(forked, ids_f, k, v, q, 0, 1)
        b = _run(copies, ids_c, k, v, q, 0, 1)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert forked.stats.hot_buffer_hits - before[0] == copies.stats.hot_buffer_hits - before[1] > 0
    assert forked.batched_decodes > 0 and forked._steps
    forked.free_sequences(ids_f[1:])          # the batch's step state (graphs, buffers) goes with them
    assert forked._steps and not any(set(k[1]) & set(ids_f[1:]) for k in forked._steps)
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
