"""Whole-step decode graphs (step_graph.py): the host side of a step done for every layer up front,
the forward run (or replayed) without it, the rest done after; the same tokens, logits and counters
as the layer-by-layer path. On a CPU the planned path runs eagerly (``plan_on_cpu``), which checks
the host side; on a GPU (gpu-marked) the forward is captured and replayed."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_integration import make_pair, prompt
from test_row_bank import _Replays

import hi_sparse as hs
from hi_sparse import step_graph
from hi_sparse.batch_step import ahead_thread
from hi_sparse.decode import attend_blocks, bucket
from hi_sparse.integration import binding_of
from hi_sparse.kernels import two_level_pays
from hi_sparse.selection import candidate_blocks

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
# sparse (top_k below the context), 8-token blocks: steps cross block and bucket boundaries
# (a background recalibration lands 2 steps after its launch, waiting for its worker: the
# models compared land theirs on the same step whatever their speed)
SPARSE = dict(max_seq_len=512, block_size=8, window_size=8, global_tokens=2, top_k=24, audit_every=2,
              recalibrate_every=16, recalibration_lag=2)


def _run(model, ids, mask, new: int):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, 1)


def _counters(model) -> dict:
    """Every scalar counter of the engine (hits, lookups, audits, bytes, tokens, recalibrations)."""
    stats = binding_of(model).engine.stats
    out = {}
    for k, v in vars(stats).items():
        if k in ("step_duration", "memory"):      # timings; memory is the same by construction
            continue
        out[k] = (v.counts, v.sum) if hasattr(v, "counts") else v
    return out


def test_bucket_rounds_up_by_at_most_an_eighth():
    for n in list(range(1, 300)) + [1000, 2048, 2049, 16383, 131072 // 64 + 1]:
        b = bucket(n)
        assert n <= b <= n + max(1, n // 8 + 1), (n, b)
    # a few keys per doubling, not one per block
    assert len({bucket(n) for n in range(1025, 2049)}) == 8
    assert [bucket(n, 8) for n in (1, 8, 9, 20, 200)] == [8, 8, 16, 24, 208]


def test_attend_blocks_change_together_and_rarely_and_bound_what_they_must():
    """On the H200 at 1-2K tokens the selection and candidate block counts stepped on alternate
    blocks (1/8 of a power of two is two 64-token blocks there): a new key, an eager step and a
    capture after every completed block (benchmarks/stall_profile.py). Now both change on the same
    step, at least BUCKET_LEAST_TOKENS and 16 blocks apart (the selection count a multiple of 16:
    Triton specializes integers on divisibility by 16); they still cover every block and
    candidate, and the rounding never turns on two-level scoring the sequence alone would not use."""
    keys = [attend_blocks(n, 1 << 20, 64, 64, 0, 16, 4) for n in range(1001, 1701)]
    assert sum(a != b for a, b in zip(keys, keys[1:])) == 1      # 11 before: every block from 1,088
    assert [nb for nb, _ in keys[:: 100]] == [16] * 1 + [32] * 6
    for ps, window, first_lo, group, n_super, spare in itertools.product(
            (8, 64), (8, 64, 1024), (0, 100), (1, 2, 16), (2, 5), (0, 8)):
        for n in range(1, 6000, 13):
            real = -(-n // ps)
            room = real + spare                        # the bounds hold at least the tokens' blocks
            nb, n_cand = attend_blocks(n, room, ps, window, first_lo, group, n_super)
            assert real <= nb <= room, (n, ps, nb)
            assert nb % 16 == 0 or nb in (real, room) or two_level_pays(nb + 1, group, n_super), (n, ps, nb)
            assert candidate_blocks(nb, n - window, first_lo, ps) <= n_cand <= nb, (n, ps, window, n_cand)
            assert two_level_pays(nb, group, n_super) == two_level_pays(real, group, n_super), (n, nb)


def test_a_planned_decode_keeps_its_graph_key_over_many_blocks():
    """The key a whole-step graph is replayed under, taken from the planned path on the CPU over
    300 steps from 1,000 tokens (64-token blocks, a 4-bit host): it changed after every completed
    block before (an eager step and a capture each on the H200); now only where the rounded block
    count steps up (1,024, when the banks and the host pool grow too)."""
    _, model = make_pair("llama", max_position_embeddings=4096)
    # the first fit in the prefill's step: it lands later in the background, and its fitted probe
    # changes the key there (not a block's doing)
    hs.enable_hisparse_kv_cache(model, max_seq_len=4096, block_size=64, window_size=64, global_tokens=8,
                                top_k=128, host_kv_bits=4, background_recalibration=False)
    graphs = step_graph.of(model)
    graphs.plan_on_cpu = True
    keys: list = []
    run = graphs._run

    def record(plan, call, cache):
        keys.append((plan.starts[0], plan.key))
        return run(plan, call, cache)

    graphs._run = record
    ids, mask = prompt(1, 1000)
    _run(model, ids, mask, 300)
    changed = [p for (p, a), (_, b) in zip(keys, keys[1:]) if a != b]
    assert len(keys) == 299 and keys[0][0] == 1000, (len(keys), keys[0][0])
    assert changed == [1023], changed
    hs.disable_hisparse_kv_cache(model)


# 16-token blocks, a bounded host pool (a growing one moves its buffers: a key of their own)
# (the first fit in the prefill's step, as above)
AHEAD = dict(max_seq_len=2048, block_size=16, window_size=64, global_tokens=8, top_k=256, host_kv_bits=4,
             host_pool_blocks=256, background_recalibration=False)


def test_buffers_grow_only_where_the_key_changes_anyway():
    """The bound banks and the token -> slot maps grow to a key's block count (key_bounds.key_tokens),
    so a whole-step graph's key changes only where its shapes do: at 1,024 tokens, where the
    buffers grow too, and at 1,536, where nothing grows. Before, the banks grew at 1,280 and the
    token maps at 1,200 as well. Both keys are foreseen (Decoder.later), the growth staged, as a
    GPU captures them ahead (the next test)."""
    _, model = make_pair("llama", max_position_embeddings=2048)
    hs.enable_hisparse_kv_cache(model, **AHEAD)
    graphs = step_graph.of(model)
    graphs.plan_on_cpu = True
    engine = binding_of(model).engine
    rows = engine.layers[0]
    seen: list = []
    foreseen: dict = {}
    copies: dict = {}
    run = graphs._run

    def record(plan, call, cache):
        seen.append((plan.starts[0], plan.shapes, plan.key, [t.data_ptr() for t in rows.buffers()]))
        later = engine.plan_later(plan, step_graph.AHEAD_TOKENS)     # as a capture ahead plans it
        if later is not None:
            foreseen.setdefault(later.starts[0], later.key)
            if later.copies.copies:          # the graph of its growth's copies, as one captured ahead
                later.copies.graph = _Replays(later.copies)
                copies.setdefault(later.starts[0], []).append(later.copies)
        return run(plan, call, cache)

    graphs._run = record
    ids, mask = prompt(1, 600)
    _run(model, ids, mask, 1000)
    changed = [(p, s != t, m != n) for (p, s, k, m), (_, t, q, n) in zip(seen, seen[1:]) if k != q]
    assert changed == [(1023, True, True), (1535, True, False)], changed
    # each new key was foreseen 256 tokens ahead, the buffers it grows included (staged then)
    keys = {p: k for p, _, k, _ in seen}
    assert sorted(foreseen) == [1024, 1536] and all(foreseen[p] == keys[p] for p in foreseen), sorted(foreseen)
    # the growth at 1,024 made exactly the copies its last staging recorded (every layer's bank kinds
    # and token map), in one replay; the one at 1,536 grows nothing
    assert sorted(copies) == [1024] and [c.replayed for c in copies[1024]] == [False] * (len(copies[1024]) - 1) + [True]
    assert len(copies[1024][-1].copies) == 7 * len(engine.layers) and copies[1024][-1].graph is None
    hs.disable_hisparse_kv_cache(model)


def _planned_against_layers(label: str, **options):
    """The same model twice with ``options``, one through the planned path (eagerly, on the CPU):
    both decode 40 tokens of a left-padded batch with equal tokens, logits (bit for bit) and
    counters. Returns (reference, planned model)."""
    ref, model = make_pair("llama")
    for m, name in ((ref, "layers"), (model, "planned")):
        hs.enable_hisparse_kv_cache(m, name=f"test-step-{label}-{name}", **options, **SPARSE)
    step_graph.of(model).plan_on_cpu = True
    ids, mask = prompt(2, 45, pads=[0, 6])
    want, want_logits = _run(ref, ids, mask, 40)
    got, got_logits = _run(model, ids, mask, 40)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    assert _counters(model) == _counters(ref)
    assert binding_of(model).engine.stats.recalibrations["schedule"] >= 2
    return ref, model


@pytest.mark.parametrize("bits", [None, 4])
def test_planned_steps_equal_layer_by_layer_steps(bits):
    """The planned path (host side up front and after) decodes the same tokens with the same
    logits and counts the same, audits and recalibrations included. With a 4-bit host the steps
    whose token completes a block (at 47, 55, ..., 79 of the 39 from position 45) are planned
    too: they read the block from its float tail and seal it after the forward, where the
    reference seals it in the append, before reading the same floats."""
    ref, model = _planned_against_layers(f"bits{bits}", host_kv_bits=bits)
    counts = step_graph.of(model).counts
    assert counts == {"eager": 39, "captured": 0, "replayed": 0, "layer_by_layer": 0, "capture_retried": 0,
                      "ahead": 0, "ahead_failed": 0}, counts
    assert step_graph.of(ref).counts["eager"] == 0         # nothing planned on the reference
    # (the counters the helper compares include the quantized blocks: the planned steps sealed
    # every block the reference sealed) every planned step after the first was prepared at the
    # end of the step before
    assert binding_of(model).engine._decoder.ahead_used == 38


def _interleaved(plan_ahead: bool, between) -> tuple[list[torch.Tensor], int]:
    """Two caches of one model (sequences A, then B) decoded step by step through the planned
    path, with ``between(model, step, caches)`` run after each of A's steps; A's logits per step
    and the planned steps that took a preparation made at the step before's end."""
    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, name=f"test-step-ahead-{plan_ahead}", **SPARSE, host_kv_bits=4)
    step_graph.of(model).plan_on_cpu = True
    eng = binding_of(model).engine
    eng.plan_ahead = plan_ahead
    kw = hs.hf_compat.installed_cache_kwarg()
    caches, toks, logits = [], [], []
    with torch.no_grad():
        for seed in (1, 2):
            out = model(prompt(1, 30, seed=seed)[0], use_cache=True)
            caches.append(hs.hf_compat.output_cache(out))
            toks.append(out.logits[:, -1:].argmax(-1))
        for step in range(12):
            out = model(toks[0], **{kw: caches[0]}, use_cache=True)
            logits.append(out.logits[:, -1])
            toks[0] = out.logits[:, -1:].argmax(-1)
            between(model, step, caches)
    return logits, eng._decoder.ahead_used


