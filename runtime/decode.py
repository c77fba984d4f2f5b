"""The append and the decode step: one path for every batch, graph-capturable, eager on the CPU.

A call appends to (or attends for) B sequences at one layer. Host-side bookkeeping runs first:
pages, the quantization of blocks the new tokens complete, bank growth, the batch's rows made
consecutive, its per-sequence positions and the LRU clock set into device tensors. Then a
*body* does the device work, every shape known on the host and every step-to-step value read
from device tensors, so the graph runner (batch_step.py) can capture and replay a decode body:

- :func:`append_body`: back the new tokens up into the host pool, widen the key bounds, make
  them hot (most recently used), score them as anchors;
- :func:`attend_body`: block bounds -> selection (window + anchors + ranked blocks) -> hot
  buffer lookup (hits, LRU misses) -> prefetch of the next-ranked blocks -> swap-in of misses
  and prefetches from the host pool (dequantized) -> counters on the device -> importance and
  recent queries -> sparse attention over the selected slots.

Sequences of different lengths, left padding, holes, contexts shorter than top_k, any
quantization policy and layers on several GPUs all take these two bodies: a batch of one is a
batch, and per-sequence values are device tensors padded to the batch's widths.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import torch

from hi_sparse.kernels import sparse_decode_attention, two_level_least, two_level_pays
from hi_sparse.kernels._dispatch import use_triton
from hi_sparse.kernels.counts import reference_tally, tally
from hi_sparse.kernels.swap_in import swap_plan

from . import anchors, key_bounds
from .batch_state import APPEND, ATTEND, WINDOW, Batch, swap_rows, upload  # noqa: F401 (re-exported)
from .config import HiSparseConfig
from .host_pool import HostPool, QuantEvents
from .host_seal import HotRows, to_device
from .hot_buffer import ticks
from .key_bounds import bucket, key_blocks  # noqa: F401 (bucket re-exported)
from .layers import KVShape, LayerRows
from .metrics import DEVICE_COUNTERS, RuntimeMetrics
from .recalibration import remember_queries
from .row_bank import GrowthCopies, fills_together, growth_copies, staged_view
from .selection import bound_scores, candidate_blocks, select
from .sequences import Sequence, SequenceTable
from .storage import Storage
from .trace import phase

SWAP_IN_BYTES = DEVICE_COUNTERS.index("swap_in_bytes")   # the counter a mixed-width pool's load adds to
_ADDRESS = torch.Tensor.data_ptr    # a buffer's address (body_key: map over the buffers, no Python frame each)


def attend_blocks(n_max: int, room: int, ps: int, window: int, first_lo: int, group: int,
                  n_super: int) -> tuple[int, int]:
    """(selection blocks, candidate blocks) of attend_body for a longest sequence of ``n_max``
    tokens in blocks of ``ps``, ``room`` blocks of bounds, the batch's first visible position
    ``first_lo``. Rounded up (key_bounds.key_blocks: at least BUCKET_LEAST_TOKENS and BUCKET_LEAST_BLOCKS
    apart; select masks blocks past a row's tokens) so that a captured step keeps its key over many blocks; the
    candidates are bounded as if the longest sequence filled its rounded count, so both change on
    the same step. The rounding never turns on two-level scoring that the sequence's own block
    count would not use (it would select differently)."""
    real = -(-n_max // ps)
    nb = min(room, key_blocks(real, ps))
    least = two_level_least(group, n_super)
    if least is not None and real < least <= nb:
        nb = max(real, min(room, least - 1))
    return nb, min(nb, candidate_blocks(nb, nb * ps - window, first_lo, ps))


def append_body(rows: LayerRows, host: HostPool, batch: Batch, cfg: HiSparseConfig, shape: KVShape,
                k: torch.Tensor, v: torch.Tensor) -> None:
    """New tokens k, v (B, Hkv, T, D) of the batch at ``rows``' layer: backed up into the host
    pool, key bounds widened, made hot, scored as anchors."""
    layer = rows.index
    B, H, T, D = k.shape
    start = batch.starts(layer, APPEND)
    host.backup(layer, batch.tables, batch.tail_units, start, k, v)
    key_bounds.update(rows.bank, batch.rows, start, k, cfg.select_block, cfg.bound_group, cfg.decode_kernels)
    pos = batch.head_starts(layer, APPEND)                                              # (B*H, T)
    if T > 1:
        pos = pos + torch.arange(T, device=k.device)
    # resident as the most recent, their K / V written into the hot rows (the slot choice and the
    # writes of a decode token: one launch)
    rows.hot.rows(batch.first_row, B).insert(pos, batch.clock[APPEND, layer],
                                             (k.reshape(B * H, T, D), v.reshape(B * H, T, D), rows.k.view(-1, D),
                                              rows.v.view(-1, D)))
    anchors.pin_new_tokens(rows.probe, rows.bank, batch.rows, k, pos.view(B, H, T), batch.first,
                           (cfg.threshold_base, cfg.threshold_min, cfg.threshold_max), cfg.decode_kernels)


def attend_body(rows: LayerRows, host: HostPool, batch: Batch, cfg: HiSparseConfig, shape: KVShape,
                n_super: int, q: torch.Tensor, nb: int, n_cand: int, mixed_levels: bool,
                holes: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode attention of the batch at ``rows``' layer, q (B, Hq, D) -> ((B, Hq, D), the
    selected positions (B*Hkv, K)). nb: selection blocks (``cfg.select_block`` tokens) of the
    longest sequence; n_cand: a host bound on the candidate selection blocks
    (selection.candidate_blocks); mixed_levels: some sequences are too short
    for two-level scoring to pay on their own (they are scored as they would be alone); holes:
    some sequence lost blocks to streaming mode. Block hits add to the importance in streaming
    mode only (only its eviction reads them)."""
    layer, bank = rows.index, rows.bank.t
    B, H, D, bs = batch.size, shape.num_kv_heads, shape.head_dim, shape.block_size
    ps = cfg.select_block                                   # selection block (divides the storage block)
    ns = -(-nb * ps // bs)                                  # storage blocks of the longest sequence
    r = batch.rows
    n, n_head = batch.starts(layer, ATTEND), batch.head_starts(layer, ATTEND)          # (B,), (B*H, 1)
    window_block = batch.window_blocks(layer)      # the first selection block of each window (B,)
    row_blocks = torch.div(n + ps - 1, ps, rounding_mode="floor")[:, None] if mixed_levels else None
    # with the decode kernels at long context: two-level scoring's listed blocks, ranked as they
    # are (not scattered over every block and ranked there)
    scores = bound_scores(q.view(B, H, shape.group_size, D), bank["kmin"][r, :, :nb], bank["kmax"][r, :, :nb],
                          bank["smin"][r], bank["smax"][r], cfg.bound_group, n_super, window_block[:, None],
                          row_blocks, listed=cfg.decode_kernels and not holes)
    if isinstance(scores, tuple):                       # (the listed blocks, their scores)
        scores = (scores[0].reshape(B * H, -1), scores[1].reshape(B * H, -1))
    else:
        scores = scores.reshape(B * H, nb)
    sel = select(scores, n_head, batch.first_of_head, cfg.window_size, cfg.top_k, ps,
                 bank["anchors"][r].reshape(B * H, -1),
                 bank["holes"][r, :ns].repeat_interleave(H, 0) if holes else None, cfg.prefetch_units,
                 n_cand, cfg.sink_tokens, store_block=bs, kernels=cfg.decode_kernels, nb=nb)
    state = rows.hot.rows(batch.first_row, B)
    clock = batch.clock[ATTEND, layer]
    # the lookup (counts: (B*H, 3)), then as many prefetches as it left room for (S - selected),
    # stamped after its stamps; with the kernels one launch
    slots, miss, counts, loaded, prefetch_slots = state.lookup_prefetch(sel.tokens, sel.prefetch, clock)
    # swap-in of misses and prefetches at fixed width (-1 rows copy nothing)
    tail = batch.tail_units.view(-1, 1) if host.quantized else None
    kernels = cfg.decode_kernels and use_triton(q)
    if kernels:
        src, src_tail, dst = swap_plan(sel.both, miss, loaded, slots, prefetch_slots, batch.head_rows, batch.tables,
                                       batch.seq_of_head, batch.kv_head, n_head, tail, bs, H)
    else:
        src, src_tail, dst = swap_rows(host, batch, sel.both, miss, loaded, slots, prefetch_slots, n_head, tail)
    sizes = host.row_bytes(layer)      # None: a pool of mixed widths counts its bytes in load
    nbytes = host.load(layer, src, src_tail, rows.k.view(-1, D), rows.v.view(-1, D), dst, count=sizes is None)
    # every count of the step (kernels/counts.py; with the decode kernels one launch)
    (tally if kernels else reference_tally)(rows.counters.acc, counts, loaded, sel.loaded, src, src_tail,
                                            *(sizes or (0, 0)))
    if nbytes is not None:
        rows.counters.acc[SWAP_IN_BYTES] += nbytes
    if cfg.streaming:
        bank["importance"][r, :ns] += sel.block_hits.view(B, H, ns).sum(1)
    remember_queries(rows.bank, r, q[:, None])
    out = sparse_decode_attention(q.to(shape.dtype), rows.k[r], rows.v[r], slots.view(B, H, -1), shape.scale)
    return out.to(q.dtype), sel.tokens


@dataclass
class StepPlan:
    """One decode step of a batch with its host side done for every layer up front (positions,
    clocks, pages, bound room), so that the whole forward can run as one captured graph: the
    bodies run (or replay) without their host side, and :meth:`Decoder.finish` does the rest
    after. key: what a graph of the whole step depends on beyond device tensors."""
    seqs: list[Sequence]
    batch: Batch
    starts: list[int]                         # each sequence's new position (every layer's)
    shapes: tuple                             # attend_body's host shapes (every layer's)
    key: tuple
    tokens: list = field(default_factory=list)  # per layer: the selection (attend_body's second output)
    q: list = field(default_factory=list)       # per layer: the query (the audit reads it after the step)
    seals: list = field(default_factory=list)   # (sequence, first position) of blocks its tokens complete
    copies: GrowthCopies | None = None          # a later step's (Decoder.later): its growths' copies


@dataclass
class Ahead:
    """The host side of a planned step done before it (:meth:`Decoder.prepare`): valid while its
    batch holds ``starts`` tokens and every layer's hot-buffer clock stands at ``clocks``."""
    starts: list[int]
    batch: Batch
    clocks: list[int]


class Decoder:
    """The host side of appends and decode steps, and the device state of each batch."""

    def __init__(self, cfg: HiSparseConfig, shape: KVShape, layers: list[LayerRows], host: HostPool,
                 storage: Storage, sequences: SequenceTable, metrics: RuntimeMetrics) -> None:
        self.cfg, self.shape, self.layers, self.host = cfg, shape, layers, host
        self.storage, self.sequences, self.metrics = storage, sequences, metrics
        self.n_super = key_bounds.n_super(cfg.top_k, cfg.window_size, cfg.global_tokens, cfg.select_block,
                                          cfg.prefetch_units)
        # graphs on CUDA with decode_graphs, when every layer is on one GPU (graphs per layer and
        # device have not been run on the hardware yet: a split decodes through the same bodies
        # without them)
        self._one_device = len({layer.device for layer in layers}) == 1
        self._graphs = cfg.decode_graphs and self._one_device
        self._batches: dict[tuple, Batch] = {}
        self._pending_errors: list[torch.Tensor] = []       # QuantEvents.pending, until the step ends
        self._pending_counts: list = []                     # QuantEvents.pending_counts, likewise
        self._local = threading.local()     # .plan: the step whose host side ran up front (per thread)
        self.ahead_used = 0                                 # planned steps whose prepare ran early
        self.copies_ahead: GrowthCopies | None = None       # the staged growths' copies (later())
        width = cfg.top_k + cfg.global_tokens                # select's token width
        self._attend_ticks = ticks(selected=width, prefetched=cfg.prefetch_blocks * shape.block_size)

    @property
    def planned(self) -> StepPlan | None:
        """This thread's planned step (step_graph.py captures a later key's step on another)."""
        return getattr(self._local, "plan", None)

    @planned.setter
    def planned(self, plan: StepPlan | None) -> None:
        self._local.plan = plan

    def batch(self, seqs: list[Sequence], device: torch.device) -> Batch:
        """The batch state of these sequences on ``device`` (their rows made consecutive)."""
        if self.sequences.make_consecutive(seqs):
            self.forget([s.seq_id for s in seqs])
        key = (device, tuple(s.seq_id for s in seqs))
        batch = self._batches.get(key)
        if batch is None or batch.first_row != seqs[0].row:
            if len(self._batches) > 8:
                self._batches.clear()
            graphs = self._graphs and device.type == "cuda"
            batch = self._batches[key] = Batch(seqs, device, self.shape, self.cfg.max_seq_len, graphs, self.host,
                                               self.cfg.window_size, self.cfg.select_block)
        batch.refresh_tables(self.storage.pages)
        return batch

    def forget(self, seq_ids: list[int]) -> None:
        """Drop the state (graphs, buffers) of batches that held any of these sequences."""
        gone = set(seq_ids)
        for key in [k for k in self._batches if gone & set(k[1])]:
            del self._batches[key]

    def graph_key(self, rows: LayerRows, batch: Batch | None, *shape: int) -> tuple | None:
        """What a captured body depends on beyond its device tensors: host-side shapes, whether the
        layer's probe is fitted unless the kernel reads it (anchors.pin_key; a refit updates the
        weights in place) and the addresses of every buffer it touches (a bank or pool that grew
        moved them). None for a batch that runs without graphs (nothing to key)."""
        if batch is not None and batch.runner.no_graphs:
            return None
        return self.body_key(rows, *shape)

    def body_key(self, rows: LayerRows, *shape) -> tuple:
        return (*shape, anchors.pin_key(rows.probe, rows.device, self.cfg.decode_kernels),
                *map(_ADDRESS, rows.buffers()), *map(_ADDRESS, self.host.buffers(rows.index)))

    # -- the host side of the two bodies ------------------------------------------------------
    def _make_room(self, rows: LayerRows, seqs: list[Sequence], starts: list[int], T: int) -> Batch:
        """Pages for T new tokens at ``starts``, room in the bounds and hot buffer; the batch."""
        with phase("prefill.extend", T > 1):
            self.storage.extend(seqs, [p + T for p in starts])
        with phase("prefill.grow", T > 1):
            rows.make_room(max(starts) + T, self.cfg)
        return self.batch(seqs, rows.device)

    def _attend_shapes(self, rows: LayerRows, batch: Batch, seqs: list[Sequence],
                       lengths: list[int]) -> tuple[int, int, bool, bool]:
        """attend_body's host shapes for token counts ``lengths``: (selection blocks, candidate
        blocks, mixed levels, holes); the block counts from :func:`attend_blocks`."""
        ps, n_max = self.cfg.select_block, max(lengths)
        nb, n_cand = attend_blocks(n_max, rows.bank.size("kmin", 1), ps, self.cfg.window_size, batch.first_lo,
                                   self.cfg.bound_group, self.n_super)
        mixed = len({two_level_pays(-(-n // ps), self.cfg.bound_group, self.n_super) for n in lengths}) > 1
        holes = any(self.storage.has_holes(s) for s in seqs)
        return nb, n_cand, mixed, holes

    def _after_append(self, layers: list[LayerRows], seqs: list[Sequence], starts: list[int], T: int) -> None:
        """What follows the append body of T tokens at ``starts`` at each of ``layers``."""
        for device in {rows.device for rows in layers}:
            self.host.note_device_writes(device)
        self.metrics.backup_bytes.inc(len(layers) * self.host.backup_bytes(starts, T))
        for s, p in zip(seqs, starts):
            for rows in layers:
                s.lengths[rows.index] = p + T

    def _after_attend(self, layers: list[LayerRows], seqs: list[Sequence], tokens: list[torch.Tensor]) -> None:
        """What follows the attend body at each of ``layers``, tokens: each one's selection."""
        H, R = self.shape.num_kv_heads, self.cfg.recalibrate_queries
        for rows, sel in zip(layers, tokens):
            for b, s in enumerate(seqs):
                s.last_selection[rows.index] = (sel, b * H, (b + 1) * H)
        for s in seqs:
            for rows in layers:
                s.queries_kept[rows.index] = min(R, s.queries_kept[rows.index] + 1)

    # -- one layer at a time ------------------------------------------------------------------
    def append(self, rows: LayerRows, seqs: list[Sequence], k: torch.Tensor, v: torch.Tensor) -> None:
        """New tokens k, v (B, Hkv, T, D), on the layer's device in the KV dtype."""
        plan = self.planned
        if plan is not None:             # the host side ran up front and the rest comes after
            append_body(rows, self.host, plan.batch, self.cfg, self.shape, k, v)
            return
        cfg, bs, layer = self.cfg, self.shape.block_size, rows.index
        T = k.shape[2]
        starts = [s.lengths[layer] for s in seqs]
        batch = self._make_room(rows, seqs, starts, T)
        if self.host.quantized:          # blocks the tokens complete: quantized on the host first
            items = [(self.storage.block_table(s), s.tail_slot, p, k[b], v[b])
                     for b, (s, p) in enumerate(zip(seqs, starts)) if (p + T) // bs > p // bs]
            if items:                    # the batch's sequences together (they fill blocks together)
                with phase("prefill.seal", T > 1):
                    self._count_write(*self.host.seal_many(layer, items))
        n = ticks(inserted=min(T, self.shape.slots))
        rows.hot.room_for(n)
        batch.set(layer, APPEND, starts, rows.hot.reserve(n))
        body = functools.partial(append_body, rows, self.host, batch, cfg, self.shape)
        if T == 1:
            batch.runner.run((layer, "append"), self.graph_key(rows, batch, T), body, k, v)
        else:                            # prefill: run once per shape, not worth a graph
            with phase("prefill.append"):
                body(k, v)
        self._after_append([rows], seqs, starts, T)

    def _count_write(self, nbytes: int, events: QuantEvents) -> None:
        m = self.metrics
        m.backup_bytes.inc(nbytes)
        for bits, c in events.counts.items():
            m.quant_blocks[bits].inc(c)
        for e in events.errors:
            m.quant_error.observe(e)
        self._pending_errors.extend(events.pending)
        self._pending_counts.extend(events.pending_counts)

    def flush_quant_errors(self) -> None:
        """Observe the relative errors of units quantized on a GPU this step, and count the units
        a graph's seal counted there by width (one read-back for all of them, at the step's end,
        instead of a host sync per seal)."""
        if not self._pending_errors:
            return
        m, hist = self.metrics, self.metrics.quant_error
        errors = torch.cat([e.reshape(-1).double() for e in self._pending_errors])
        widths = self._pending_counts
        self._pending_errors, self._pending_counts = [], []
        # bucketed where they are (a first bound >= the value: Histogram.observe's rule, in
        # float64 as it compares), one read-back of the buckets, the sum and the units by width
        at = torch.bucketize(errors, to_device(torch.tensor(hist.bounds, dtype=torch.float64), errors.device))
        back = [torch.bincount(at, minlength=len(hist.counts)).double(), errors.sum()[None]]
        back += [c.reshape(-1).double().to(errors.device) for _, c, _ in widths]
        values = torch.cat(back).tolist()
        n = len(hist.counts)
        hist.observe_counts(values[:n], values[n])
        at_width = n + 1
        for ws, c, nbytes in widths:          # c: (keys / values, widths), nbytes alike
            for row in nbytes:
                for w, size in zip(ws, row):
                    units = int(values[at_width])
                    m.quant_blocks[w].inc(units)
                    m.backup_bytes.inc(units * size)
                    at_width += 1

    def attend(self, rows: LayerRows, seqs: list[Sequence], q: torch.Tensor) -> torch.Tensor:
        """The decode step's attention, q (B, Hq, D) on the layer's device -> (B, Hq, D)."""
        layer, plan = rows.index, self.planned
        if plan is not None:
            out, plan.tokens[layer] = attend_body(rows, self.host, plan.batch, self.cfg, self.shape, self.n_super,
                                                  q, *plan.shapes)
            return out
        lengths = [s.lengths[layer] for s in seqs]
        batch = self.batch(seqs, rows.device)
        shapes = self._attend_shapes(rows, batch, seqs, lengths)
        self.host.prepare(layer, rows.device)
        rows.hot.room_for(self._attend_ticks)
        batch.set(layer, ATTEND, lengths, rows.hot.reserve(self._attend_ticks))
        body = functools.partial(attend_body, rows, self.host, batch, self.cfg, self.shape, self.n_super)
        key = self.graph_key(rows, batch, *shapes)
        out, tokens = batch.runner.run((layer, "attend"), key, body, q, *shapes)
        self._after_attend([rows], seqs, [tokens])
        return out

    # -- a whole step at once -----------------------------------------------------------------
    def plan(self, seqs: list[Sequence], ahead: Ahead | None = None) -> StepPlan | None:
        """The host side of a one-token decode step of ``seqs`` at every layer, done now; None
        (nothing done) when the step must run layer by layer: layers on several devices. A token
        that completes a block of a quantized pool is backed up to its float tail like any other,
        the step reads the block from there (batch_state.tail_block) and :meth:`finish` seals it after
        the forward. Every layer holds the same tokens, so pages, the batch and the bodies' shapes
        are worked out once; room, LRU clocks and positions per layer come from ``ahead``
        (:meth:`prepare`, run while the step before ran) when it still holds, else are done now.
        What a graph key names (buffer addresses, the probe's state) is read now: whatever ran
        since ``ahead`` may have moved a buffer."""
        if not self._one_device:
            return None
        starts = [s.lengths[0] for s in seqs]
        lengths = [p + 1 for p in starts]
        self.storage.extend(seqs, lengths)
        batch = self.batch(seqs, self.layers[0].device)
        if ahead is not None and self._holds(ahead, batch, starts):
            self.ahead_used += 1
        else:
            self.prepare(seqs)
        keys = []
        for rows in self.layers:
            self.host.prepare(rows.index, rows.device)   # a pool the extend grew rebuilds its copies
            rows.hot.sync_order()                        # an eviction in the extend may reset stamps
            keys.append(self.body_key(rows))
        shape = self._attend_shapes(self.layers[0], batch, seqs, lengths)
        bs = self.shape.block_size
        seals = [(s, p + 1 - bs) for s, p in zip(seqs, starts) if self.host.quantized and (p + 1) % bs == 0]
        return StepPlan(seqs, batch, starts, shape, (shape, tuple(keys)), [None] * len(keys), [None] * len(keys),
                        seals)

    def later(self, plan: StepPlan, within: int) -> StepPlan | None:
        """The first step of ``plan``'s batch within ``within`` tokens after it whose host shapes
        differ from ``plan``'s (its longest sequence enters another bucket of blocks), planned as
        far as a captured step depends on it, for a row_bank.staged_view: those shapes, and the
        buffers as they will be (the banks and token maps that step grows are staged now; a host
        pool that grows before then moves its buffers: that key is never met). None when no such
        step comes so soon. Nothing in use changes."""
        ps, n = self.cfg.select_block, max(plan.starts) + 1
        d = -(-n // ps) * ps + 1 - n                 # the first step whose longest sequence adds a block
        while d <= within:
            starts = [p + d for p in plan.starts]
            shape = self._attend_shapes(self.layers[0], plan.batch, plan.seqs, [p + 1 for p in starts])
            if shape != plan.shapes:
                copies = self.copies_ahead = GrowthCopies()
                with fills_together(), copies.recording():   # (their fills: a few launches, not one a tensor)
                    for rows in self.layers:
                        rows.make_room(max(starts) + 1, self.cfg, staged=True)
                with staged_view():
                    shape = self._attend_shapes(self.layers[0], plan.batch, plan.seqs, [p + 1 for p in starts])
                    keys = tuple(self.body_key(rows) for rows in self.layers)
                L = len(self.layers)
                return StepPlan(plan.seqs, plan.batch, starts, shape, (shape, keys), [None] * L, [None] * L,
                                copies=copies)
            d += ps
        return None

    def prepare(self, seqs: list[Sequence]) -> Ahead | None:
        """What of a planned step's host side can run before it, while the step before it runs on
        the device (the engine does it at a step's end): room for one more token in every layer's
        bounds and hot buffer, the pool's per-device copies, the LRU clocks of both bodies
        reserved, and every body's positions and clock written into the batch's tensors (in the
        stream's order: after the running step has read them). None when the step cannot be
        planned. Pages are left to :meth:`plan`: a new block may grow the host pool, which the
        running step writes to."""
        if not self._one_device:
            return None
        starts = [s.lengths[0] for s in seqs]
        L, n_max = len(self.layers), max(starts) + 1
        clocks = []
        with growth_copies(self.copies_ahead) as grown:     # one graph's replay, when staged ahead
            for rows in self.layers:
                rows.make_room(n_max, self.cfg)
        self.copies_ahead = None if grown else self.copies_ahead     # (spent, or its staging gone)
        for rows in self.layers:
            self.host.prepare(rows.index, rows.device)
            rows.hot.room_for(ticks(inserted=1) + self._attend_ticks)   # both: else the append's may pass the attend's
            clocks.append((rows.hot.reserve(ticks(inserted=1)), rows.hot.reserve(self._attend_ticks)))
        batch = self.batch(seqs, self.layers[0].device)
        batch.set_all(torch.tensor([[starts] * L, [[p + 1 for p in starts]] * L]), torch.tensor(clocks).T)
        return Ahead(starts, batch, [rows.hot.clock for rows in self.layers])

    def _holds(self, ahead: Ahead, batch: Batch, starts: list[int]) -> bool:
        """``ahead`` is still this step's: the same batch (rows unmoved) at the same positions,
        and no layer's hot buffer has reserved a stamp since (every append, attend or
        renumbering does; the batch's positions and clocks are as it wrote them)."""
        return (ahead.batch is batch and ahead.starts == starts
                and all(rows.hot.clock == c for rows, c in zip(self.layers, ahead.clocks)))

    def ready_seal(self, plan: StepPlan) -> None:
        """With graphs, capture the seal of the blocks ``plan``'s batch completes now (as its step
        is captured), not at the first step that completes them (~150 ms of host work at 32 layers)."""
        if self._graphs and self.host.quantized:
            with self.layers[0].on_device():
                self.host.ready_seal(len(plan.seqs), self.layers[0].device, self._hot_rows())

    def _hot_rows(self, rows: list[int] | None = None, starts: list[int] | None = None) -> HotRows:
        """The layers' hot buffers, where a seal reads the rows they hold (host_seal.HotRows): the
        blocks' rows (of sequence rows ``rows``, from positions ``starts``) are the window's (all of
        them with a window of a block or more), held there after the step that completes them."""
        return HotRows([(r.k, r.v, r.hot.slot_token_s) for r in self.layers], rows or [], starts or [])

    def finish(self, plan: StepPlan) -> None:
        """The host side that follows a planned step's bodies (however they ran), the blocks its
        tokens completed first: sealed from their float tails, after the forward in stream order
        (a seal that fails leaves the sequences' lengths as they were, so the step can run again)."""
        if plan.seals:      # (each completed block's physical id: no whole block table built for it)
            bs, pages = self.shape.block_size, self.storage.pages.seqs
            items = [(pages[s.seq_id].blocks[b0 // bs].block_id, s.tail_slot) for s, b0 in plan.seals]
            hot = self._hot_rows([s.row for s, _ in plan.seals], [b0 for _, b0 in plan.seals])
            with self.layers[0].on_device():             # a planned step's layers share one device
                self._count_write(*self.host.seal_tails(items, self.layers[0].device, self._graphs, len(plan.seqs),
                                                        hot))
        self._after_append(self.layers, plan.seqs, plan.starts, 1)
        self._after_attend(self.layers, plan.seqs, plan.tokens)
