"""Triton: install tokens into hot-buffer slots in one launch (lru.py says what it writes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import next_pow2


@triton.jit
def _install_kernel(
    p_ts, p_st, p_stamp, p_pf, p_mask, p_tok, p_slot, p_new_stamp, M,
    s_ts, s_st, s_stamp, s_pf, s_mask_h, s_mask_m, s_tok_h, s_tok_m, s_slot_h, s_slot_m, s_ns_h, s_ns_m,
    FLAG: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    h = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < M
    if HAS_MASK:
        m = m & (tl.load(p_mask + h * s_mask_h + o * s_mask_m, mask=m, other=0) != 0)
    slot = tl.load(p_slot + h * s_slot_h + o * s_slot_m, mask=m, other=0).to(tl.int64)
    tok = tl.load(p_tok + h * s_tok_h + o * s_tok_m, mask=m, other=0).to(tl.int64)
    stamp = tl.load(p_new_stamp + h * s_ns_h + o * s_ns_m, mask=m, other=0)
    old = tl.load(p_st + h * s_st + slot, mask=m, other=-1)
    # the evicted token leaves the map (no installed token is resident: no entry writes it back)
    tl.store(p_ts + h * s_ts + 1 + old, tl.full([BLOCK], -1, tl.int64), mask=m & (old >= 0))
    tl.store(p_ts + h * s_ts + 1 + tok, slot, mask=m)
    tl.store(p_st + h * s_st + slot, tok, mask=m)
    tl.store(p_stamp + h * s_stamp + slot, stamp, mask=m)
    tl.store(p_pf + h * s_pf + slot, tl.full([BLOCK], FLAG, tl.uint8), mask=m)


def install_slots(token_slot: torch.Tensor, slot_token: torch.Tensor, slot_stamp: torch.Tensor,
                  prefetched: torch.Tensor, mask: torch.Tensor | None, tokens: torch.Tensor,
                  slots: torch.Tensor, stamps: torch.Tensor, flag: bool) -> None:
    H, M = slots.shape
    for t in (token_slot, slot_token, slot_stamp, prefetched):
        if t.stride(1) != 1:
            raise ValueError("the state tensors need contiguous rows")
    pf = prefetched.view(torch.uint8)
    mask_arg = mask.view(torch.uint8) if mask is not None else slots
    BLOCK = min(next_pow2(M), 1024)
    grid = (H, triton.cdiv(M, BLOCK))
    _install_kernel[grid](
        token_slot, slot_token, slot_stamp, pf, mask_arg, tokens, slots, stamps, M,
        token_slot.stride(0), slot_token.stride(0), slot_stamp.stride(0), pf.stride(0),
        mask_arg.stride(0), mask_arg.stride(1), tokens.stride(0), tokens.stride(1),
        slots.stride(0), slots.stride(1), stamps.stride(0), stamps.stride(1),
        FLAG=int(bool(flag)), HAS_MASK=mask is not None, BLOCK=BLOCK,
    )


@triton.jit
def _hits_body(h, p_sel, p_ts, p_pf, p_stamp, p_clock, p_slot, p_miss, p_counts, K,
               s_sel, s_ts, s_pf, s_stamp, s_slot, s_miss, BLOCK: tl.constexpr):
    """Head h's hit detection; hits lose the prefetch flag and become the most recent. Returns
    the hits."""
    o = tl.arange(0, BLOCK)
    m = o < K
    sel = tl.load(p_sel + h * s_sel + o, mask=m, other=-1)
    valid = m & (sel >= 0)
    slot = tl.load(p_ts + h * s_ts + 1 + sel, mask=valid, other=-1)
    hit = slot >= 0
    miss = valid & (slot < 0)
    clock = tl.load(p_clock)
    used_pf = tl.load(p_pf + h * s_pf + slot, mask=hit, other=0).to(tl.int64)
    tl.store(p_pf + h * s_pf + slot, tl.zeros([BLOCK], tl.uint8), mask=hit)
    tl.store(p_stamp + h * s_stamp + slot, clock + K + o, mask=hit)
    tl.store(p_slot + h * s_slot + o, slot, mask=m)
    tl.store(p_miss + h * s_miss + o, miss.to(tl.uint8), mask=m)
    n_hits = tl.sum(hit.to(tl.int64), 0)
    tl.store(p_counts + h * 3, tl.sum(valid.to(tl.int64), 0))
    tl.store(p_counts + h * 3 + 1, n_hits)
    tl.store(p_counts + h * 3 + 2, tl.sum(used_pf, 0))
    return n_hits


@triton.jit
def _lookup_hits_kernel(
    p_sel, p_ts, p_pf, p_stamp, p_clock, p_slot, p_miss, p_counts, K,
    s_sel, s_ts, s_pf, s_stamp, s_slot, s_miss,
    BLOCK: tl.constexpr,
):
    # one program per head
    _hits_body(tl.program_id(0).to(tl.int64), p_sel, p_ts, p_pf, p_stamp, p_clock, p_slot, p_miss, p_counts, K,
               s_sel, s_ts, s_pf, s_stamp, s_slot, s_miss, BLOCK)


@triton.jit
def _commit_order(p_ranked, s_ranked, p_ord, s_ord, h, S, a, b, hits, BS: tl.constexpr):
    """Head h's LRU order after a lookup and its prefetch (least recent first), from the lookup's
    ranking (the order without the hits, then the hits): the slots nothing took (ranked past the
    a misses' and b prefetches' victims), the misses' victims, the hits, the prefetched slots, as
    their new stamps order them (misses clock + o, hits clock + K + o, prefetches after)."""
    j = tl.arange(0, BS)
    m = j < S
    r = tl.load(p_ranked + h * s_ranked + j, mask=m, other=0, volatile=True)
    rest = S - hits - a - b
    dest = tl.where(j < a, rest + j,
                    tl.where(j < a + b, rest + a + hits + (j - a),
                             tl.where(j < S - hits, j - a - b, rest + a + (j - (S - hits)))))
    tl.store(p_ord + h * s_ord + dest, r.to(p_ord.dtype.element_ty), mask=m)


@triton.jit
def _ranked_body(h, p_ord, p_stamp, p_slot, p_clock, p_ranked, S, K, s_ord, s_stamp, s_slot, s_ranked,
                 BS: tl.constexpr, BK: tl.constexpr):
    """Head h's LRU ranking after the lookup's hits took their stamps, without a sort: the bank's
    order (least recent first) without the hits (stamped clock + K + o, above every other stamp),
    then the hits in selection order. (Volatile loads: in the fused step other threads of the
    program wrote them.)"""
    j = tl.arange(0, BS)
    m = j < S
    slot = tl.load(p_ord + h * s_ord + j, mask=m, other=0).to(tl.int64)
    stamp = tl.load(p_stamp + h * s_stamp + slot, mask=m, other=0, volatile=True)
    keep = m & (stamp < tl.load(p_clock) + K)
    k = keep.to(tl.int32)
    tl.store(p_ranked + h * s_ranked + tl.cumsum(k, 0) - k, slot, mask=keep)
    o = tl.arange(0, BK)
    hs = tl.load(p_slot + h * s_slot + o, mask=o < K, other=-1, volatile=True)
    hit = hs >= 0
    c = hit.to(tl.int32)
    tl.store(p_ranked + h * s_ranked + tl.sum(k, 0) + tl.cumsum(c, 0) - c, hs, mask=hit)


@triton.jit
def _ranked_kernel(p_ord, p_stamp, p_slot, p_clock, p_ranked, S, K, s_ord, s_stamp, s_slot, s_ranked,
                   BS: tl.constexpr, BK: tl.constexpr):
    # one program per head
    _ranked_body(tl.program_id(0).to(tl.int64), p_ord, p_stamp, p_slot, p_clock, p_ranked, S, K, s_ord, s_stamp,
                 s_slot, s_ranked, BS, BK)


@triton.jit
def _install_body(h, p_sel, p_miss, p_slot, p_order, p_ts, p_st, p_stamp, p_pf, p_clock, p_n_miss, K,
                  s_sel, s_miss, s_slot, s_order, s_ts, s_st, s_stamp, s_pf, BLOCK: tl.constexpr):
    """Head h's misses: the r-th takes the r-th least recent slot of the ranking. Returns the
    misses."""
    o = tl.arange(0, BLOCK)
    m = o < K
    miss = tl.load(p_miss + h * s_miss + o, mask=m, other=0, volatile=True).to(tl.int64)
    rank = tl.cumsum(miss, 0) - miss
    is_miss = miss != 0
    victim = tl.load(p_order + h * s_order + rank, mask=is_miss, other=0, volatile=True)
    tok = tl.load(p_sel + h * s_sel + o, mask=is_miss, other=0)
    old = tl.load(p_st + h * s_st + victim, mask=is_miss, other=-1)
    tl.store(p_ts + h * s_ts + 1 + old, tl.full([BLOCK], -1, tl.int64), mask=is_miss & (old >= 0))
    tl.store(p_ts + h * s_ts + 1 + tok, victim, mask=is_miss)
    tl.store(p_st + h * s_st + victim, tok, mask=is_miss)
    tl.store(p_stamp + h * s_stamp + victim, tl.load(p_clock) + o, mask=is_miss)
    tl.store(p_pf + h * s_pf + victim, tl.zeros([BLOCK], tl.uint8), mask=is_miss)
    tl.store(p_slot + h * s_slot + o, victim, mask=is_miss)
    n_miss = tl.sum(miss, 0)
    tl.store(p_n_miss + h, n_miss)
    return n_miss


@triton.jit
def _lookup_install_kernel(
    p_sel, p_miss, p_slot, p_order, p_ts, p_st, p_stamp, p_pf, p_clock, p_n_miss, K,
    s_sel, s_miss, s_slot, s_order, s_ts, s_st, s_stamp, s_pf,
    p_ord, s_ord, p_counts, s_counts, S,
    COMMIT: tl.constexpr, BLOCK: tl.constexpr, BS: tl.constexpr,
):
    # one program per head
    h = tl.program_id(0).to(tl.int64)
    n_miss = _install_body(h, p_sel, p_miss, p_slot, p_order, p_ts, p_st, p_stamp, p_pf, p_clock, p_n_miss, K,
                           s_sel, s_miss, s_slot, s_order, s_ts, s_st, s_stamp, s_pf, BLOCK)
    if COMMIT:           # no prefetch follows: the bank's order now
        tl.debug_barrier()
        _commit_order(p_order, s_order, p_ord, s_ord, h, S, n_miss, 0, tl.load(p_counts + h * s_counts + 1), BS)


@triton.jit
def _prefetch_body(h, p_tok, room, skip, p_order, p_ts, p_st, p_stamp, p_pf, p_clock, c0, p_loaded, p_victim, P,
                   W, s_tok, s_order, s_ts, s_st, s_stamp, s_pf, s_loaded, s_victim, BLOCK: tl.constexpr):
    """Head h's prefetch: non-resident tokens, up to ``room``, take the slots of the lookup's
    ranking past its ``skip`` misses' victims. Returns the loaded ones."""
    o = tl.arange(0, BLOCK)
    m = o < P
    tok = tl.load(p_tok + h * s_tok + o, mask=m, other=-1)
    cand = m & (tok >= 0)
    cand = cand & (tl.load(p_ts + h * s_ts + 1 + tok, mask=cand, other=0, volatile=True) < 0)
    c = cand.to(tl.int64)
    rank = tl.cumsum(c, 0) - c
    cand = cand & (rank < room)
    victim = tl.load(p_order + h * s_order + tl.minimum(skip + rank, W - 1), mask=m, other=0, volatile=True)
    old = tl.load(p_st + h * s_st + victim, mask=cand, other=-1)
    tl.store(p_ts + h * s_ts + 1 + old, tl.full([BLOCK], -1, tl.int64), mask=cand & (old >= 0))
    tl.store(p_ts + h * s_ts + 1 + tok, victim, mask=cand)
    tl.store(p_st + h * s_st + victim, tok, mask=cand)
    tl.store(p_stamp + h * s_stamp + victim, tl.load(p_clock) + c0 + o, mask=cand)
    tl.store(p_pf + h * s_pf + victim, tl.full([BLOCK], 1, tl.uint8), mask=cand)
    tl.store(p_loaded + h * s_loaded + o, cand.to(tl.uint8), mask=m)
    tl.store(p_victim + h * s_victim + o, victim, mask=m)
    return tl.sum(cand.to(tl.int64), 0)


