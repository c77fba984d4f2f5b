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
