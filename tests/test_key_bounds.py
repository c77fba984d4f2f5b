"""Key bounds of a batch's rows: widened by runs of new tokens at any positions, equal to the bounds
of all their tokens computed afresh (blocks and super-blocks), and grown with room to spare."""

import pytest
import torch

from hi_sparse import key_bounds
from hi_sparse.kernels import superblock_bounds
from hi_sparse.row_bank import RowBank

H, D, BS, GROUP = 2, 8, 4, 3


def _bank(rows: int) -> RowBank:
    bank = RowBank("cpu")
    key_bounds.add_kinds(bank, H, D, torch.float32)
    bank.grow_rows(rows)
    return bank


@pytest.mark.parametrize("runs", [[1] * 9, [5, 1, 1, 7], [13, 2, 1], [3, 9, 1, 1, 4]],
                         ids=["decode", "prefill-then-decode", "blocks-at-once", "mixed"])
def test_updates_equal_a_fresh_fold_of_every_token(runs):
    g = torch.Generator().manual_seed(len(runs))
    starts = torch.tensor([0, 3, 6])                 # three sequences at different positions
    total = sum(runs)
    keys = torch.randn(3, H, total, D, generator=g)
    bank = _bank(3)
    done = 0
    for T in runs:
        key_bounds.grow(bank, int(starts.max()) + done + T, BS, BS, GROUP, max_seq_len=64)
        key_bounds.update(bank, slice(0, 3), starts + done, keys[:, :, done:done + T], BS, GROUP)
        done += T
    for b in range(3):
        blocks = (int(starts[b]) + torch.arange(total)) // BS                    # each token's block
        nb = int(blocks[-1]) + 1
        for blk in range(nb):
            mine = keys[b][:, blocks == blk]                                        # (H, tokens, D)
            if mine.shape[1]:
                assert torch.equal(bank.t["kmin"][b, :, blk], mine.amin(1)), (b, blk)
                assert torch.equal(bank.t["kmax"][b, :, blk], mine.amax(1)), (b, blk)
            else:
                assert torch.isinf(bank.t["kmin"][b, :, blk]).all()
        assert torch.isinf(bank.t["kmin"][b, :, nb:]).all()                          # nothing past the end
        slo, shi = superblock_bounds(bank.t["kmin"][b], bank.t["kmax"][b], GROUP)
        assert torch.equal(bank.t["smin"][b], slo) and torch.equal(bank.t["smax"][b], shi)


def test_growth_is_in_whole_super_blocks_with_two_to_spare_and_covers_every_per_block_kind():
    bank = _bank(1)
    key_bounds.grow(bank, 5 * BS, BS, BS, GROUP, max_seq_len=1024)
    cap = bank.size("kmin", 1)
    assert cap % GROUP == 0 and cap >= (-(-5 // GROUP) + 2) * GROUP
    assert bank.size("importance", 0) == bank.size("holes", 0) == cap and bank.size("smin", 1) == cap // GROUP
    key_bounds.grow(bank, 4 * BS, BS, BS, GROUP, max_seq_len=1024)  # enough already: unchanged
    assert bank.size("kmin", 1) == cap


def test_selection_blocks_finer_than_storage_blocks_grow_both_kinds_in_their_own_units():
    bank = _bank(1)
    key_bounds.grow(bank, 37, 4 * BS, BS, GROUP, max_seq_len=1024)   # 10 selection blocks, 3 storage
    cap = bank.size("kmin", 1)
    assert cap % GROUP == 0 and cap >= (-(-10 // GROUP) + 2) * GROUP and bank.size("smin", 1) == cap // GROUP
    # the per-storage-block kinds cover every storage block the selection blocks span
    assert bank.size("importance", 0) == bank.size("holes", 0) == -(-cap // 4)


def test_updates_fold_at_the_selection_block_size():
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(1, H, 11, D, generator=g)
    bank = _bank(1)
    key_bounds.grow(bank, 11 + 1, 4 * BS, 2, GROUP, max_seq_len=64)
    key_bounds.update(bank, slice(0, 1), torch.tensor([1]), keys, 2, GROUP)
    for blk in range(6):                               # tokens 1..11 in 2-token selection blocks
        mine = keys[0][:, [t - 1 for t in range(2 * blk, 2 * blk + 2) if 1 <= t <= 11]]
        assert torch.equal(bank.t["kmin"][0, :, blk], mine.amin(1)), blk
        assert torch.equal(bank.t["kmax"][0, :, blk], mine.amax(1)), blk


def test_n_super_covers_the_selection_budget():
    # (top_k - window + anchors) / block_size blocks, plus rank slack and the prefetch
    assert key_bounds.n_super(2048, 1024, 16, 64, 1) == 17 + 2 + 1