@triton.jit
def _prefetch_kernel(
    p_tok, p_limit, p_counts, S, p_skip, p_order, p_ts, p_st, p_stamp, p_pf, p_clock, c0, p_loaded, p_victim, P,
    W, s_tok, s_counts, s_order, s_ts, s_st, s_stamp, s_pf, s_loaded, s_victim, p_ord, s_ord,
    HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr, COMMIT: tl.constexpr, BS: tl.constexpr,
):
    # one program per head: at most the room the lookup left (and the limit)
    h = tl.program_id(0).to(tl.int64)
    room = S - tl.load(p_counts + h * s_counts)
    if HAS_LIMIT:
        room = tl.minimum(tl.load(p_limit + h), room)
    skip = tl.load(p_skip + h)
    n_pf = _prefetch_body(h, p_tok, room, skip, p_order, p_ts, p_st, p_stamp, p_pf, p_clock, c0, p_loaded, p_victim,
                          P, W, s_tok, s_order, s_ts, s_st, s_stamp, s_pf, s_loaded, s_victim, BLOCK)
    if COMMIT:           # the lookup's ranking is the whole order: the bank's order now
        tl.debug_barrier()
        _commit_order(p_order, s_order, p_ord, s_ord, h, S, skip, n_pf, tl.load(p_counts + h * s_counts + 1), BS)


