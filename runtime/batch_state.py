"""A batch's device state for the decode step (decode.py): block tables, tail units, first
positions, every body's per-layer positions and LRU clock, and the batch's graphs, in fixed
buffers a captured step keeps the addresses of; and :func:`upload`, the host -> device copy that
does not wait for the device; the reference of a step's swap-in rows (:func:`swap_rows`)."""

from __future__ import annotations

import torch

from .batch_step import GraphRunner
from .host_pool import HostPool
from .host_seal import to_device
from .layers import KVShape
from .page_table import PageTable
from .sequences import Sequence

APPEND, ATTEND = 0, 1    # the two bodies of a layer's decode step: each reads its own positions and clock
WINDOW = 2               # beside them in Batch.positions: the attend's first window block (selection blocks)


class Batch:
    """Device state of one batch of sequences in consecutive rows, on one device: block tables
    (refreshed in place: a captured graph keeps their addresses), tail units, first positions,
    per-layer positions and LRU clock of each body (APPEND, ATTEND: a whole-step graph holds both
    bodies of every layer), and the batch's graphs (per layer, and of a whole step: step_graph.py)."""

    def __init__(self, seqs: list[Sequence], device: torch.device, shape: KVShape, max_seq_len: int,
                 graphs: bool, host: HostPool, window: int, select_block: int) -> None:
        B, H = len(seqs), shape.num_kv_heads
        self.seq_ids = tuple(s.seq_id for s in seqs)
        self.first_row, self.size = seqs[0].row, B
        self.rows = slice(self.first_row, self.first_row + B)
        self.tables = torch.full((B, -(-max_seq_len // shape.block_size)), -1, dtype=torch.int64, device=device)
        self._uploaded: list | None = None     # per row: (its pages, version, edits, blocks) in tables
        firsts = [s.first_token for s in seqs]
        self.first = to_device(torch.tensor(firsts, dtype=torch.int64), device)              # (B,)
        self.first_lo = min(firsts)
        heads = torch.arange(B * H, device=device)
        self.seq_of_head, self.kv_head = (heads // H)[:, None], (heads % H)[:, None]        # (B*H, 1)
        self.head_rows = ((self.first_row * H + heads) * shape.slots)[:, None]             # first slot's row
        # what the decode step reads per (sequence, KV head) row, gathered once per batch: the
        # captured step holds no indexing for them
        self.first_of_head = self.first[self.seq_of_head]                                   # (B*H, 1)
        tails = to_device(torch.tensor([s.tail_slot for s in seqs], dtype=torch.int64), device)
        self.tail_units = host.tail_units(tails)                                            # (B, H)
        # per body and layer: each sequence's first new position (append) or token count
        # (attend), once per KV head (so the step reads per-sequence and per-row views of one
        # tensor), and the first LRU stamp; third, the attend's first window block, worked out on
        # the host with the positions (no kernels of its own in the step)
        self.window, self.select_block = window, select_block
        self.positions = torch.zeros(3, shape.num_layers, B, H, dtype=torch.int64, device=device)
        self.clock = torch.zeros(2, shape.num_layers, dtype=torch.int64, device=device)
        self.runner = GraphRunner(graphs)
        self.whole: dict = {}                 # the whole-step graph's state (step_graph.py)

    def starts(self, layer: int, body: int) -> torch.Tensor:
        """This step's position of each sequence at ``layer`` for ``body``: (B,) (a view)."""
        return self.positions[body, layer, :, 0]

    def window_blocks(self, layer: int) -> torch.Tensor:
        """The attend's first window block of each sequence at ``layer``: (B,) (a view), the
        selection block of position n - window rounded up, at least 0 (n the token count)."""
        return self.positions[WINDOW, layer, :, 0]

    def _first_window_block(self, n: torch.Tensor) -> torch.Tensor:
        ps = self.select_block
        return torch.div(n - (self.window - ps + 1), ps, rounding_mode="floor").clamp(min=0)

    def head_starts(self, layer: int, body: int) -> torch.Tensor:
        """The same per (sequence, KV head) row: (B*H, 1) (a view)."""
        return self.positions[body, layer].view(-1, 1)

    def refresh_tables(self, pages: PageTable) -> None:
        """Block tables into the fixed buffer, when a sequence's page list changed: only the
        columns of blocks appended since the last refresh (every sequence of a batch gains a block
        on the same step, one column at 128K instead of the ~2,000 of a whole table), every
        column from the first when a list changed otherwise (a fork's shared prefix, a hole, a
        restore)."""
        now = [pages.seqs[i] for i in self.seq_ids]
        seen = self._uploaded
        if seen is not None and all(p is q and p.version == v for p, (q, v, _, _) in zip(now, seen)):
            return
        lo = 0
        if seen is not None and all(p is q and p.edits == e for p, (q, _, e, _) in zip(now, seen)):
            lo = min(n for p, (_, v, _, n) in zip(now, seen) if p.version != v)
        hi = max(len(p.blocks) for p in now)
        if hi > lo:
            cols = [[-1 if b is None else b.block_id for b in p.blocks[lo:hi]] for p in now]
            upload(self.tables[:, lo:hi], torch.tensor([c + [-1] * (hi - lo - len(c)) for c in cols],
                                                       dtype=torch.int64))
        self._uploaded = [(p, p.version, p.edits, len(p.blocks)) for p in now]

    def set(self, layer: int, body: int, positions: list[int], clock: int) -> None:
        """This step's positions (one per sequence) and first LRU stamp of ``body`` at ``layer``."""
        rows = [(body, positions)]
        if body == ATTEND:
            rows.append((WINDOW, self._first_window_block(torch.tensor(positions)).tolist()))
        for at, values in rows:
            if len(set(values)) == 1:
                self.positions[at, layer].fill_(values[0])  # a fill launches no host -> device copy
            else:
                self.positions[at, layer].copy_(torch.tensor(values)[:, None].expand(self.positions.shape[2:]))
        self.clock[body, layer].fill_(clock)

    def set_all(self, positions: torch.Tensor, clocks: torch.Tensor) -> None:
        """Every body's and layer's positions (2, L, B) and clocks (2, L) (host int64) in two copies
        (the window blocks worked out from the attend's positions on the way)."""
        whole = torch.cat([positions, self._first_window_block(positions[ATTEND])[None]])
        upload(self.positions, whole[..., None].expand(self.positions.shape))
        upload(self.clock, clocks)


def upload(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src (a host tensor) in the current stream's order, without the host waiting for the
    device: to a GPU through pinned memory (the caching host allocator keeps it until the copy has
    run), so a step planned while the one before it runs does not wait for it."""
    if not dst.is_cuda:
        dst.copy_(src)
        return
    staged = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
    staged.copy_(src)
    dst.copy_(staged, non_blocking=True)


def tail_block(n: torch.Tensor, block_size: int) -> torch.Tensor:
    """The block a decode step reads from a quantized pool's float tail, of a sequence of n
    tokens: its last token's. The step whose token completes a block reads that block from the
    tail too (the token is backed up there as well): a planned step seals it after its forward
    (decode.Decoder.finish), a step layer by layer before (in the append), and both read the
    same floats."""
    return torch.div(n - 1, block_size, rounding_mode="floor")


def swap_rows(host: HostPool, batch: Batch, both: torch.Tensor, miss: torch.Tensor, loaded: torch.Tensor,
              slots: torch.Tensor, prefetch_slots: torch.Tensor, n_head: torch.Tensor,
              tail: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The host rows (main pool, float tail or -1) and hot-buffer rows of a step's swap-in, flat
    (the reference of kernels/swap_in.py ``swap_plan``)."""
    bs = host.block_size
    tokens = both.clamp(min=0)                                      # the selection, then the prefetch
    take = torch.cat([miss, loaded], 1)
    dst = (batch.head_rows + torch.cat([slots, prefetch_slots], 1)).reshape(-1)
    logical, offset = tokens // bs, tokens % bs
    main = host.block_rows(batch.tables, batch.kv_head, logical, offset, seq=batch.seq_of_head)
    if tail is None:
        return torch.where(take, main, -1).reshape(-1), None, dst
    in_tail = logical >= tail_block(n_head, bs)                     # the last token's block: the float tail
    src = torch.where(take & ~in_tail, main, -1)
    return src.reshape(-1), torch.where(take & in_tail, tail + offset, -1).reshape(-1), dst
