"""Installing tokens into hot-buffer slots: the LRU state's one write (runtime/hot_buffer.py).

Per head h (a row of the state) and entry j where ``mask[h, j]`` (None: every entry), with
s = slots[h, j] and t = tokens[h, j]:

    old = slot_token[h, s];  if old >= 0: token_slot[h, 1 + old] = -1      (the evicted token)
    token_slot[h, 1 + t] = s;  slot_token[h, s] = t;  slot_stamp[h, s] = stamps[h, j]
    prefetched[h, s] = flag

``token_slot`` (H, 1 + tokens) maps positions to slots with one column before position 0;
``slot_token``, ``slot_stamp``, ``prefetched`` are (H, S + 1) with a spill column past the S
slots. The masked-in slots are distinct per head and no installed token is resident (so no entry
evicts a token another entry installs): the entries are independent, and the Triton kernel writes
them in parallel, one launch for what the reference does in about ten. Masked-out entries change
nothing there; the reference writes them to the spill columns and to column 0 of the map, which
hold no state (readers mask them).
"""
from __future__ import annotations

import torch

from ._dispatch import check, kernel_module, use_triton


def reference_install_slots(token_slot: torch.Tensor, slot_token: torch.Tensor, slot_stamp: torch.Tensor,
                            prefetched: torch.Tensor, mask: torch.Tensor | None, tokens: torch.Tensor,
                            slots: torch.Tensor, stamps: torch.Tensor, flag: bool) -> None:
    spill = slot_token.shape[1] - 1
    at = slots if mask is None else torch.where(mask, slots, spill)
    # the evicted tokens leave the map (an empty slot's -1, and the spill's, go to column 0)
    token_slot.scatter_(1, slot_token.gather(1, at) + 1, -1)
    if mask is None:
        token_slot.scatter_(1, tokens + 1, slots)
        slot_token.scatter_(1, at, tokens)
    else:
        token_slot.scatter_(1, torch.where(mask, tokens + 1, 0), slots)
        slot_token.scatter_(1, at, torch.where(mask, tokens, -1))          # the spill stays -1
    slot_stamp.scatter_(1, at, stamps.to(slot_stamp.dtype))
    if flag and mask is not None:
        prefetched.scatter_(1, at, mask)                                    # the spill stays False
    else:
        prefetched.scatter_(1, at, flag)


def install_slots(token_slot: torch.Tensor, slot_token: torch.Tensor, slot_stamp: torch.Tensor,
                  prefetched: torch.Tensor, mask: torch.Tensor | None, tokens: torch.Tensor,
                  slots: torch.Tensor, stamps: torch.Tensor, flag: bool) -> None:
    """Install ``tokens`` (H, M) into ``slots`` (H, M) with ``stamps`` (H, M) where ``mask`` (H, M)
    (None: everywhere), in place (module docstring). tokens, slots and stamps may be broadcast
    views (stride 0); every index is int64."""
    H, M = slots.shape
    check(tokens.shape == (H, M) and stamps.shape == (H, M) and (mask is None or mask.shape == (H, M)),
          f"tokens, stamps and mask must be (H={H}, M={M}) like slots, got {tuple(tokens.shape)}, "
          f"{tuple(stamps.shape)} and {None if mask is None else tuple(mask.shape)}")
    check(slot_token.shape == slot_stamp.shape == prefetched.shape and token_slot.shape[0] == H
          and slot_token.shape[0] == H, "the state tensors must have one row per head")
    if M == 0:
        return
    if use_triton(slot_token, slots):
        kernel_module("_lru_triton").install_slots(token_slot, slot_token, slot_stamp, prefetched, mask, tokens,
                                                   slots, stamps, flag)
        return
    reference_install_slots(token_slot, slot_token, slot_stamp, prefetched, mask, tokens, slots, stamps, flag)


