"""The token selection's assembly after its block ranking, in one launch (runtime/selection.py's
``select`` is the reference; this is its Triton path for rows without holes).

Given the ranked blocks ``top`` (R, take) of the masked scores ``s`` (R, NB), each row's token
count and first position (R, 1) and its anchors (R, A): writes the row's selection ``both``
(R, window + A + w_keep + w_pf): the window (-1 before ``first``), the anchors (-1 unless before
the window and past the sinks), then the sinks, the kept ranked tokens (up to the budget left by
the others) and the prefetch, -1 padded; the selected tokens per storage block of ``sb`` tokens
(R, NBS), and the tokens of each row's touched blocks (R,).

The ranking before it: ``candidate_scores`` (the masked scores ``s``) then ``s.topk(take)``, or
both in one launch, ``ranked_candidates``, where a row holds at most ``RANK_MAX`` blocks; or, at
long context, ``ranked_listed``: the candidates among the blocks two-level scoring listed (a few
hundred a row instead of every block), whose ``top`` holds -1 where a rank holds no candidate
(the assembly then needs no ``s``).
"""
from __future__ import annotations

import torch

from ._dispatch import check, kernel_module

# Rows of at most this many blocks are ranked in one launch (one program a row, in registers).
RANK_MAX = 4096


def assemble_selection(top: torch.Tensor, s: torch.Tensor | None, n_tokens: torch.Tensor, first: torch.Tensor,
                       anchors: torch.Tensor, window: int, top_k: int, block_size: int, sinks: int, w_keep: int,
                       w_pf: int, store_block: int, n_store_blocks: int) -> tuple[torch.Tensor, ...]:
    R = top.shape[0]
    check((s is None or s.shape[0] == R) and n_tokens.shape == (R, 1) and first.shape == (R, 1)
          and anchors.shape[0] == R, "top, s, n_tokens, first and anchors need one row per selection row")
    check(store_block % block_size == 0, "the storage block must be a multiple of the selection block")
    return kernel_module("_select_triton").assemble(top, s, n_tokens, first, anchors, window, top_k, block_size,
                                                    sinks, w_keep, w_pf, store_block, n_store_blocks)


def candidate_scores(scores: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor, window: int,
                     block_size: int) -> torch.Tensor:
    """The ranking's input in one launch (select's torch path is the reference): scores (R, NB)
    as fp32 where block j is a candidate of its row (it starts before the window, at
    n_tokens - window, and ends after ``first``), -inf elsewhere."""
    R = scores.shape[0]
    check(n_tokens.shape == (R, 1) and first.shape == (R, 1), "n_tokens and first must be (R, 1)")
    return kernel_module("_select_triton").candidates(scores, n_tokens, first, window, block_size)


def ranked_candidates(scores: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor, window: int,
                      block_size: int, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``candidate_scores`` and its ranking in one launch, one program per row (NB <= RANK_MAX):
    s (R, NB) as there, and top (R, take) int64, the columns of the ``take`` highest s of each
    row, best first, ties (-inf ones included, when a row has fewer candidates) to the lower
    column; the same scores in the same order as ``s.topk(take, dim=1)`` (a NaN score of a
    candidate block, which bounds of its keys never give, would rank last here, first in topk).
    The kernel sorts chunks of next_pow2(take) blocks and halves them with bitonic merges."""
    R, NB = scores.shape
    check(n_tokens.shape == (R, 1) and first.shape == (R, 1), "n_tokens and first must be (R, 1)")
    check(NB <= RANK_MAX and 0 <= take <= NB, f"ranked_candidates takes 0..NB of rows of at most {RANK_MAX} "
          f"blocks, got take={take} of NB={NB}")
    return kernel_module("_select_triton").ranked_candidates(scores, n_tokens, first, window, block_size, take)


def ranked_listed(blocks: torch.Tensor, scores: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor,
                  window: int, block_size: int, take: int) -> torch.Tensor:
    """The ranking of ``ranked_candidates`` over listed blocks (R, M) (-1 for none; unique per row,
    e.g. two_level_candidates's) with their scores (R, M), in one launch (M <= RANK_MAX): top
    (R, take), the numbers of the ``take`` best candidate blocks, best first, ties to the lower
    block, -1 where fewer than take are candidates with a score above -inf (NaN ranks last). The
    same blocks, in the same order, as ``ranked_candidates`` of those scores scattered over every
    block (-inf elsewhere), where those rank -inf blocks in a row of too few candidates."""
    R, M = blocks.shape
    check(scores.shape == (R, M) and n_tokens.shape == (R, 1) and first.shape == (R, 1),
          "blocks and scores must be (R, M) and n_tokens, first (R, 1)")
    check(M <= RANK_MAX and 0 <= take <= M, f"ranked_listed takes 0..M of rows of at most {RANK_MAX} blocks, "
          f"got take={take} of M={M}")
    return kernel_module("_select_triton").ranked_listed(blocks, scores, n_tokens, first, window, block_size, take)
