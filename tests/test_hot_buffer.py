"""Hot buffer LRU against a naive per-head oracle on random selections; counters equal events.

The operations are sync-free (what a CUDA graph can hold): they stamp from a clock the bank hands
out (HotBufferBank.reserve, hot_buffer.ticks) and return masks and slots at fixed widths."""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hi_sparse.hot_buffer import STAMP_MAX, HotBufferBank, ticks


class NaiveLRU:
    """One head: a list of slots from least to most recently used, and a token -> slot dict."""

    def __init__(self, S: int) -> None:
        self.order = list(range(S))
        self.where: dict[int, int] = {}
        self.slot_tok = [-1] * S
        self.flag = [False] * S
        self.lookups = self.hits = self.used = 0

    def _take(self, slot: int, tok: int) -> None:
        old = self.slot_tok[slot]
        if old >= 0:
            del self.where[old]
        self.slot_tok[slot], self.where[tok] = tok, slot
        self.flag[slot] = False

    def insert(self, toks: list[int]) -> list[int]:
        out = []
        for t in toks:
            s = self.order.pop(0)
            self._take(s, t)
            self.order.append(s)
            out.append(s)
        return out

    def lookup(self, sel: list[int]) -> list[int]:
        hits = [t for t in sel if t in self.where]
        hit_slots = [self.where[t] for t in hits]
        self.lookups += len(sel)
        self.hits += len(hits)
        self.used += sum(self.flag[s] for s in hit_slots)
        for s in hit_slots:
            self.flag[s] = False
        evictable = [s for s in self.order if s not in hit_slots]
        misses = [t for t in sel if t not in self.where]
        miss_slots = evictable[: len(misses)]
        for t, s in zip(misses, miss_slots):
            self._take(s, t)
        self.order = evictable[len(misses):] + miss_slots + hit_slots
        return [self.where[t] for t in sel]

    def prefetch(self, toks: list[int], limit: int) -> list[int]:
        toks = [t for t in toks if t not in self.where][:limit]
        slots = self.order[: len(toks)]
        for t, s in zip(toks, slots):
            self._take(s, t)
            self.flag[s] = True
        self.order = self.order[len(toks):] + slots
        return slots


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), S=st.integers(4, 24), H=st.integers(1, 3), near_limit=st.booleans())
def test_lru_matches_naive_oracle(seed, S, H, near_limit):
    """near_limit: the clock jumps to within a few steps of the int32 stamps' end now and then,
    so room_for renumbers the stamps between operations: the LRU stays the oracle's."""
    _against_the_oracle(seed, S, H, "cpu", near_limit=near_limit)


def test_stamps_are_renumbered_by_rank_before_they_would_pass_int32():
    bank = HotBufferBank(2, 6, rows=2)
    hb = bank.rows(0, 2)
    hb.ensure_tokens(40)
    bank.clock = STAMP_MAX - 20
    hb.insert(torch.arange(9), bank.reserve(ticks(inserted=6)))
    before = bank.slot_stamp.clone()
    bank.room_for(14)                                    # fits: nothing changes
    assert torch.equal(bank.slot_stamp, before) and bank.clock == STAMP_MAX - 14
    with pytest.raises(RuntimeError, match="room_for"):
        bank.reserve(15)
    bank.room_for(15)
    assert bank.clock == 0
    assert torch.equal(bank.slot_stamp.argsort(dim=1), before.argsort(dim=1))       # the same order
    assert (bank.slot_stamp.sort(dim=1).values == torch.arange(-6, 0)).all()         # ranks, below 0
    assert bank.slot_stamp.dtype == torch.int32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("kernels", [False, True])
def test_on_a_gpu_the_lru_matches_the_naive_oracle(kernels):
    """On CUDA the ranking sorts the stamps (topk on the CPU) and, with kernels, the lookup,
    prefetch and install are Triton kernels: the same LRU as the oracle's."""
    rng = random.Random(7)
    for _ in range(12):
        _against_the_oracle(rng.randint(0, 10_000), rng.randint(4, 24), rng.randint(1, 3), "cuda", kernels,
                            near_limit=rng.random() < 0.5)


