"""The append and the decode step through decode.Decoder, wired from the parts (no engine): where a
step's data goes. An append stores the tokens in the host pool, makes them hot and widens the
bounds; an attend leaves every selected token hot with the K/V the host pool holds for it, counts
what it looked up and copied, adds its block hits to the importance and keeps the query."""

import pytest
import torch

from hi_sparse.block_pool import BlockPool
from hi_sparse.config import HiSparseConfig
from hi_sparse.decode import Decoder
from hi_sparse.host_pool import HostPool
from hi_sparse.layers import KVShape, LayerRows
from hi_sparse.metrics import DeviceCounters, RuntimeMetrics
from hi_sparse.page_table import PageTable
from hi_sparse.probe import ImportanceProbe
from hi_sparse.sequences import SequenceTable
from hi_sparse.storage import Storage

HQ, HKV, D, BS = 4, 2, 16, 8


class Parts:
    """One layer's decode path on the CPU, built the way the engine wires it."""

    def __init__(self, bits=None, **kw):
        cfg = dict(max_seq_len=512, cache_block_size=BS, window_size=8, global_tokens=2, top_k=24,
                   device_buffer_tokens=32, host_kv_bits=bits, telemetry=False, prefetch_blocks=1)
        cfg.update(kw)
        self.cfg = cfg = HiSparseConfig(**cfg).validate()
        cpu = torch.device("cpu")
        self.shape = shape = KVShape(1, HQ, HKV, D, BS, cfg.buffer_tokens, torch.float32)
        self.metrics = RuntimeMetrics(None)
        self.pool = BlockPool(0)
        self.pages = PageTable(self.pool, BS)
        self.host = HostPool(1, HKV, D, BS, torch.float32, pin=False, host_kv_bits=bits)
        if cfg.host_pool_blocks:
            self.pool.grow(cfg.host_pool_blocks)
            self.host.grow(blocks=cfg.host_pool_blocks)
        self.layer = LayerRows(0, cpu, shape, cfg.global_tokens, cfg.recalibrate_queries, cfg.max_seq_len,
                               ImportanceProbe(D), DeviceCounters(cpu), False)
        self.seqs = SequenceTable(cfg, [self.layer], self.host, self.pages)
        self.storage = Storage(cfg, self.pool, self.pages, self.host, [self.layer], self.seqs, self.metrics)
        self.decoder = Decoder(cfg, shape, [self.layer], self.host, self.storage, self.seqs, self.metrics)

    def host_kv(self, s, pos):
        """K, V (Hkv, len(pos), D) of a sequence's tokens as the host pool holds them."""
        full = self.pages.num_tokens(s.seq_id) // BS
        return self.host.read(0, self.storage.block_table(s), s.tail_slot, full, torch.arange(HKV)[:, None],
                              pos[None])


@pytest.mark.parametrize("bits", [None, 4, "budget"])
def test_an_append_stores_makes_hot_and_bounds_the_new_tokens(bits):
    parts = Parts(bits)
    seqs = parts.seqs.add([0, 3])
    k, v = torch.randn(2, HKV, 21, D), torch.randn(2, HKV, 21, D)
    parts.decoder.append(parts.layer, seqs, k, v)
    k1, v1 = torch.randn(2, HKV, 1, D), torch.randn(2, HKV, 1, D)
    parts.decoder.append(parts.layer, seqs, k1, v1)
    for b, s in enumerate(seqs):
        assert s.lengths == [22]
        hk, hv = parts.host_kv(s, torch.arange(22))
        want = torch.cat([k[b], k1[b]], 1)
        if bits is None:
            assert torch.equal(hk, want) and torch.equal(hv, torch.cat([v[b], v1[b]], 1))
        else:                                        # sealed blocks quantized, the tail exact
            assert torch.equal(hk[:, 16:], want[:, 16:]) and (hk[:, :16] - want[:, :16]).abs().max() < 0.5
        hot = s.hot[0]
        assert hot.resident() == HKV * 22                              # everything fits the buffer
        slots = hot.token_slot[:, 21]                                  # the newest token, in every head
        assert torch.equal(parts.layer.k[s.row, torch.arange(HKV), slots], k1[b, :, 0])
        assert torch.equal(s.kmin[0][:, 1], want[:, 8:16].amin(1))
        assert torch.equal(s.kmax[0][:, 2], want[:, 16:].amax(1))
    assert parts.metrics.snapshot().backup_bytes > 0


