"""Triton: the selection's assembly after the block ranking, one program per row (select.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2
from .select import RANK_MAX


@triton.jit
def _run_in_blocks(lo, hi, b_lo, sb):
    """Tokens of the run [lo, hi) in each storage block starting at b_lo."""
    return tl.maximum(tl.minimum(hi, b_lo + sb) - tl.maximum(lo, b_lo), 0)


@triton.jit
def _assemble_kernel(
    p_top, p_s, p_n, p_first, p_anc, p_both, p_blocks, p_loaded,
    s_top, s_s, s_n, s_first, s_anc, s_both, s_blocks,
    window, top_k, bs, sinks, A, take, w_keep, w_pf, sb, NBS,
    BW: tl.constexpr, BA: tl.constexpr, CA: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr,
    BG: tl.constexpr, BB: tl.constexpr, HAS_S: tl.constexpr,
):
    # A few programs a launch (one per row): latency bound. So every input is read up front (the
    # loads overlap, no loop of loads), the window's and the sinks' tokens are counted per block
    # arithmetically and the ranked ones with one atomic per group of lanes (no run of
    # same-address atomics per token), and the atomics are relaxed (the barriers order them)
    r = tl.program_id(0).to(tl.int64)
    n = tl.load(p_n + r * s_n)
    first = tl.load(p_first + r * s_first)
    o_q = tl.arange(0, BQ)
    m_q = o_q < take * bs
    blk = tl.load(p_top + r * s_top + o_q // bs, mask=m_q, other=0)
    o_g = tl.arange(0, BQ // BG) * BG                  # each group's first lane
    g_blk = tl.load(p_top + r * s_top + o_g // bs, mask=o_g < take * bs, other=0)
    o_a = tl.arange(0, BA)
    m_a = o_a < A
    anc = tl.load(p_anc + r * s_anc + o_a, mask=m_a, other=-1)
    w0 = n - window
    rest = first + sinks
    pos = blk * bs + o_q % bs
    if HAS_S:
        score = tl.load(p_s + r * s_s + blk, mask=m_q, other=float("-inf"))
    else:        # a listed ranking's top: -1 where a rank holds no candidate
        score = tl.where(m_q & (blk >= 0), 0.0, float("-inf"))
    # the positions that are none of the kept anchors (pos >= 0 never matches the -1 of the
    # others): a (CA, BQ) tile at a time, each thread holding every anchor of it (the reduction
    # over them stays within the thread, pos keeps its layout)
    not_anc = m_q
    for c in tl.static_range(BA // CA):
        o_c = c * CA + tl.arange(0, CA)
        a = tl.load(p_anc + r * s_anc + o_c, mask=o_c < A, other=-1)
        a = tl.where((a >= rest) & (a < w0), a, -1)
        not_anc = not_anc & (tl.max((a[:, None] == pos[None, :]).to(tl.int32), 0) == 0)
    row = p_both + r * s_both
    counts = p_blocks + r * s_blocks
    # the selected tokens per storage block start from the window's and the sinks' (runs of
    # positions; every block written: no zero fill before the launch), the anchors and the
    # ranked tokens are added after the barrier
    sink_end = tl.minimum(rest, w0)
    for b0 in range(0, NBS, BB):
        o_b = b0 + tl.arange(0, BB)
        b_lo = o_b.to(tl.int64) * sb
        runs = _run_in_blocks(tl.maximum(w0, first), n, b_lo, sb) + _run_in_blocks(first, sink_end, b_lo, sb)
        tl.store(counts + o_b, runs, mask=o_b < NBS)
    # the window
    o_w = tl.arange(0, BW)
    m_w = o_w < window
    win = w0 + o_w
    win_ok = m_w & (win >= first)
    tl.store(row + o_w, tl.where(win_ok, win, -1), mask=m_w)
    # the anchors
    anc_ok = m_a & (anc >= rest) & (anc < w0)
    tl.store(row + window + o_a, tl.where(anc_ok, anc, -1), mask=m_a)
    # the sinks
    o_s = tl.arange(0, BS)
    sink = first + o_s
    sink_ok = (o_s < sinks) & (sink < w0)
    n_sink = tl.sum(sink_ok.to(tl.int64), 0)
    budget = top_k - tl.sum(win_ok.to(tl.int64), 0) - tl.sum(anc_ok.to(tl.int64), 0) - n_sink
    budget = tl.minimum(tl.maximum(budget, 0), w_keep - n_sink)
    # the ranked tokens: candidates, none of the kept anchors
    ok = m_q & (pos >= rest) & (pos < w0) & (score > float("-inf")) & not_anc
    rank = tl.cumsum(ok.to(tl.int64), 0)              # 1-based among the ok positions
    dest = tl.where(rank <= budget, rank + n_sink - 1, rank + w_keep - 1 - budget)
    # the kept ones per group of BG lanes (BG divides bs: one selection block, so one storage block)
    kept = tl.sum(tl.reshape((ok & (rank <= budget)).to(tl.int64), [BQ // BG, BG]), 1)
    # the packed part: sinks, the kept ranked tokens, then the prefetch, -1 where none
    packed = row + window + A
    o_p = tl.arange(0, BP)
    tl.store(packed + o_p, tl.full([BP], -1, tl.int64), mask=o_p < w_keep + w_pf)
    tl.debug_barrier()
    tl.store(packed + o_s, sink, mask=sink_ok)        # sink_ok holds for a prefix: column i
    tl.store(packed + dest, pos, mask=ok & (rank <= budget + w_pf))
    tl.atomic_add(counts + anc // sb, tl.full([BA], 1, tl.int64), mask=anc_ok, sem="relaxed")
    tl.atomic_add(counts + (g_blk * bs + o_g % bs) // sb, kept, mask=kept > 0, sem="relaxed")
    tl.debug_barrier()
    # the tokens of the touched blocks, this row's (summed where they are counted)
    loaded = tl.zeros([BB], tl.int64)
    for b0 in range(0, NBS, BB):
        o_b = b0 + tl.arange(0, BB)
        m_b = o_b < NBS
        hits = tl.load(counts + o_b, mask=m_b, other=0, volatile=True)
        size = _run_in_blocks(0, n, o_b.to(tl.int64) * sb, sb)
        loaded += tl.where(hits > 0, size, 0)
    tl.store(p_loaded + r, tl.sum(loaded, 0))


def assemble(top: torch.Tensor, s: torch.Tensor | None, n_tokens: torch.Tensor, first: torch.Tensor,
             anchors: torch.Tensor, window: int, top_k: int, bs: int, sinks: int, w_keep: int, w_pf: int, sb: int,
             n_store_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    R, take = top.shape
    A = anchors.shape[1]
    for t in (top, anchors) if s is None else (top, s, anchors):
        if t.shape[1] and t.stride(1) != 1:
            raise ValueError("top, scores and anchors need contiguous rows")
    both = torch.empty(R, window + A + w_keep + w_pf, dtype=torch.int64, device=top.device)
    # every element written by the kernel: no fill launch before it
    blocks = torch.empty(R, n_store_blocks, dtype=torch.int64, device=top.device)
    loaded = torch.empty(R, dtype=torch.int64, device=top.device)
    BA, BQ = next_pow2(A), next_pow2(take * bs)
    _assemble_kernel[(R,)](
        top, top if s is None else s, n_tokens, first, anchors, both, blocks, loaded,
        top.stride(0), 0 if s is None else s.stride(0), n_tokens.stride(0), first.stride(0), anchors.stride(0),
        both.stride(0),
        blocks.stride(0),
        window, top_k, bs, sinks, A, take, w_keep, w_pf, sb, n_store_blocks,
        # the anchor test's (CA, BQ) tiles of at most 16K elements; groups of lanes of the largest
        # power of 2 dividing bs
        BW=next_pow2(window), BA=BA, CA=max(1, min(BA, 16384 // BQ)), BS=next_pow2(sinks),
        BP=next_pow2(w_keep + w_pf), BQ=BQ, BG=min(bs & -bs, BQ), BB=min(next_pow2(n_store_blocks), 4096),
        HAS_S=s is not None, num_warps=8,
    )
    return both, blocks, loaded


@triton.jit
def _candidate_row(p_scores, p_n, p_first, r, o, m, s_sc, s_n, s_first, window, bs):
    """Row r's scores at columns o as fp32 where block o is a candidate (it starts before the
    window and ends after the row's first position), -inf elsewhere (never read there)."""
    w0 = tl.load(p_n + r * s_n) - window
    first = tl.load(p_first + r * s_first)
    blk0 = o.to(tl.int64) * bs
    cand = (blk0 < w0) & (blk0 + bs > first)
    x = tl.load(p_scores + r * s_sc + o, mask=m & cand, other=0).to(tl.float32)
    return tl.where(cand, x, float("-inf"))