def _against_the_oracle(seed: int, S: int, H: int, device: str, kernels: bool = False,
                        near_limit: bool = False) -> None:
    rng = random.Random(seed)
    bank = HotBufferBank(H, S, device, rows=1, kernels=kernels)
    hb = bank.rows(0)
    oracles = [NaiveLRU(S) for _ in range(H)]
    n = 0
    lookups = hits = used = 0
    for _ in range(12):
        if near_limit and rng.random() < 0.4:        # a later clock keeps the order: only the room shrinks
            bank.clock = max(bank.clock, STAMP_MAX - rng.randint(0, 4 * S))
        op = rng.random()
        if op < 0.3 or n == 0:  # append new tokens (prefill chunk or decode token)
            T = rng.randint(1, S + 3)
            pos = torch.arange(n, n + T, device=device)
            n += T
            hb.ensure_tokens(n)
            bank.room_for(ticks(inserted=min(T, S)))
            slots = hb.insert(pos, bank.reserve(ticks(inserted=min(T, S))))
            for h, o in enumerate(oracles):
                assert slots[h].tolist() == o.insert(pos[-S:].tolist())
        else:
            K = rng.randint(1, min(S, n))
            rows = [rng.sample(range(n), K) for _ in range(H)]
            pad = rng.randint(0, 2)
            sel = torch.tensor([r + [-1] * pad for r in rows], device=device)
            P = rng.randint(1, 4) if rng.random() < 0.5 else 0      # a prefetch follows
            shared = P and rng.random() < 0.5    # its victims from the lookup's ranking (decode's way)
            # decode's way: the prefetch continues the lookup's stamps and takes the room it left
            implicit = shared and rng.random() < 0.5
            cand_w = min(P, n)
            bank.room_for(ticks(selected=sel.shape[1], prefetched=cand_w))     # the lookup's and the prefetch's
            clock = bank.reserve(ticks(selected=sel.shape[1], prefetched=cand_w if implicit else 0))
            cand = torch.tensor([rng.sample(range(n), cand_w) for _ in range(H)], device=device) if P else None
            fused = implicit and rng.random() < 0.5           # lookup_prefetch: with the kernels one launch
            if fused:
                slots, miss, counts, loaded, ps = hb.lookup_prefetch(sel, cand, clock)
            else:
                slots, miss, counts = hb.lookup(sel, clock, P if shared else 0)
            n_look, n_hit, n_used = counts.unbind(1)
            assert n_look.tolist() == [K] * H                # selected tokens per head
            lookups += int(n_look.sum())
            hits += int(n_hit.sum())
            used += int(n_used.sum())
            for h, o in enumerate(oracles):
                assert slots[h, :K].tolist() == o.lookup(rows[h])
                assert (slots[h, K:] == -1).all()
            # the misses the caller copies in are exactly the selected tokens that were absent
            assert int(miss.sum()) == int(n_look.sum() - n_hit.sum())
            if P:
                if fused:
                    pass
                elif implicit:
                    loaded, ps = hb.prefetch(cand)
                else:
                    limit = torch.tensor([S - K] * H, device=device)
                    loaded, ps = hb.prefetch(cand, limit, bank.reserve(ticks(prefetched=cand.shape[1])))
                for h, o in enumerate(oracles):
                    exp = o.prefetch(cand[h].tolist(), S - K)
                    assert ps[h][loaded[h]].tolist() == exp
        for h, o in enumerate(oracles):
            assert hb.slot_token[h].tolist() == o.slot_tok
            assert hb.prefetched[h].tolist() == o.flag
        if bank.order_valid and bank.kernels:     # the kernels' kept order is the stamps' (no sort made it)
            assert torch.equal(bank.order.long(), bank.slot_stamp.argsort(dim=1)), "the kept LRU order went stale"
    assert lookups == sum(o.lookups for o in oracles)
    assert hits == sum(o.hits for o in oracles)
    assert used == sum(o.used for o in oracles)


