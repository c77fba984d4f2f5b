"""The batched decode step of one batch without host syncs, and its CUDA graphs.

A batch is B sequences of one length in consecutive engine rows (docs/runtime.md, batched
decode). Each layer's append (one token per sequence) and attend run here as *bodies*: every
shape is known on the host and every value that changes from step to step (the token count n,
the hot buffer's LRU clock) is read from a device scalar, so a body can be captured once in a
CUDA graph and replayed while the host-side shape keys stay the same (until n crosses a block
boundary or a bank grows). On the CPU, or with ``decode_graphs=False``, the bodies run eagerly.

Host-side bookkeeping (page tables, sequence lengths, the host mirror of the LRU clock,
counters that live on the host) stays outside the bodies and runs every step.
"""

from __future__ import annotations

import gc
import os
import traceback
import warnings

import torch

from hi_sparse import kernels
from hi_sparse.kernels import sparse_decode_attention

from .probe import probe_threshold
from .selection import bound_scores, select_fixed


def push_query(bank, r: slice, q: torch.Tensor) -> None:
    """Shift this step's queries q (B, Hq, D) into rows r of the bank's recent queries
    (recalibration re-scores anchors with them)."""
    qb = bank.t["queries"][r]
    qb.copy_(torch.cat([qb[:, 1:], q[:, None].float()], 1))


def _cause(exc: BaseException) -> str:
    """What broke a capture, first: when an op of the body raised, ending the capture raises too
    ("operation failed due to a previous error during capture") with the op's error as context."""
    first = exc.__context__ if exc.__context__ is not None else exc
    own = (os.path.dirname(__file__), os.path.dirname(kernels.__file__))
    where = [f for f in traceback.extract_tb(first.__traceback__) if f.filename.startswith(own)][-1:]
    at = f" at {os.path.basename(where[0].filename)}:{where[0].lineno} ({where[0].name})" if where else ""
    text = f"{type(first).__name__}: {_line(first)}{at}"
    return text if first is exc else f"{text}; then ending the capture: {_line(exc)}"


def _line(exc: BaseException) -> str:
    """An error's first line (torch's CUDA errors go on with generic debugging advice)."""
    return (str(exc).strip().splitlines() or [""])[0]


def _after_failed_capture(stream: torch.cuda.Stream, pool) -> None:
    """Undo what torch.cuda.graph leaves behind when ending a capture raises: its capture stream
    stays current (later work would run unordered with the caller's stream), the memory pool
    stays registered for allocations, and the CUDA random generator stays in capture mode (every
    later random op on the GPU, sampling included, would raise "Offset increment outside graph
    capture"). Only a capture that ends resets the generator: one tiny capture, in a new pool (the
    failed one cannot take another)."""
    torch.cuda.set_stream(stream)
    try:
        torch._C._cuda_endAllocateToPool(stream.device_index, pool)
    except (AttributeError, RuntimeError):     # a torch without it, or the pool already closed
        pass
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.zeros(1, device=stream.device).add_(1)
    except RuntimeError:                       # if this fails too, the stream at least comes back
        torch.cuda.set_stream(stream)


