"""Hot buffer LRU against a naive per-head oracle on random selections; counters equal events."""

import random

import torch
from hypothesis import given, settings, strategies as st

from hi_sparse.hot_buffer import HotBufferState


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
@given(seed=st.integers(0, 10_000), S=st.integers(4, 24), H=st.integers(1, 3))
def test_lru_matches_naive_oracle(seed, S, H):
    rng = random.Random(seed)
    hb = HotBufferState(H, S)
    oracles = [NaiveLRU(S) for _ in range(H)]
    n = 0
    lookups = hits = used = 0
    for _ in range(12):
        op = rng.random()
        if op < 0.3 or n == 0:  # append new tokens (prefill chunk or decode token)
            T = rng.randint(1, S + 3)
            pos = torch.arange(n, n + T)
            n += T
            slots = hb.insert(pos)
            for h, o in enumerate(oracles):
                assert slots[h].tolist() == o.insert(pos[-S:].tolist())
        else:
            K = rng.randint(1, min(S, n))
            rows = [rng.sample(range(n), K) for _ in range(H)]
            pad = rng.randint(0, 2)
            sel = torch.tensor([r + [-1] * pad for r in rows])
            res = hb.lookup(sel)
            lookups += int(res.lookups)
            hits += int(res.hits)
            used += int(res.prefetch_used)
            for h, o in enumerate(oracles):
                assert res.slots[h, :K].tolist() == o.lookup(rows[h])
                assert (res.slots[h, K:] == -1).all()
            # the misses the caller copies in are exactly the selected tokens that were absent
            assert res.miss_token.numel() == int(res.lookups - res.hits)
            if rng.random() < 0.5:
                P = rng.randint(1, 4)
                cand = torch.tensor([rng.sample(range(n), min(P, n)) for _ in range(H)])
                limit = torch.tensor([S - K] * H)
                ph, pt, ps = hb.prefetch(cand, limit)
                for h, o in enumerate(oracles):
                    exp = o.prefetch(cand[h].tolist(), S - K)
                    assert ps[ph == h].tolist() == exp
        for h, o in enumerate(oracles):
            assert hb.slot_token[h].tolist() == o.slot_tok
            assert hb.prefetched[h].tolist() == o.flag
    assert lookups == sum(o.lookups for o in oracles)
    assert hits == sum(o.hits for o in oracles)
    assert used == sum(o.used for o in oracles)


def test_newest_token_resident_and_invalidate():
    hb = HotBufferState(2, 4)
    hb.insert(torch.arange(0, 10))          # keeps the last 4
    assert sorted(hb.slot_token[0].tolist()) == [6, 7, 8, 9]
    res = hb.lookup(torch.tensor([[9, 0, 1, 2], [9, 8, 7, 6]]))
    assert res.hits.item() == 5 and res.lookups.item() == 8
    hb.insert(torch.tensor([10]))
    assert 10 in hb.slot_token[0].tolist() and 10 in hb.slot_token[1].tolist()
    hb.invalidate(6, 9)
    assert not any(t in (6, 7, 8) for t in hb.slot_token.flatten().tolist())
    assert (hb.token_slot[:, 6:9] == -1).all()


def test_fixed_width_lookup_and_prefetch_equal_the_compact_ones():
    """lookup_fixed / prefetch_fixed (no host syncs: what a CUDA graph can hold) leave the same
    state and give the same slots as lookup / prefetch, over a random run of selections."""
    import torch

    from hi_sparse.hot_buffer import HotBufferState

    g = torch.Generator().manual_seed(3)
    H, S, n = 3, 24, 200
    a, b = HotBufferState(H, S, token_capacity=n), HotBufferState(H, S, token_capacity=n)
    for step in range(40):
        pos = torch.tensor([100 + step])
        a.insert(pos, end=n)
        b.insert(pos, end=n, clock=torch.tensor(b.clock))
        K = 12
        sel = torch.stack([torch.randperm(100 + step, generator=g)[:K] for _ in range(H)])
        sel[:, -3:] = -1 if step % 2 else sel[:, -3:]
        la = a.lookup(sel)
        slots, miss, lookups, hits, used = b.lookup_fixed(sel, torch.tensor(b.clock))
        assert torch.equal(la.slots, slots) and int(la.hits) == int(hits) and int(la.lookups) == int(lookups)
        assert int(la.prefetch_used) == int(used) and int(miss.sum()) == la.miss_token.numel()
        assert torch.equal(torch.sort(sel[miss]).values, torch.sort(la.miss_token).values)
        pf = torch.stack([torch.randperm(100 + step, generator=g)[:5] for _ in range(H)])
        limit = torch.tensor([5, 2, 0])
        ph, pt, ps = a.prefetch(pf, limit)
        loaded, pslots = b.prefetch_fixed(pf, limit, torch.tensor(b.clock))
        assert torch.equal(torch.sort(pf[loaded]).values, torch.sort(pt).values)
        assert torch.equal(torch.sort(pslots[loaded]).values, torch.sort(ps).values)
        for name in ("slot_token", "slot_stamp", "prefetched", "token_slot"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
        assert a.clock == b.clock