def test_newest_token_resident_and_invalidate():
    bank = HotBufferBank(2, 4, rows=1, token_capacity=11)
    hb = bank.rows(0)
    hb.insert(torch.arange(0, 10), bank.reserve(ticks(inserted=4)))          # keeps the last 4
    assert sorted(hb.slot_token[0].tolist()) == [6, 7, 8, 9]
    sel = torch.tensor([[9, 0, 1, 2], [9, 8, 7, 6]])
    _, _, counts = hb.lookup(sel, bank.reserve(ticks(selected=4)))
    assert counts[:, 1].sum().item() == 5 and counts[:, 0].tolist() == [4, 4]
    hb.insert(torch.tensor([10]), bank.reserve(ticks(inserted=1)))
    assert 10 in hb.slot_token[0].tolist() and 10 in hb.slot_token[1].tolist()
    hb.invalidate(6, 9)
    assert not any(t in (6, 7, 8) for t in hb.slot_token.flatten().tolist())
    assert (hb.token_slot[:, 6:9] == -1).all()


def test_a_batch_of_rows_is_one_state_and_positions_may_differ_per_row():
    """rows(r, B) looks up B rows' heads at once; insert takes each head's own positions (sequences
    of different lengths), and the result equals each row on its own."""
    H, S = 2, 6
    both, each = HotBufferBank(H, S, rows=2, token_capacity=40), HotBufferBank(H, S, rows=2, token_capacity=40)
    pos = torch.tensor([[30, 31, 32], [30, 31, 32], [7, 8, 9], [7, 8, 9]])     # row 0 at 30, row 1 at 7
    both.rows(0, 2).insert(pos, both.reserve(ticks(inserted=3)))
    for r in range(2):
        each.rows(r).insert(pos[r * H:(r + 1) * H], each.reserve(ticks(inserted=3)))
    sel = torch.tensor([[32, 5, -1], [31, 30, 4], [9, 1, -1], [2, 8, 7]])
    got = both.rows(0, 2).lookup(sel, both.reserve(ticks(selected=3)))
    for r in range(2):
        one = each.rows(r).lookup(sel[r * H:(r + 1) * H], each.reserve(ticks(selected=3)))
        assert torch.equal(got[0][r * H:(r + 1) * H], one[0]) and torch.equal(got[1][r * H:(r + 1) * H], one[1])
    for name in ("slot_token", "prefetched", "token_slot"):
        assert torch.equal(getattr(both, name), getattr(each, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("graphs", [False, True])
def test_on_a_gpu_the_decode_kernels_decode_like_the_reference(graphs):
    """decode_kernels=True (the selection's assembly, the hot buffer's lookup, prefetch and
    install and the key bounds' widening as Triton kernels; replayed from per-layer graphs or
    launched) leaves the LRU state, key bounds, hit counts and outputs of the torch path, through
    a 2,000-token prefill of two sequences and 40 steps that cross blocks. The prefill's background
    recalibration lands at a fixed step in both (recalibration_lag; without it, once the worker
    finished: a step that depends on the timing)."""
    from hi_sparse.config import HiSparseConfig
    from hi_sparse.engine import HiSparseEngine
    from hi_sparse.workloads import run_decode, run_prefill

    base = dict(max_seq_len=4096, cache_block_size=32, window_size=64, global_tokens=8, top_k=256, audit_every=0,
                telemetry=False, recalibrate_every=1 << 20, decode_graphs=graphs, recalibration_lag=8)
    g = torch.Generator().manual_seed(5)
    L, HQ, HKV, D, T = 2, 8, 2, 64, 2000
    k, v, q = (torch.randn(2, h, T, D, generator=g).cuda() for h in (HKV, HKV, HQ))
    steps = [tuple(torch.randn(2, h, 1, D, generator=g).cuda() for h in (HQ, HKV, HKV)) for _ in range(40)]
    runs = []
    for kernels in (True, False):
        eng = HiSparseEngine(HiSparseConfig(**base, decode_kernels=kernels), L, HQ, HKV, D, device="cuda")
        sid = eng.add_sequences(2)
        run_prefill(eng, sid, k, v, q)
        outs = [run_decode(eng, sid, *s) for s in steps]
        state = [t.clone() for layer in eng.layers for t in (layer.hot.slot_token, layer.hot.slot_stamp,
                                                               layer.hot.prefetched, layer.hot.token_slot)]
        state += [layer.bank.t[name].clone() for layer in eng.layers for name in ("kmin", "kmax", "smin", "smax")]
        runs.append((outs, state, eng.stats.hot_buffer_hits, eng.stats.hot_buffer_lookups))
    (a_out, a_state, a_hits, a_look), (b_out, b_state, b_hits, b_look) = runs
    assert (a_hits, a_look) == (b_hits, b_look) and 0 < a_hits < a_look
    assert all(torch.equal(x, y) for x, y in zip(a_state, b_state))
    assert all(torch.equal(x, y) for x, y in zip(a_out, b_out))


def test_an_engine_decodes_the_same_across_a_renumbering_of_its_stamps():
    """Every layer's clock a few steps from the int32 end: the decode step renumbers the stamps
    (decode.Decoder calls room_for before it reserves) and decodes exactly as with room to spare."""
    from hi_sparse.config import HiSparseConfig
    from hi_sparse.engine import HiSparseEngine
    from hi_sparse.workloads import run_decode, run_prefill

    cfg = HiSparseConfig(max_seq_len=1024, cache_block_size=16, window_size=32, global_tokens=4, top_k=96,
                         audit_every=0, telemetry=False, recalibrate_every=1 << 20)
    g = torch.Generator().manual_seed(3)
    L, HQ, HKV, D, T = 2, 4, 2, 32, 400
    k, v, q = (torch.randn(1, h, T, D, generator=g) for h in (HKV, HKV, HQ))
    steps = [tuple(torch.randn(1, h, 1, D, generator=g) for h in (HQ, HKV, HKV)) for _ in range(6)]
    runs = []
    for near in (False, True):
        eng = HiSparseEngine(cfg, L, HQ, HKV, D)
        sid = eng.add_sequences(1)
        run_prefill(eng, sid, k, v, q)
        if near:
            for layer in eng.layers:
                layer.hot.clock = STAMP_MAX - 3 * layer.hot.num_slots
        outs = [run_decode(eng, sid, *s) for s in steps]
        runs.append((outs, [layer.hot.slot_token.clone() for layer in eng.layers],
                     [layer.hot.clock for layer in eng.layers], eng.stats.hot_buffer_hits))
    (a_out, a_tok, _, a_hits), (b_out, b_tok, b_clock, b_hits) = runs
    assert all(c < 1 << 20 for c in b_clock)                  # renumbered: the clocks started again
    assert a_hits == b_hits and all(torch.equal(x, y) for x, y in zip(a_tok, b_tok))
    assert all(torch.equal(x, y) for x, y in zip(a_out, b_out))


def test_a_staged_token_map_is_taken_by_the_growth_with_the_contents_then():
    """The token -> slot map grown ahead (ensure_tokens(staged=True)): seen only in a staged_view,
    taken by the growth to its width with the map as it is then."""
    from hi_sparse.hot_buffer import HotBufferBank
    from hi_sparse.row_bank import staged_view

    bank = HotBufferBank(2, 4, rows=1, token_capacity=8)
    bank.ensure_tokens(100, align=lambda n: 160, staged=True)       # a map of 64 positions so far
    staged = bank._staged_map
    assert bank.token_slot_s.shape == (2, 65) and staged.shape == (2, 161)
    with staged_view():
        assert bank.token_slot_s is staged
    bank.token_slot_s[:, 3] = 1                                # written after staging
    bank.ensure_tokens(100, align=lambda n: 160)
    assert bank.token_slot_s is staged and bank._staged_map is None
    assert bool((staged[:, 3] == 1).all()) and bool((staged[:, 65:] == -1).all())
