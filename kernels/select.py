"""The token selection's assembly after its block ranking, in one launch (runtime/selection.py's
``select`` is the reference; this is its Triton path for rows without holes).

Given the ranked blocks ``top`` (R, take) of the masked scores ``s`` (R, NB), each row's token
count and first position (R, 1) and its anchors (R, A): writes the row's selection ``both``
(R, window + A + w_keep + w_pf): the window (-1 before ``first``), the anchors (-1 unless before
the window and past the sinks), then the sinks, the kept ranked tokens (up to the budget left by
the others) and the prefetch, -1 padded; the selected tokens per storage block of ``sb`` tokens
(R, NBS), and the tokens of the touched blocks summed over rows (0-dim).
"""
from __future__ import annotations

import torch

from ._dispatch import check, kernel_module


def assemble_selection(top: torch.Tensor, s: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor,
                       anchors: torch.Tensor, window: int, top_k: int, block_size: int, sinks: int, w_keep: int,
                       w_pf: int, store_block: int, n_store_blocks: int) -> tuple[torch.Tensor, ...]:
    R = top.shape[0]
    check(s.shape[0] == R and n_tokens.shape == (R, 1) and first.shape == (R, 1) and anchors.shape[0] == R,
          "top, s, n_tokens, first and anchors need one row per selection row")
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
