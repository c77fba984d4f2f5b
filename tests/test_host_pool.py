"""The host pool through the entry points the decode path uses: seal and backup to store, load
and read to get rows back, with one address formula (main rows, tail rows) for all of them."""

import pytest
import torch

from hi_sparse import pinned
from hi_sparse.host_pool import HostPool
from hi_sparse.kernels import packed_width
from hi_sparse.quant_policy import relative_error

H, D, BS = 2, 16, 4


def _pool(bits, blocks=8, tails=3):
    hp = HostPool(1, H, D, BS, torch.float32, pin=False, host_kv_bits=bits)
    hp.grow(blocks=blocks, tails=tails)
    return hp


def _append(hp, table, tail, start, k, v):
    """What an append of one sequence stores: blocks its tokens complete sealed, the rest backed up."""
    hp.seal(0, table, tail, start, k, v)
    hp.backup(0, table[None], hp.tail_units(torch.tensor([tail])), torch.tensor([start]), k[None], v[None])


@pytest.mark.parametrize("bits", [None, 4, 8, "auto", "budget"])
def test_round_trip_across_tail_and_quantized_blocks(bits):
    g = torch.Generator().manual_seed(2)
    hp = _pool(bits)
    table = torch.tensor([5, 2, 7, 0, 3])
    k, v = torch.randn(H, 19, D, generator=g), torch.randn(H, 19, D, generator=g)
    for lo, hi in ((0, 3), (3, 4), (4, 13), (13, 19)):  # partial, completing, multi-block, tail
        _append(hp, table, 1, lo, k[:, lo:hi], v[:, lo:hi])
    rk, rv = hp.read(0, table, 1, 19 // BS, torch.arange(H)[:, None], torch.arange(19)[None])
    keys, none = hp.read(0, table, 1, 19 // BS, torch.arange(H)[:, None], torch.arange(19)[None], values=False)
    assert none is None and torch.equal(keys, rk)          # the keys alone (a context read to score it)
    if bits is None:
        assert torch.equal(rk, k) and torch.equal(rv, v)
    else:
        tol = {4: 0.2, 8: 0.02, "auto": 0.12, "budget": 0.021}[bits]
        full = slice(0, 16)
        assert relative_error(k[None, :, full], rk[None, :, full]).item() <= tol
        assert torch.equal(rk[:, 16:], k[:, 16:])  # the tail block stays exact until it fills


@pytest.mark.parametrize("bits", [None, 4], ids=["bf", "int4"])
def test_a_batch_backup_at_different_positions_equals_one_sequence_at_a_time(bits):
    g = torch.Generator().manual_seed(3)
    tables = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]])
    tails, starts = torch.tensor([0, 2]), [6, 13]
    k, v = torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g)
    both, one = _pool(bits), _pool(bits)
    both.backup(0, tables, both.tail_units(tails), torch.tensor(starts), k, v)
    for b in range(2):
        one.backup(0, tables[b:b + 1], one.tail_units(tails[b:b + 1]), torch.tensor(starts[b:b + 1]), k[b:b + 1],
                   v[b:b + 1])
    for name, t in both.layers[0].items():
        assert torch.equal(t, one.layers[0][name]), name
    rows = (both.tail_rows(tails[:, None, None], torch.arange(H)[None, :, None], torch.tensor(starts)[:, None, None])
            if bits else both.main_rows(tables, torch.arange(H)[None, :, None], torch.tensor(starts)[:, None, None]))
    store = both.layers[0]["k_tail" if bits else "k"]
    assert torch.equal(store[rows.reshape(-1)], k.reshape(-1, D))
    assert both.backup_bytes(starts, 1) == 2 * 2 * H * D * 4


def test_the_row_formula_is_the_one_every_address_uses():
    hp = _pool(None)
    table = torch.tensor([[5, -1, 2]])
    pos = torch.tensor([[1, 5, 9]])
    assert hp.main_rows(table, torch.tensor([[1]]), pos).tolist() == [[(5 * H + 1) * BS + 1, (0 * H + 1) * BS + 1,
                                                                      (2 * H + 1) * BS + 1]]   # a hole reads block 0
    assert hp.main_rows(table, 0, pos, seq=torch.tensor([[0]])).tolist() == hp.main_rows(table, 0, pos).tolist()
    assert int(hp.tail_rows(3, 1, torch.tensor(6))) == (3 * H + 1) * BS + 2