@pytest.mark.parametrize("bits", [None, 4, "auto"])
def test_an_attend_leaves_the_selection_hot_with_the_host_pool_s_values_and_counts_it(bits):
    """Tokens the step swapped in hold what the host pool holds (dequantized); tokens that were hot
    already keep their values (as appended: exact, even with a quantized pool). In streaming mode
    the step's block hits add to the importance its eviction ranks blocks by."""
    torch.manual_seed(1)
    # 32 slots < 120 tokens: misses are swapped in
    parts = Parts(bits, device_buffer_tokens=32, streaming=True, host_pool_blocks=64)
    seqs = parts.seqs.add([0, 5])
    n = 120
    parts.decoder.append(parts.layer, seqs, torch.randn(2, HKV, n, D), torch.randn(2, HKV, n, D))
    before = [(s.hot[0].token_slot[:, :n].clone(), parts.layer.k[s.row].clone()) for s in seqs]
    importance = parts.layer.bank.t["importance"].clone()
    q = torch.randn(2, HQ, D)
    out = parts.decoder.attend(parts.layer, seqs, q)
    assert out.shape == (2, HQ, D) and torch.isfinite(out).all()
    selected = swapped = 0
    for b, s in enumerate(seqs):
        sel, (was_slot, was_k) = s.selection(0), before[b]              # sel: (Hkv, K), -1 padded
        for h in range(HKV):
            toks = sel[h][sel[h] >= 0]
            slots = s.hot[0].token_slot[h, toks]
            assert (slots >= 0).all()                                        # every selected token is hot
            new = was_slot[h, toks] < 0
            hk, hv = parts.host_kv(s, toks[new])
            assert torch.equal(parts.layer.k[s.row, h, slots[new]], hk[h])  # swapped in from the pool
            assert torch.equal(parts.layer.v[s.row, h, slots[new]], hv[h])
            assert torch.equal(parts.layer.k[s.row, h, slots[~new]], was_k[h, was_slot[h, toks[~new]]])
            selected, swapped = selected + toks.numel(), swapped + int(new.sum())
        assert s.queries_kept == [1] and torch.equal(s.queries[0][-1], q[b])
    parts.layer.counters.flush_into(parts.metrics)
    st = parts.metrics.snapshot()
    assert st.hot_buffer_lookups == selected and st.hot_buffer_lookups - st.hot_buffer_hits == swapped > 0
    assert st.swap_in_bytes > 0 and st.prefetch_issued > 0
    added = parts.layer.bank.t["importance"] - importance                    # the step's block hits
    assert added.sum() == selected and (added >= 0).all()


def test_rows_out_of_order_move_into_consecutive_rows_with_their_state():
    """A batch [c, a] of rows 2 and 0 moves to two new consecutive rows, its hot K/V and LRU state
    with it (10 tokens: everything is selected and already hot, so the step changes neither)."""
    parts = Parts()
    a, b, c = parts.seqs.add([0, 0, 0])
    for s in (a, b, c):
        parts.decoder.append(parts.layer, [s], torch.randn(1, HKV, 10, D), torch.randn(1, HKV, 10, D))
    before = {s.seq_id: (parts.layer.k[s.row].clone(), s.hot[0].token_slot.clone()) for s in (c, a)}
    old_rows = (c.row, a.row)
    out = parts.decoder.attend(parts.layer, [c, a], torch.randn(2, HQ, D))
    assert old_rows == (2, 0) and (c.row, a.row) == (3, 4) and torch.isfinite(out).all()
    for s in (c, a):
        k, token_slot = before[s.seq_id]
        assert torch.equal(parts.layer.k[s.row], k) and torch.equal(s.hot[0].token_slot, token_slot)
    assert (parts.layer.hot.slot_token[2 * HKV:3 * HKV] == -1).all()     # the rows left behind are empty
