"""Exact attention for prefill (a forward of several new tokens), and reading a whole context.

A prefill chunk attends causally over everything its sequence holds: earlier tokens read back
from the host pool (dequantized when quantized), this step's own new tokens as appended (kept
exactly: a quantized pool would round them). The audit and recalibration read contexts the
same way (:class:`ContextReader`).
"""

from __future__ import annotations

import torch
from torch.nn.attention.bias import causal_lower_right

from .host_pool import HostPool
from .host_seal import to_device
from .layers import KVShape, LayerRows
from .page_table import PageTable
from .recalibration import remember_queries
from .sequences import Sequence
from .storage import Storage
from .trace import phase

_PREFILL_SCORE_BUDGET = 1 << 25  # elements of one prefill attention score chunk (CPU: math kernel)
_PREFILL_MASK_BUDGET = 1 << 29   # bytes of one prefill boolean mask chunk (CUDA: fused kernels)


class ContextReader:
    """A sequence's K/V and visibility as the host pool holds them."""

    def __init__(self, host: HostPool, pages: PageTable, storage: Storage, block_size: int) -> None:
        self.host, self.pages, self.storage, self.block_size = host, pages, storage, block_size

    def read(self, s: Sequence, layer: LayerRows, heads: torch.Tensor, pos: torch.Tensor,
             dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of tokens pos at KV heads heads (broadcast: (*S,)) -> two (*S, D) on the layer's device."""
        full = self.pages.num_tokens(s.seq_id) // self.block_size
        dev = layer.device
        # on a GPU the rows are gathered by the GPU from the pinned pool (no host-side gather)
        k, v = self.host.read(layer.index, self.storage.block_table(s), s.tail_slot, full, heads.cpu(),
                              pos.cpu(), dtype, device=dev if dev.type == "cuda" else None)
        return k.to(dev), v.to(dev)

    def read_meta(self, seqs: list[Sequence], layer: LayerRows, tables: dict | None = None) -> torch.Tensor:
        """What :meth:`read_batch` reads B sequences by, as they are now: (B, W + 3) int64 on the
        host, each row a block table (-1 padded to W) then its tail slot, complete blocks and
        length at the layer. ``tables``: block tables by sequence id, filled as they are made
        (the layers of one step share them)."""
        made = {} if tables is None else tables
        for s in seqs:
            if s.seq_id not in made:
                made[s.seq_id] = self.storage.block_table(s)
        padded = torch.nn.utils.rnn.pad_sequence([made[s.seq_id] for s in seqs], batch_first=True, padding_value=-1)
        per_seq = torch.tensor([[s.tail_slot, self.pages.num_tokens(s.seq_id) // self.block_size,
                                 s.lengths[layer.index]] for s in seqs])
        return torch.cat([padded, per_seq], 1)

    def tail_rows(self, meta: torch.Tensor, device: torch.device) -> torch.Tensor | None:
        """Where :meth:`read_tails` reads the sequences ``meta`` describes from, on ``device`` (the
        same at every layer of a step: made once for them), -1 past each tail's last token (a read
        takes none from there); None for a pool without tails."""
        if not self.host.quantized:
            return None
        slot, full, length = to_device(meta[:, -3:].contiguous(), device).unbind(1)
        rows = self.host.tail_block_rows(slot)                                                  # (B, Hkv, block)
        held = torch.arange(self.block_size, device=device) < (length - full * self.block_size)[:, None]
        return torch.where(held[:, None], rows, -1)

    def read_tails(self, meta: torch.Tensor, layers: list[LayerRows], rows: torch.Tensor | None = None
                   ) -> torch.Tensor | None:
        """The float tails of the sequences ``meta`` describes at each of ``layers`` (on one
        device), read now in one gather: (L, B, Hkv, block, D) keys in the stored dtype there, what
        a later :meth:`read_batch` with ``meta`` takes its tail positions from (a sequence's next
        block reuses its tail); None for a pool without tails. ``rows``: :meth:`tail_rows`, made
        before."""
        if not self.host.quantized:
            return None
        rows = self.tail_rows(meta, layers[0].device) if rows is None else rows
        return self.host.read_tails([layer.index for layer in layers], rows)

    def read_batch(self, seqs: list[Sequence], layer: LayerRows, n: int, head: int | None = None,
                   dtype: torch.dtype = torch.float32, meta: torch.Tensor | None = None,
                   tails: torch.Tensor | None = None) -> torch.Tensor:
        """The keys of the first n positions of B sequences at every KV head (or at ``head`` only)
        in one read -> (B, Hkv or 1, n, D) on the layer's device; a position at or past a
        sequence's length holds a copy of its last token (:meth:`visible_batch` masks it out).
        What the read needs is copied to a GPU in one transfer. ``meta`` (:meth:`read_meta`,
        taken earlier): the sequences as they were then, and ``tails`` (:meth:`read_tails`, read
        then) their float tails: a read that runs later reads what was there then."""
        meta = self.read_meta(seqs, layer) if meta is None else meta
        pos = torch.arange(n, device=layer.device)[None]
        k = self._read(meta, layer, pos, head, dtype)
        if tails is None:
            return k
        dev = k.device
        full, length = to_device(meta[:, -2:], dev).unbind(1)
        at = torch.minimum(torch.arange(n, device=dev), (length - 1).clamp_min(0)[:, None])              # (B, n)
        in_tail = (at // self.block_size >= full[:, None])[:, None, :, None]
        heads = slice(None) if head is None else slice(head, head + 1)
        from_tail = tails[:, heads].gather(2, (at % self.block_size)[:, None, :, None].expand(-1, k.shape[1], -1,
                                                                                                k.shape[3]))
        return torch.where(in_tail, from_tail.to(dtype), k)

    def _read(self, meta: torch.Tensor, layer: LayerRows, pos: torch.Tensor, head: int | None,
              dtype: torch.dtype) -> torch.Tensor:
        """Keys at positions ``pos`` ((1 or B, n), clamped to each length; or (B, 1, n)) of the
        sequences ``meta`` describes -> (B, Hkv or 1, n, D) on the layer's device."""
        dev = layer.device
        meta = to_device(meta, dev)
        W = meta.shape[1] - 3
        tail, full, length = meta[:, W:].unbind(1)
        pos = to_device(pos, dev)      # (a blocking copy would wait for the device: a host sync)
        if pos.dim() == 2:
            pos = torch.minimum(pos, (length - 1).clamp_min(0)[:, None])[:, None]                 # (B, 1, n)
        H = self.host.num_kv_heads
        heads = torch.arange(H, device=dev) if head is None else torch.full((1,), head, device=dev)
        k, _ = self.host.read(layer.index, meta[:, :W], tail, full, heads[None, :, None], pos, dtype,
                              device=dev if dev.type == "cuda" else None, values=False)
        return k                       # on dev: gathered there (a GPU), or the host's rows (the CPU)

    def visible(self, s: Sequence, layer: LayerRows, n: int) -> torch.Tensor:
        """(n,) bool on the layer's device: positions after the left padding and outside holes."""
        return self.visible_batch([s], layer, n)[0]

    def visible_batch(self, seqs: list[Sequence], layer: LayerRows, n: int) -> torch.Tensor:
        """(B, n) bool on the layer's device: each sequence's positions after its left padding,
        before its length at the layer, and outside holes."""
        dev = layer.device
        per_seq = torch.tensor([[s.first_token, s.lengths[layer.index], s.row] for s in seqs])
        first, length, row = to_device(per_seq, dev).unbind(1)
        pos = torch.arange(n, device=dev)
        holes = layer.bank.t["holes"][row[:, None], (pos // self.block_size)[None]]
        return (pos >= first[:, None]) & (pos < length[:, None]) & ~holes


class PrefillAttention:
    """Exact causal attention of a prefill chunk, over its sequence's whole context."""

    def __init__(self, shape: KVShape, reader: ContextReader) -> None:
        self.shape, self.reader = shape, reader
        # per layer: exact copies of this step's new K/V (Hkv, T, D) by sequence id
        self._new: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(shape.num_layers)]

    def keep(self, layer: int, seqs: list[Sequence], k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's new K/V of the sequences, k, v (B, Hkv, T, D) as appended (a copy of one
        that is a view of a larger buffer: kept until the step's last layer, the view would keep
        the whole buffer, such as the fused q/k/v output of fused_projections, 6x v's bytes in
        Llama-3-8B, ~11 GB over a 32K chunk's 32 layers)."""
        k, v = _own(k), _own(v)
        for b, s in enumerate(seqs):
            self._new[layer][s.seq_id] = (k[b], v[b])

    def end_step(self) -> None:
        for kept in self._new:
            kept.clear()

    def forget(self, seq_ids: list[int]) -> None:
        for kept in self._new:
            for seq_id in seq_ids:
                kept.pop(seq_id, None)

    def attend(self, layer: LayerRows, s: Sequence, q: torch.Tensor) -> torch.Tensor:
        """Exact causal attention of q (Hq, Tq, D), the sequence's last Tq tokens -> (Hq, Tq, D)."""
        shape = self.shape
        n, Tq = s.lengths[layer.index], q.shape[1]
        kl, vl = self._new[layer.index].get(s.seq_id, (None, None))
        new = kl.shape[1] if kl is not None else 0
        old = n - new
        if old > 0:
            with phase("prefill.read_context"):
                ko, vo = self.reader.read(s, layer, torch.arange(shape.num_kv_heads)[:, None],
                                          torch.arange(old)[None], shape.dtype)
            k = torch.cat([ko, kl], 1) if new else ko
            v = torch.cat([vo, vl], 1) if new else vo
        else:
            k, v = kl, vl
        # no left padding and no holes: every earlier position is visible, so the mask is the
        # causal one (SDPA's own: no mask tensor, the fused kernels, no chunks)
        plain = s.first_token == 0 and not self.reader.storage.has_holes(s)
        visible = None if plain else self.reader.visible(s, layer, n)
        with phase("prefill.attention"):
            out = _causal(q, k.to(q.dtype), v.to(q.dtype), visible, shape.group_size)
        remember_queries(layer.bank, slice(s.row, s.row + 1), q.transpose(0, 1)[None])
        kept = layer.bank.size("queries", 0)
        s.queries_kept[layer.index] = min(kept, s.queries_kept[layer.index] + Tq)
        return out


def _own(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it (the same dimension order, dense) when t views a buffer over twice its
    own bytes."""
    return t.clone() if t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size() else t


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
            group: int) -> torch.Tensor:
    """q (Hq, Tq, D) at the last Tq of n positions over k, v (Hkv, n, D); visible (n,) bool (a
    query always sees itself), or None when every position is. With a mask: chunked over queries
    so that scores or masks stay bounded."""
    n, Tq = k.shape[1], q.shape[1]
    if visible is None:
        # SDPA's own causal mask, aligned to the bottom right for a later chunk (CausalBias
        # dispatches that to flash on a GPU): the fused kernels, no mask tensor, no chunks. On a
        # GPU equal head counts keep it off the math kernel (which would hold Tq x n scores); the
        # CPU's fused kernel takes the GQA group itself
        gqa = group > 1
        if q.is_cuda and gqa:
            k, v, gqa = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), False
        mask = None if Tq == n else causal_lower_right(Tq, n)
        return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                                is_causal=Tq == n, enable_gqa=gqa)[0]
    kpos = torch.arange(n, device=q.device)
    qpos = torch.arange(n - Tq, n, device=q.device)
    gqa = group > 1
    if q.is_cuda:
        # the memory-efficient kernel takes a mask without materialising scores, so chunks
        # are bounded by the mask; it wants equal head counts, so K/V are expanded
        chunk = max(1, _PREFILL_MASK_BUDGET // n)
        if gqa:
            k, v, gqa = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), False
    else:
        chunk = max(1, _PREFILL_SCORE_BUDGET // max(1, q.shape[0] * n))
    outs = []
    for c in range(0, Tq, chunk):
        qp = qpos[c:c + chunk]
        mask = ((kpos[None] <= qp[:, None]) & visible[None]) | (kpos[None] == qp[:, None])
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[None, :, c:c + chunk], k[None], v[None], attn_mask=mask[None, None], enable_gqa=gqa)[0])
    return torch.cat(outs, 1)