@triton.jit
def _lru_step_kernel(
    p_sel, p_ts, p_st, p_stamp, p_pf, p_clock, p_slot, p_miss, p_counts, p_n_miss, p_ord, p_ranked,
    p_tok, p_loaded, p_victim, K, S, P,
    s_sel, s_ts, s_st, s_stamp, s_pf, s_slot, s_miss, s_ord, s_ranked, s_tok, s_loaded, s_victim,
    BLOCK: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr,
):
    # one program per head: a decode step's lookup and the prefetch after it in one launch (the
    # phases of the four kernels above, a barrier between each: each reads what the last wrote)
    h = tl.program_id(0).to(tl.int64)
    n_hits = _hits_body(h, p_sel, p_ts, p_pf, p_stamp, p_clock, p_slot, p_miss, p_counts, K,
                        s_sel, s_ts, s_pf, s_stamp, s_slot, s_miss, BLOCK)
    tl.debug_barrier()
    _ranked_body(h, p_ord, p_stamp, p_slot, p_clock, p_ranked, S, K, s_ord, s_stamp, s_slot, s_ranked, BS, BLOCK)
    tl.debug_barrier()
    n_miss = _install_body(h, p_sel, p_miss, p_slot, p_ranked, p_ts, p_st, p_stamp, p_pf, p_clock, p_n_miss, K,
                           s_sel, s_miss, s_slot, s_ranked, s_ts, s_st, s_stamp, s_pf, BLOCK)
    tl.debug_barrier()
    n_valid = tl.load(p_counts + h * 3, volatile=True)
    n_pf = _prefetch_body(h, p_tok, S - n_valid, n_miss, p_ranked, p_ts, p_st, p_stamp, p_pf, p_clock, 2 * K,
                          p_loaded, p_victim, P, S, s_tok, s_ranked, s_ts, s_st, s_stamp, s_pf, s_loaded, s_victim,
                          BP)
    tl.debug_barrier()
    _commit_order(p_ranked, s_ranked, p_ord, s_ord, h, S, n_miss, n_pf, n_hits, BS)


