"""LRU bookkeeping of one sequence's device hot buffer at one layer (Hkv heads x S slots).

Only indices live here; the K/V bytes sit in the engine's (rows, Hkv, S, D) buffers. Each slot
has a stamp (larger = more recently used; stamps are unique per head). A lookup of the selection
(same rules as SGLang's swap-in kernel and its ``naive_load_topk`` oracle):

1. hit detection: a selected token with a slot is a hit;
2. the k-th miss takes the k-th least recently used slot that is not a hit;
3. new LRU order: [stale slots, misses in selection order, hits in selection order] (MRU last).

New tokens are inserted as most recently used at append time, so the newest token is always
resident when the next selection (whose window contains it) runs. Prefetched slots carry a flag;
a later hit on a flagged slot counts as a used prefetch, an eviction clears it unused.

Every operation is fixed-width and sync-free (its results are masks and slots, shapes known on
the host), so a CUDA graph can hold it. It stamps from a ``clock`` argument (an int or a 0-dim
device tensor); the bank's host clock hands out those stamps (:meth:`HotBufferBank.reserve`), as
many as :func:`ticks` says a step uses.

With the kernels (CUDA) the bank also keeps each head's slots in LRU order (``order``), updated
by the decode step's kernels (the append moves its victim to the end; the lookup ranks from it
and its install or the following prefetch writes the new order), so no step sorts the stamps;
any other update marks it stale, and :meth:`HotBufferBank.sync_order` rebuilds it from the
stamps before the next step (``room_for`` calls it).

Stamps are int32: a GPU sorts them in 25 us against 38 for int64 (8 x 4,096; 38 against 60 at
192 heads; bench_lru.py, H200), the LRU ranking every step and layer makes. Before the clock
would pass the int32 range (:meth:`HotBufferBank.room_for`, every ~300K decode steps at a top_k
of 2,048) the stamps are renumbered by their rank, which keeps every head's order exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hi_sparse.kernels._dispatch import use_triton
from hi_sparse.kernels.lru import (
    insert_one_triton,
    install_slots,
    lookup_triton,
    lru_step_triton,
    prefetch_triton,
    reference_install_slots,
)

from .row_bank import copy_in, full, in_staged_view, note_staged

STAMP = torch.int32
STAMP_MAX = torch.iinfo(STAMP).max


# A decode step's lookup and prefetch run as one launch (lru_step, one program per head, a barrier
# between its phases) up to this many heads (batch x KV heads), else as the four kernels of the two
# calls. H200, bench_lru.py (S 4,096, K 2,048 half resident, P 80; CUDA graphs): 8 heads 18.7 us
# against 22.4; 192 heads 47.9 against 43.3 (the phases' barriers cost more than the launches
# there). Between the two not measured: 64 is a guess.
LRU_STEP_MAX_HEADS = 64

def ticks(inserted: int = 0, selected: int = 0, prefetched: int = 0) -> int:
    """Stamps a step takes from the clock: one per inserted token (at most the S slots), two per
    selected token (misses, then hits) and one per prefetch position (the widths, not the data)."""
    return inserted + 2 * selected + prefetched


class HotBufferBank:
    """The LRU state of every engine row at one layer: (rows x H) heads of S slots.

    Each sequence's :class:`HotBufferState` is a view of its row's H heads, so a batch of
    sequences in consecutive rows is one state of B x H heads (:meth:`rows`) that a decode step
    looks up with one set of kernels. Stamps come from one clock per bank (unique per head).

    Every per-slot tensor has one *spill* column past the S slots and the token -> slot map one
    before position 0, so that an update writes its masked-out entries there instead of being
    built as a whole new row and merged (a scatter each instead of four ops; a decode step makes
    four such updates per layer). The spill of ``slot_token`` always holds -1 and that of
    ``prefetched`` False (what a read of the spill sees); the others hold anything. The public
    tensors (``slot_token`` ...) are views without the spill.
    """

    def __init__(self, num_heads: int, num_slots: int, device: torch.device | str = "cpu",
                 rows: int = 0, token_capacity: int = 0, max_tokens: int | None = None,
                 kernels: bool = False) -> None:
        self.num_heads, self.num_slots, self.device = num_heads, num_slots, torch.device(device)
        self.kernels = kernels     # on CUDA, lookup / prefetch / install as Triton kernels (kernels/lru.py)
        self.max_tokens = max_tokens
        self.clock = 0
        self.num_rows = 0
        S1 = num_slots + 1
        self.slot_token_s = torch.empty(0, S1, dtype=torch.int64, device=self.device)    # (N, S + 1)
        self.slot_stamp_s = torch.empty(0, S1, dtype=STAMP, device=self.device)
        self.prefetched_s = torch.empty(0, S1, dtype=torch.bool, device=self.device)
        self._token_slot_s = torch.empty(0, 1, dtype=torch.int64, device=self.device)    # (N, 1 + tokens)
        self._staged_map: torch.Tensor | None = None       # ensure_tokens(staged=True)
        # with the kernels: each head's slots from least to most recently used (the stamps' order,
        # kept by the decode step's kernels so that no step sorts the stamps); order_valid False
        # after an operation that does not keep it, until sync_order rebuilds it from the stamps
        self.order = torch.empty(0, num_slots, dtype=torch.int32, device=self.device)
        self.order_valid = True
        self.grow_rows(rows)
        self.ensure_tokens(token_capacity)

    @property
    def token_slot_s(self) -> torch.Tensor:
        """The token -> slot map (with its spill column); in a row_bank.staged_view, the staged one."""
        if self._staged_map is not None and in_staged_view():
            return self._staged_map
        return self._token_slot_s

    @token_slot_s.setter
    def token_slot_s(self, t: torch.Tensor) -> None:
        self._token_slot_s = t

    # without the spill columns (views: in-place updates land in the bank)
    slot_token = property(lambda self: self.slot_token_s[:, :-1])
    slot_stamp = property(lambda self: self.slot_stamp_s[:, :-1])
    prefetched = property(lambda self: self.prefetched_s[:, :-1])
    token_slot = property(lambda self: self.token_slot_s[:, 1:])

    def grow_rows(self, rows: int) -> None:
        """Hold at least ``rows`` rows (new rows start empty); contents kept."""
        if rows <= self.num_rows:
            return
        self._staged_map = None
        n0, n1 = self.num_rows * self.num_heads, rows * self.num_heads

        def grown(t: torch.Tensor, fill) -> torch.Tensor:
            new = torch.full((n1, t.shape[1]), fill, dtype=t.dtype, device=self.device)
            new[:n0] = t
            return new
        self.slot_token_s = grown(self.slot_token_s, -1)
        self.slot_stamp_s = grown(self.slot_stamp_s, 0)
        self.prefetched_s = grown(self.prefetched_s, False)
        self.token_slot_s = grown(self.token_slot_s, -1)
        self.order = grown(self.order, 0)
        self.num_rows = rows
        self.slot_stamp[n0:] = self._empty_stamps()          # the rest is filled empty above
        self.order[n0:] = torch.arange(self.num_slots, dtype=torch.int32, device=self.device)

    def _empty_stamps(self) -> torch.Tensor:
        """An empty head's stamps: every slot older than any stamp handed out, lowest first."""
        return torch.arange(-self.num_slots, 0, dtype=STAMP, device=self.device)

    def reset(self, row: int) -> None:
        """Empty one row (a new sequence takes it): no tokens, empty slots oldest, lowest first."""
        h = slice(row * self.num_heads, (row + 1) * self.num_heads)
        self.slot_token_s[h] = -1
        self.slot_stamp[h] = self._empty_stamps()
        self.prefetched_s[h] = False
        self.token_slot_s[h] = -1
        self.order[h] = torch.arange(self.num_slots, dtype=torch.int32, device=self.device)

    def ensure_tokens(self, n: int, align: Callable[[int], int] | None = None, staged: bool = False) -> None:
        """Make the token -> slot map cover positions [0, n) in every row (grows by doubling, to
        a width ``align`` rounds up, up to max_tokens), into the map staged for that width if
        there is one. ``staged``: make that map now instead (filled; its contents are copied at
        the growth, and a row_bank.staged_view shows it before)."""
        cap = self._token_slot_s.shape[1] - 1
        if n <= cap:
            return
        width = max(n, 2 * cap, 64)
        if align is not None:
            width = align(width)
        if self.max_tokens is not None:
            width = max(n, min(width, self.max_tokens))
        shape = (self._token_slot_s.shape[0], 1 + width)
        have, self._staged_map = self._staged_map, None
        if have is None or tuple(have.shape) != shape:
            make = full if staged else torch.full      # (row_bank.full: its fill may come later)
            have = make(shape, -1, dtype=torch.int64, device=self.device)
        if staged:
            self._staged_map = have
            note_staged(have, self._token_slot_s, 1)
            return
        copy_in(have, self._token_slot_s, 1)
        self._token_slot_s = have

    def copy_row(self, src: int, dst: int, count: int = 1) -> None:
        """Rows [dst, dst + count) take row src's LRU state (forked sequences; the caller copies
        the K/V)."""
        H = self.num_heads
        for t in self.buffers():
            t[dst * H:(dst + count) * H].view(count, H, -1).copy_(t[src * H:(src + 1) * H].expand(count, H, -1))

    def rows(self, row: int, count: int = 1) -> "HotBufferState":
        """The state of rows [row, row + count) as one HotBufferState of count x H heads."""
        H = self.num_heads
        return HotBufferState(self, row * H, count * H)

    def reserve(self, n: int) -> int:
        """The first of ``n`` fresh stamps (the host clock moves past them): what a step passes as
        ``clock`` to the state's operations, n from :func:`ticks`. Call :meth:`room_for` first
        with every stamp the step will reserve."""
        if self.clock + n > STAMP_MAX:
            raise RuntimeError(f"HiSparse hot buffer: {n} stamps from clock {self.clock} pass the int32 range; "
                               "room_for(n) renumbers the stamps before a step reserves them")
        first = self.clock
        self.clock += n
        return first

    def room_for(self, n: int) -> None:
        """Make sure the next ``n`` stamps fit in int32, before a step reserves any (renumbering
        between two reservations of one step would put the first one's stamps above the second's):
        when they would not, every head's stamps become their rank among the head's (-S .. -1,
        the order kept exactly) and the clock restarts at 0. Also rebuilds a stale LRU order
        (:meth:`sync_order`). Outside a CUDA graph capture only."""
        self.sync_order()
        if self.clock + n <= STAMP_MAX:
            return
        if n > STAMP_MAX // 2:
            raise ValueError(f"a step of {n} stamps does not fit the hot buffer's int32 clock")
        if self.slot_stamp.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("HiSparse hot buffer: the stamps must be renumbered outside a CUDA graph capture")
        N, S = self.slot_stamp.shape
        if N:
            rank = torch.empty_like(self.slot_stamp)
            rank.scatter_(1, self.slot_stamp.argsort(dim=1),
                          torch.arange(-S, 0, dtype=STAMP, device=self.device).expand(N, S))
            self.slot_stamp.copy_(rank)
        self.clock = 0

    def sync_order(self) -> None:
        """Rebuild each head's LRU order from the stamps where an operation left it stale (the
        decode step's kernels keep it; a prefill, a reset of stamps by streaming mode or the torch
        path do not). Outside a CUDA graph capture; a no-op without the kernels."""
        if self.order_valid or not (self.kernels and use_triton(self.slot_stamp_s)):
            return
        self.order.copy_(self.slot_stamp.argsort(dim=1))
        self.order_valid = True

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The tensors the operations read and write (their addresses key a captured step)."""
        return self.slot_token_s, self.slot_stamp_s, self.prefetched_s, self.token_slot_s, self.order

    def memory_bytes(self) -> int:
        staged = () if self._staged_map is None else (self._staged_map,)
        return sum(t.numel() * t.element_size() for t in (*self.buffers(), *staged))


class HotBufferState:
    """The LRU state of H consecutive heads of a :class:`HotBufferBank` (a view: in-place updates
    land in the bank). Make one with :meth:`HotBufferBank.rows`."""

    def __init__(self, bank: HotBufferBank, head0: int, num_heads: int) -> None:
        self._bank, self._h0 = bank, head0
        self.num_heads, self.num_slots, self.device = num_heads, bank.num_slots, bank.device
        self._after_lookup: tuple | None = None   # (order, misses (H,), counts (H, 3), clock, K)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t[self._h0:self._h0 + self.num_heads]

    # the bank's rows of these heads (views: in-place updates land in the bank), with the spill
    # columns (``_s``) and without
    slot_token_s = property(lambda self: self._rows(self._bank.slot_token_s))
    slot_stamp_s = property(lambda self: self._rows(self._bank.slot_stamp_s))
    prefetched_s = property(lambda self: self._rows(self._bank.prefetched_s))
    token_slot_s = property(lambda self: self._rows(self._bank.token_slot_s))
    slot_token = property(lambda self: self._rows(self._bank.slot_token))
    slot_stamp = property(lambda self: self._rows(self._bank.slot_stamp))
    prefetched = property(lambda self: self._rows(self._bank.prefetched))
    token_slot = property(lambda self: self._rows(self._bank.token_slot))
    order = property(lambda self: self._rows(self._bank.order))

    def ensure_tokens(self, n: int, align: Callable[[int], int] | None = None, staged: bool = False) -> None:
        """Make the token -> slot map cover positions [0, n) (grows by doubling;
        HotBufferBank.ensure_tokens)."""
        self._bank.ensure_tokens(n, align, staged)

    def resident(self) -> int:
        return int((self.slot_token >= 0).sum())

    @staticmethod
    def _lru(stamp: torch.Tensor, k: int) -> torch.Tensor:
        """Slots of the k smallest stamps per head, oldest first: (H, k)."""
        k = max(0, min(k, stamp.shape[1]))
        if k == 1:       # one token appended: a min reduction (a radix select on a GPU costs ~50 us)
            return stamp.argmin(dim=1, keepdim=True)
        if stamp.is_cuda:  # stamps are unique per head, so a sort ranks as topk does; on an H200 it
            # takes 25 us (int32) against topk's 78 (8 x 4,096 stamps, k 2,128; bench_lru.py); on a CPU topk wins
            return stamp.sort(dim=1).indices[:, :k]
        return stamp.topk(k, dim=1, largest=False, sorted=True).indices

    def insert(self, positions: torch.Tensor, clock: int | torch.Tensor,
               kv: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Make new tokens ``positions`` (T,) for every head, or (H, T) per head, resident as MRU
        (the last S if T > S), stamped from ``clock`` on (``ticks(inserted=min(T, S))`` stamps).

        The token -> slot map must cover them (:meth:`ensure_tokens`). Returns slots (H, T') for
        positions[..., -T':]. ``kv``: (k, v (H, T, D), k_dst, v_dst (rows, D)): their keys and
        values are written too, into the hot K / V rows of this state's heads at
        (head0 + h) * S + slot (a decode token: in the same launch); otherwise the caller writes them.
        """
        positions = positions[..., -self.num_slots:]
        T = positions.shape[-1]
        tok = positions.expand(self.num_heads, -1)
        if T == 1 and self._kernels(tok):         # a decode step's append: the minimum and the install, one launch
            one = None if kv is None else (kv[0][:, -1], kv[1][:, -1], kv[2], kv[3])
            return insert_one_triton(tok, self.token_slot_s, self.slot_token_s, self.slot_stamp_s, self.prefetched_s,
                                     self._clock(clock), self.num_slots, one, self._h0, self.order)
        victims = self._lru(self.slot_stamp, T)                                 # (H, T) LRU first
        stamps = (clock + torch.arange(T, device=self.device, dtype=STAMP))[None].expand(self.num_heads, -1)
        self._install(None, tok, victims, stamps, prefetched=False)
        if kv is not None:
            # flat rows + index_copy_: several times cheaper on CPU than a scatter_ with an index
            # expanded over D (slots are unique per head, so the writes agree)
            k, v, k_dst, v_dst = kv
            D = k.shape[-1]
            flat = ((self._h0 + torch.arange(self.num_heads, device=self.device)[:, None]) * self.num_slots
                    + victims).reshape(-1)
            new = slice(k.shape[1] - T, k.shape[1])
            k_dst.index_copy_(0, flat, k[:, new].reshape(-1, D).to(k_dst.dtype))
            v_dst.index_copy_(0, flat, v[:, new].reshape(-1, D).to(v_dst.dtype))
        return victims

    def _install(self, mask: torch.Tensor | None, tokens: torch.Tensor, slots: torch.Tensor,
                 stamps: torch.Tensor, prefetched: bool) -> None:
        """Where ``mask`` (H, M) (None: everywhere): evict what ``slots`` held and map ``tokens``
        into them with ``stamps``. Masked-out entries write to the spill columns (their slots and
        tokens may be anything); masked-in slots are distinct per head, and no token is both
        evicted and installed (installed tokens are not resident)."""
        self._bank.order_valid = False            # the generic install does not keep the order
        install = install_slots if self._bank.kernels else reference_install_slots
        install(self.token_slot_s, self.slot_token_s, self.slot_stamp_s, self.prefetched_s, mask, tokens, slots,
                stamps, prefetched)

    def lookup(self, sel: torch.Tensor, clock: int | torch.Tensor, prefetch: int = 0) -> tuple[torch.Tensor, ...]:
        """Hit detection and miss assignment for selected tokens sel (H, K), -1 padded, unique per
        row, stamped from ``clock`` on (``ticks(selected=K)`` stamps). Misses stay in place as a
        mask over sel. Returns (slots (H, K) of every selected token (-1 for padding), miss (H, K)
        bool, counts (H, 3) int64: per head the selected tokens, the hits and the hits on
        prefetched slots): a miss's token is sel, its new slot is slots, and the caller copies it
        in. The counts stay per head (summing them is a kernel the caller can fold elsewhere).

        ``prefetch``: the width P of a :meth:`prefetch` that follows at once. One ranking of the
        K + P least recent slots then serves both: after the install the least recent slots are
        the ranking's, past the misses' victims, in the same order (the victims and hits are
        stamped above every older stamp), so the prefetch needs no second one. With the kernels
        the ranking is not sorted from the stamps but taken from the bank's kept order (the order
        without the hits, then the hits), and the new order is written by the install, or by the
        prefetch when one follows.
        """
        S = self.num_slots
        K = sel.shape[1]
        if self._kernels(sel):   # the same steps in kernels, the ranking from the kept order (no sort)
            self._bank.sync_order()
            slot, miss, counts, n_miss, order = lookup_triton(
                sel, self.token_slot_s, self.slot_token_s, self.slot_stamp_s, self.prefetched_s,
                self._clock(clock), self.order, commit=not prefetch)
            if prefetch:         # the prefetch writes the new order
                self._bank.order_valid = False
                self._after_lookup = (order, n_miss, counts, clock, K)
            return slot, miss, counts
        valid = sel >= 0
        slot = torch.where(valid, self.token_slot_s.gather(1, sel + 1), -1)
        hit = slot >= 0
        miss = valid ^ hit                                                   # a hit is valid
        hit_at = torch.where(hit, slot, S)
        stamps = clock + torch.arange(K, device=self.device, dtype=STAMP).expand_as(sel)
        prefetch_used = self.prefetched_s.gather(1, hit_at).sum(1)        # the spill reads False
        self.prefetched_s.scatter_(1, hit_at, False)
        # hits become the most recent first (stamps past every miss's); then the misses' victims,
        # the least recent slots, are never hits: misses + hits <= K <= S
        self.slot_stamp_s.scatter_(1, hit_at, stamps + K)
        order = self._lru(self.slot_stamp, K + prefetch)
        victims = order.gather(1, self._rank(miss, K))
        self._install(miss, sel, victims, stamps, prefetched=False)
        counts = torch.stack([valid.sum(1), hit.sum(1), prefetch_used], 1)
        if prefetch:
            self._after_lookup = (order, miss.sum(1), counts, clock, K)
        return torch.where(miss, victims, slot), miss, counts

    def lookup_prefetch(self, sel: torch.Tensor, tokens: torch.Tensor,
                        clock: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A decode step's :meth:`lookup` of sel (H, K) and the :meth:`prefetch` of tokens (H, P)
        that follows it (as many as the lookup left room for, stamped after its stamps): with the
        kernels one launch up to LRU_STEP_MAX_HEADS heads, else the two calls (with the kernels
        four launches). Returns (slots, miss, counts, loaded, prefetch slots)."""
        if self._kernels(sel, tokens) and sel.shape[0] <= LRU_STEP_MAX_HEADS:
            self._bank.sync_order()
            return lru_step_triton(sel, tokens, self.token_slot_s, self.slot_token_s, self.slot_stamp_s,
                                   self.prefetched_s, self.order, self._clock(clock))
        slot, miss, counts = self.lookup(sel, clock, tokens.shape[1])
        return (slot, miss, counts, *self.prefetch(tokens))

    def _kernels(self, *index: torch.Tensor) -> bool:
        return self._bank.kernels and use_triton(self.slot_stamp_s, *index)

    def _clock(self, clock: int | torch.Tensor) -> torch.Tensor:
        """The clock as a device tensor a kernel reads (a decode step's already is one)."""
        return clock if isinstance(clock, torch.Tensor) else torch.tensor(clock, device=self.device)

    def _rank(self, mask: torch.Tensor, width: int) -> torch.Tensor:
        """Each entry's count of masked entries before it in its row (H, M): a masked entry's
        0-based rank among them, and for the others an index that is in range for the ``width``
        least recent slots (no clamp needed)."""
        rank = mask.cumsum(1) - mask.long()
        return rank if width <= self.num_slots else rank.clamp(max=self.num_slots - 1)

    def prefetch(self, tokens: torch.Tensor, limit: torch.Tensor | None = None,
                 clock: int | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Load tokens (H, P), -1 padded, ahead of need: at most ``limit`` (H,) per head, stamped
        from ``clock`` on (``ticks(prefetched=P)`` stamps). Already resident tokens are skipped;
        loaded slots become MRU with the prefetch flag. Returns (loaded (H, P) bool, slots (H, P)):
        the caller fills the loaded ones. Right after a ``lookup(..., prefetch=P)`` it takes its
        victims from that lookup's ranking, and at most the slots the lookup left unselected;
        there ``limit`` None means just that many and ``clock`` None the stamps after the
        lookup's (both computed where they are used, no kernel of their own)."""
        after, self._after_lookup = self._after_lookup, None
        if after is None and (limit is None or clock is None):
            raise ValueError("prefetch needs a limit and a clock unless it follows a lookup(..., prefetch=P)")
        P = tokens.shape[1]
        if after is not None and self._kernels(tokens):
            order, skip, counts, clock0, K = after
            at, offset = (self._clock(clock0), ticks(selected=K)) if clock is None else (self._clock(clock), 0)
            out = prefetch_triton(tokens, limit, counts, self.num_slots, skip, order, self.token_slot_s,
                                  self.slot_token_s, self.slot_stamp_s, self.prefetched_s, at, offset, self.order)
            self._bank.order_valid = True
            return out
        cand = (tokens >= 0) & (self.token_slot_s.gather(1, tokens + 1) < 0)
        rank = self._rank(cand, P)
        if after is None:
            cand &= rank < limit[:, None]
            victims = self._lru(self.slot_stamp, P).gather(1, rank)
        else:
            order, skip, counts, clock0, K = after
            room = self.num_slots - counts[:, 0]
            cand &= rank < (room if limit is None else torch.minimum(limit, room))[:, None]
            victims = order.gather(1, (skip[:, None] + rank).clamp(max=order.shape[1] - 1))
            if clock is None:
                clock = clock0 + ticks(selected=K)
        stamps = clock + torch.arange(P, device=self.device, dtype=STAMP).expand(self.num_heads, -1)
        self._install(cand, tokens, victims, stamps, prefetched=True)
        return cand, victims

    def invalidate(self, start: int, end: int) -> None:
        """Forget tokens in [start, end) (their host block was overwritten by streaming mode)."""
        self._bank.order_valid = False
        span = self.token_slot[:, start:end]
        h, t = (span >= 0).nonzero(as_tuple=True)
        slots = span[h, t]
        self.slot_token[h, slots] = -1
        self.prefetched[h, slots] = False
        self.slot_stamp[h, slots] = self.slot_stamp.min() - 1 - torch.arange(slots.numel(), device=self.device,
                                                                              dtype=STAMP)
        self.token_slot[:, start:end] = -1
