"""Host blocks of the sequences: pages for new tokens, allocation and streaming eviction.

Allocation takes free blocks; a pool without ``host_pool_blocks`` grows geometrically, a bounded
one first recycles pending blocks early and then, in streaming mode, overwrites the least
important blocks (never anchors, padding, the window, holes or blocks forks share) and leaves
holes in their sequences (page_table.py). Importance is the number of selected tokens per block, which every
decode step adds up in the layers' banks.
"""

from __future__ import annotations

import torch

from .block_pool import BlockPool, KVBlock
from .config import HiSparseConfig
from .host_pool import HostPool
from .layers import LayerRows
from .metrics import RuntimeMetrics
from .page_table import PageTable, PoolExhausted
from .sequences import Sequence, SequenceTable


class Storage:
    def __init__(self, cfg: HiSparseConfig, pool: BlockPool, pages: PageTable, host: HostPool,
                 layers: list[LayerRows], sequences: SequenceTable, metrics: RuntimeMetrics) -> None:
        self.cfg, self.pool, self.pages, self.host = cfg, pool, pages, host
        self.layers, self.sequences, self.metrics = layers, sequences, metrics

    def extend(self, seqs: list[Sequence], lengths: list[int]) -> None:
        """Pages for ``lengths[i]`` tokens in sequence i (within max_seq_len)."""
        for s, n in zip(seqs, lengths):
            if n > self.cfg.max_seq_len:
                raise ValueError(f"sequence {s.seq_id} would hold {n} tokens, more than max_seq_len="
                                 f"{self.cfg.max_seq_len}; raise max_seq_len")
            have = self.pages.num_tokens(s.seq_id)
            if n > have:
                need = self.pages.blocks_needed(s.seq_id, n - have)
                self.pages.extend(s.seq_id, n - have, self.allocate(s, need) if need else [])

    def allocate(self, s: Sequence, need: int) -> list[KVBlock]:
        """``need`` blocks for sequence s, or PoolExhausted naming the fix."""
        pool = self.pool
        blocks = pool.get_new_blocks(need)
        if blocks is None and self.cfg.host_pool_blocks is None:
            pool.grow(max(need, _growth(pool.num_blocks)))
            self.host.grow(blocks=pool.num_blocks)
            self.host.lock_ahead(pool.num_blocks + _growth(pool.num_blocks))     # the next growth's pages
            blocks = pool.get_new_blocks(need)
        if blocks is None and pool.num_pending:
            blocks = pool.get_new_blocks(need, cut_grace=True)
        if blocks is None and self.cfg.streaming:
            blocks = self._evict(need - pool.num_free)
            if blocks is not None:
                blocks += pool.get_new_blocks(need - len(blocks)) or []
        if blocks is None or len(blocks) != need:
            raise PoolExhausted(
                f"host KV pool exhausted: {pool.num_blocks} blocks of {self.cfg.cache_block_size} tokens are all "
                f"in use and sequence {s.seq_id} needs {need} more; raise host_pool_blocks, free "
                "sequences, or set streaming=True to overwrite unimportant blocks")
        return blocks

    def _evict(self, n: int) -> list[KVBlock] | None:
        """Streaming mode: detach the n least important evictable blocks (never anchors, window, tail)."""
        bs, window = self.cfg.cache_block_size, self.cfg.window_size
        cands = []  # (importance, seq id, logical block)
        for s in self.sequences.live.values():
            limit = (min(s.lengths) - window) // bs  # blocks wholly before the window
            if limit <= 0:
                continue
            imp = sum(layer.bank.t["importance"][s.row, :limit].cpu() for layer in self.layers)
            imp[s.holes[:limit].cpu()] = float("inf")
            for layer in self.layers:
                a = layer.bank.t["anchors"][s.row].cpu()
                a = a[a >= 0] // bs
                imp[a[a < limit]] = float("inf")
            imp[: -(-s.first_token // bs) if s.first_token else 0] = float("inf")  # keep pad blocks simple
            # a block a fork shares holds the other sequences' tokens too
            shared = [b is not None and b.ref_cnt > 1 for b in self.pages.seqs[s.seq_id].blocks[:limit]]
            imp[torch.tensor(shared, dtype=torch.bool)] = float("inf")
            for lb in torch.nonzero(torch.isfinite(imp)).squeeze(1).tolist():
                cands.append((float(imp[lb]), s.seq_id, lb))
        if len(cands) < n:
            return None
        cands.sort()
        out = []
        for _, seq_id, lb in cands[:n]:
            s = self.sequences.live[seq_id]
            out.append(self.pages.punch_hole(seq_id, lb))
            for layer, hot in zip(self.layers, s.hot):
                layer.bank.t["holes"][s.row, lb] = True
                hot.invalidate(lb * bs, (lb + 1) * bs)
            self.metrics.block_evictions.inc()
        return out

    def block_table(self, s: Sequence) -> torch.Tensor:
        """Physical block id per logical block (-1 for a hole), cached on the CPU: its readers (the
        host pool's seal and read) index pinned host memory with it."""
        version = self.pages.seqs[s.seq_id].version
        if s.table_version != version:
            s.block_table = torch.tensor(self.pages.block_ids(s.seq_id), dtype=torch.int64)
            s.table_version = version
        return s.block_table

    def has_holes(self, s: Sequence) -> bool:
        return self.pages.seqs[s.seq_id].holes > 0


def _growth(blocks: int) -> int:
    """How many blocks a pool of ``blocks`` grows by, at least (geometric: O(1) amortised work)."""
    return max(blocks // 4, 16)
