"""Page table: (sequence, logical block) -> physical block, plus each sequence's token count.

A fork shares its source's full blocks (:meth:`PageTable.share`: reference counts in the block
pool; a full block is never written again), so forks of one prompt hold one copy of it.

Pure bookkeeping over :class:`~hi_sparse.block_pool.BlockPool`; tensors are built by the caller
from :meth:`PageTable.block_ids` (``version`` says when a cached tensor is stale, ``edits`` when
more changed than blocks appended at the end). A logical block
may become a *hole* (``None``) when streaming mode overwrote it: its tokens are gone for good.

    tokens:   |0 ........ bs-1|bs ....... 2bs-1|2bs ... n-1     |
    logical:  |   block 0     |    block 1     |  block 2 (tail) |
    physical: |     17        |      4         |      9          |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .block_pool import BlockPool, KVBlock


@dataclass(slots=True)
class SequencePages:
    blocks: list[KVBlock | None] = field(default_factory=list)
    num_tokens: int = 0
    version: int = 0
    edits: int = 0                     # changes of the block list other than appending blocks
    holes: int = 0                     # logical blocks streaming mode detached
    generations: tuple[int, ...] = ()  # of each live block when removed (for restore)


class PoolExhausted(RuntimeError):
    """The host pool has no free block for a new token."""


class PageTable:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.seqs: dict[int, SequencePages] = {}

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            raise RuntimeError(f"bug: sequence {seq_id} already has a page table")
        self.seqs[seq_id] = SequencePages()

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Blocks to allocate before ``new_tokens`` more tokens fit."""
        p = self.seqs[seq_id]
        have = len(p.blocks) * self.block_size
        short = p.num_tokens + new_tokens - have
        return max(0, -(-short // self.block_size))

    def extend(self, seq_id: int, new_tokens: int, blocks: list[KVBlock]) -> None:
        """Record ``new_tokens`` more tokens, appending ``blocks`` (exactly those needed)."""
        if len(blocks) != self.blocks_needed(seq_id, new_tokens):
            raise RuntimeError(f"bug: extend of sequence {seq_id} by {new_tokens} tokens got "
                               f"{len(blocks)} blocks, needs {self.blocks_needed(seq_id, new_tokens)}")
        p = self.seqs[seq_id]
        p.blocks.extend(blocks)
        p.num_tokens += new_tokens
        if blocks:               # the version names the block list (cached block tables)
            p.version += 1

    def share(self, seq_id: int, src_id: int) -> list[KVBlock]:
        """A new sequence that continues from ``src_id``'s full blocks, shared (one more reference
        each: a full block is never written again); the caller then extends it by the rest (its
        own partly filled block). Sharing first keeps the blocks' reference counts above one
        while that block is allocated, so streaming eviction cannot pick them. Returns them."""
        src, p = self.seqs[src_id], self.seqs[seq_id]
        if p.blocks or p.num_tokens:
            raise RuntimeError(f"bug: sequence {seq_id} already holds tokens; it cannot share {src_id}'s")
        full = src.num_tokens // self.block_size
        if any(b is None for b in src.blocks):
            raise RuntimeError(f"bug: sharing sequence {src_id} ({len(src.blocks)} blocks, {full} full, "
                               f"holes {src.holes})")
        shared = src.blocks[:full]
        self.pool.touch(shared)
        p.blocks = list(shared)
        p.num_tokens = full * self.block_size
        p.version += 1
        p.edits += 1
        return shared

    def block_ids(self, seq_id: int) -> list[int]:
        """Physical block id per logical block (-1 for a hole)."""
        return [-1 if b is None else b.block_id for b in self.seqs[seq_id].blocks]

    def num_tokens(self, seq_id: int) -> int:
        return self.seqs[seq_id].num_tokens

    def punch_hole(self, seq_id: int, logical: int) -> KVBlock:
        """Detach a logical block (streaming eviction); returns the physical block, still active."""
        p = self.seqs[seq_id]
        b = p.blocks[logical]
        if b is None:
            raise RuntimeError(f"bug: logical block {logical} of sequence {seq_id} is already a hole")
        p.blocks[logical] = None
        p.version += 1
        p.edits += 1
        p.holes += 1
        return b

    def remove(self, seq_id: int) -> SequencePages:
        """Forget a sequence and drop its references (blocks enter their grace period)."""
        p = self.seqs.pop(seq_id)
        live = [b for b in p.blocks if b is not None]
        p.generations = tuple(b.generation for b in live)
        self.pool.free_blocks(live)
        return p

    def restore(self, seq_id: int, pages: SequencePages) -> bool:
        """Take back a removed sequence if all its blocks still hold its tokens: pending (reclaim),
        or active because another sequence shares them (a fork); else False."""
        live = [b for b in pages.blocks if b is not None]
        if seq_id in self.seqs or any(b.state == "free" or b.generation != g
                                      for b, g in zip(live, pages.generations)):
            return False
        self.pool.touch(live)
        pages.version += 1
        pages.edits += 1
        self.seqs[seq_id] = pages
        return True
