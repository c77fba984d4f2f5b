"""Per-block key bounds and the Quest upper bound of q.k per block.

block_bounds: k (Hkv, L, D) -> kmin, kmax (Hkv, NB, D), NB = ceil(L / block_size).
block_scores: q (..., Hkv, G, D), kmin/kmax (..., Hkv, NB, D) -> (..., Hkv, NB) fp32 =
max over g of sum_d max(q*kmin, q*kmax). Leading batch dims are an extension of the contract so a
whole decode batch is scored in one launch; `blocks` (..., Hkv, M) scores only the listed blocks.

Two-level bounds keep the bound read short at long context: super-blocks of `group` consecutive
blocks carry the min of their blocks' kmin and the max of their kmax, so a super-block's bound is
>= the bound of every block in it. `two_level_candidates` scores the super-blocks, keeps the best
`n_super` per KV head and scores only their blocks: bytes read per step fall from NB to
NB / group + n_super * group block bounds (1M tokens, 64-token blocks, group 16, n_super 18:
16,384 -> 1,312).
It is a heuristic: a block outside the kept super-blocks is never a candidate, even if its own
bound would have ranked it (keep n_super >= the blocks selected, which the runtime does).
"""
from __future__ import annotations

import torch

from ._dispatch import FLOAT_DTYPES, check, kernel_module, use_triton
from .select import RANK_MAX


