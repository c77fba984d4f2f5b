"""The KV block pool: which physical host blocks are free, in use, or waiting to be recycled.

Blocks are metadata only (the bytes live in :mod:`hi_sparse.host_pool`). A block moves through::

    free --get_new_blocks--> active (ref_cnt >= 1) --free_blocks (ref_cnt -> 0)--> pending_recycle
      ^                          ^                                                   |   |
      |                          +------------- touch (within grace: reclaim) --------+   |
      +------------------------- recycle_expired (grace elapsed) ------------------------+

A block released by its last owner keeps its contents for ``grace_s`` seconds so that a sequence
resumed quickly (multi-turn) can take it back without recomputation. Lists are intrusive doubly
linked lists with sentinels, so every move is O(1). Running out of blocks returns ``None``: the
caller decides (grow, evict in streaming mode, or raise a clear error).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

FREE, ACTIVE, PENDING = "free", "active", "pending_recycle"


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    state: str = FREE
    released_at: float = 0.0
    generation: int = 0  # bumped at each allocation: a restore must find the same contents
    prev: "KVBlock | None" = None
    next: "KVBlock | None" = None


class _BlockList:
    """Intrusive doubly linked list of blocks (a block is in at most one list)."""

    __slots__ = ("head", "tail", "size")

    def __init__(self) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0

    def append(self, b: KVBlock) -> None:
        last = self.tail.prev
        last.next, b.prev, b.next, self.tail.prev = b, last, self.tail, b
        self.size += 1

    def remove(self, b: KVBlock) -> None:
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.size -= 1

    def first(self) -> KVBlock | None:
        b = self.head.next
        return None if b is self.tail else b

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[KVBlock]:
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


class _Tally:
    """A count with a telemetry counter's interface (inc, value)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self, n: int = 1) -> None:
        self.value += n


EVENTS = ("allocations", "recycles", "reclaims")


class BlockPool:
    """Physical KV blocks with reference counts and a recycle grace period.

    ``num_blocks`` may be 0 and grown with :meth:`grow`. ``clock`` returns seconds (monotonic);
    tests inject a fake one. ``counters``: what counts the EVENTS, objects with ``inc`` and
    ``value`` (the runtime passes its telemetry counters); plain tallies by default.
    """

    def __init__(self, num_blocks: int = 0, grace_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, counters: Mapping[str, Any] | None = None) -> None:
        self.grace_s = grace_s
        self.clock = clock
        self.blocks: list[KVBlock] = []
        self._free = _BlockList()
        self._pending = _BlockList()  # ordered by released_at (the clock is monotonic)
        self.num_active = 0
        self._counts = {event: (counters or {}).get(event) or _Tally() for event in EVENTS}
        self.grow(num_blocks)

    @property
    def allocations(self) -> int:
        """Blocks taken from the free list, ever."""
        return int(self._counts["allocations"].value)

    @property
    def recycles(self) -> int:
        """Blocks returned to the free list after their grace period, ever."""
        return int(self._counts["recycles"].value)

    @property
    def reclaims(self) -> int:
        """Pending blocks taken back within their grace period, ever."""
        return int(self._counts["reclaims"].value)

    # -- capacity ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def grow(self, n: int) -> None:
        """Add ``n`` free blocks with the next ids."""
        start = len(self.blocks)
        for i in range(start, start + n):
            b = KVBlock(i)
            self.blocks.append(b)
            self._free.append(b)

    # -- verbs ---------------------------------------------------------------------------------
    def get_new_blocks(self, n: int, cut_grace: bool = False) -> list[KVBlock] | None:
        """Take ``n`` blocks (ref_cnt 1) or return None if there are not enough.

        Expired pending blocks are recycled first. With ``cut_grace`` (a bounded pool under
        pressure), pending blocks still inside their grace period are recycled too, oldest first.
        """
        self.recycle_expired()
        if cut_grace:
            while len(self._free) < n and len(self._pending):
                self._recycle(self._pending.first())
        if len(self._free) < n:
            return None
        out = []
        for _ in range(n):
            b = self._free.first()
            self._free.remove(b)
            b.ref_cnt, b.state = 1, ACTIVE
            b.generation += 1
            out.append(b)
        self.num_active += n
        self._counts["allocations"].inc(n)
        return out

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; a block with no owner starts its grace period."""
        now = self.clock()
        for b in blocks:
            if b.state != ACTIVE or b.ref_cnt <= 0:
                raise RuntimeError(f"bug: freeing block {b.block_id} in state {b.state} with "
                                   f"ref_cnt {b.ref_cnt} (double free)")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                b.state, b.released_at = PENDING, now
                self._pending.append(b)
                self.num_active -= 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference; a pending block is reclaimed (its contents are still valid)."""
        for b in blocks:
            if b.state == ACTIVE:
                b.ref_cnt += 1
            elif b.state == PENDING:
                self._pending.remove(b)
                b.state, b.ref_cnt = ACTIVE, 1
                self.num_active += 1
                self._counts["reclaims"].inc(1)
            else:
                raise RuntimeError(f"bug: touching free block {b.block_id}; its contents are gone")

    def recycle_expired(self, now: float | None = None) -> int:
        """Return pending blocks whose grace period has elapsed to the free list."""
        now = self.clock() if now is None else now
        n = 0
        b = self._pending.first()
        while b is not None and b.released_at + self.grace_s <= now:
            self._recycle(b)
            n += 1
            b = self._pending.first()
        return n

    def _recycle(self, b: KVBlock) -> None:
        self._pending.remove(b)
        b.state, b.ref_cnt = FREE, 0
        self._free.append(b)
        self._counts["recycles"].inc(1)

    # -- checks --------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise if the lists and counts disagree (used by tests; O(num_blocks))."""
        free = {b.block_id for b in self._free}
        pending = {b.block_id for b in self._pending}
        active = {b.block_id for b in self.blocks if b.state == ACTIVE}
        if free & pending or free & active or pending & active:
            raise RuntimeError("bug: a block is in two states at once")
        if len(free) + len(pending) + len(active) != len(self.blocks):
            raise RuntimeError("bug: a block is in no state (leak)")
        if len(active) != self.num_active:
            raise RuntimeError(f"bug: num_active {self.num_active} != {len(active)} active blocks")
        for b in self.blocks:
            if (b.state == ACTIVE) != (b.ref_cnt > 0):
                raise RuntimeError(f"bug: block {b.block_id} is {b.state} with ref_cnt {b.ref_cnt}")