def _b_steps(model, step, caches):
    """B decodes one step after every step of A (on the same layers, another batch)."""
    kw = hs.hf_compat.installed_cache_kwarg()
    model(torch.full((1, 1), 5), **{kw: caches[1]}, use_cache=True)


def _b_prefills(model, step, caches):
    """Every third step of A, B takes a prompt chunk (layer by layer: it reserves stamps on every
    layer's hot buffer, which A's prepared step had reserved before it)."""
    if step % 3 == 1:
        kw = hs.hf_compat.installed_cache_kwarg()
        model(prompt(1, 9, seed=3)[0], **{kw: caches[1]}, use_cache=True)


# A decodes 12 steps from position 30 in 8-token blocks with a 4-bit host (the steps at 31 and 39
# complete a block): all but the first (after the prompt) are prepared ahead; B's prompt chunks come
# before A's steps at 32, 35, 38 and 41
@pytest.mark.parametrize("between, used", [(lambda *a: None, 11), (_b_steps, 0), (_b_prefills, 11 - 4)])
def test_a_step_prepared_ahead_is_used_only_while_it_holds(between, used):
    """A step's room, clocks and positions are prepared at the end of the step before (while it
    runs on a GPU). The preparation is used only while nothing touched the layers since: another
    batch's step or prompt in between makes the step prepare again, and every path decodes the
    logits of steps prepared in the step itself (plan_ahead False), bit for bit."""
    want, none_used = _interleaved(False, between)
    got, ahead_used = _interleaved(True, between)
    assert none_used == 0 and ahead_used == used
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_planned_steps_with_background_recalibration_equal_layer_by_layer_steps():
    """A recalibration in the background is committed at the same boundaries whichever path the
    steps take (a planned step settles it first when its token would reuse the tail it read)."""
    _planned_against_layers("bg", host_kv_bits=4, background_recalibration=True)