def test_mixed_widths_load_each_unit_at_its_own_bits_and_count_what_they_read():
    """A budget pool holds units at several widths; a load with -1 entries copies only the rest,
    dequantizes each row at its unit's width and counts the packed bytes (+ scale and zero) read."""
    g = torch.Generator().manual_seed(5)
    hp = _pool("budget")
    table = torch.tensor([0, 1, 2])
    x = torch.randn(H, 12, D, generator=g)
    x[:, 4:8] = x[:, 4:8] * 0.01 + 3.0               # a nearly constant block: few bits suffice
    _append(hp, table, 0, 0, x, x)
    bits = hp.layers[0]["k_bits"][: 3 * H]
    assert len(set(bits.tolist())) > 1
    rows = hp.main_rows(table[None], torch.arange(H)[:, None].reshape(1, -1, 1), torch.arange(12)[None, None])
    rows = rows.reshape(-1)
    rows[::3] = -1                                    # entries of a fixed-width list that load nothing
    dst = torch.full((rows.numel(), D), float("nan"))
    dst_v = dst.clone()
    nbytes = hp.load(0, rows, torch.full_like(rows, -1), dst, dst_v, torch.arange(rows.numel()))
    kept = rows >= 0
    assert torch.isnan(dst[~kept]).all() and torch.isfinite(dst[kept]).all()
    want = x.reshape(-1, D)[kept]
    assert relative_error(want[None], dst[kept][None]).item() < 0.1
    unit_bits = lambda name: hp.layers[0][name][rows[kept] // BS].tolist()   # noqa: E731
    # a key row's share of its unit's per-channel fp16 scale and zero, a value row's own pair
    pairs = {"k_bits": -(-4 * D // BS), "v_bits": 4}
    expect = sum(packed_width(D, b) + pairs[name] for name in pairs for b in unit_bits(name))
    assert int(nbytes) == expect


@pytest.mark.parametrize("consecutive", [True, False])
def test_copy_blocks_copies_every_tensor_of_the_blocks(consecutive):
    g = torch.Generator().manual_seed(6)
    hp = _pool(4)
    src, dst = ([0, 1], [4, 5]) if consecutive else ([0, 1], [6, 3])
    x = torch.randn(H, 8, D, generator=g)
    _append(hp, torch.tensor(src), 0, 0, x, x)
    hp.copy_blocks(src, dst)
    a = hp.read(0, torch.tensor(src), 0, 2, torch.arange(H)[:, None], torch.arange(8)[None])[0]
    b = hp.read(0, torch.tensor(dst), 0, 2, torch.arange(H)[:, None], torch.arange(8)[None])[0]
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bits", [4, 8, "auto", "budget"])
def test_sealing_on_the_gpu_writes_what_sealing_on_the_host_writes(bits):
    """On a GPU with a pinned pool seal quantizes there and the row-copy kernel writes the units
    (packed rows, pairs, widths) over UVA with no host sync; the errors come back at the step's
    end (QuantEvents.pending). The pool must hold what the host path writes: the same widths, the
    same values read back (Triton's rounding against the reference's: within a code step)."""
    g = torch.Generator().manual_seed(11)
    host, pinned = _pool(bits), HostPool(1, H, D, BS, torch.float32, pin=True, host_kv_bits=bits)
    pinned.grow(blocks=8, tails=3)
    table = torch.tensor([5, 2, 7, 0, 3])
    k, v = torch.randn(H, 19, D, generator=g), torch.randn(H, 19, D, generator=g)
    errors = {"host": [], "gpu": []}
    for lo, hi in ((0, 3), (3, 4), (4, 13), (13, 19)):  # partial, completing (from the tail), multi-block, tail
        _, ev = host.seal(0, table, 1, lo, k[:, lo:hi], v[:, lo:hi])
        errors["host"] += ev.errors
        host.backup(0, table[None], host.tail_units(torch.tensor([1])), torch.tensor([lo]), k[None, :, lo:hi],
                    v[None, :, lo:hi])
        kc, vc = k[:, lo:hi].cuda(), v[:, lo:hi].cuda()
        _, ev = pinned.seal(0, table, 1, lo, kc, vc)
        assert not ev.errors
        errors["gpu"] += torch.cat([e.cpu() for e in ev.pending]).tolist() if ev.pending else []
        pinned.backup(0, table[None].cuda(), pinned.tail_units(torch.tensor([1])).cuda(), torch.tensor([lo]).cuda(),
                      kc[None], vc[None])
        pinned.note_device_writes(torch.device("cuda"))
    torch.cuda.synchronize()
    for prefix in ("k", "v"):
        assert torch.equal(pinned.layers[0][f"{prefix}_bits"], host.layers[0][f"{prefix}_bits"]), prefix
    assert errors["gpu"] == pytest.approx(errors["host"], abs=2e-3)
    want = host.read(0, table, 1, 19 // BS, torch.arange(H)[:, None], torch.arange(19)[None])
    got = pinned.read(0, table, 1, 19 // BS, torch.arange(H)[:, None], torch.arange(19)[None], device="cuda")
    step = {4: 0.5, 8: 0.05, "auto": 0.3, "budget": 0.1}[bits]   # at most about one code of the unit's range
    for w, x in zip(want, got):
        assert (w - x.cpu()).abs().max() <= step * (k.abs().max() + v.abs().max())
        assert torch.equal(w[:, 16:], x.cpu()[:, 16:])            # the tail is exact on both
    keys, _ = pinned.read(0, table, 1, 19 // BS, torch.arange(H)[:, None], torch.arange(19)[None], device="cuda",
                          values=False)
    assert torch.equal(keys, got[0])                              # the keys alone: the same launches' rows
    assert len(errors["gpu"]) == len(errors["host"]) > 0


@pytest.mark.parametrize("together", [False, True], ids=["cpu-grouping", "all-units-at-once"])
@pytest.mark.parametrize("bits", [4, "auto"])
def test_sealing_a_batch_at_once_writes_what_sealing_each_sequence_writes(bits, together):
    """seal_many (a decode step whose sequences fill their blocks together): the same pool, the
    same widths and the same errors as one seal per sequence, tails read in one gather."""
    g = torch.Generator().manual_seed(5)
    one, many = _pool(bits, blocks=16, tails=4), _pool(bits, blocks=16, tails=4)
    tables = [torch.tensor([5, 2, 7]), torch.tensor([1, 9, 3]), torch.tensor([11, 4, 6])]
    k, v = torch.randn(3, H, 11, D, generator=g), torch.randn(3, H, 11, D, generator=g)
    starts = [(0, 3), (0, 7), (0, 2)]       # different tail fills: 3, 3 and 2 old tokens below
    for hp in (one, many):
        for b, (table, (lo, hi)) in enumerate(zip(tables, starts)):
            hp.backup(0, table[None], hp.tail_units(torch.tensor([b])), torch.tensor([lo]), k[None, b, :, lo:hi],
                      v[None, b, :, lo:hi])
    ends = [4, 8, 9]                         # each appends up to and past its block's end
    items = [(tables[b], b, hi, k[b, :, hi:end], v[b, :, hi:end]) for b, ((_, hi), end) in
             enumerate(zip(starts, ends))]
    errors = []
    for item in items:
        _, ev = one.seal(0, *item)
        errors += ev.errors
    _, ev = many.seal_many(0, items, together=together)
    assert sorted(ev.errors) == pytest.approx(sorted(errors)) and len(errors) == 2 * H * 4
    for name, t in one.layers[0].items():
        assert torch.equal(t, many.layers[0][name]), name


@pytest.mark.parametrize("bits", [4, "auto"])
def test_sealing_full_tails_at_every_layer_writes_what_sealing_in_the_append_writes(bits):
    """seal_tails (a planned decode step whose tokens completed their blocks: every token already
    backed up to the tail, sealed after the forward, all layers at once) writes what seal_many
    writes in the append (the block's older tokens from the tail, the step's own from its K/V)."""
    g = torch.Generator().manual_seed(9)
    tables = [torch.tensor([5, 2, 7]), torch.tensor([1, 9, 3]), torch.tensor([11, 4, 6])]
    k, v = torch.randn(2, 3, H, BS, D, generator=g), torch.randn(2, 3, H, BS, D, generator=g)
    pools = []
    for _ in range(2):
        hp = HostPool(2, H, D, BS, torch.float32, pin=False, host_kv_bits=bits)
        hp.grow(blocks=16, tails=4)
        pools.append(hp)
    append, after = pools
    errors = []
    for layer in range(2):
        # the block's first BS - 1 tokens in both pools' tails, the last one by the step
        for hp in pools:
            hp.backup(layer, torch.stack(tables), hp.tail_units(torch.arange(3)), torch.zeros(3, dtype=torch.long),
                      k[layer, :, :, :BS - 1], v[layer, :, :, :BS - 1])
        _, ev = append.seal_many(layer, [(tables[b], b, BS - 1, k[layer, b, :, BS - 1:], v[layer, b, :, BS - 1:])
                                         for b in range(3)])
        errors += ev.errors
        after.backup(layer, torch.stack(tables), after.tail_units(torch.arange(3)), torch.full((3,), BS - 1),
                     k[layer, :, :, BS - 1:], v[layer, :, :, BS - 1:])
    written, ours = after.seal_tails([(int(tables[b][0]), b) for b in range(3)], torch.device("cpu"))
    assert written > 0 and sorted(ours.errors) == pytest.approx(sorted(errors)) and len(errors) == 2 * 2 * 3 * H
    for layer in range(2):
        for name, t in append.layers[layer].items():
            if not name.endswith("_tail"):
                assert torch.equal(t, after.layers[layer][name]), (layer, name)


def test_the_device_indices_of_a_seal_are_staged_once_for_every_layer():
    """_write_units with ``staged`` (seal_tails: one seal for every layer) copies each distinct
    index tensor to the device once and writes what it writes without."""
    from hi_sparse import host_seal
    from hi_sparse.quant_policy import LAYOUT, quantize_roundtrip

    g = torch.Generator().manual_seed(3)
    pools = [HostPool(2, H, D, BS, torch.float32, pin=False, host_kv_bits=4) for _ in range(2)]
    for hp in pools:
        hp.grow(blocks=8, tails=2)
    u = torch.tensor([6, 7, 2, 3])                               # units of blocks 3 and 1
    rows = (u[:, None] * BS + torch.arange(BS)).reshape(-1)
    copies, real = [], host_seal.to_device
    host_seal.to_device = lambda t, dev: (copies.append(t), real(t, dev))[1]
    try:
        staged: dict = {}
        for layer in range(2):
            for prefix in ("k", "v"):
                x = torch.randn(4, BS, D, generator=g)
                packed, scale, zero, _ = quantize_roundtrip(x, 4, LAYOUT[prefix])
                for hp, how in zip(pools, (None, staged)):
                    on = [host_seal._on(t, torch.device("cpu"), how) for t in (u, rows)]
                    host_seal._write_units(hp, [layer], prefix, *on, 4, packed, scale, zero)
    finally:
        host_seal.to_device = real
    assert len(staged) == 2                                       # rows and units, whatever the layout
    assert len(copies) == 2 * 2 * 2 + 2                           # 2 a call without, 2 once with
    for layer in range(2):
        for name, t in pools[0].layers[layer].items():
            assert torch.equal(t, pools[1].layers[layer][name]), (layer, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bits", [4, "auto"])
def test_sealing_a_batch_on_the_gpu_writes_what_the_host_writes(bits):
    """On a GPU the batch's units are quantized in one go: the same widths as the host's, values
    within a code step."""
    g = torch.Generator().manual_seed(7)
    host, pinned = _pool(bits, blocks=16, tails=4), HostPool(1, H, D, BS, torch.float32, pin=True, host_kv_bits=bits)
    pinned.grow(blocks=16, tails=4)
    tables = [torch.tensor([5, 2, 7]), torch.tensor([1, 9, 3]), torch.tensor([11, 4, 6])]
    k, v = torch.randn(3, H, 9, D, generator=g), torch.randn(3, H, 9, D, generator=g)
    for b, table in enumerate(tables):
        host.backup(0, table[None], host.tail_units(torch.tensor([b])), torch.tensor([0]), k[None, b, :, :3],
                    v[None, b, :, :3])
        pinned.backup(0, table[None].cuda(), pinned.tail_units(torch.tensor([b])).cuda(), torch.tensor([0]).cuda(),
                      k[None, b, :, :3].cuda(), v[None, b, :, :3].cuda())
    pinned.note_device_writes(torch.device("cuda"))
    host.seal_many(0, [(t, b, 3, k[b, :, 3:9], v[b, :, 3:9]) for b, t in enumerate(tables)])
    pinned.seal_many(0, [(t, b, 3, k[b, :, 3:9].cuda(), v[b, :, 3:9].cuda()) for b, t in enumerate(tables)])
    pinned.note_device_writes(torch.device("cuda"))
    torch.cuda.synchronize()
    for prefix in ("k", "v"):
        assert torch.equal(pinned.layers[0][f"{prefix}_bits"], host.layers[0][f"{prefix}_bits"]), prefix
    step = {4: 0.5, "auto": 0.3}[bits]
    for b, table in enumerate(tables):
        want = host.read(0, table, b, 2, torch.arange(H)[:, None], torch.arange(8)[None])
        got = pinned.read(0, table, b, 2, torch.arange(H)[:, None], torch.arange(8)[None], device="cuda")
        for w, x in zip(want, got):
            assert (w - x.cpu()).abs().max() <= step * (k.abs().max() + v.abs().max())


def _settled(written: int, ev) -> tuple[int, dict]:
    """Bytes and units by width of a seal, those a graph counted on the device read back."""
    counts = dict(ev.counts)
    for widths, c, nbytes in ev.pending_counts:
        for row, units in zip(nbytes, c.cpu().tolist()):
            for w, size, u in zip(widths, row, units):
                counts[w] = counts.get(w, 0) + u
                written += u * size
    return written, {w: c for w, c in counts.items() if c}


def _units_of_two_widths(g: torch.Generator, L: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (L, n, H, BS, D) of n blocks: head 0's units on a 4-bit grid (every key
    channel and value token spans 0..15), so "auto" takes 4 bits there and more for head 1's
    uniform ones."""
    k, v = (2 * torch.rand(2, L, n, H, BS, D, generator=g) - 1).unbind(0)
    ints = torch.randint(0, 16, (L, n, BS, D), generator=g).float()
    k[:, :, 0], v[:, :, 0] = ints, ints.clone()
    k[:, :, 0, 0], k[:, :, 0, 1] = 0.0, 15.0
    v[:, :, 0, :, 0], v[:, :, 0, :, 1] = 0.0, 15.0
    return k, v


def _back_up_as_decode(hp: HostPool, blocks: list[int], slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
    """Back up k, v (L, n, H, BS, D) into blocks' tails at slots as decode does: a block's first
    tokens, then the token that completes it (a backup of a whole block skips the tails)."""
    dev = k.device
    tables, tails = torch.tensor(blocks, device=dev)[:, None], hp.tail_units(torch.tensor(slots)).to(dev)
    for layer in range(k.shape[0]):
        for lo, hi in ((0, BS - 1), (BS - 1, BS)):
            hp.backup(layer, tables, tails, torch.full((len(blocks),), lo, device=dev), k[layer, :, :, lo:hi],
                      v[layer, :, :, lo:hi])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("streams,move", [(1, "in place"), (4, "in place"), (4, "moved")])
@pytest.mark.parametrize("bits", [4, "auto"])
def test_a_seal_replayed_from_its_graph_writes_what_the_seal_op_by_op_writes(bits, streams, move, monkeypatch):
    """seal_tails with graphs (a pinned pool of one width on a GPU): captured for room for 3
    blocks the first time, replayed after, and after the pool grew in place; captured again once
    it grew out of its reserved space (moved). Every round writes
    what the op-by-op seal writes (same pool bytes, counts, bytes and errors), with new blocks and
    tail slots each round (the replay reads this round's indices, not the capture's) and fewer
    blocks than its room (padded: nothing else written, the padding's errors not counted)."""
    from hi_sparse.host_seal import SealGraph
    monkeypatch.setattr(SealGraph, "STREAMS", streams)      # the layers on up to 4 streams
    if move == "moved":                                     # no address space to spare
        monkeypatch.setattr(pinned, "RESERVE", 1)
        monkeypatch.setattr(pinned, "RESERVE_LEAST", 0)
    g = torch.Generator().manual_seed(11)
    L, dev = 3, torch.device("cuda")
    pools = []
    for _ in range(2):
        hp = HostPool(L, H, D, BS, torch.bfloat16, pin=True, host_kv_bits=bits)
        hp.grow(blocks=16, tails=4)
        pools.append(hp)
    rounds = [([5, 1, 11], [0, 1, 2]), ([2], [2]), ([7, 3], [1, 3]), ([20, 6, 25], [3, 2, 1])]
    where = pools[1].layers[0]["k_packed"].data_ptr()
    widths = set()
    captured = []
    for r, (blocks, slots) in enumerate(rounds):
        if r == 3:               # a pool grown in place keeps its graph; one that outgrew its space moves
            for hp in pools:
                hp.grow(blocks=256)
            kept = pools[1].layers[0]["k_packed"].data_ptr() == where
        n = len(blocks)
        k, v = (t.to(dev, torch.bfloat16) for t in _units_of_two_widths(g, L, n))
        results = []
        for hp, graphs in zip(pools, (False, True)):
            _back_up_as_decode(hp, blocks, slots, k, v)
            hp.note_device_writes(dev)
            written, ev = hp.seal_tails(list(zip(blocks, slots)), dev, graphs=graphs, room=3)
            results.append((*_settled(written, ev), torch.cat([e.reshape(-1).float().cpu() for e in ev.pending])))
        captured.append(pools[1]._seal_graphs[(3 * H, dev)].graph)
        torch.cuda.synchronize()
        (w0, c0, e0), (w1, c1, e1) = results
        assert w0 == w1 > 0 and c0 == c1 and sum(c0.values()) == 2 * L * n * H
        widths |= set(c0)
        assert torch.equal(e0.sort().values, e1.sort().values)
        for layer in range(L):
            for name, t in pools[0].layers[layer].items():
                assert torch.equal(t, pools[1].layers[layer][name]), (r, layer, name)
            for prefix in ("k", "v"):                         # the bits' device copies ("auto")
                mirrors = [hp._bits_on.get((layer, prefix)) for hp in pools]
                assert (mirrors[0] is None) == (mirrors[1] is None) == (bits == 4)
                assert mirrors[0] is None or torch.equal(mirrors[0], mirrors[1])
    # (a pool of several widths makes its bits' device copies again as it grows: a new graph)
    assert kept == (move == "in place") and captured[0] is captured[1] is captured[2]
    assert (captured[3] is captured[2]) == (kept and bits == 4)
    assert widths == {4} if bits == 4 else (len(widths) >= 2 and 4 in widths), widths


def test_pending_errors_are_counted_as_observing_each_one_counts():
    """flush_quant_errors buckets the step's pending errors (device tensors on a GPU) where they
    are and reads back the counts once: the histogram ends as observing every value (values on
    a bound, between bounds and past the last included)."""
    from types import SimpleNamespace

    from easymats import catalogue, telemetry
    from hi_sparse.decode import Decoder

    bounds = catalogue.QUANT_ERROR_BUCKETS
    pending = [torch.tensor([bounds[0], bounds[1] * 0.999, 3.0], dtype=torch.float64),    # exactly on a bound
               torch.tensor([[0.0, bounds[4]], [bounds[4] * 1.01, 1e-9]])]
    want = telemetry.Histogram(bounds)
    for e in torch.cat([p.reshape(-1) for p in pending]).tolist():
        want.observe(e)
    dec = SimpleNamespace(_pending_errors=list(pending), _pending_counts=[],
                          metrics=SimpleNamespace(quant_error=telemetry.Histogram(bounds)))
    Decoder.flush_quant_errors(dec)
    got = dec.metrics.quant_error
    assert got.counts == want.counts and got.sum == pytest.approx(want.sum) and dec._pending_errors == []


@pytest.mark.parametrize("groups", [[[0], [1]], [[0, 1]]], ids=["layer-by-layer", "layers-together"])
@pytest.mark.parametrize("bits", [4, "auto", "budget"])
def test_the_graph_seals_layer_arithmetic_writes_what_the_op_by_op_seal_writes(bits, groups):
    """The body a seal graph records (host_seal._seal_group: indices on the device, a group of
    layers read, quantized and written together, every width chosen there, each unit quantized at
    every width and its own kept, units counted by width), run eagerly on the CPU, one layer a
    group and both layers in one: the same pool bytes, errors and units by width as seal_tails op
    by op."""
    from hi_sparse import host_seal

    g = torch.Generator().manual_seed(4)
    L, blocks, slots = 2, [5, 1, 11], [0, 1, 2]
    n = len(blocks)
    pools = []
    for _ in range(2):
        hp = HostPool(L, H, D, BS, torch.float32, pin=False, host_kv_bits=bits)
        hp.grow(blocks=16, tails=4)
        pools.append(hp)
    k, v = _units_of_two_widths(g, L, n)
    for hp in pools:
        _back_up_as_decode(hp, blocks, slots, k, v)
    written, ev = pools[0].seal_tails(list(zip(blocks, slots)), torch.device("cpu"))
    hp = pools[1]
    units = (torch.tensor(blocks)[:, None] * H + torch.arange(H)).reshape(-1)
    tail = (hp.unit_rows(torch.tensor(slots)[:, None], torch.arange(H)[None])[..., None] + torch.arange(BS)).reshape(-1)
    unit_rows = (units[:, None] * BS + torch.arange(BS)).reshape(-1)
    errors, counts = [], []
    ours = sum(host_seal._seal_group(hp, layers, tail, units, unit_rows, errors, counts) for layers in groups)
    assert torch.equal(torch.cat(errors).flatten().sort().values, torch.tensor(ev.errors).sort().values)
    if bits == 4:
        assert ours == written and not counts
    else:
        by_width = torch.stack(counts).view(-1, 2, len(hp.widths)).sum(0)
        got = {w: int(c) for w, c in zip(hp.widths, by_width.sum(0)) if c}
        assert got == ev.counts and len(got) >= 2
        nbytes = host_seal.unit_bytes(hp)
        assert sum(int(c) * b for row_c, row_b in zip(by_width, nbytes) for c, b in zip(row_c, row_b)) == written
    for layer in range(L):
        for name, t in pools[0].layers[layer].items():
            assert torch.equal(t, hp.layers[layer][name]), (layer, name)


@pytest.mark.parametrize("bits", [None, 4])
def test_a_pool_grows_in_place_until_it_outgrows_its_reserved_space(bits, monkeypatch):
    """Each tensor lives in an address range reserved for it (pinned.Space, RESERVE times its
    size): a growth keeps its address (a captured step keeps reading and writing it) and its
    contents; one past the reservation moves it, the contents kept as well."""
    monkeypatch.setattr(pinned, "RESERVE", 4)
    monkeypatch.setattr(pinned, "RESERVE_LEAST", 0)
    hp = _pool(bits, blocks=8)
    def head(t):                                        # the first bytes (up to 64) of a tensor
        raw = t.view(torch.uint8).view(-1)
        return raw[:min(64, raw.numel())]

    wrote = {}
    for name, t in hp.layers[0].items():
        wrote[name] = torch.arange(head(t).numel(), dtype=torch.uint8)
        head(t).copy_(wrote[name])
    where = {name: t.data_ptr() for name, t in hp.layers[0].items()}
    assert not hp._moves(24, 3)
    hp.grow(blocks=24)                                  # 3x: within the reservation
    assert {name: t.data_ptr() for name, t in hp.layers[0].items()} == where
    assert hp.layers[0]["k_tail" if bits else "k"].shape[0] == (3 if bits else 24) * H * BS
    assert hp._moves(4096, 3)
    hp.grow(blocks=4096)                                # past it (at least a page each)
    moved = {name for name, t in hp.layers[0].items() if t.data_ptr() != where[name]}
    assert moved == {name for name in where if not name.endswith("tail")}, moved
    for name, t in hp.layers[0].items():
        assert torch.equal(head(t)[:len(wrote[name])], wrote[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("bits", [None, 4])
def test_the_next_growth_finds_its_pages_locked_ahead(bits, monkeypatch):
    """HostPool.lock_ahead page-locks, on a thread, what a growth to n blocks takes in place, and
    makes its views there: that growth (in a decode step) registers nothing and takes those views;
    one past n registers only the rest. Every page a view covers is locked (the GPU reads it over
    UVA)."""
    calls = []
    real = pinned._register
    monkeypatch.setattr(pinned, "_register", lambda ptr, size: (calls.append(size), real(ptr, size)))
    hp = HostPool(2, H, D, BS, torch.float16, pin=True, host_kv_bits=bits)
    hp.grow(blocks=64, tails=3)
    made = len(calls)
    hp.lock_ahead(80)
    hp.locking.result()
    ahead = len(calls) - made
    assert ahead >= 4                                        # every layer's K and V rows at least
    ready = {(i, name): space.ready[2] for i, spaces in enumerate(hp._spaces) for name, space in spaces.items()
             if space is not None and space.ready is not None}
    hp.grow(blocks=80)
    assert len(calls) == made + ahead                        # nothing left to lock in the step
    assert len(ready) >= 4 and all(hp.layers[i][name] is t for (i, name), t in ready.items())
    hp.grow(blocks=2000)                                     # past what was locked ahead (whole pages)
    assert len(calls) > made + ahead
    for spaces, store in zip(hp._spaces, hp.layers):
        for name, t in store.items():
            space = spaces[name]
            assert space.locked >= t.numel() * t.element_size(), name
            assert t.data_ptr() == space.base.data_ptr()     # grown in place
    k = hp.layers[0]["k" if bits is None else "k_packed"]
    assert k.is_pinned()


@pytest.mark.parametrize("bits", [4, "auto"])
def test_a_seal_reads_the_rows_the_hot_buffers_hold_there_and_the_rest_from_the_tails(bits):
    """host_seal.HotRows: a row a layer's hot buffer holds (at whatever slot its slot -> token
    table says) is read there, the others from the float tail. Blocks whose held rows have garbage in their
    tails seal to what true tails seal to: op by op (seal_tails) and in the body a seal graph
    records (_seal_group: layer 0 alone, then both layers together, in another order), both run
    here on the CPU."""
    from hi_sparse import host_seal

    g = torch.Generator().manual_seed(7)
    L, blocks, slots = 2, [5, 1, 11], [0, 1, 2]
    n, R, S = len(blocks), 3, 2 * BS + 5
    seq_rows, starts = [2, 0, 1], [3 * BS, 0, 7 * BS]          # each item's sequence row, block start
    k, v = _units_of_two_widths(g, L, n)                         # (L, n, H, BS, D)
    held = torch.rand(L, n, H, BS, generator=g) < 0.6
    assert held.any() and not held.all()
    layers = []
    for layer in range(L):
        kh, vh = torch.randn(2, R, H, S, D, generator=g).unbind(0)   # other slots hold other tokens
        slot_token = torch.randint(-1, 4 * BS, (R * H, S + 1), generator=g)
        slot_token[(slot_token >= 0) & (slot_token < 8 * BS)] += 8 * BS    # (none of the sealed blocks')
        slot_token[:, S] = -1                                              # the spill column
        for i, (row, start) in enumerate(zip(seq_rows, starts)):
            for h in range(H):
                free = torch.randperm(S, generator=g)
                for t in held[layer, i, h].nonzero().flatten().tolist():
                    slot = int(free[t])
                    kh[row, h, slot], vh[row, h, slot] = k[layer, i, h, t], v[layer, i, h, t]
                    slot_token[row * H + h, slot] = start + t
        layers.append((kh, vh, slot_token))
    hot = host_seal.HotRows(layers, seq_rows, starts)
    noise = 50 + torch.rand(2, *k.shape, generator=g)
    bad_k, bad_v = (torch.where(held[..., None], z, x) for z, x in zip(noise, (k, v)))
    pools = [HostPool(L, H, D, BS, torch.float32, pin=False, host_kv_bits=bits) for _ in range(3)]
    for hp, (kk, vv) in zip(pools, [(k, v), (bad_k, bad_v), (bad_k, bad_v)]):
        hp.grow(blocks=16, tails=4)
        _back_up_as_decode(hp, blocks, slots, kk, vv)
    items, cpu = list(zip(blocks, slots)), torch.device("cpu")
    written, ev = pools[0].seal_tails(items, cpu)
    got, got_ev = pools[1].seal_tails(items, cpu, hot=hot)
    assert got == written and sorted(got_ev.errors) == sorted(ev.errors) and got_ev.counts == ev.counts
    hp = pools[2]                                                # the graph's body, eagerly
    units = (torch.tensor(blocks)[:, None] * H + torch.arange(H)).reshape(-1)
    tail = (hp.unit_rows(torch.tensor(slots)[:, None], torch.arange(H)[None])[..., None] + torch.arange(BS)).reshape(-1)
    unit_rows = (units[:, None] * BS + torch.arange(BS)).reshape(-1)
    at = hot.where(H)
    host_seal._seal_group(hp, [0], tail, units, unit_rows, [], [], ([layers[0]], *at))
    host_seal._seal_group(hp, [1, 0], tail, units, unit_rows, [], [], ([layers[1], layers[0]], *at))
    for layer in range(L):
        for name, t in pools[0].layers[layer].items():
            if not name.endswith("_tail"):                       # (the tails differ: garbage where held)
                assert torch.equal(t, pools[1].layers[layer][name]), (layer, name)
                assert torch.equal(t, hp.layers[layer][name]), (layer, name)