@triton.jit
def _candidates_kernel(p_scores, p_n, p_first, p_s, NB, s_sc, s_n, s_first, s_s, window, bs, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < NB
    x = _candidate_row(p_scores, p_n, p_first, r, o, m, s_sc, s_n, s_first, window, bs)
    tl.store(p_s + r * s_s + o, x, mask=m)


def candidates(scores: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor, window: int,
               block_size: int) -> torch.Tensor:
    R, NB = scores.shape
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    out = torch.empty(R, NB, dtype=torch.float32, device=scores.device)
    BLOCK = min(next_pow2(NB), 1024)
    _candidates_kernel[(R, triton.cdiv(NB, BLOCK))](scores, n_tokens, first, out, NB, scores.stride(0),
                                                    n_tokens.stride(0), first.stride(0), out.stride(0), window,
                                                    block_size, BLOCK=BLOCK)
    return out


@triton.jit
def _merge_rows(v, desc, M: tl.constexpr, W: tl.constexpr, LOG_W: tl.constexpr):
    """Sort each bitonic row of v (M, W) int64, descending where desc (M, 1), else ascending:
    compare-exchanges at strides W / 2 .. 1, the larger kept below in descending rows."""
    for i in tl.static_range(LOG_W):
        h = tl.reshape(v, [M, 1 << i, 2, W >> (i + 1)])                        # pairs along axis 2
        low = (tl.arange(0, 2) == 0)[None, None, :, None]
        keep_max = low == tl.reshape(desc, [M, 1, 1, 1])
        h = tl.where(keep_max, tl.max(h, axis=2, keep_dims=True), tl.min(h, axis=2, keep_dims=True))
        v = tl.reshape(h, [M, W])
    return v


@triton.jit
def _rank_kernel(p_scores, p_n, p_first, p_s, p_top, NB, s_sc, s_n, s_first, s_s, s_top, window, bs, take,
                 p_blocks, s_blk, MODE: tl.constexpr, BLOCK: tl.constexpr, W: tl.constexpr, LOG_C: tl.constexpr,
                 LOG_W: tl.constexpr):
    """Row r's ``take`` (<= W) best columns, best first, ties to the lower column, NaN last. MODE
    0: of the scores as they are; 1: of the candidate scores (_candidate_row, stored to p_s); 2:
    of a list of NB blocks per row (p_blocks, -1 for none) and their scores, the candidates among
    them: the best blocks' numbers, ties to the lower block, -1 where a rank holds no candidate.

    Each score becomes an int64 whose order is the ranking: the fp32 bits made order-preserving as
    an int32 (negative floats' low 31 bits flipped; NaN the lowest, -0 as +0) in the high word,
    ID - 1 - id in the low word (id: the column, or in MODE 2 the block; the lower one wins a
    tie). The row's C = BLOCK / W chunks are sorted (ascending in odd chunks: ~ reverses the int64
    order), then halved LOG_C times: the elementwise max of a descending and an ascending chunk
    holds their best W, as a bitonic sequence, which a merge sorts (alternately, then descending
    at the last)."""
    r = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < NB
    if MODE == 1:
        x = _candidate_row(p_scores, p_n, p_first, r, o, m, s_sc, s_n, s_first, window, bs)
        tl.store(p_s + r * s_s + o, x, mask=m)
    elif MODE == 2:
        ids = tl.load(p_blocks + r * s_blk + o, mask=m, other=-1)
        w0 = tl.load(p_n + r * s_n) - window
        b0 = ids * bs
        cand = (ids >= 0) & (b0 < w0) & (b0 + bs > tl.load(p_first + r * s_first))
        x = tl.where(cand, tl.load(p_scores + r * s_sc + o, mask=m & cand, other=0).to(tl.float32), float("-inf"))
    else:
        x = tl.load(p_scores + r * s_sc + o, mask=m, other=0).to(tl.float32)
    if MODE != 2:
        ids = o.to(tl.int64)
    ID: tl.constexpr = BLOCK if MODE != 2 else 2147483647     # a listed block is < 2**31 - 1: -1 fits too
    bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where((x != x) | ~m, -2147483648, key)          # NaN, then the padding, below -inf
    packed = (key.to(tl.int64) << 32) | (ID - 1 - ids)
    v = tl.reshape(packed, [BLOCK // W, W])
    odd = (tl.arange(0, BLOCK // W) % 2 == 1)[:, None]
    u = tl.sort(tl.where(odd, ~v, v), dim=1, descending=True)
    v = tl.where(odd, ~u, u)
    for i in tl.static_range(LOG_C):
        half = tl.max(tl.reshape(v, [BLOCK // W // (2 << i), 2, W]), axis=1)
        v = _merge_rows(half, (tl.arange(0, BLOCK // W // (2 << i)) % 2 == 0)[:, None], BLOCK // W // (2 << i), W,
                        LOG_W)
    ow = tl.arange(0, W)
    best = tl.reshape(v, [W])
    col = (ID - 1) - best.to(tl.int32).to(tl.int64)          # the low word (< 2**31: no sign)
    if MODE == 2:        # the key of -inf: -inf's bits (0xFF800000) ^ 0x7FFFFFFF, as an int32
        col = tl.where((best >> 32) > -2139095041, col, -1)
    tl.store(p_top + r * s_top + ow, col, mask=ow < take)


def _rank(scores: torch.Tensor, take: int, s: torch.Tensor | None, n_tokens: torch.Tensor, first: torch.Tensor,
          window: int, block_size: int, chunk: int | None = None, num_warps: int | None = None,
          blocks: torch.Tensor | None = None) -> torch.Tensor:
    """top (R, take) of scores (R, NB); with s, of the candidate scores, written to s (R, NB); with
    blocks (R, NB), of the candidates among those listed blocks (their numbers, -1 for none)
    (n_tokens, first, window and block_size are read only with s or blocks). chunk, num_warps: the
    launch's (default: chunks of next_pow2(take), at least 16; the warps fastest on an H200 at
    take 48 and 4, R 8 and 192: 8 from 2048 blocks, bench_rank.py)."""
    R, NB = scores.shape
    if NB > RANK_MAX or not 0 <= take <= NB:
        raise ValueError(f"the ranking sorts rows of 0..{RANK_MAX} blocks for 0..NB of them, got NB={NB}, "
                         f"take={take}")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    top = torch.empty(R, take, dtype=torch.int64, device=scores.device)
    if R == 0:
        return top
    out = scores if s is None else s                                  # not written when s is None
    BLOCK = max(next_pow2(NB), 16)
    W = min(chunk or max(next_pow2(take), 16), BLOCK)
    if W < take or W & (W - 1):
        raise ValueError(f"chunks of {W} blocks: a power of 2 of at least take={take} (or the whole row)")
    if blocks is not None and blocks.stride(1) != 1:
        blocks = blocks.contiguous()
    _rank_kernel[(R,)](scores, n_tokens, first, out, top, NB, scores.stride(0), n_tokens.stride(0), first.stride(0),
                       out.stride(0), top.stride(0), window, block_size, take, top if blocks is None else blocks,
                       0 if blocks is None else blocks.stride(0), MODE=2 if blocks is not None else int(s is not None),
                       BLOCK=BLOCK, W=W, LOG_C=(BLOCK // W).bit_length() - 1, LOG_W=W.bit_length() - 1,
                       num_warps=num_warps or (2 if BLOCK <= 256 else 4 if BLOCK <= 1024 else 8))
    return top


def ranked_candidates(scores: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor, window: int,
                      block_size: int, take: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
    return s, _rank(scores, take, s, n_tokens, first, window, block_size)


def ranked_listed(blocks: torch.Tensor, scores: torch.Tensor, n_tokens: torch.Tensor, first: torch.Tensor,
                  window: int, block_size: int, take: int) -> torch.Tensor:
    return _rank(scores, take, None, n_tokens, first, window, block_size, blocks=blocks)


def row_topk(scores: torch.Tensor, take: int) -> torch.Tensor:
    """The take best columns of each row (R, NB) of scores, best first, ties to the lower column,
    NaN last."""
    return _rank(scores, take, None, scores, scores, 0, 1)