def reference_block_bounds(k: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k (Hkv, L, D) -> (kmin, kmax), each (Hkv, NB, D) in k's dtype; partial last block uses its rows."""
    h, length, d = k.shape
    nb = -(-length // block_size)
    pad = nb * block_size - length
    lo = torch.nn.functional.pad(k.float(), (0, 0, 0, pad), value=float("inf"))
    hi = torch.nn.functional.pad(k.float(), (0, 0, 0, pad), value=float("-inf"))
    kmin = lo.view(h, nb, block_size, d).amin(dim=2)
    kmax = hi.view(h, nb, block_size, d).amax(dim=2)
    return kmin.to(k.dtype), kmax.to(k.dtype)


def reference_block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                           blocks: torch.Tensor | None = None, limit: int | None = None) -> torch.Tensor:
    """q (..., Hkv, G, D), kmin/kmax (..., Hkv, NB, D) -> (..., Hkv, NB) fp32; with blocks
    (..., Hkv, M) int64 (-1 = none): (..., Hkv, M), -inf where blocks is -1. Blocks >= limit
    score -inf.

    max(q*kmin, q*kmax) summed over d equals relu(q).kmax + min(q, 0).kmin, so two matmuls do it.
    """
    nb = kmin.shape[-2]
    limit = nb if limit is None else limit
    if blocks is not None:
        idx = blocks.clamp(min=0)[..., None].expand(*blocks.shape, kmin.shape[-1])
        s = reference_block_scores(q, kmin.gather(-2, idx), kmax.gather(-2, idx))
        return torch.where((blocks >= 0) & (blocks < limit), s, float("-inf"))
    qf = q.float()
    pos, neg = qf.clamp(min=0), qf.clamp(max=0)
    s = pos @ kmax.float().transpose(-1, -2) + neg @ kmin.float().transpose(-1, -2)   # (..., Hkv, G, NB)
    s = s.amax(dim=-2)
    return s if limit >= nb else torch.where(torch.arange(nb, device=s.device) < limit, s, float("-inf"))


def superblock_bounds(kmin: torch.Tensor, kmax: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kmin/kmax (..., NB, D) -> (smin, smax) (..., ceil(NB / group), D): the min of each run of
    `group` blocks' kmin and the max of their kmax (a partial last group uses its blocks)."""
    check(isinstance(group, int) and group >= 1, f"group must be a positive int, got {group!r}")
    check(kmin.shape == kmax.shape and kmin.dim() >= 2, f"kmin {tuple(kmin.shape)} and kmax "
          f"{tuple(kmax.shape)} must be equal shapes (..., NB, D)")
    nb, d = kmin.shape[-2:]
    ns = -(-nb // group)
    pad = ns * group - nb
    lead = kmin.shape[:-2]

    def fold(t: torch.Tensor, fill: float, op) -> torch.Tensor:
        if pad:
            t = torch.cat([t, t.new_full((*lead, pad, d), fill)], -2)
        return op(t.reshape(*lead, ns, group, d), dim=-2)

    return fold(kmin, float("inf"), torch.amin), fold(kmax, float("-inf"), torch.amax)


def two_level_least(group: int, n_super: int) -> int | None:
    """The fewest blocks at which two-level scoring pays (:func:`two_level_pays`); None where it
    never does (group <= 1)."""
    return 4 * n_super * group if group > 1 else None


def two_level_pays(nb, group: int, n_super: int):
    """Whether two-level scoring reads clearly fewer bounds than scoring all nb blocks: the refined
    blocks (n_super * group) are at most a quarter of them. group <= 1 turns it off. nb: an int
    (-> bool), or a tensor of block counts (-> a bool tensor, elementwise)."""
    least = two_level_least(group, n_super)
    if isinstance(nb, torch.Tensor):
        return nb >= least if least is not None else torch.zeros_like(nb, dtype=torch.bool)
    return least is not None and nb >= least


def two_level_candidates(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, smin: torch.Tensor,
                         smax: torch.Tensor, group: int, n_super: int,
                         limit: int | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate blocks of the `n_super` best super-blocks per KV head and their bounds.

    q (..., Hkv, G, D); kmin/kmax (..., Hkv, NB, D); smin/smax (..., Hkv, NS, D) from
    `superblock_bounds(kmin, kmax, group)` (or kept up to date incrementally). Only blocks below
    `limit` (default NB) are candidates (e.g. the blocks before an always-selected window);
    `limit` may be a tensor broadcastable to (..., Hkv), one limit per row of a batch whose rows
    hold different numbers of blocks (super-blocks past a row's limit never take one of its
    n_super places, whatever their bounds: NaN for a row's unfilled blocks).
    Returns blocks (..., Hkv, n_super * group) int64 (-1 for no candidate) and their scores (fp32,
    -inf where blocks is -1); with n_super >= NS every block below limit is a candidate.
    """
    nb, ns = kmin.shape[-2], smin.shape[-2]
    check(ns == -(-nb // group), f"smin/smax hold {ns} super-blocks but {nb} blocks in groups of {group} "
          f"need {-(-nb // group)}; rebuild them with superblock_bounds")
    check(n_super >= 1, f"n_super must be >= 1, got {n_super}")
    per_row = isinstance(limit, torch.Tensor)
    host_limit = nb if limit is None or per_row else max(0, min(limit, nb))
    n_super = min(n_super, ns)
    if use_triton(q, kmin, kmax):
        # two scoring launches and the ranking between them; a per-row limit is read in the
        # kernels (as torch ops it took ~9 small launches a layer)
        mod = kernel_module("_bounds_triton")
        row_limit = limit if per_row else host_limit
        sup = top_blocks(mod.scores(q, smin, smax, limit=row_limit, limit_div=group), n_super)
        return mod.scores(q, kmin, kmax, limit=row_limit, super_idx=sup, group=group)
    sup_scores = block_scores(q, smin, smax, limit=-(-host_limit // group))           # (..., Hkv, NS)
    if per_row:
        sup_limit = torch.div(limit + group - 1, group, rounding_mode="floor")[..., None]
        sup_scores = torch.where(torch.arange(ns, device=q.device) < sup_limit, sup_scores, float("-inf"))
    sup = top_blocks(sup_scores, n_super)                                              # (..., Hkv, n_super)
    blocks = (sup[..., None] * group + torch.arange(group, device=sup.device)).flatten(-2)
    blocks = torch.where(blocks < host_limit, blocks, -1)
    sc = reference_block_scores(q, kmin, kmax, blocks)
    if per_row:
        blocks = torch.where(blocks < limit[..., None], blocks, -1)
        sc = torch.where(blocks >= 0, sc, float("-inf"))
    return blocks, sc


def top_blocks(scores: torch.Tensor, n: int, chunk: int = 1024) -> torch.Tensor:
    """Indices (..., n) int64 of the n highest scores along the last dim (same set as torch.topk,
    but NaN ranks lowest, with -inf: a block whose bound is NaN never displaces a scored one).

    With Triton, a row of at most RANK_MAX scores is ranked in one program (one launch for all
    rows: kernels/select.py's ranking, ties to the lower index). Otherwise torch.topk; one over a
    long row runs on few thread blocks when the batch is small (one decode sequence), so long rows
    go in two exact stages: the top n of each chunk, then the top n of those candidates (every
    global top-n element is in its chunk's top n). Order is unspecified.
    """
    nb = scores.shape[-1]
    check(0 < n <= nb, f"n={n} must be in 1..{nb} (the number of blocks)")
    rows = scores.numel() // max(nb, 1)
    if use_triton(scores) and nb <= RANK_MAX and scores.dtype in FLOAT_DTYPES:
        top = kernel_module("_select_triton").row_topk(scores.reshape(rows, nb), n)
        return top.view(*scores.shape[:-1], n)
    scores = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    if nb <= 4 * chunk or n > chunk // 4 or rows > 64:      # many rows already fill the GPU
        return scores.topk(n, dim=-1, sorted=False).indices
    n_chunks = -(-nb // chunk)
    padded = torch.nn.functional.pad(scores, (0, n_chunks * chunk - nb), value=float("-inf"))
    vals, idx = padded.view(*scores.shape[:-1], n_chunks, chunk).topk(n, dim=-1, sorted=False)
    idx = idx + torch.arange(0, n_chunks * chunk, chunk, device=scores.device)[:, None]
    best = vals.flatten(-2).topk(n, dim=-1, sorted=False).indices
    return idx.flatten(-2).gather(-1, best)


def block_bounds(k: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise min and max of the keys of each block of block_size tokens.

    k (Hkv, L, D) -> kmin, kmax (Hkv, ceil(L / block_size), D) in k's dtype.
    """
    check(k.dim() == 3, f"k must be (Hkv, L, D), got shape {tuple(k.shape)}")
    check(k.shape[1] > 0, "k has no tokens (L = 0); bounds need at least one token")
    check(isinstance(block_size, int) and block_size > 0, f"block_size must be a positive int, got {block_size!r}")
    check(k.dtype in FLOAT_DTYPES, f"k dtype {k.dtype} unsupported; use float16, bfloat16 or float32")
    if use_triton(k):
        return kernel_module("_bounds_triton").bounds(k, block_size)
    return reference_block_bounds(k, block_size)


def block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor,
                 blocks: torch.Tensor | None = None, limit: int | None = None) -> torch.Tensor:
    """Quest upper bound of q.k per block: q (..., Hkv, G, D), kmin/kmax (..., Hkv, NB, D) -> (..., Hkv, NB) fp32.

    With blocks (..., Hkv, M) int64 block indices (-1 = none): only those, (..., Hkv, M), -inf at -1.
    Blocks numbered >= limit (default: none) score -inf.
    """
    check(q.dim() >= 3, f"q must be (..., Hkv, G, D), got shape {tuple(q.shape)}")
    check(kmin.shape == kmax.shape, f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} differ")
    check(kmin.dim() == q.dim() and kmin.shape[:-2] == q.shape[:-2] and kmin.shape[-1] == q.shape[-1],
          f"kmin/kmax {tuple(kmin.shape)} must be (..., Hkv, NB, D) matching q {tuple(q.shape)}")
    for name, t in (("q", q), ("kmin", kmin), ("kmax", kmax)):
        check(t.dtype in FLOAT_DTYPES, f"{name} dtype {t.dtype} unsupported; use float16, bfloat16 or float32")
    check(len({q.device, kmin.device, kmax.device}) == 1, "q, kmin and kmax must be on one device")
    if blocks is not None:
        check(blocks.dim() == q.dim() - 1 and blocks.shape[:-1] == q.shape[:-2],
              f"blocks {tuple(blocks.shape)} must be (..., Hkv, M) matching q {tuple(q.shape)}")
        check(blocks.dtype == torch.int64 and blocks.device == q.device,
              f"blocks must be int64 on {q.device}, got {blocks.dtype} on {blocks.device}")
    if use_triton(q, kmin, kmax):
        return kernel_module("_bounds_triton").scores(q, kmin, kmax, blocks, limit)
    return reference_block_scores(q, kmin, kmax, blocks, limit)


def reference_widen_bounds(kmin: torch.Tensor, kmax: torch.Tensor, smin: torch.Tensor, smax: torch.Tensor,
                           k: torch.Tensor, start: torch.Tensor, block_size: int, group: int) -> None:
    """One new key per row k (B, H, 1, D) at positions start (B,): in place, the bounds (B, H, NB,
    D) of its block (start // block_size) and the super-block bounds (B, H, NS, D) of that
    block's group (block // group) take the elementwise min / max with it."""
    B, H, _, D = k.shape
    for lo, hi, cell in ((kmin, kmax, torch.div(start, block_size, rounding_mode="floor")),
                         (smin, smax, torch.div(start, block_size * group, rounding_mode="floor"))):
        idx = cell[:, None, None, None].expand(B, H, 1, D)
        lo.scatter_(2, idx, torch.minimum(lo.gather(2, idx), k))
        hi.scatter_(2, idx, torch.maximum(hi.gather(2, idx), k))


def widen_bounds(kmin: torch.Tensor, kmax: torch.Tensor, smin: torch.Tensor, smax: torch.Tensor,
                 k: torch.Tensor, start: torch.Tensor, block_size: int, group: int) -> None:
    """:func:`reference_widen_bounds` in one Triton launch on CUDA (a decode step's 14 small ops)."""
    check(k.dim() == 4 and k.shape[2] == 1 and start.shape == (k.shape[0],),
          f"widen_bounds takes one key per row, k (B, H, 1, D) and start (B,); got {tuple(k.shape)}, "
          f"{tuple(start.shape)}")
    if use_triton(kmin, k):
        kernel_module("_bounds_triton").widen(kmin, kmax, smin, smax, k, start, block_size, group)
        return
    reference_widen_bounds(kmin, kmax, smin, smax, k, start, block_size, group)