@triton.jit
def _insert_one_kernel(
    p_tok, p_ts, p_st, p_stamp, p_pf, p_clock, p_victim, S,
    s_tok, s_ts, s_st, s_stamp, s_pf,
    p_k, p_v, p_kd, p_vd, s_k, s_v, s_kd, s_vd, head0, D, p_ord, s_ord,
    HAS_KV: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, ORDER: tl.constexpr,
):
    # one program per head: one appended token takes the least recent slot (stamps are unique per
    # head: one minimum), the ranking and the install in one launch; with HAS_KV also its key and
    # value written into the slot's row of the hot K / V ((head0 + h) * S + slot)
    h = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    stamp = tl.load(p_stamp + h * s_stamp + o, mask=o < S, other=2147483647)      # int32 stamps: their max
    victim = tl.argmin(stamp, 0).to(tl.int64)
    tok = tl.load(p_tok + h * s_tok).to(tl.int64)
    old = tl.load(p_st + h * s_st + victim)
    tl.store(p_ts + h * s_ts + 1 + old, -1, mask=old >= 0)
    tl.store(p_ts + h * s_ts + 1 + tok, victim)
    tl.store(p_st + h * s_st + victim, tok)
    tl.store(p_stamp + h * s_stamp + victim, tl.load(p_clock))
    tl.store(p_pf + h * s_pf + victim, tl.zeros([], tl.uint8))
    tl.store(p_victim + h, victim)
    if ORDER:            # the bank's order: the victim (its least recent slot) becomes the most recent
        ordv = tl.load(p_ord + h * s_ord + o, mask=o < S, other=0)
        keep = (o < S) & (ordv != victim)
        k = keep.to(tl.int32)
        pos = tl.cumsum(k, 0) - k
        tl.debug_barrier()                        # every thread's read before any write
        tl.store(p_ord + h * s_ord + pos, ordv, mask=keep)
        tl.store(p_ord + h * s_ord + S - 1, victim.to(p_ord.dtype.element_ty))
    if HAS_KV:
        d = tl.arange(0, BD)
        dm = d < D
        row = (head0 + h) * S + victim
        tl.store(p_kd + row * s_kd + d, tl.load(p_k + h * s_k + d, mask=dm).to(p_kd.dtype.element_ty), mask=dm)
        tl.store(p_vd + row * s_vd + d, tl.load(p_v + h * s_v + d, mask=dm).to(p_vd.dtype.element_ty), mask=dm)