def lookup_triton(sel: torch.Tensor, token_slot: torch.Tensor, slot_token: torch.Tensor, slot_stamp: torch.Tensor,
                  prefetched: torch.Tensor, clock: torch.Tensor, order_s: torch.Tensor,
                  commit: bool) -> tuple[torch.Tensor, ...]:
    """The hot buffer's lookup (runtime/hot_buffer.HotBufferState.lookup, whose torch code is the
    reference) in three Triton launches: hit detection and the hits' new stamps; the LRU ranking
    of the state the first left, from the heads' kept order ``order_s`` (H, S) (least recent
    first: the same slots as a sort of the stamps, without one); the misses' install, which also
    writes the heads' new order when ``commit`` (no prefetch follows; else the prefetch does).
    Returns (slots, miss, counts (H, 3): selected, hits, used prefetches per head, misses per
    head (H,), the ranking (H, S))."""
    mod = kernel_module("_lru_triton")
    slot, miss, counts = mod.lookup_hits(sel, token_slot, prefetched, slot_stamp, clock)
    order = mod.ranked(order_s, slot_stamp, slot, clock)
    n_miss = mod.lookup_install(sel, miss, slot, order, token_slot, slot_token, slot_stamp, prefetched, clock,
                                (order_s, counts) if commit else None)
    return slot, miss, counts, n_miss, order


def prefetch_triton(tokens: torch.Tensor, limit: torch.Tensor | None, counts: torch.Tensor, num_slots: int,
                    skip: torch.Tensor, order: torch.Tensor, token_slot: torch.Tensor, slot_token: torch.Tensor,
                    slot_stamp: torch.Tensor, prefetched: torch.Tensor, clock: torch.Tensor,
                    offset: int, order_s: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefetch that follows a lookup's shared ranking (HotBufferState.prefetch), in one
    launch: at most min(limit, the room the lookup left: num_slots - counts[:, 0]) tokens per head
    (limit None: the room), past the lookup's ``skip`` (H,) victims, stamped from clock + offset;
    with ``order_s`` (the ranking is then the lookup's whole one) the heads' new order written."""
    return kernel_module("_lru_triton").prefetch_install(tokens, None if limit is None else limit.contiguous(),
                                                         counts, num_slots, skip.contiguous(), order, token_slot,
                                                         slot_token, slot_stamp, prefetched, clock, offset, order_s)


def insert_one_triton(tokens: torch.Tensor, token_slot: torch.Tensor, slot_token: torch.Tensor,
                      slot_stamp: torch.Tensor, prefetched: torch.Tensor, clock: torch.Tensor,
                      num_slots: int, kv: tuple[torch.Tensor, ...] | None = None, head0: int = 0,
                      order_s: torch.Tensor | None = None) -> torch.Tensor:
    """One appended token per head (HotBufferState.insert with T = 1, whose torch code is the
    reference: the least recent slot, then the install) in one launch. tokens (H, 1), may be a
    broadcast view; the state tensors with their spill columns. Returns the slots (H, 1). kv: the
    token's key and value per head (k (H, D), v (H, D)) and the hot K / V rows (k_dst, v_dst
    (N, D)) where they go, at row (head0 + h) * num_slots + slot (cast to k_dst's dtype). order_s:
    the heads' LRU order (H, S), kept (the slot moves to its end), or None."""
    return kernel_module("_lru_triton").insert_one(tokens, token_slot, slot_token, slot_stamp, prefetched,
                                                   clock, num_slots, kv, head0, order_s)


def lru_step_triton(sel: torch.Tensor, tokens: torch.Tensor, token_slot: torch.Tensor, slot_token: torch.Tensor,
                    slot_stamp: torch.Tensor, prefetched: torch.Tensor, order_s: torch.Tensor,
                    clock: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A decode step's lookup of sel (H, K) and its prefetch of tokens (H, P) in one launch
    (HotBufferState.lookup_prefetch; lookup then prefetch is the reference), with the heads' kept
    LRU order ``order_s`` (H, S), which it updates. Returns (slots, miss, counts, loaded,
    prefetch slots)."""
    return kernel_module("_lru_triton").lru_step(sel, tokens, token_slot, slot_token, slot_stamp, prefetched, order_s,
                                                 clock)
