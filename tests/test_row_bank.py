"""Row bank: one tensor per kind of per-row metadata; rows and per-row dims grow with contents kept."""

import torch

from hi_sparse.row_bank import RowBank, RowView


def _bank(rows: int = 2) -> RowBank:
    bank = RowBank("cpu")
    bank.add("bounds", (2, 0, 3), torch.float32, float("inf"))
    bank.add("anchors", (2, 4), torch.int64, -1)
    bank.grow_rows(rows)
    return bank


def test_growth_keeps_contents_and_fills_what_is_new():
    bank = _bank()
    bank.grow("bounds", 1, 5)
    bank.t["bounds"][1, :, :2] = 7.0
    bank.grow_rows(4)
    bank.grow("bounds", 1, 8)
    assert bank.t["bounds"].shape == (4, 2, 8, 3) and bank.size("bounds", 1) == 8
    assert (bank.t["bounds"][1, :, :2] == 7.0).all() and torch.isinf(bank.t["bounds"][1, :, 2:]).all()
    assert torch.isinf(bank.t["bounds"][2:]).all() and (bank.t["anchors"][2:] == -1).all()
    bank.grow("bounds", 1, 4)                        # never shrinks
    assert bank.size("bounds", 1) == 8


def test_reset_copy_save_and_load_a_row():
    bank = _bank(3)
    bank.grow("bounds", 1, 2)
    bank.t["anchors"][0] = torch.arange(8).view(2, 4)
    bank.t["bounds"][0] = 1.5
    saved = bank.save(0)
    bank.copy_row(0, 2)
    assert torch.equal(bank.t["anchors"][2], bank.t["anchors"][0])
    bank.reset(0)
    assert (bank.t["anchors"][0] == -1).all() and torch.isinf(bank.t["bounds"][0]).all()
    bank.grow("bounds", 1, 6)                        # the bank grew while the row was saved
    bank.load(1, saved)
    assert torch.equal(bank.t["anchors"][1], torch.arange(8).view(2, 4))
    assert (bank.t["bounds"][1, :, :2] == 1.5).all() and torch.isinf(bank.t["bounds"][1, :, 2:]).all()
    assert bank.memory_bytes() == sum(t.numel() * t.element_size() for t in bank.t.values())


def test_a_row_view_reads_and_writes_one_sequence_s_row_in_each_layer():
    banks = [_bank(), _bank()]

    class Seq:
        row = 1

    view = RowView(banks, "anchors", Seq())
    view[1] = torch.full((2, 4), 5)
    assert (banks[1].t["anchors"][1] == 5).all() and (banks[0].t["anchors"][1] == -1).all()
    assert len(view) == 2 and [int(a.sum()) for a in view] == [-8, 40]


def test_a_staged_growth_is_seen_in_a_staged_view_only_and_taken_by_the_growth():
    """A growth made ahead (for a step captured on another thread): the staged tensor is filled,
    shown only in a staged_view of the thread that enters it, and the growth to its size takes it
    with the contents as they are then; a growth to another size, or new rows, drop it."""
    import threading

    from hi_sparse.row_bank import staged_view

    bank = _bank()
    bank.grow("bounds", 1, 2)
    bank.stage("bounds", 1, 6)
    staged = bank._staged["bounds"]
    bank.stage("bounds", 1, 6)                                  # kept: the same size
    assert bank._staged["bounds"] is staged and bool((staged == float("inf")).all())
    bank.t["bounds"][0, :, :2] = 3.0                           # written after staging: copied at the growth
    seen: dict = {}
    with staged_view():
        assert bank.t["bounds"] is staged and bank.size("bounds", 1) == 6
        other = threading.Thread(target=lambda: seen.update(t=bank.t["bounds"], n=bank.size("bounds", 1)))
        other.start()
        other.join()
    assert seen["t"] is not staged and seen["n"] == 2 and bank.size("bounds", 1) == 2
    bank.grow("bounds", 1, 6)
    assert bank.t["bounds"] is staged and not bank._staged
    assert bool((staged[0, :, :2] == 3.0).all()) and bool((staged[:, :, 2:] == float("inf")).all())
    bank.stage("bounds", 1, 12)
    bank.grow("bounds", 1, 10)                                  # another size: a tensor of its own
    assert bank.t["bounds"].shape[2] == 10 and not bank._staged
    bank.stage("bounds", 1, 20)
    bank.grow_rows(3)
    assert not bank._staged