def _rows(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.stride(-1) != 1:
            raise ValueError("the state and index tensors need contiguous rows")


def lookup_hits(sel, token_slot, prefetched, slot_stamp, clock):
    H, K = sel.shape
    _rows(sel, token_slot, prefetched, slot_stamp)
    slot = torch.empty(H, K, dtype=torch.int64, device=sel.device)
    miss = torch.empty(H, K, dtype=torch.bool, device=sel.device)
    counts = torch.empty(H, 3, dtype=torch.int64, device=sel.device)
    pf = prefetched.view(torch.uint8)
    _lookup_hits_kernel[(H,)](sel, token_slot, pf, slot_stamp, clock, slot, miss.view(torch.uint8), counts, K,
                              sel.stride(0), token_slot.stride(0), pf.stride(0), slot_stamp.stride(0),
                              slot.stride(0), K, BLOCK=next_pow2(K), num_warps=8 if K > 2048 else 4)
    return slot, miss, counts


def ranked(order_s, slot_stamp, slot, clock):
    """The LRU ranking (H, S) int64 of the heads whose order (H, S) is ``order_s`` (least recent
    first), after lookup_hits stamped the hits ``slot`` (H, K) (-1 for none) from clock + K."""
    H, S = order_s.shape
    K = slot.shape[1]
    _rows(order_s, slot_stamp, slot)
    out = torch.empty(H, S, dtype=torch.int64, device=slot.device)
    _ranked_kernel[(H,)](order_s, slot_stamp, slot, clock, out, S, K, order_s.stride(0), slot_stamp.stride(0),
                         slot.stride(0), out.stride(0), BS=next_pow2(S), BK=next_pow2(K),
                         num_warps=8 if S > 2048 else 4)
    return out


def lookup_install(sel, miss, slot, order, token_slot, slot_token, slot_stamp, prefetched, clock, commit=None):
    """commit: (order_s (H, S), counts (H, 3)) to write the bank's new order (no prefetch follows;
    ``order`` is then the whole ranking from :func:`ranked`), or None."""
    H, K = sel.shape
    _rows(sel, order, token_slot, slot_token, slot_stamp, prefetched)
    n_miss = torch.empty(H, dtype=torch.int64, device=sel.device)
    pf = prefetched.view(torch.uint8)
    ord_s, counts = commit if commit is not None else (order, n_miss[:, None])
    S = ord_s.shape[1]
    _lookup_install_kernel[(H,)](sel, miss.view(torch.uint8), slot, order, token_slot, slot_token, slot_stamp, pf,
                                 clock, n_miss, K, sel.stride(0), K, slot.stride(0), order.stride(0),
                                 token_slot.stride(0), slot_token.stride(0), slot_stamp.stride(0), pf.stride(0),
                                 ord_s, ord_s.stride(0), counts, counts.stride(0), S, COMMIT=commit is not None,
                                 BLOCK=next_pow2(K), BS=next_pow2(S), num_warps=8 if max(K, S) > 2048 else 4)
    return n_miss


def prefetch_install(tokens, limit, counts, num_slots, skip, order, token_slot, slot_token, slot_stamp, prefetched,
                     clock, offset, order_s=None):
    """order_s: the bank's order (H, S) to write after the prefetch (``order`` is then the whole
    ranking from :func:`ranked`), or None."""
    H, P = tokens.shape
    _rows(tokens, order, token_slot, slot_token, slot_stamp, prefetched)
    loaded = torch.empty(H, P, dtype=torch.bool, device=tokens.device)
    victims = torch.empty(H, P, dtype=torch.int64, device=tokens.device)
    pf = prefetched.view(torch.uint8)
    ord_s = order if order_s is None else order_s
    _prefetch_kernel[(H,)](tokens, tokens if limit is None else limit, counts, num_slots, skip, order, token_slot,
                           slot_token, slot_stamp, pf, clock, offset, loaded.view(torch.uint8), victims, P,
                           order.shape[1], tokens.stride(0), counts.stride(0), order.stride(0),
                           token_slot.stride(0), slot_token.stride(0), slot_stamp.stride(0), pf.stride(0), P, P,
                           ord_s, ord_s.stride(0), HAS_LIMIT=limit is not None, BLOCK=next_pow2(P),
                           COMMIT=order_s is not None, BS=next_pow2(num_slots),
                           num_warps=8 if num_slots > 2048 else 4)
    return loaded, victims


def insert_one(tokens, token_slot, slot_token, slot_stamp, prefetched, clock, num_slots, kv=None, head0=0,
               order_s=None):
    """One token per head, tokens (H, 1) (may broadcast), into each head's least recent slot:
    returns the slots (H, 1). kv: (k (H, D), v (H, D), k_dst (N, D), v_dst (N, D)) or None.
    order_s: the heads' LRU order (H, S) to keep (the victim moves to its end), or None."""
    H = tokens.shape[0]
    _rows(token_slot, slot_token, slot_stamp, prefetched)
    victims = torch.empty(H, 1, dtype=torch.int64, device=tokens.device)
    pf = prefetched.view(torch.uint8)
    k, v, kd, vd = kv if kv is not None else (victims,) * 4
    if kv is not None:
        _rows(k, v, kd, vd)
    D = kd.shape[1] if kv is not None else 1
    _insert_one_kernel[(H,)](tokens, token_slot, slot_token, slot_stamp, pf, clock, victims, num_slots,
                             tokens.stride(0), token_slot.stride(0), slot_token.stride(0), slot_stamp.stride(0),
                             pf.stride(0), k, v, kd, vd, k.stride(0), v.stride(0), kd.stride(0), vd.stride(0),
                             head0, D, victims if order_s is None else order_s,
                             0 if order_s is None else order_s.stride(0), HAS_KV=kv is not None, BD=next_pow2(D),
                             BLOCK=next_pow2(num_slots), ORDER=order_s is not None,
                             num_warps=8 if num_slots > 2048 else 4)
    return victims


def lru_step(sel, tokens, token_slot, slot_token, slot_stamp, prefetched, order_s, clock):
    """A lookup of sel (H, K) and the prefetch of tokens (H, P) after it, with the heads' kept
    order, in one launch: (slot, miss, counts, loaded, victims) as lookup_hits / lookup_install
    and prefetch_install give them (the prefetch at most the room the lookup left, stamped from
    clock + 2K)."""
    H, K = sel.shape
    P = tokens.shape[1]
    S = order_s.shape[1]
    _rows(sel, tokens, token_slot, slot_token, slot_stamp, prefetched, order_s)
    dev = sel.device
    slot = torch.empty(H, K, dtype=torch.int64, device=dev)
    miss = torch.empty(H, K, dtype=torch.bool, device=dev)
    counts = torch.empty(H, 3, dtype=torch.int64, device=dev)
    n_miss = torch.empty(H, dtype=torch.int64, device=dev)
    ranked_ = torch.empty(H, S, dtype=torch.int64, device=dev)
    loaded = torch.empty(H, P, dtype=torch.bool, device=dev)
    victims = torch.empty(H, P, dtype=torch.int64, device=dev)
    pf = prefetched.view(torch.uint8)
    _lru_step_kernel[(H,)](sel, token_slot, slot_token, slot_stamp, pf, clock, slot, miss.view(torch.uint8), counts,
                           n_miss, order_s, ranked_, tokens, loaded.view(torch.uint8), victims, K, S, P,
                           sel.stride(0), token_slot.stride(0), slot_token.stride(0), slot_stamp.stride(0),
                           pf.stride(0), K, K, order_s.stride(0), S, tokens.stride(0), P, P,
                           BLOCK=next_pow2(max(K, 1)), BS=next_pow2(S), BP=next_pow2(max(P, 1)),
                           num_warps=8 if max(K, S) > 2048 else 4)
    return slot, miss, counts, loaded, victims