def test_a_forward_that_fails_part_way_leaves_lengths_as_they_were():
    ref, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, name="test-step-fail", **SPARSE)
    graphs = step_graph.of(model)
    graphs.plan_on_cpu = True
    ids, _ = prompt(1, 20)
    cache_kw = hs.hf_compat.installed_cache_kwarg()
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = hs.hf_compat.output_cache(out)
        layer1 = model.model.layers[1].mlp
        handle = layer1.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            model(ids[:, :1], **{cache_kw: cache}, use_cache=True)
        handle.remove()
        assert cache.get_seq_length() == 20
        assert [binding_of(model).engine.seq_len(i) for i in cache.layers[0].sequences.seq_ids] == [20]
        step = model(ids[:, :1], **{cache_kw: cache}, use_cache=True)   # and the next step decodes
    assert cache.get_seq_length() == 21 and step.logits.shape == (1, 1, 128)


def test_a_planned_step_whose_seal_fails_leaves_lengths_as_they_were():
    """The seal after a planned step whose token completes a block comes before its lengths move:
    when it fails, the forward raises, the cache and the engine hold the tokens they held, and the
    step runs again (and seals)."""
    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, name="test-step-seal-fails", host_kv_bits=4, **SPARSE)
    step_graph.of(model).plan_on_cpu = True
    eng = binding_of(model).engine
    real, calls = eng.host.seal_tails, []

    def fails_once(*a):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (the test's)")
        return real(*a)

    eng.host.seal_tails = fails_once
    kw = hs.hf_compat.installed_cache_kwarg()
    with torch.no_grad():
        out = model(prompt(1, 20)[0], use_cache=True)
        cache, tok = hs.hf_compat.output_cache(out), out.logits[:, -1:].argmax(-1)
        for _ in range(3):                                   # positions 20-22
            tok = model(tok, **{kw: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        sealed = sum(eng.stats.quant_blocks.values())
        with pytest.raises(torch.OutOfMemoryError):          # position 23 completes the block
            model(tok, **{kw: cache}, use_cache=True)
        seq = cache.layers[0].sequences.seq_ids[0]
        assert cache.get_seq_length() == 23 and eng.seq_len(seq) == 23
        model(tok, **{kw: cache}, use_cache=True)
    assert cache.get_seq_length() == 24 and eng.seq_len(seq) == 24 and len(calls) == 2
    assert sum(eng.stats.quant_blocks.values()) > sealed


def test_decode_graphs_takes_true_false_or_step():
    _, model = make_pair("llama")
    with pytest.raises(ValueError, match="decode_graphs must be True, False or 'step', got 'whole'"):
        hs.enable_hisparse_kv_cache(model, decode_graphs="whole", **SPARSE)
    hs.enable_hisparse_kv_cache(model, name="test-step-cpu", decode_graphs="step", **SPARSE)
    graphs = step_graph.of(model)
    assert not graphs.graphs               # a CPU model: no graphs, every step layer by layer
    ids, mask = prompt(1, 30)
    _run(model, ids, mask, 4)
    assert graphs.counts == {"eager": 0, "captured": 0, "replayed": 0, "layer_by_layer": 0,
                             "capture_retried": 0, "ahead": 0, "ahead_failed": 0}


def test_disable_puts_the_forward_back():
    _, model = make_pair("llama")
    plain = model.model.forward
    hs.enable_hisparse_kv_cache(model, name="test-step-disable", **SPARSE)
    assert step_graph.of(model) is not None
    hs.disable_hisparse_kv_cache(model)
    assert step_graph.of(model) is None and "forward" not in vars(model.model)
    assert model.model.forward == plain


def test_a_kept_graph_output_holds_no_cache_and_each_step_returns_the_callers():
    """What a whole-step graph keeps of its captured output must not hold that step's cache (it
    would keep a finished generate()'s sequences alive); each replay returns the cache passed in."""
    import gc
    import weakref

    from transformers import DynamicCache

    from hi_sparse.hf_compat import output_cache

    ref, _ = make_pair("llama")
    ids, _mask = prompt(1, 5)
    cache = DynamicCache()
    with torch.no_grad():
        output = ref.model(input_ids=ids, **{step_graph.hf_compat.cache_kwarg(ref.model.forward): cache},
                           use_cache=True)
    assert output_cache(output) is cache
    have = step_graph.WholeStep(("key",), None, {}, output, [], [])
    gone = weakref.ref(cache)
    del output, cache
    gc.collect()
    assert gone() is None
    again = DynamicCache()
    result = step_graph.StepGraphs._result(have, again)
    assert output_cache(result) is again
    assert torch.equal(result.last_hidden_state, have.output.last_hidden_state)
    assert result.last_hidden_state.data_ptr() != have.output.last_hidden_state.data_ptr()


def test_a_failed_preparation_ahead_does_not_fail_the_step_that_ran():
    """The preparation made at a step's end is speculative (the caller may stop there): when it
    fails (here: no memory), the step that ran still returns, and the next step prepares in its
    plan and decodes what a model whose preparations never failed decodes."""
    kw = hs.hf_compat.installed_cache_kwarg()
    logits = []
    for fail in (False, True):
        _, model = make_pair("llama")
        hs.enable_hisparse_kv_cache(model, name=f"test-step-ahead-fails-{fail}", **SPARSE)
        step_graph.of(model).plan_on_cpu = True
        eng = binding_of(model).engine
        real = eng._decoder.prepare

        def no_memory(seqs):
            raise torch.OutOfMemoryError("CUDA out of memory (the test's)")

        with torch.no_grad():
            out = model(prompt(1, 20)[0], use_cache=True)
            cache, tok, got = hs.hf_compat.output_cache(out), out.logits[:, -1:].argmax(-1), []
            for step in range(4):
                eng._decoder.prepare = no_memory if fail and step == 1 else real
                out = model(tok, **{kw: cache}, use_cache=True)
                eng._decoder.prepare = real
                got.append(out.logits[:, -1])
                tok = out.logits[:, -1:].argmax(-1)
        assert cache.get_seq_length() == 24
        # steps 2-4 follow planned steps; step 3's preparation failed at step 2's end
        assert eng._decoder.ahead_used == (2 if fail else 3)
        logits.append(torch.cat(got))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("bits", [None, 4, "auto"])
def test_whole_step_graphs_replay_the_layer_by_layer_decode(bits, monkeypatch):
    """On a GPU (decode_graphs="step") the forward is captured once per key and replayed: the
    same tokens as the model with decode_graphs=False, logits within float32 noise, the same
    counters (quantized blocks and their errors too: blocks the steps complete are sealed from a
    graph, captured with the step's, not at the first step that completes a block)."""
    import inspect

    from hi_sparse import host_seal
    seal_captures, real_init = [], host_seal.SealGraph.__init__

    def init(self, *a, **kw):
        seal_captures.append([f.function for f in inspect.stack()])
        real_init(self, *a, **kw)

    monkeypatch.setattr(host_seal.SealGraph, "__init__", init)
    ref, model = make_pair("llama")
    ref, model = ref.cuda(), model.cuda()
    hs.enable_hisparse_kv_cache(ref, name="test-step-eager", host_kv_bits=bits, decode_graphs=False, **SPARSE)
    hs.enable_hisparse_kv_cache(model, name="test-step-graph", host_kv_bits=bits, decode_graphs="step", **SPARSE)
    ids, mask = prompt(2, 45, pads=[0, 6])
    want, want_logits = _run(ref, ids.cuda(), mask.cuda(), 60)
    got, got_logits = _run(model, ids.cuda(), mask.cuda(), 60)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    got_counters, want_counters = _counters(model), _counters(ref)
    # the errors' sum: the same values, added in another order where units have several widths
    (got_hist, got_sum), (want_hist, want_sum) = got_counters.pop("quant_error"), want_counters.pop("quant_error")
    assert got_hist == want_hist and got_sum == pytest.approx(want_sum, rel=1e-12)
    assert got_counters == want_counters
    counts = step_graph.of(model).counts
    assert counts["replayed"] >= 30 and counts["captured"] >= 1, counts
    # the replayed steps were prepared while the step before them ran (their positions and clocks
    # copied in the stream's order, after that step's graph read the last ones)
    assert binding_of(model).engine._decoder.ahead_used >= 30
    if bits is not None:
        assert seal_captures and all("ready_seal" in stack for stack in seal_captures)
        assert "failed" not in binding_of(model).engine.host._seal_graphs


def _graphed_like_eager(label: str, dtype: torch.dtype, positions: int, kw: dict, n: int, steps: int,
                        tol: float) -> tuple:
    """A tiny Llama on the GPU decoding ``steps`` tokens after an ``n``-token prompt with
    whole-step graphs, and a copy without graphs: equal tokens, logits within ``tol``. Returns
    (the graphed model, the prompt (ids, mask))."""
    ref, model = make_pair("llama", dtype=dtype, max_position_embeddings=positions)
    ref, model = ref.cuda(), model.cuda()
    hs.enable_hisparse_kv_cache(ref, name=f"{label}-eager", decode_graphs=False, **kw)
    hs.enable_hisparse_kv_cache(model, name=f"{label}-graph", decode_graphs="step", **kw)
    ids, mask = prompt(1, n)
    want, want_logits = _run(ref, ids.cuda(), mask.cuda(), steps)
    got, got_logits = _run(model, ids.cuda(), mask.cuda(), steps)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=tol, atol=tol)
    return model, (ids, mask)


@pytest.mark.gpu
@needs_cuda
def test_a_coming_key_is_captured_ahead_and_decodes_like_no_graphs():
    """The keys of test_buffers_grow_only_where_the_key_changes_anyway on a GPU: each (at 1,024
    tokens, with the banks and token maps it grows staged, and at 1,536) is captured on another
    thread while the key before it replays, and the step that reaches it replays that graph. The
    tokens equal those decoded without graphs; a sampling decode samples while the captures go on."""
    kw = dict(AHEAD, recalibration_lag=2)
    model, (ids, mask) = _graphed_like_eager("test-ahead", torch.float32, 2048, kw, 600, 1000, 1e-4)
    counts = step_graph.of(model).counts
    assert counts["ahead"] == 2 and counts["ahead_failed"] == 0 and counts["captured"] == 1, counts
    # a sampling decode: the caller's multinomial runs while the coming key is captured in another
    # thread (a capture puts the generator's state in capture mode, which rejects it: the capture
    # takes a copy, batch_step.private_random_state)
    _, sampled = make_pair("llama", max_position_embeddings=2048)
    hs.enable_hisparse_kv_cache(sampled.cuda(), name="test-ahead-sampled", decode_graphs="step", **kw)
    with torch.no_grad():
        out = sampled.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), do_sample=True, top_k=50,
                               min_new_tokens=1000, max_new_tokens=1000)
    assert out.shape[1] == 600 + 1000
    assert step_graph.of(sampled).counts["ahead"] == 2, step_graph.of(sampled).counts


