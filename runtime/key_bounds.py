"""Key bounds of every row: the one place they are laid out, grown and updated.

Per KV head, each row keeps the elementwise min and max key of each *selection block* of
``select_block`` tokens (kmin / kmax (Hkv, NB, D)) and of each super-block of ``bound_group``
selection blocks (smin / smax (Hkv, NS, D)); selection scores selection blocks by them
(selection.bound_scores). A selection block is a run of rows of one storage block
(``cache_block_size``, a multiple of it): selecting finer than the host pool stores keeps a
block that holds one important token from spending a whole storage block of the budget. Two
more kinds are per *storage* block and share the growth: importance (selected tokens per
block, summed over layers by streaming eviction) and holes (blocks streaming mode overwrote).

Bounds only widen as tokens arrive, so an update folds the new tokens into per-block bounds and
widens the stored ones with them; the super-blocks are widened with the blocks' new bounds,
which equals a refold of their blocks.
"""

from __future__ import annotations

import torch

from hi_sparse.kernels.bounds import widen_bounds

from .row_bank import RowBank

BOUNDS = ("kmin", "kmax")                 # per selection block
PER_SUPER_BLOCK = ("smin", "smax")
PER_BLOCK = ("importance", "holes")      # per storage block


def add_kinds(bank: RowBank, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    """Declare the bound kinds of a bank (no blocks yet: :func:`grow` makes room)."""
    inf = float("inf")
    for name, fill in (("kmin", inf), ("kmax", -inf), ("smin", inf), ("smax", -inf)):
        bank.add(name, (num_kv_heads, 0, head_dim), dtype, fill)
    bank.add("importance", (0,), torch.float32, 0.0)
    bank.add("holes", (0,), torch.bool, False)


# The finest step of the block counts in a graph's key, in tokens. Below ~4K tokens (64-token
# blocks) 1/8 of the power of two is one or two blocks; on the H200 at 1-2K tokens the key then
# changed after every completed block, each change an eager step and a capture of 20-40x a step.
BUCKET_LEAST_TOKENS = 512
# ... and in blocks: a multiple of 16, so that the sizes and strides that follow from the count
# keep their divisibility by 16, on which Triton specializes integer arguments (each new
# specialization a compile: a key change at 1,536 tokens, 24 -> 32 blocks, took 0.8 s eagerly)
BUCKET_LEAST_BLOCKS = 16


def bucket(n: int, least: int = 1) -> int:
    """n rounded up to a multiple of 1/8 of its power of two (at most 12.5 % more), and of
    ``least``: a captured step keyed by a block count changes key ~8 times per doubling of the
    context, not every block."""
    q = max(least, 1 << max(0, n.bit_length() - 4))
    return -(-n // q) * q


def key_blocks(blocks: int, select_block: int) -> int:
    """The block count a decode step's key holds for a longest sequence of ``blocks`` selection
    blocks (decode.attend_blocks): :func:`bucket` at least BUCKET_LEAST_BLOCKS and
    BUCKET_LEAST_TOKENS apart."""
    return bucket(blocks, max(BUCKET_LEAST_BLOCKS, BUCKET_LEAST_TOKENS // select_block))


def key_tokens(n: int, select_block: int) -> int:
    """The most tokens a longest sequence of ``n`` tokens holds before its step's key changes:
    what a buffer that grows with the tokens is rounded up to, so that it grows on the step whose
    key changes anyway (a captured step keys the buffer's address too; else a growth between
    two changes is a key of its own, an extra capture)."""
    return key_blocks(-(-n // select_block), select_block) * select_block


def n_super(top_k: int, window: int, global_tokens: int, select_block: int, prefetch_units: int) -> int:
    """Super-blocks two-level scoring keeps per KV head: enough for every selection block the
    selection can take (its budget, anchors that may overlap it, rank slack and prefetch)."""
    return -(-(top_k - window + global_tokens) // select_block) + 2 + prefetch_units


def grow(bank: RowBank, tokens: int, block_size: int, select_block: int, group: int, max_seq_len: int,
         staged: bool = False) -> None:
    """Room for ``tokens`` tokens in every row: their selection blocks in whole super-blocks plus
    two spare ones (an update's folds may reach a block and a super-block past the last token, with
    nothing in them), and the storage blocks (``block_size`` tokens) those selection blocks span.
    Grows geometrically, to a step key's block count (:func:`key_tokens`) plus the spares.
    ``staged``: the growth made ahead (RowBank.stage), for the step that will need it."""
    blocks = -(-tokens // select_block)
    need = (-(-blocks // group) + 2) * group
    cap = bank.size("kmin", 1)
    if need <= cap:
        return
    limit = (-(-max_seq_len // select_block) // group + 3) * group
    new = max(need, min(max(2 * cap, 8), limit))                          # geometric
    # the spare super-blocks past a key's block count (key_tokens): the next growth comes on the
    # step that changes the key anyway, with a group that divides the count (the default's)
    new = min(max(new, key_blocks(new - 2 * group, select_block) + 2 * group), limit)
    new = -(-max(need, new) // group) * group                              # whole super-blocks
    act = bank.stage if staged else bank.grow
    for name in BOUNDS:
        act(name, 1, new)
    for name in PER_SUPER_BLOCK:
        act(name, 1, new // group)
    for name in PER_BLOCK:
        act(name, 0, -(-new * select_block // block_size))


def update(bank: RowBank, rows: slice, start: torch.Tensor, k: torch.Tensor, select_block: int, group: int,
           kernels: bool = False) -> None:
    """Widen the bounds of rows ``rows`` by new keys k (B, Hkv, T, D) at positions start (B,) + t
    (a device tensor: no host sync; a decode token is its own bounds, so T = 1 folds nothing;
    ``kernels``: one token's widening in one Triton launch on CUDA, kernels/bounds.py)."""
    if kernels and k.shape[2] == 1:
        widen_bounds(bank.t["kmin"][rows], bank.t["kmax"][rows], bank.t["smin"][rows], bank.t["smax"][rows], k,
                     start, select_block, group)
        return
    lo, hi, first = _fold(k, k, start, select_block)
    _widen(bank.t["kmin"][rows], first, lo, torch.minimum)
    _widen(bank.t["kmax"][rows], first, hi, torch.maximum)
    slo, shi, sfirst = _fold(lo, hi, first, group)
    _widen(bank.t["smin"][rows], sfirst, slo, torch.minimum)
    _widen(bank.t["smax"][rows], sfirst, shi, torch.maximum)


def _fold(lo: torch.Tensor, hi: torch.Tensor, start: torch.Tensor,
          size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elementwise min of lo and max of hi (B, H, T, D), items at positions start (B,) + t, over
    each cell of ``size`` positions they touch: (min (B, H, C, D), max, first cell (B,)), C cells
    from each row's first (cells past a row's items hold +inf / -inf)."""
    B, H, T, D = lo.shape
    first = torch.div(start, size, rounding_mode="floor")
    if T == 1:
        return lo, hi, first
    cells = -(-(size - 1 + T) // size)
    at = (start - first * size)[:, None] + torch.arange(T, device=lo.device)           # (B, T)
    idx = at[:, None, :, None].expand(B, H, T, D)
    runs = []
    for x, fill, op in ((lo, float("inf"), torch.amin), (hi, float("-inf"), torch.amax)):
        buf = torch.full((B, H, cells * size, D), fill, dtype=x.dtype, device=x.device).scatter_(2, idx, x)
        runs.append(op(buf.view(B, H, cells, size, D), dim=3))
    return runs[0], runs[1], first


def _widen(stored: torch.Tensor, first: torch.Tensor, new: torch.Tensor, op) -> None:
    """stored (B, H, N, D) at cells first (B,) + c takes op(stored, new (B, H, C, D)) in place."""
    B, H, C, D = new.shape
    cells = first[:, None] if C == 1 else first[:, None] + torch.arange(C, device=new.device)   # (B, C)
    idx = cells[:, None, :, None].expand(B, H, C, D)
    stored.scatter_(2, idx, op(stored.gather(2, idx), new))
