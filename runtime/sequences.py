"""Sequences and the rows they own: add, fork, free, resume within grace, consecutive batches.

A sequence owns one row in every layer (layers.py) and, with a quantized pool, one float tail
slot. Freed sequences keep their metadata for ``recycle_grace_s`` so that a quick resume takes
back their host blocks (block_pool.py's reclaim); their row goes back at once (a resumed
sequence starts with a cold hot buffer in a new row). A batch decodes from consecutive rows in
the order of its ids; :meth:`SequenceTable.make_consecutive` moves its sequences there first
when they are not (forks, sequences added at different times).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .config import HiSparseConfig
from .host_pool import HostPool
from .host_seal import to_device
from .hot_buffer import HotBufferState
from .layers import LayerRows
from .page_table import PageTable, SequencePages
from .row_bank import RowBank, RowView


@dataclass(eq=False)
class Sequence:
    seq_id: int
    row: int
    first_token: int                 # positions before it are left padding
    tail_slot: int                   # the float tail block of a quantized pool (-1: none)
    lengths: list[int]               # tokens held per layer, padding included
    queries_kept: list[int]          # recent decode queries held per layer (recalibration)
    hot: list[HotBufferState]        # per layer: a view of the layer's HotBufferBank row
    banks: list[RowBank]
    # per layer: the last decode step's selection of its batch (B*Hkv, K) and this sequence's rows
    last_selection: dict[int, tuple[torch.Tensor, int, int]] = field(default_factory=dict)
    saved: list[dict[str, torch.Tensor]] | None = None   # the bank rows of a freed sequence (resume)
    block_table: torch.Tensor | None = None              # cached from the page table at table_version
    table_version: int = -1

    # per layer, views of this sequence's row in the layer's RowBank: key bounds per block
    # (Hkv, NB, D), per super-block (Hkv, NS, D), anchors (Hkv, A) and their probabilities,
    # recent queries (R, Hq, D)
    kmin = property(lambda self: RowView(self.banks, "kmin", self))
    kmax = property(lambda self: RowView(self.banks, "kmax", self))
    smin = property(lambda self: RowView(self.banks, "smin", self))
    smax = property(lambda self: RowView(self.banks, "smax", self))
    anchors = property(lambda self: RowView(self.banks, "anchors", self))
    anchor_p = property(lambda self: RowView(self.banks, "anchor_p", self))
    queries = property(lambda self: RowView(self.banks, "queries", self))

    @property
    def holes(self) -> torch.Tensor:
        """(NB,) bool: the logical blocks streaming mode overwrote."""
        return self.banks[0].t["holes"][self.row]

    def selection(self, layer: int) -> torch.Tensor | None:
        """The token positions (Hkv, K), -1 padded, selected at ``layer`` by the last decode step."""
        got = self.last_selection.get(layer)
        return None if got is None else got[0][got[1]:got[2]]

    @property
    def length(self) -> int:
        """Tokens held (the most of any layer: between forward passes they agree)."""
        return max(self.lengths)


class SequenceTable:
    """The live sequences by id, the freed ones within grace, free rows and tail slots."""

    def __init__(self, cfg: HiSparseConfig, layers: list[LayerRows], host: HostPool, pages: PageTable) -> None:
        self.cfg, self.layers, self.host, self.pages = cfg, layers, host, pages
        self.live: dict[int, Sequence] = {}
        self._removed: dict[int, tuple[float, Sequence, SequencePages]] = {}
        self._free_rows: list[int] = []
        self._free_tails: list[int] = []
        self._next_id = 0

    def get(self, seq_id: int) -> Sequence:
        try:
            return self.live[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence id {seq_id}: add it with add_sequences() first "
                             "(or it was freed)") from None

    def add(self, pads: list[int]) -> list[Sequence]:
        """New sequences with these left paddings, in consecutive rows."""
        out = []
        for row, pad in zip(self.take_rows(len(pads)), pads):
            seq_id = self._next_id
            self._next_id += 1
            self.pages.add_sequence(seq_id)
            self.live[seq_id] = seq = self._new(seq_id, row, pad)
            out.append(seq)
        return out

    def _new(self, seq_id: int, row: int, pad: int, reset: bool = True) -> Sequence:
        tail = -1
        if self.host.quantized:
            if not self._free_tails:
                n = self.host.num_tail
                self.host.grow(tails=max(4, 2 * n))
                self._free_tails.extend(range(n, self.host.num_tail))
            tail = self._free_tails.pop(0)
        if reset:                        # (a fork copies its row over instead)
            for layer in self.layers:
                layer.reset(row)
        L = len(self.layers)
        return Sequence(seq_id=seq_id, row=row, first_token=pad, tail_slot=tail, lengths=[0] * L,
                        queries_kept=[0] * L, hot=[layer.hot.rows(row) for layer in self.layers],
                        banks=[layer.bank for layer in self.layers])

    def fork(self, src: Sequence, copies: int, allocate) -> list[Sequence]:
        """``copies`` new sequences in consecutive rows that continue from ``src`` as it is now.
        They share its full host blocks (copy on write: a full block is never written again);
        each gets its own block for a partly filled last one (``allocate(seq, n)`` gives n
        blocks; an unquantized pool copies its rows, a quantized pool's fills from the copy's
        own tail), tail, bank row and hot buffer."""
        pages = self.pages.seqs[src.seq_id]
        partial = pages.blocks[pages.num_tokens // self.cfg.cache_block_size:]     # 0 or 1 block
        out = []
        rows = self.take_rows(copies)
        for layer in self.layers:
            layer.copy_row(src.row, rows[0], copies)
        for row in rows:
            seq_id = self._next_id
            self._next_id += 1
            self.pages.add_sequence(seq_id)
            self.live[seq_id] = s = self._new(seq_id, row, src.first_token, reset=False)
            self.pages.share(seq_id, src.seq_id)
            own = allocate(s, len(partial)) if partial else []
            self.pages.extend(seq_id, pages.num_tokens % self.cfg.cache_block_size, own)
            if not self.host.quantized:
                self.host.copy_blocks([b.block_id for b in partial], [b.block_id for b in own])
            if src.tail_slot >= 0:
                self.host.copy_tail(src.tail_slot, s.tail_slot)
            s.lengths, s.queries_kept = list(src.lengths), list(src.queries_kept)
            out.append(s)
        return out

    def take_rows(self, n: int) -> list[int]:
        """n free consecutive rows (every layer grows when no free run is long enough)."""
        free = sorted(self._free_rows)
        for i in range(len(free) - n + 1):
            if free[i + n - 1] - free[i] == n - 1:
                rows = free[i:i + n]
                self._free_rows = [r for r in self._free_rows if r not in rows]
                return rows
        start = self.layers[0].num_rows
        cap = max(start + n, 2 * start)
        for layer in self.layers:
            layer.grow_rows(cap)
        self._free_rows.extend(range(start + n, cap))
        return list(range(start, start + n))

    def make_consecutive(self, seqs: list[Sequence]) -> bool:
        """Move the sequences into consecutive rows in this order if they are not; True if moved."""
        r0 = seqs[0].row
        if all(s.row == r0 + i for i, s in enumerate(seqs)):
            return False
        old = [s.row for s in seqs]
        self._free_rows.extend(old)            # their own rows may form the run they move to
        new = self.take_rows(len(seqs))
        staged = {}
        for layer in self.layers:              # copy out first: a new row may be another's old row
            staged[layer.index] = [(layer.bank.save(r), layer.k[r].clone(), layer.v[r].clone()) for r in old]
        for s, row in zip(seqs, new):
            s.row = row
        for layer in self.layers:
            for s, (bank_row, k, v) in zip(seqs, staged[layer.index]):
                layer.bank.load(s.row, bank_row)
                layer.k[s.row].copy_(k)
                layer.v[s.row].copy_(v)
            self._move_hot(layer, old, new)
        for s in seqs:
            s.hot = [layer.hot.rows(s.row) for layer in self.layers]
        for r in set(old) - set(new):
            for layer in self.layers:
                layer.reset(r)
        return True

    @staticmethod
    def _move_hot(layer: LayerRows, old: list[int], new: list[int]) -> None:
        """Hot-buffer LRU state of rows old to rows new (all at once: they may overlap)."""
        H = layer.hot.num_heads
        src = to_device((torch.tensor(old)[:, None] * H + torch.arange(H)).reshape(-1), layer.device)
        dst = to_device((torch.tensor(new)[:, None] * H + torch.arange(H)).reshape(-1), layer.device)
        for t in layer.hot.buffers():
            t.index_copy_(0, dst, t.index_select(0, src))

    def free(self, seq_ids: list[int]) -> None:
        """Release sequences; their host blocks stay reclaimable for recycle_grace_s (resume)."""
        now = time.monotonic()
        for seq_id in seq_ids:
            s = self.get(seq_id)
            del self.live[seq_id]
            pages = self.pages.remove(seq_id)
            self._free_rows.append(s.row)
            s.saved = [layer.bank.save(s.row) for layer in self.layers]  # the row goes back; metadata is kept
            for layer in self.layers:
                layer.reset(s.row)
            s.hot = []  # device slots go back with the row; a resumed sequence starts cold
            self._removed[seq_id] = (now, s, pages)
        self.expire(now)

    def resume(self, seq_id: int) -> bool:
        """Take back a freed sequence within its grace period (its blocks are reclaimed); False
        when it is too late (the blocks were recycled): the caller then re-prefills."""
        self.expire(time.monotonic())
        entry = self._removed.pop(seq_id, None)
        if entry is None:
            return False
        _, s, pages = entry
        if not self.pages.restore(seq_id, pages):
            self._release_tail(s)
            return False
        s.row = self.take_rows(1)[0]
        for layer, saved in zip(self.layers, s.saved or []):
            layer.reset(s.row)
            layer.make_room(s.length, self.cfg)
            layer.bank.load(s.row, saved)
        s.saved = None
        s.hot = [layer.hot.rows(s.row) for layer in self.layers]
        s.table_version = -1
        self.live[seq_id] = s
        return True

    def expire(self, now: float) -> None:
        """Forget freed sequences whose grace period is over (their tail slots go back)."""
        grace = self.cfg.recycle_grace_s
        for seq_id in [k for k, (t, _, _) in self._removed.items() if now - t > grace]:
            self._release_tail(self._removed.pop(seq_id)[1])

    def _release_tail(self, s: Sequence) -> None:
        if s.tail_slot >= 0:
            self._free_tails.append(s.tail_slot)
            s.tail_slot = -1