@pytest.mark.gpu
@needs_cuda
def test_a_key_change_soon_after_the_prompt_is_foreseen_at_the_capture_and_the_old_graph_goes(monkeypatch):
    """A prompt of 1,000 tokens: its batch's key changes at 1,024, within AHEAD_TOKENS of its
    first captured step (1,001). That step, a capture's already, also stages the coming key and
    begins its capture ahead, not the replayed step after it (on an H100 the staging of 32 layers'
    ~230 tensors made that one 2.4-3.5x the median). At the key change the replaced graph is
    destroyed on the capture-ahead thread (batch_step.ahead_thread), not in the step: replaying it
    then fails. The growth's copies at the key change (every layer's bank kinds and token map)
    were captured ahead in one graph there too, and replayed in one launch. The tokens equal those
    decoded without graphs."""
    retired, retire = [], step_graph._retire
    monkeypatch.setattr(step_graph, "_retire", lambda have: (retired.append(have), retire(have)))
    copies, capture_copies = [], step_graph._capture_copies
    monkeypatch.setattr(step_graph, "_capture_copies", lambda c: (copies.append(c), capture_copies(c)))
    model, _ = _graphed_like_eager("test-ahead-soon", torch.float32, 2048, dict(AHEAD, recalibration_lag=2),
                                   1000, 40, 1e-4)
    graphs = step_graph.of(model)
    assert list(graphs.ahead_at)[:1] == [1001] and graphs.counts["captured"] == 1, (graphs.ahead_at, graphs.counts)
    assert graphs.counts["ahead"] == 1 and graphs.counts["ahead_failed"] == 0, graphs.counts
    # the graph of the key before 1,024 (kept here, dropped by the runtime), once the thread is done
    assert len(retired) == 1 and retired[0] is not None
    ahead_thread().submit(lambda: None).result()
    with pytest.raises(RuntimeError):
        retired[0].graph.replay()
    assert len(copies) == 1 and len(copies[0].copies) == 7 * len(binding_of(model).engine.layers)
    assert copies[0].replayed and copies[0].graph is None