class BatchStep:
    """Device state of one batch: block tables and tail slots (refreshed in place), each
    sequence's first position per head, per-layer device scalars (n, clock), graphs."""

    def __init__(self, eng, seqs: list, device: torch.device) -> None:
        self.eng, self.dev = eng, device
        self.B, self.r0 = len(seqs), seqs[0].row
        H, bs = eng.Hkv, eng.bs
        self.width = -(-eng.cfg.max_seq_len // bs)
        self.tables = torch.full((self.B, self.width), -1, dtype=torch.int64, device=device)
        self.versions: tuple | None = None
        self.tails = torch.tensor([s.tail for s in seqs], dtype=torch.int64).to(device)
        firsts = [s.first for s in seqs]
        self.first = torch.tensor(firsts, dtype=torch.int64).repeat_interleave(H)[:, None].to(device)
        self.first_lo = min(firsts)
        self.heads = torch.arange(H, device=device)
        self.flat_heads = torch.arange(self.r0 * H, (self.r0 + self.B) * H, device=device)
        self.bh = torch.arange(self.B * H, device=device)[:, None]            # (B*H, 1) batch head
        self.n = torch.zeros(eng.L, 2, dtype=torch.int64, device=device)      # per layer: n, clock
        self.graphs: dict[tuple[int, str], tuple[tuple, torch.cuda.CUDAGraph]] = {}   # slot -> (key, graph)
        self.inputs: dict[tuple[int, str], list] = {}
        self.outputs: dict[tuple[int, str], tuple] = {}
        # graphs on CUDA with decode_graphs, when every layer is on one GPU (graphs per layer and
        # device have not been run on the hardware yet: a split decodes through the same bodies
        # without them); a failed capture turns them off too
        self.no_graphs = not (eng.cfg.decode_graphs and device.type == "cuda") or len(set(eng.layer_devices)) > 1
        self.warm: dict[tuple[int, str], tuple] = {}    # slot -> the key last run eagerly
        self.pool = None

    def refresh_tables(self, seqs: list) -> None:
        """Block tables into the fixed buffer (in place: a captured graph keeps its address)."""
        pages = self.eng.pages
        versions = tuple(pages.seqs[s.seq_id].version for s in seqs)
        if versions == self.versions:
            return
        ids = [pages.block_ids(s.seq_id) for s in seqs]
        w = max(len(x) for x in ids)
        self.tables[:, :w].copy_(torch.tensor([x + [-1] * (w - len(x)) for x in ids], dtype=torch.int64))
        self.versions = versions

    # -- running a body: eagerly, or through a CUDA graph ------------------------------------------
    def run(self, layer: int, kind: str, key: tuple, n: int, clock: int, body, *args):
        """Set the layer's device scalars, then run ``body(layer, *args)``: eagerly, or (CUDA,
        ``decode_graphs``) eagerly the first time a key is seen, then captured, then replayed.
        Tensor arguments are copied into buffers the graph reads. Returns the body's output."""
        self.n[layer, 0].fill_(n)
        self.n[layer, 1].fill_(clock)
        if self.no_graphs:
            return body(layer, *args)
        slot = (layer, kind)
        bufs = self.inputs.get(slot)
        if bufs is None or any(isinstance(a, torch.Tensor) and a.shape != b.shape for a, b in zip(args, bufs)):
            bufs = self.inputs[slot] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        for a, b in zip(args, bufs):
            if isinstance(a, torch.Tensor):
                b.copy_(a)
        args = [b if isinstance(b, torch.Tensor) else a for a, b in zip(args, bufs)]
        have = self.graphs.get(slot)
        if have is not None and have[0] == key:
            have[1].replay()
            return self.outputs.get(slot)
        if self.warm.get(slot) != key:           # first sight: eager (compiles, cuBLAS workspaces)
            self.warm[slot] = key
            out = body(layer, *args)
            if out is not None:                  # its outputs' shapes size the graph's output buffers
                self.outputs[slot] = tuple(torch.empty_like(o) for o in out)
            return out
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # The graphs share one memory pool, which is safe for what lives only during a replay;
        # outputs outlive it (the caller reads them after later layers' replays), so the graph
        # copies them into buffers allocated outside the pool.
        stream = torch.cuda.current_stream()
        collecting = gc.isenabled()
        # A collection during the capture would run CUDA calls a capture forbids (unregistering a
        # dropped pool's pinned pages, destroying an old engine's graphs) and break it; other
        # threads' CUDA calls (thread_local) may go on.
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = body(layer, *args)
                if out is not None:
                    for o, b in zip(out, self.outputs[slot]):
                        b.copy_(o)
        except RuntimeError as exc:   # decode on without graphs rather than stop serving
            _after_failed_capture(stream, self.pool)
            warnings.warn(f"HiSparse: CUDA graph capture of the batched decode step failed ({_cause(exc)}); "
                          "this batch decodes without graphs (set decode_graphs=False to silence this)",
                          RuntimeWarning, stacklevel=2)
            self.no_graphs = True
            return body(layer, *args)
        finally:
            if collecting:
                gc.enable()
        self.graphs[slot] = (key, graph)
        graph.replay()                            # capture records, it does not run
        return self.outputs.get(slot)

    def key(self, layer: int, *shape) -> tuple:
        """What a captured body depends on beyond its device scalars: host-side shapes, whether
        the layer's probe is fitted (the append scores new tokens as anchors only then; a refit
        updates the weights in place) and the addresses of every buffer it touches (a bank or
        pool that grew moved them)."""
        eng = self.eng
        ts = list(eng.banks[layer].t.values()) + [eng.k_hot[layer], eng.v_hot[layer]]
        hb = eng.hot_banks[layer]
        ts += [hb.slot_token, hb.slot_stamp, hb.prefetched, hb.token_slot]
        ts += list(eng.host.layers[layer].values())
        return shape + (eng.probes[layer].fitted,) + tuple(t.data_ptr() for t in ts)

    # -- bodies ----------------------------------------------------------------------------------
    def append_body(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token per sequence, k, v (B, Hkv, 1, D): backup into the pinned pool (main rows, or
        the tail block of a quantized pool), key bounds, hot buffer, anchors."""
        eng, cfg = self.eng, self.eng.cfg
        B, H, D, bs, r = self.B, eng.Hkv, eng.D, eng.bs, slice(self.r0, self.r0 + self.B)
        p0, clock = self.n[layer, 0], self.n[layer, 1]
        kf, vf = k[:, :, 0], v[:, :, 0]                                             # (B, H, D)
        where = self.tails if eng.host.quantized else self.tables.gather(1, (p0 // bs).expand(B, 1))[:, 0]
        rows = ((where[:, None] * H + self.heads) * bs + p0 % bs).reshape(-1)
        eng.host.backup_rows(layer, rows, kf.reshape(-1, D), vf.reshape(-1, D), tail=eng.host.quantized)
        bank = eng.banks[layer]
        blk = p0 // bs
        for name, i, op in (("kmin", blk, torch.minimum), ("kmax", blk, torch.maximum),
                            ("smin", blk // cfg.bound_group, torch.minimum),
                            ("smax", blk // cfg.bound_group, torch.maximum)):
            t = bank.t[name][r]                                                     # (B, H, N, D)
            idx = i.view(1, 1, 1, 1).expand(B, H, 1, D)
            t.scatter_(2, idx, op(t.gather(2, idx), kf[:, :, None]))
        victims = eng.hot_banks[layer].rows(self.r0, B).insert(p0.view(1), end=0, clock=clock)
        flat = self.flat_heads * eng.S + victims[:, 0]
        eng.k_hot[layer].view(-1, D).index_copy_(0, flat, kf.reshape(-1, D))
        eng.v_hot[layer].view(-1, D).index_copy_(0, flat, vf.reshape(-1, D))
        A = cfg.global_tokens
        if A and eng.probes[layer].fitted:
            thr = probe_threshold(p0 + 1, cfg.threshold_base, cfg.threshold_min, cfg.threshold_max)
            p = eng.probes[layer].predict(kf)                                       # (B, H)
            p = torch.where(p > thr, p, -1.0)[..., None]
            ap, an = bank.t["anchor_p"][r], bank.t["anchors"][r]                   # (B, H, A)
            top_p, i = torch.cat([ap, p], 2).topk(A, dim=2)
            pos = torch.cat([an, p0.expand(B, H, 1)], 2).gather(2, i)
            an.copy_(torch.where(top_p >= 0, pos, -1))
            ap.copy_(top_p)

    def attend_body(self, layer: int, q: torch.Tensor, nb: int, limit: int, n_cand: int) -> torch.Tensor:
        """Sparse decode attention of the batch, q (B, Hq, D) -> (B, Hq, D): bounds (two-level at
        long context), fixed-width selection, lookup, prefetch, swap-in of the masked rows,
        counters on the device, recent queries, attention."""
        eng, cfg = self.eng, self.eng.cfg
        B, H, G, D, bs, S = self.B, eng.Hkv, eng.G, eng.D, eng.bs, eng.S
        r = slice(self.r0, self.r0 + B)
        n, clock = self.n[layer, 0], self.n[layer, 1]
        bank = eng.banks[layer]
        scores = bound_scores(q.view(B, H, G, D), bank.t["kmin"][r, :, :nb], bank.t["kmax"][r, :, :nb],
                              bank.t["smin"][r], bank.t["smax"][r], cfg.bound_group, eng.n_super, limit)
        sel = select_fixed(scores.reshape(B * H, nb), n, self.first, cfg.window_size, cfg.top_k, bs,
                           bank.t["anchors"][r].reshape(B * H, -1), cfg.prefetch_blocks, n_cand)
        K = sel.tokens.shape[1]
        state = eng.hot_banks[layer].rows(self.r0, B)
        slots, miss, lookups, hits, pf_used = state.lookup_fixed(sel.tokens, clock)
        used = (sel.tokens >= 0).sum(1)
        loaded, pslots = state.prefetch_fixed(sel.prefetch, S - used, clock + 2 * K)
        # swap-in of misses and prefetches, fixed width (-1 rows copy nothing)
        toks = torch.cat([sel.tokens, sel.prefetch], 1).clamp(min=0)
        take = torch.cat([miss, loaded], 1)
        dst = ((self.r0 * H + self.bh) * S + torch.cat([slots, pslots], 1)).reshape(-1)
        b, h = self.bh // H, self.bh % H
        main = (self.tables[b, toks // bs].clamp(min=0) * H + h) * bs + toks % bs
        dk, dv = eng.k_hot[layer].view(-1, D), eng.v_hot[layer].view(-1, D)
        host = eng.host
        if host.quantized:
            in_tail = toks // bs >= n // bs            # the unfilled last block: the float tail
            tail = (self.tails[b] * H + h) * bs + toks % bs
            src = torch.where(take & ~in_tail, main, -1).reshape(-1)
            src_t = torch.where(take & in_tail, tail, -1).reshape(-1)
            host.load(layer, src, src_t, dk, dv, dst, dst)
            row_bytes = torch.where(in_tail, 2 * D * host.layers[layer]["k_tail"].element_size(),
                                    2 * (host.P + 8))
        else:
            empty = dst[:0]
            host.load(layer, torch.where(take, main, -1).reshape(-1), empty, dk, dv, dst, empty)
            row_bytes = 2 * D * host.layers[layer]["k"].element_size()
        eng._dev[layer].add(lookups, hits, pf_used, used.sum(), sel.loaded, loaded.sum(),
                            (take * row_bytes).sum())
        push_query(bank, r, q)
        out = sparse_decode_attention(q.to(eng.dtype), eng.k_hot[layer][r], eng.v_hot[layer][r],
                                      slots.view(B, H, -1), eng.scale).to(q.dtype)
        return out, sel.tokens