def test_fills_together_make_what_torch_full_makes_in_a_few_ops():
    """row_bank.full inside fills_together (a capture ahead's staging of every layer's banks):
    each tensor holds what torch.full gives it, once the outermost context ends; the fills are a
    few ops for all (by dtype and value), not one a tensor; outside, full fills at once."""
    from torch.profiler import ProfilerActivity, profile

    from hi_sparse.row_bank import fills_together, full

    kinds = [((3, 0, 4), float("inf"), torch.float32), ((3, 5), float("-inf"), torch.bfloat16),
             ((3, 2, 4), -1, torch.int64), ((3, 7), 0.0, torch.float32), ((3, 6), False, torch.bool),
             ((3, 6), True, torch.bool), ((3, 9), -1.0, torch.float32), ((3, 4), 2, torch.int32)]
    made = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with fills_together():
            for _ in range(32):                                     # a layer's kinds, 32 layers
                with fills_together():                              # (inner: filled at the outer end)
                    made += [(full(shape, fill, dtype=dtype, device="cpu"), fill) for shape, fill, dtype in kinds]
    for t, fill in made:
        want = torch.full(t.shape, fill, dtype=t.dtype)
        assert t.dtype == want.dtype and torch.equal(t, want), (t.dtype, fill)
    ops = [e.key for e in prof.key_averages() if "fill" in e.key or "_foreach" in e.key]
    calls = sum(e.count for e in prof.key_averages() if e.key in ("aten::fill_", "aten::_foreach_zero_",
                                                                  "aten::_foreach_add_"))
    assert calls <= 2 * len(kinds) + 32, (calls, ops)               # 32 for the 32 True bool tensors
    t = full((2, 3), 5, dtype=torch.int64, device="cpu")
    assert torch.equal(t, torch.full((2, 3), 5))


class _Replays:
    """Stands in for the CUDA graph of a GrowthCopies (a CPU has none): what a replay does, the
    recorded copies, run when replayed; ``count`` the replays."""

    def __init__(self, copies) -> None:
        self.copies, self.count = copies, 0

    def replay(self) -> None:
        self.count += 1
        self.copies.run()


def test_a_staged_growths_copies_are_recorded_and_made_in_one_replay_when_the_growth_is_the_staged_one():
    """Stagings inside GrowthCopies.recording() note the copies their growths will make (a bank's
    kinds, a hot buffer's token map); growths inside growth_copies() defer theirs to the block's
    end, where the recorded ones are made by one replay of the graph (here a stand-in) with the
    contents as they are then, and no copy is made twice; growths that are not the recorded ones
    (new rows dropped the staging) copy one by one. Outside a block a growth copies at once."""
    from hi_sparse.hot_buffer import HotBufferBank
    from hi_sparse.row_bank import GrowthCopies, growth_copies

    def make():
        bank, hot = _bank(), HotBufferBank(2, 4, rows=2, token_capacity=8)
        bank.grow("bounds", 1, 2)
        copies = GrowthCopies()
        with copies.recording():
            bank.stage("bounds", 1, 6)
            hot.ensure_tokens(100, align=lambda n: 160, staged=True)
        bank.stage("anchors", 1, 8)                              # not recorded: outside recording()
        bank.t["bounds"][0, :, :2] = 3.0                         # written after the staging
        hot.token_slot_s[:, 3] = 1
        return bank, hot, copies

    bank, hot, copies = make()
    assert [(d.shape, s.shape, n) for d, s, n in copies.copies] == [
        ((2, 2, 6, 3), (2, 2, 2, 3), 2), ((4, 161), (4, 65), 1)]
    copies.graph = stand_in = _Replays(copies)
    with growth_copies(copies) as grown:
        bank.grow("bounds", 1, 6)
        hot.ensure_tokens(100, align=lambda n: 160)
        assert not bool((bank.t["bounds"][0, :, :2] == 3.0).any())    # deferred to the block's end
    assert len(grown) == 2 and stand_in.count == 1 and copies.replayed and copies.graph is None
    assert bool((bank.t["bounds"][0, :, :2] == 3.0).all()) and bool((bank.t["bounds"][:, :, 2:] == float("inf")).all())
    assert bool((hot.token_slot_s[:, 3] == 1).all()) and bool((hot.token_slot_s[:, 65:] == -1).all())

    bank, hot, copies = make()
    copies.graph = stand_in = _Replays(copies)
    bank.grow_rows(3)                                           # drops the staged bounds: a growth of its own
    with growth_copies(copies):
        bank.grow("bounds", 1, 6)
        hot.ensure_tokens(100, align=lambda n: 160)
    assert stand_in.count == 0 and not copies.replayed
    assert bool((bank.t["bounds"][0, :, :2] == 3.0).all()) and bool((hot.token_slot_s[:, 3] == 1).all())

    bank.grow("bounds", 1, 12)                                  # outside a block: at once
    assert bank.t["bounds"].shape[2] == 12 and bool((bank.t["bounds"][0, :, :2] == 3.0).all())
