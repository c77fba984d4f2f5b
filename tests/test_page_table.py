"""Page table: tokens to logical blocks to physical blocks, holes, removal and restore."""

import pytest

from hi_sparse.block_pool import PENDING, BlockPool
from hi_sparse.page_table import PageTable

BS = 4


def _table(blocks: int = 8):
    pool = BlockPool(blocks, grace_s=1.0, clock=lambda: 0.0)
    return pool, PageTable(pool, BS)


def test_blocks_are_needed_only_when_tokens_overflow_the_last_one():
    pool, pt = _table()
    pt.add_sequence(0)
    assert pt.blocks_needed(0, 1) == 1 and pt.blocks_needed(0, 4) == 1 and pt.blocks_needed(0, 5) == 2
    pt.extend(0, 3, pool.get_new_blocks(1))
    assert pt.blocks_needed(0, 1) == 0 and pt.blocks_needed(0, 2) == 1
    v = pt.seqs[0].version
    pt.extend(0, 1, [])                               # fills the block: no new block, same version
    assert pt.num_tokens(0) == 4 and pt.seqs[0].version == v
    pt.extend(0, 1, pool.get_new_blocks(1))           # a new block: cached block tables are stale
    assert pt.seqs[0].version == v + 1 and len(pt.block_ids(0)) == 2
    with pytest.raises(RuntimeError, match="bug: extend of sequence 0 by 9 tokens got 0 blocks, needs 2"):
        pt.extend(0, 9, [])


def test_a_hole_reads_minus_one_and_stays_active_until_its_block_is_reused():
    pool, pt = _table()
    pt.add_sequence(7)
    pt.extend(7, 12, pool.get_new_blocks(3))
    ids = pt.block_ids(7)
    v = pt.seqs[7].version
    detached = pt.punch_hole(7, 1)
    assert detached.block_id == ids[1] and pt.block_ids(7) == [ids[0], -1, ids[2]]
    assert pt.seqs[7].version == v + 1
    with pytest.raises(RuntimeError, match="already a hole"):
        pt.punch_hole(7, 1)


def test_removed_sequences_come_back_only_while_their_blocks_wait_in_grace():
    pool, pt = _table(4)
    pt.add_sequence(1)
    pt.extend(1, 8, pool.get_new_blocks(2))
    pages = pt.remove(1)
    assert all(b.state == PENDING for b in pages.blocks) and pool.num_active == 0
    assert pt.restore(1, pages) and pt.num_tokens(1) == 8 and pool.reclaims == 2
    pages = pt.remove(1)
    pool.get_new_blocks(4, cut_grace=True)            # pressure: the grace is cut, the blocks reused
    assert not pt.restore(1, pages) and 1 not in pt.seqs


def test_adding_a_sequence_twice_is_a_bug():
    _, pt = _table()
    pt.add_sequence(3)
    with pytest.raises(RuntimeError, match="bug: sequence 3 already has a page table"):
        pt.add_sequence(3)


def test_a_batchs_block_tables_follow_every_change_of_its_page_lists():
    """decode.Batch.refresh_tables writes only the columns of blocks appended since it last ran
    (the step where a batch's sequences all gain a block), and every column when a list changed
    otherwise (a hole, a fork's shared prefix, a restore): after each change the device table
    reads what block_ids reads, -1 past each list."""
    import torch

    from hi_sparse.decode import Batch

    pool, pt = _table(blocks=64)
    for seq in (0, 1, 2):
        pt.add_sequence(seq)
    batch = Batch.__new__(Batch)            # the table and its bookkeeping only
    batch.seq_ids, batch._uploaded = (0, 1, 2), None
    batch.tables = torch.full((3, 16), -1, dtype=torch.int64)
    writes = []
    real = torch.Tensor.copy_

    def check(columns=None):
        batch.refresh_tables(pt)
        for row, seq in enumerate(batch.seq_ids):
            ids = pt.block_ids(seq)
            assert batch.tables[row, :len(ids)].tolist() == ids, (row, ids)
            assert (batch.tables[row, len(ids):] == -1).all()
        if columns is not None:
            assert writes[-1] == columns, writes
    torch.Tensor.copy_ = lambda dst, src, *a, **k: (writes.append(dst.shape[1]), real(dst, src, *a, **k))[1]
    try:
        def extend(seq, n):
            pt.extend(seq, n, pool.get_new_blocks(pt.blocks_needed(seq, n)))

        for seq, n in ((0, 9), (1, 5), (2, 1)):
            extend(seq, n)
        check(3)                            # the first: every column
        for seq in (0, 1, 2):
            extend(seq, BS)                 # each gains one block at its own end
        check(4 - 1)                        # columns 1..3 (from the shortest list's old end)
        n = len(writes)
        check()                             # nothing changed: nothing written
        assert len(writes) == n
        extend(1, 1)                        # within its last block: no new block, no write
        check()
        assert len(writes) == n
        pt.punch_hole(0, 1)                 # a hole: every column again
        check(4)
        assert pt.restore(2, pt.remove(2))  # freed and taken back (a new list object): every column
        check(4)
        extend(0, 3 * BS)
        check(7 - 4)                        # the appended columns 4..6 only
    finally:
        torch.Tensor.copy_ = real
