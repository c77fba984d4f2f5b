"""Token selection for one decode step of a batch, per KV head (GQA group).

At most ``top_k`` tokens per KV head: the last ``window`` tokens, the pinned anchors, the first
``sinks`` visible tokens, then tokens of the blocks with the highest upper bound of q.k (Quest:
per-block elementwise min/max keys), in rank order, until ``top_k`` is reached (the last block
may be taken in part)::

    tokens:  |pad|sinks| ........ candidate blocks ranked by bound ........ | window |
                      ^anchors pinned anywhere before the window

The sinks: on SmolLM2 half of the layers put 20-55 % of their attention on token 0 (attention
sinks), and a ranked block holding it is not always among the best bounds; a selection without
it renormalizes the rest (docs/quality/README.md: the 5th percentile of the mass kept in such
layers rose from 0.04-0.31 to 0.5-0.75 with 4 sinks).

Tokens before ``first`` (left padding) and tokens of holes (blocks streaming mode overwrote)
are never selected; with ``top_k`` >= the visible context every visible token is selected.

One call selects for every KV head of every sequence of a batch: a *row* is one (sequence, KV
head), and each row carries its sequence's token count and first position as device tensors,
so sequences of different lengths, paddings and holes select together without a host sync, at
widths fixed on the host (a CUDA graph can hold the call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hi_sparse.kernels import block_scores, two_level_candidates, two_level_pays
from hi_sparse.kernels._dispatch import use_triton
from hi_sparse.kernels.select import RANK_MAX, assemble_selection, candidate_scores, ranked_candidates, ranked_listed


def bound_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, smin: torch.Tensor, smax: torch.Tensor,
                 group: int, n_super: int, limit: int | torch.Tensor, row_blocks: torch.Tensor | None = None,
                 listed: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Quest upper bounds (..., Hkv, NB) of the blocks for q (..., Hkv, G, D) against key bounds
    kmin / kmax (..., Hkv, NB, D). When two-level scoring pays (long context) only the blocks of
    the best super-blocks (smin / smax (..., Hkv, >= NS, D)) before block ``limit`` (an int, or a
    tensor broadcastable to (..., Hkv) per sequence) are scored; the others get -inf (select
    never takes window blocks from the ranking anyway). Blocks past a sequence's last token may
    score anything, NaN included: select masks them.

    row_blocks: for a batch whose shorter sequences hold too few blocks for two-level scoring to
    pay on their own, each sequence's block count (broadcastable to (..., Hkv)); those rows are
    scored one-level, as they would be alone (the whole batch's bounds are read then).

    listed: where two-level scoring applies to every row, return its candidates as they are,
    (blocks (..., Hkv, M), -1 for none, and their scores), for :func:`select` to rank.
    """
    nb = kmin.shape[-2]
    if not two_level_pays(nb, group, n_super):
        return block_scores(q, kmin, kmax)
    ns = -(-nb // group)
    blocks, sc = two_level_candidates(q, kmin, kmax, smin[..., :ns, :], smax[..., :ns, :], group, n_super,
                                      limit=limit)
    if listed and row_blocks is None:
        return blocks, sc
    two = _scatter(blocks.reshape(-1, blocks.shape[-1]), sc.reshape(-1, sc.shape[-1]), nb).view(*sc.shape[:-1], nb)
    if row_blocks is None:
        return two
    pays = two_level_pays(row_blocks, group, n_super)                      # the same rule, per row
    return torch.where(pays[..., None], two, block_scores(q, kmin, kmax))


@dataclass
class Selection:
    """tokens: (R, top_k + A) selected positions, -1 padded, unique per row: the window, the
    anchors, then the ranked blocks' tokens.
    prefetch: (R, prefetch_blocks * block_size) positions predicted for the next step (the
    next-ranked blocks), -1 padded.
    block_hits: (R, NS) selected tokens per storage block (importance for streaming).
    loaded: (R,) tokens in the storage blocks each row's selection touched (per row: the kernel's
    programs write their own rows, no zeroed sum; kernels/counts.py sums them).
    both: (R, top_k + A + prefetch width): tokens then prefetch in one tensor (they are its views).
    """
    tokens: torch.Tensor
    prefetch: torch.Tensor
    block_hits: torch.Tensor
    loaded: torch.Tensor
    both: torch.Tensor


def candidate_blocks(nb: int, w0: int, first_lo: int, bs: int) -> int:
    """Upper bound, on the host, on the blocks that hold candidates: those of the nb before the
    window (start w0, the latest of the batch) from the block of first_lo (<= every sequence's
    first position) on."""
    return max(0, min(nb, -(-w0 // bs)) - first_lo // bs)


def select(scores: torch.Tensor | tuple[torch.Tensor, torch.Tensor], n_tokens: torch.Tensor, first: torch.Tensor,
           window: int, top_k: int, block_size: int, anchors: torch.Tensor, holes: torch.Tensor | None,
           prefetch_blocks: int, n_cand: int, sinks: int = 0, store_block: int | None = None, kernels: bool = False,
           nb: int | None = None) -> Selection:
    """Select tokens for each row (a KV head of a sequence).

    scores: (R, NB) upper bounds of selection blocks of ``block_size`` tokens (NaN allowed past a
    row's tokens), or listed blocks (blocks (R, M) int64, -1 for none, unique per row; their
    bounds (R, M)) with ``nb`` the row width NB, every block not listed scoring -inf (what
    bound_scores(listed=True) gives at long context: ranked as they are, not over NB);
    n_tokens, first: (R, 1) int64 device tensors, the row's token count and first
    visible position; anchors: (R, A) positions, -1 padded; holes: (R, NS) bool per storage block
    of ``store_block`` tokens (a multiple of block_size; default equal), or None; block_hits and
    loaded count storage blocks too; n_cand: a host upper bound on the candidate blocks of every
    row (:func:`candidate_blocks`); sinks: the first visible tokens always kept (<= top_k - window,
    the first columns of the ranked part). No host sync: widths come from the budget, not the data.
    ``kernels``: on CUDA, rows without holes are masked and ranked in one Triton launch (up to
    RANK_MAX blocks a row), listed blocks ranked as they are, and assembled in another launch
    (kernels/select.py; this function's torch code is their reference).
    """
    bs, sb, device = block_size, store_block or block_size, n_tokens.device
    w_keep, w_pf = top_k - window, prefetch_blocks * bs
    # enough ranked blocks for the largest budget (top_k - window bounds it on the host: no sync),
    # anchors that may overlap them, a partial first block and the prefetch
    take = min(n_cand, -(-(w_keep + anchors.shape[1]) // bs) + 2 + prefetch_blocks)
    listed = scores if isinstance(scores, tuple) else None
    if listed is not None:
        if nb is None:
            raise ValueError("select of listed blocks needs nb, the number of blocks of a row")
        if not (kernels and holes is None and use_triton(listed[1]) and take <= listed[0].shape[1] <= RANK_MAX):
            scores, listed = _scatter(*listed, nb), None            # the paths below rank every block
    if listed is None:
        nb = scores.shape[1]
    assert nb is not None
    if listed is not None:        # the candidates among the listed blocks, ranked in one launch
        top = ranked_listed(*listed, n_tokens, first, window, bs, take)
        both, per_block, loaded = assemble_selection(top, None, n_tokens, first, anchors, window, top_k, bs, sinks,
                                                     w_keep, w_pf, sb, -(-nb * bs // sb))
        K = both.shape[1] - w_pf
        return Selection(both[:, :K], both[:, K:], per_block, loaded, both)
    if kernels and holes is None and use_triton(scores):
        if nb <= RANK_MAX:                                                      # the mask below and its ranking
            s, top = ranked_candidates(scores, n_tokens, first, window, bs, take)
        else:
            s = candidate_scores(scores, n_tokens, first, window, bs)           # the mask below, one launch
            top = s.topk(take, dim=1).indices
        both, per_block, loaded = assemble_selection(top, s, n_tokens, first, anchors, window, top_k, bs, sinks,
                                                     w_keep, w_pf, sb, -(-nb * bs // sb))
        K = both.shape[1] - w_pf
        return Selection(both[:, :K], both[:, K:], per_block, loaded, both)
    w0 = n_tokens - window                                                      # (R, 1) window start
    blk0 = torch.arange(nb, device=device) * bs                                 # each block's first token
    cand_blk = (blk0 < w0) & (blk0 + bs > first)                                # (R, NB)
    return _assemble(scores, n_tokens, first, w0, cand_blk, window, top_k, bs, sb, anchors, holes, sinks, w_pf, take)


def _scatter(blocks: torch.Tensor, sc: torch.Tensor, nb: int) -> torch.Tensor:
    """Listed blocks' scores over every block of a row (R, nb), -inf where none is listed."""
    full = torch.full((blocks.shape[0], nb + 1), float("-inf"), device=sc.device)
    return full.scatter_(-1, blocks + 1, sc.float())[:, 1:]     # column 0 takes the -1 padding


def _assemble(scores: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor, w0: torch.Tensor,
              cand_blk: torch.Tensor, window: int, top_k: int, bs: int, sb: int, anchors: torch.Tensor,
              holes: torch.Tensor | None, sinks: int, w_pf: int, take: int) -> Selection:
    """select's torch path (the reference of kernels/select.py): the window, anchors and sinks,
    the ranking of the candidate blocks and the packing of their tokens."""
    (R, nb), device, w_keep = scores.shape, scores.device, top_k - window
    win = w0 + torch.arange(window, device=device)
    win_ok = win >= first
    sink = first + torch.arange(sinks, device=device)                          # (R, sinks)
    sink_ok = sink < w0
    rest = first + sinks                                                        # first ranked position
    anc_ok = (anchors >= rest) & (anchors < w0)                                 # (a sink is kept anyway)
    if holes is not None:
        win_ok &= ~_in_hole(holes, win, sb)
        sink_ok &= ~_in_hole(holes, sink, sb)
        anc_ok &= ~_in_hole(holes, anchors, sb)
        cand_blk &= ~(holes if sb == bs else holes.repeat_interleave(sb // bs, 1)[:, :nb])
    win, anc = torch.where(win_ok, win, -1), torch.where(anc_ok, anchors, -1)
    # the ranked budget; at most top_k - window (the window holds no holes: streaming evicts
    # only blocks before it, and a window that starts in the padding leaves no candidates)
    n_sink = sink_ok.sum(1, keepdim=True)                                       # (R, 1)
    budget = (top_k - win_ok.sum(1, keepdim=True) - anc_ok.sum(1, keepdim=True) - n_sink).clamp(min=0)
    budget = torch.minimum(budget, w_keep - n_sink)                             # (R, 1)
    s = torch.where(cand_blk, scores.float(), float("-inf"))
    top = s.topk(take, dim=1).indices                                           # (R, take) ranked
    pos = (top[:, :, None] * bs + torch.arange(bs, device=device)).reshape(R, -1)  # rank order
    # a ranked block is a candidate (finite: not masked above; NaN never ranks, as -inf)
    ok = (((pos >= rest) & (pos < w0)).view(R, take, bs) & (s.gather(1, top) > float("-inf"))[:, :, None])
    ok = ok.view(R, -1)
    if anc.shape[1]:
        ok &= _not_in(anc, pos, nb * bs)
    rank = ok.long().cumsum(1)                                                  # 1-based among ok
    # kept: the first budget ok positions, at columns [n_sink, n_sink + budget); prefetch: the next w_pf, at
    # columns [w_keep, w_keep + w_pf). Both are runs of consecutive ranks, so one scatter packs
    # them (no sort); the rest goes to a spill column that is cut off. The kept sinks come first
    dest = rank + torch.where(rank <= budget, n_sink - 1, (w_keep - 1) - budget)
    dest = torch.where(ok & (rank <= budget + w_pf), dest, w_keep + w_pf)
    if sinks:
        dest = torch.cat([torch.where(sink_ok, sink_ok.long().cumsum(1) - 1, w_keep + w_pf), dest], 1)
        pos = torch.cat([sink, pos], 1)
    packed = torch.full((R, w_keep + w_pf + 1), -1, dtype=pos.dtype, device=device).scatter_(1, dest, pos)
    both = torch.cat([win, anc, packed[:, :-1]], 1)
    K = both.shape[1] - w_pf
    per_block, loaded = _per_block(both[:, :K], n_tokens, -(-nb * bs // sb), sb)
    return Selection(both[:, :K], both[:, K:], per_block, loaded, both)


def _not_in(anc: torch.Tensor, pos: torch.Tensor, n_pos: int) -> torch.Tensor:
    """(R, P) bool: pos[r, p] is none of anc[r] (positions < n_pos, -1 padded).

    Per-row membership through a dense (R, 1 + n_pos) mask: a scatter and a gather are several
    times cheaper than a sorted isin; column 0 collects the -1 padding (pos >= 0 never reads it)."""
    outside = torch.ones(anc.shape[0], n_pos + 1, dtype=torch.bool, device=anc.device)
    outside.scatter_(1, anc + 1, False)
    return outside.gather(1, pos + 1)


def _per_block(tokens: torch.Tensor, n_tokens: torch.Tensor, nb: int,
               bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected tokens per block of ``bs`` tokens (R, nb), and the tokens of every touched block
    per row (R,).

    Column 0 of a (R, 1 + NB) count collects the -1 padding."""
    blk0 = torch.arange(nb, device=tokens.device) * bs                          # each block's first token
    per_block = torch.zeros(tokens.shape[0], nb + 1, dtype=torch.int64, device=tokens.device)
    per_block.scatter_add_(1, (tokens + bs) // bs, torch.ones_like(tokens))
    per_block = per_block[:, 1:]
    sizes = (n_tokens - blk0).clamp(0, bs)                                      # (R, NB) tokens held
    return per_block, torch.where(per_block > 0, sizes, 0).sum(1)


def _in_hole(holes: torch.Tensor, pos: torch.Tensor, bs: int) -> torch.Tensor:
    """Whether positions pos (R, M) (any value; -1 and past-the-end read an edge block) lie in
    a hole of their row, holes (R, NB)."""
    return holes.gather(1, (pos.clamp(min=0) // bs).clamp(max=holes.shape[1] - 1))