@pytest.mark.gpu
@needs_cuda
def test_whole_step_graph_of_a_long_bf16_context_matches_without_graphs():
    """bf16, 4-bit host, a 3K prompt in 64-token blocks: the replayed step follows the eager one
    through block boundaries (3007 and 3071: planned and replayed too, the block sealed after the
    forward) and a bucket change."""
    kw = dict(max_seq_len=4096, block_size=64, window_size=64, global_tokens=8, top_k=256, host_kv_bits=4,
              recalibration_lag=2)
    model, _ = _graphed_like_eager("test-step-long", torch.bfloat16, 4096, kw, 3000, 100, 2e-2)
    counts = step_graph.of(model).counts
    assert counts["replayed"] >= 80 and counts["layer_by_layer"] == 0, counts
    assert dataclasses.is_dataclass(binding_of(model).engine.stats)


def test_a_layers_graph_key_names_every_buffer_and_moves_when_one_grows():
    """The key a captured step is replayed under holds the address of every buffer the layer's
    bodies touch (its banks, hot K/V and LRU state, its host pool tensors): equal while nothing
    moved, different once the key bounds or the hot buffer's token map grew."""
    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **SPARSE, host_kv_bits=4)
    eng = binding_of(model).engine
    with torch.no_grad():
        model(prompt(1, 40)[0])
    decoder, rows = eng._decoder, eng.layers[1]
    key = decoder.body_key(rows, 7)
    addresses = {t.data_ptr() for t in rows.buffers() + decoder.host.buffers(1)}
    assert key[:2] == (7, rows.probe.fitted) and set(key[2:]) == addresses and len(key) == 2 + len(addresses)
    assert decoder.body_key(rows, 7) == key
    rows.make_room(4 * rows.hot.token_slot_s.shape[1], decoder.cfg)       # the token map and the bounds grow
    moved = decoder.body_key(rows, 7)
    assert moved != key and moved[:2] == key[:2]
    hs.disable_hisparse_kv_cache(model)


@pytest.mark.parametrize("measure", ["top_m", "mass"])
def test_the_first_launches_warm_up_runs_the_audit_and_the_commits_copy_at_the_engines_shapes(measure):
    """warm_first_launches (at install on a GPU) runs on zeros at the engine's head size, with each
    audit measure: here on the CPU, where it runs the same ops."""
    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **SPARSE | {"audit_measure": measure, "audit_top_m": 4}, telemetry=False)
    step_graph.warm_first_launches(binding_of(model).engine, torch.device("cpu"))
