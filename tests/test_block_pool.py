"""Block pool and page table under random operation sequences (hypothesis state machine)."""

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hi_sparse.block_pool import ACTIVE, FREE, PENDING, BlockPool
from hi_sparse.page_table import PageTable, SequencePages

BS = 4
GRACE = 1.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.pool = BlockPool(6, grace_s=GRACE, clock=self.clock)
        self.pt = PageTable(self.pool, BS)
        self.next_id = 0
        self.removed: dict[int, tuple] = {}  # seq -> (pages, released_at)
        self.watch: dict[int, dict[int, int]] = {}  # removed seq -> block id -> generation
        self.lost: set[int] = set()  # removed seqs whose contents were recycled since

    # -- operations ----------------------------------------------------------------------------
    @rule()
    def add(self) -> None:
        self.pt.add_sequence(self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.pt.seqs)
    @rule(data=st.data(), n=st.integers(1, 9), cut=st.booleans())
    def extend(self, data, n, cut) -> None:
        seq = data.draw(st.sampled_from(sorted(self.pt.seqs)))
        need = self.pt.blocks_needed(seq, n)
        free_before, pending_before = self.pool.num_free, self.pool.num_pending
        expired = sum(1 for b in self.pool.blocks
                      if b.state == PENDING and b.released_at + GRACE <= self.clock.t)
        got = self.pool.get_new_blocks(need, cut_grace=cut)
        available = free_before + expired + ((pending_before - expired) if cut else 0)
        if got is None:
            assert available < need
            return
        assert available >= need
        assert all(b.ref_cnt == 1 and b.state == ACTIVE for b in got)
        self.pt.extend(seq, n, got)

    @precondition(lambda self: self.pt.seqs)
    @rule(data=st.data())
    def remove(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.pt.seqs)))
        pages = self.pt.remove(seq)
        self.removed[seq] = (pages, self.clock.t)
        self.watch[seq] = {b.block_id: b.generation for b in pages.blocks}

    @precondition(lambda self: self.removed)
    @rule(data=st.data())
    def restore(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.removed)))
        pages, _ = self.removed[seq]
        live = [b for b in pages.blocks if b is not None]
        # blocks still pending, or active because a sharer holds them (copy on write), still hold
        # the sequence's tokens; a recycled one (free, or allocated again since) does not
        expect = seq not in self.lost and all(b.state != FREE for b in live)
        reclaims = self.pool.reclaims
        pending = sum(1 for b in live if b.state == PENDING)
        ok = self.pt.restore(seq, pages)
        assert ok == expect
        if ok:
            del self.removed[seq]
            assert self.pool.reclaims - reclaims == pending

    @precondition(lambda self: any(p.num_tokens >= BS for p in self.pt.seqs.values()))
    @rule(data=st.data())
    def share(self, data) -> None:
        """A second owner of a sequence's full blocks (copy-on-write sharing): ref counts above 1."""
        src = data.draw(st.sampled_from(sorted(s for s, p in self.pt.seqs.items()
                                               if p.num_tokens >= BS)))
        full = self.pt.seqs[src].num_tokens // BS
        shared = list(self.pt.seqs[src].blocks[:full])
        self.pool.touch(shared)
        self.pt.seqs[self.next_id] = SequencePages(blocks=shared, num_tokens=full * BS)
        self.next_id += 1

    @rule(dt=st.sampled_from([0.1, 0.5, 0.99, 1.0, 2.5]))
    def advance(self, dt) -> None:
        self.clock.t += dt

    @rule()
    def recycle(self) -> None:
        pending = [b for b in self.pool.blocks if b.state == PENDING]
        due = [b for b in pending if b.released_at + GRACE <= self.clock.t]
        n = self.pool.recycle_expired()
        assert n == len(due)
        assert all(b.state == FREE for b in due)
        assert all(b.state == PENDING for b in pending if b not in due)  # never before grace

    @precondition(lambda self: self.pt.seqs)
    @rule(data=st.data())
    def double_free_is_caught(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.pt.seqs)))
        pending = [b for b in self.pool.blocks if b.state != ACTIVE]
        if pending:
            with pytest.raises(RuntimeError, match="double free"):
                self.pool.free_blocks([pending[0]])

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for p in self.pt.seqs.values():
            assert len(p.blocks) * BS >= p.num_tokens > (len(p.blocks) - 1) * BS or p.num_tokens == 0
            for b in p.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            # ref counts equal the page-table references: no leak, no dangling owner
            assert b.ref_cnt == refs.get(b.block_id, 0), (b, refs.get(b.block_id))
            assert (b.state == ACTIVE) == (b.block_id in refs)
        counts = self.pool.num_free + self.pool.num_pending + self.pool.num_active
        assert counts == self.pool.num_blocks
        # every block that is not free was allocated once more than it was recycled
        assert self.pool.allocations - self.pool.recycles == self.pool.num_blocks - self.pool.num_free

    @invariant()
    def track_recycled(self) -> None:
        # model side of restore: a removed sequence is lost once any of its blocks was recycled
        # (free now, or allocated again since: a new generation)
        for seq, gens in self.watch.items():
            if seq in self.removed and any(self.pool.blocks[i].state == FREE
                                           or self.pool.blocks[i].generation != g
                                           for i, g in gens.items()):
                self.lost.add(seq)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_lifecycle_counts_with_fake_clock():
    clock = FakeClock()
    pool = BlockPool(4, grace_s=0.5, clock=clock)
    a = pool.get_new_blocks(3)
    assert pool.allocations == 3 and pool.num_free == 1
    assert pool.get_new_blocks(2) is None  # exhausted: the caller decides
    pool.free_blocks(a[:2])
    assert pool.num_pending == 2
    clock.t += 0.4
    pool.touch(a[:1])  # within grace: reclaimed with its contents
    assert pool.reclaims == 1 and a[0].state == ACTIVE
    clock.t += 0.1
    assert pool.recycle_expired() == 1 and pool.recycles == 1
    with pytest.raises(RuntimeError, match="free block"):
        pool.touch(a[1:2])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks(a[1:2])  # a[1] is free: a double free is a bug, said so


def test_restore_refuses_blocks_recycled_and_reused_since():
    """A -> pending -> free -> another owner -> pending again: A must not take it back (ABA)."""
    clock = FakeClock()
    pt = PageTable(BlockPool(1, grace_s=0.5, clock=clock), BS)
    pt.add_sequence(0)
    pt.extend(0, 2, pt.pool.get_new_blocks(1))
    pages = pt.remove(0)
    clock.t += 1.0
    pt.add_sequence(1)
    pt.extend(1, 3, pt.pool.get_new_blocks(1))  # recycles and reuses the same physical block
    pt.remove(1)
    assert not pt.restore(0, pages)
    assert pt.restore(1, pt_pages := pages.__class__(blocks=list(pages.blocks), num_tokens=3,
                                                     generations=(2,)))
    assert pt.pool.reclaims == 1 and pt_pages.num_tokens == 3
