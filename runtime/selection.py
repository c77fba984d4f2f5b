"""Token selection for one decode step of one sequence and layer, per KV head (GQA group).

At most ``top_k`` tokens per KV head: the last ``window`` tokens, the pinned anchors, then tokens
of the blocks with the highest upper bound of q.k (Quest: per-block elementwise min/max keys),
in rank order, until ``top_k`` is reached (the last block may be taken in part)::

    tokens:  |pad| ........ candidate blocks ranked by bound ........ | window |
                      ^anchors pinned anywhere before the window

Tokens before ``first`` (left padding) and tokens of holes (blocks streaming mode overwrote)
are never selected. With ``top_k`` >= the visible context every visible token is selected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hi_sparse.kernels import block_scores, two_level_candidates, two_level_pays


def bound_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, smin: torch.Tensor, smax: torch.Tensor,
                 group: int, n_super: int, limit: int) -> torch.Tensor:
    """Quest upper bounds (..., Hkv, NB) of the blocks for q (..., Hkv, G, D) against key bounds
    kmin / kmax (..., Hkv, NB, D). When two-level scoring pays (long context) only the blocks of
    the best super-blocks (smin / smax (..., Hkv, >= NS, D)) before block ``limit`` are scored;
    the others get -inf (select never takes window blocks from the ranking anyway)."""
    nb = kmin.shape[-2]
    if not two_level_pays(nb, group, n_super):
        return block_scores(q, kmin, kmax)
    ns = -(-nb // group)
    blocks, sc = two_level_candidates(q, kmin, kmax, smin[..., :ns, :], smax[..., :ns, :], group, n_super,
                                      limit=limit)
    # column 0 collects the -1 padding of the candidate list and is cut off
    full = torch.full((*sc.shape[:-1], nb + 1), float("-inf"), device=sc.device)
    return full.scatter_(-1, blocks + 1, sc)[..., 1:]


@dataclass
class Selection:
    """tokens: (Hkv, K) selected positions, -1 padded, unique per row.
    prefetch: (Hkv, P) positions predicted for the next step (next-ranked blocks), -1 padded.
    block_hits: (NB,) selected tokens per logical block over all heads (importance for streaming).
    loaded: 0-dim, tokens in the blocks the selection touched, summed over heads.
    """
    tokens: torch.Tensor
    prefetch: torch.Tensor
    block_hits: torch.Tensor
    loaded: torch.Tensor


def select(scores: torch.Tensor | None, n_tokens: int, first: int | torch.Tensor, window: int, top_k: int,
           block_size: int, anchors: torch.Tensor, holes: torch.Tensor | None,
           prefetch_blocks: int = 0, num_heads: int | None = None,
           first_range: tuple[int, int] | None = None) -> Selection:
    """Select tokens for each KV head.

    scores: (Hkv, NB) fp32 block upper bounds (NB = ceil(n_tokens / block_size)), or None when
    everything visible fits. anchors: (Hkv, A) positions, -1 padded. holes: (NB,) bool or None.

    A batch of sequences of one length is one call with their heads stacked (Hkv = B x heads):
    ``first`` is then a (Hkv,) tensor of each head's sequence's first position and
    ``first_range`` its (min, max) on the host; every head must have more than ``top_k`` visible
    tokens and its window after ``first`` (the caller checks), and ``holes`` must be None.
    """
    if isinstance(first, torch.Tensor):
        if first_range is None or holes is not None or scores is None:
            raise ValueError("bug: a per-head first needs first_range, scores and no holes")
        f_lo, f_hi = first_range
        if n_tokens - f_hi <= top_k or n_tokens - window < f_hi:
            raise ValueError("bug: batched select needs every head's context longer than top_k "
                             "and its window after its first token")
        return _select_ranked(scores, n_tokens, first[:, None], f_lo, n_tokens - window, top_k, block_size,
                              anchors, None, prefetch_blocks, anchors.shape[0])
    device = anchors.device
    H = anchors.shape[0] if num_heads is None else num_heads
    bs = block_size
    nb = -(-n_tokens // bs)
    visible = n_tokens - first
    if holes is not None and bool(holes.any()):
        hb = holes.nonzero().squeeze(1)
        lo = torch.clamp(hb * bs, min=first)
        hi = torch.clamp((hb + 1) * bs, max=n_tokens)
        visible -= int((hi - lo).clamp(min=0).sum())
    if scores is None or visible <= top_k:
        pos = torch.arange(first, n_tokens, device=device)
        if holes is not None and bool(holes.any()):
            pos = pos[~holes[pos // bs]]
        tokens = pos[None].expand(H, -1)
        counts = torch.bincount(pos // bs, minlength=nb) * H
        e = torch.empty(H, 0, dtype=torch.int64, device=device)
        return Selection(tokens, e, counts, torch.tensor(pos.numel() * H))
    return _select_ranked(scores, n_tokens, first, first, max(first, n_tokens - window), top_k, bs, anchors,
                          holes, prefetch_blocks, H)


def candidate_blocks(nb: int, w0: int, first_lo: int, bs: int) -> int:
    """Upper bound, on the host, on the blocks that hold candidates: those of the nb before the
    window (start w0) from the block of first_lo (<= every sequence's first position) on."""
    return max(0, min(nb, -(-w0 // bs)) - first_lo // bs)


def _select_ranked(scores: torch.Tensor, n_tokens: int, first, first_lo: int, w0: int, top_k: int, bs: int,
                   anchors: torch.Tensor, holes: torch.Tensor | None, prefetch_blocks: int, H: int) -> Selection:
    """Window, anchors and ranked blocks. first: an int or (H, 1) per head; first_lo <= every
    first (host); w0: the window start (host, the same for every head)."""
    nb = -(-n_tokens // bs)
    if holes is None:  # candidate blocks counted on the host (at most): no device sync
        n_cand = candidate_blocks(nb, w0, first_lo, bs)
    else:
        blk = torch.arange(nb, device=anchors.device)
        n_cand = int(((blk * bs < w0) & ((blk + 1) * bs > first) & ~holes).sum())
    return _rank(scores, n_tokens, first, w0, n_tokens - w0, top_k, bs, anchors, holes, prefetch_blocks, H,
                 nb, n_cand, fixed=False)


def select_fixed(scores: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor, window: int, top_k: int,
                 block_size: int, anchors: torch.Tensor, prefetch_blocks: int, n_cand: int) -> Selection:
    """:func:`select` of a batch without host syncs and at fixed widths (a CUDA graph can hold it).

    scores (H, NB) over heads of sequences that all hold ``n_tokens`` (0-dim device tensor) tokens,
    more than ``top_k`` visible, with the window after ``first`` (H, 1); n_cand: an upper bound
    on the candidate blocks before the window (host). Tokens are (H, window + A + top_k - window),
    prefetch (H, prefetch_blocks * block_size), -1 padded: the same tokens as select in the same
    order, with wider padding.
    """
    H, nb = scores.shape
    return _rank(scores, n_tokens, first, n_tokens - window, window, top_k, block_size, anchors, None,
                 prefetch_blocks, H, nb, n_cand, fixed=True)


def _rank(scores, n_tokens, first, w0, window: int, top_k: int, bs: int, anchors: torch.Tensor, holes,
          prefetch_blocks: int, H: int, nb: int, n_cand: int, fixed: bool) -> Selection:
    """The ranked selection; n_tokens and w0 are ints or 0-dim device tensors, first an int or
    (H, 1); window = n_tokens - w0 (host); fixed: output widths from the budget, not the data."""
    device = anchors.device
    win = (w0 + torch.arange(window, device=device))[None].expand(H, -1)
    anc = torch.where((anchors >= first) & (anchors < w0), anchors, -1)
    if holes is not None:
        anc = torch.where(holes[anc.clamp(min=0) // bs], -1, anc)
    budget = top_k - window - (anc >= 0).sum(1)                              # (H,)
    # blocks that hold candidates: before the window, not holes
    blk = torch.arange(nb, device=device)
    cand_blk = (blk * bs < w0) & ((blk + 1) * bs > first)
    if holes is not None:
        cand_blk &= ~holes
    s = torch.where(cand_blk if cand_blk.dim() == 2 else cand_blk[None], scores.float(), float("-inf"))
    # enough ranked blocks for the largest budget (top_k - window bounds it on the host: no sync),
    # anchors that may overlap them, a partial first block and the prefetch
    take = min(n_cand, -(-(top_k - window + anc.shape[1]) // bs) + 2 + prefetch_blocks)
    top = s.topk(take, dim=1).indices                                         # (H, take) ranked
    pos = (top[:, :, None] * bs + torch.arange(bs, device=device)).reshape(H, -1)  # rank order
    ok = (pos >= first) & (pos < w0) & torch.isfinite(s.gather(1, top)).repeat_interleave(bs, 1)
    if anc.shape[1]:
        # per-head membership through a dense (H, 1 + nb*bs) mask: a scatter and a gather are
        # several times cheaper than a sorted isin; column 0 collects the -1 padding
        member = torch.zeros(H, nb * bs + 1, dtype=torch.bool, device=device)
        member.scatter_(1, anc + 1, True)
        member[:, 0] = False
        ok &= ~member.gather(1, pos + 1)
    rank = ok.long().cumsum(1)                                                # 1-based among ok
    # kept: the first budget ok positions; prefetch: the next prefetch_blocks blocks' worth. Both
    # are runs of consecutive ranks, so each packs by a scatter to rank - offset (no sort); the
    # widths of both come back in one host read (fixed: their upper bounds, no read)
    lim = budget + prefetch_blocks * bs
    if fixed:
        w_keep, w_pf = top_k - window, prefetch_blocks * bs
    else:
        total = rank[:, -1] if rank.shape[1] else torch.zeros(H, dtype=torch.int64, device=device)
        n_keep = torch.minimum(total, budget).clamp(min=0)
        n_pf = (torch.minimum(total, lim) - n_keep).clamp(min=0)
        w_keep, w_pf = torch.stack([n_keep.max(), n_pf.max()]).tolist() if H else (0, 0)
    chosen = _scatter_pack(pos, ok & (rank <= budget[:, None]), rank - 1, w_keep)
    tokens = torch.cat([win, anc, chosen], 1)
    pf = ok & (rank > budget[:, None]) & (rank <= lim[:, None])
    prefetch = _scatter_pack(pos, pf, rank - 1 - budget.clamp(min=0)[:, None], w_pf)
    valid = tokens >= 0
    per_block = torch.zeros(H, nb, dtype=torch.int64, device=device)
    per_block.scatter_add_(1, tokens.clamp(min=0) // bs, valid.long())
    block_hits = per_block.sum(0)
    sizes = torch.clamp(n_tokens - blk * bs, max=bs)
    loaded = ((per_block > 0).long() * sizes[None]).sum()
    return Selection(tokens, prefetch, block_hits, loaded)


def _scatter_pack(pos: torch.Tensor, mask: torch.Tensor, dest: torch.Tensor, width: int) -> torch.Tensor:
    """(H, width) with pos[h, j] at column dest[h, j] where mask; -1 elsewhere.

    pos, mask, dest: (H, L); the masked dest of each row must be exactly 0..count-1 (a left-pack
    in order). Unmasked entries go to a spill column that is cut off.
    """
    H = pos.shape[0]
    out = torch.full((H, width + 1), -1, dtype=pos.dtype, device=pos.device)
    out.scatter_(1, torch.where(mask, dest, width), pos)
    return out[:, :width]
