"""Sealing: the blocks new tokens complete, quantized into a host pool (host_pool.py).

A quantized pool keeps a sequence's unfilled last block in its float tail; when tokens complete
a block, the block's older tokens (from the tail) and its new ones are quantized per unit (one
(block, KV head) run of rows) at the width the pool's policy chooses, and written: on a GPU with
a pinned pool by the row-copy kernel over UVA, in stream order (the errors are read back at the
step's end), on the CPU in place. :func:`seal_many` does it for a whole batch at once.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from hi_sparse.kernels import PARAM_DTYPES, gather_layers, packed_width, scatter_layers
from hi_sparse.kernels.swap_in import tables_kept

from .batch_step import _cause, capture
from .quant_policy import LAYOUT, quantize_roundtrip
from .streams import own_stream


@dataclass
class QuantEvents:
    """What one write quantized: unit counts by bits and each unit's relative error (floats, or
    device tensors of them when quantized on a GPU: read back later, not waited for here)."""
    counts: dict[int, int] = field(default_factory=dict)
    errors: list[float] = field(default_factory=list)
    pending: list[torch.Tensor] = field(default_factory=list)
    # units by width counted on the device (a graph's seal of several widths): (widths, counts
    # (keys / values, widths) on the device, bytes a unit of each writes alike: unit_bytes), read
    # back with the errors
    pending_counts: list[tuple[tuple[int, ...], torch.Tensor, tuple[tuple[int, ...], ...]]] = field(
        default_factory=list)


@dataclass
class HotRows:
    """Where a seal finds the rows it seals on the device: each layer's hot buffer, ``layers`` [(k,
    v (rows, Hkv, S, D), its slot -> token table (rows * Hkv, S + 1))], and each sealed item's
    sequence row and its block's first position (``rows``, ``starts``). A row the buffer holds is
    read there, the rest from the float tail in host memory: at batch 24 the tails' gather over
    PCIe took 8.5-11 ms of a completed block's step on the H100 (the step 2.3-3.5x the median).
    The slots are found from the slot -> token table, which moves only as the batch's rows grow
    (a seal graph reading the token -> slot map was captured again at every step key's change:
    the map grows with the context)."""
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)

    def where(self, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sealed unit's (item, head: seal_tails's order) table row and block start."""
        at = torch.tensor(self.rows)[:, None] * H + torch.arange(H)
        return at.reshape(-1), torch.tensor(self.starts)[:, None].expand(-1, H).reshape(-1)

    def key(self) -> tuple:
        return tuple((t.data_ptr(), tuple(t.shape)) for layer in self.layers for t in layer)


def _read_group(pool: Any, layers: list[int], tail_d: torch.Tensor, hot: tuple | None) -> torch.Tensor:
    """The float rows ``tail_d`` (M,) (units of block_size rows; -1: none, zeros) of each of
    ``layers``: (2, G, M, D), keys then values, in the pool's dtype. Those a layer's hot buffer
    holds (``hot``: each layer's k, v and slot -> token table, each unit's table row and block
    start) are read there, the rest from the tails in the host pool; one gather of the tables, one
    of the tails and one of the buffers for every layer."""
    G, bs, dev = len(layers), pool.block_size, tail_d.device
    tails = [pool.layers[layer][f"{p}_tail"] for p in "kv" for layer in layers]
    if hot is None:
        return gather_layers(tails, tail_d).view(2, G, tail_d.numel(), -1)
    bufs, at, start = hot
    S = bufs[0][0].shape[2]
    offset = gather_layers([slot_token for *_, slot_token in bufs], at)[..., :S] - start[:, None]   # (G, U, S)
    inside = (offset >= 0) & (offset < bs)                        # each slot's token in the unit's block
    slots = torch.full((G, at.numel(), bs + 1), -1, dtype=torch.int64, device=dev)      # column bs: the rest
    slots.scatter_(2, torch.where(inside, offset, bs), torch.arange(S, device=dev).expand(offset.shape))
    slots = slots[..., :bs].reshape(G, -1)                        # (G, M): each row's slot, or -1
    held = ((slots >= 0) & (tail_d >= 0)).repeat(2, 1)            # (2G, M): keys', then values'
    flat = (at.repeat_interleave(bs) * S + slots).repeat(2, 1)
    kv = gather_layers(tails, torch.where(held, -1, tail_d))
    # K and V in one row gather from the buffers (the pool's dtype, as the layers' shape gives both)
    from_hot = gather_layers([buf[i].view(-1, buf[i].shape[-1]) for i in (0, 1) for buf in bufs],
                             torch.where(held, flat, -1))
    return torch.where(held[..., None], from_hot, kv, out=kv).view(2, G, tail_d.numel(), -1)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on a GPU through a pinned staging copy: a copy from pageable memory would wait
    for everything queued on the stream first (a host sync); this one is queued behind it."""
    return t if t.device == device else t.pin_memory().to(device, non_blocking=True)


def seal_many(pool: Any, layer: int, items: list[tuple[torch.Tensor, int, int, torch.Tensor, torch.Tensor]],
              together: bool | None = None) -> tuple[int, QuantEvents]:
    """Seal for several sequences at once, items (block_table, tail_slot, start, k, v) as
    ``HostPool.seal`` takes them: their tails read in one gather and, on a GPU, their units
    quantized together (one width choice and one quantization per width), so a batch whose
    sequences fill their blocks on the same decode step seals once per layer, not once per
    sequence. Units are independent: the same result as one seal per item. ``together``:
    quantize all units in one go (default: on a GPU; the CPU's reference arithmetic goes sequence
    by sequence, as its temporaries over a whole batch leave the caches and run 2x slower).
    Returns (bytes written, quantization events)."""
    return _seal(pool, layer, _completed(pool, items) if pool.quantized else [], together)


def seal_tails(pool: Any, items: list[tuple[int, int]], device: torch.device, graphs: dict | None = None,
               room: int = 0, hot: HotRows | None = None) -> tuple[int, QuantEvents]:
    """Seal, at every layer, blocks every token of which is in the float tail already, items
    (physical block, tail slot): a planned decode step's tokens completed
    them (each was backed up to its tail, and the step read the block from there). Sealed after the
    step's forward, in stream order, by :func:`seal_many`'s arithmetic, with the work a batch's
    seal repeats per sequence and layer done once: one gather of every tail row a layer, and the
    rows' and units' indices staged on ``device`` once for every layer. graphs (a dict the pool
    keeps): a pinned pool on a GPU whose widths are chosen there (one width, "auto", "budget")
    seals by replaying a CUDA graph of the whole seal (:class:`SealGraph`), not op by op, one for
    up to ``room`` blocks (a batch's size: however many of its sequences complete a block on a
    step). ``hot``: the rows the layers' hot buffers hold are read there (:class:`HotRows`, its
    items those of ``items``)."""
    events = QuantEvents()
    if not pool.quantized or not items:
        return 0, events
    H, D, bs = pool.num_kv_heads, pool.head_dim, pool.block_size
    heads = torch.arange(H)
    units = (torch.tensor([block for block, _ in items])[:, None] * H + heads).reshape(-1)          # (I*H,)
    slots = torch.tensor([slot for _, slot in items])
    rows = (pool.unit_rows(slots[:, None], heads[None])[..., None] + torch.arange(bs)).reshape(-1)  # (I*H*bs,)
    where = hot.where(H) if hot is not None else None
    g = seal_graph(pool, graphs, max(room, len(items)) * H, device, hot)
    if g is not None:
        return g.replay(pool, units, rows, events, where)
    if not (device.type == "cuda" and pool.pin):
        pool._host_visible()
    tail_d = to_device(rows, device)
    at = None if where is None else tuple(to_device(t, device) for t in where)
    staged: dict = {}
    written = 0
    for layers in seal_groups(pool, rows.numel()):     # (read as the graph does: few address tables)
        kv = _read_group(pool, layers, tail_d, None if at is None else ([hot.layers[i] for i in layers], *at))
        for j, layer in enumerate(layers):
            pool.prepare(layer, device)
            k, v = kv[0, j].view(-1, bs, D), kv[1, j].view(-1, bs, D)    # units (I*H, bs, D), as `units`
            kb, vb = pool.policy.choose(k, v)
            for x, bits, prefix in ((k, kb, "k"), (v, vb, "v")):
                written += store_units(pool, layer, prefix, units, x, bits, events, staged)
    return written, events


def seal_graph(pool: Any, graphs: dict | None, n: int, device: torch.device,
               hot: HotRows | None = None) -> SealGraph | None:
    """The graph :func:`seal_tails` replays to seal n units on ``device`` (captured now if it is
    not yet), or None where the seal runs op by op: no ``graphs``, a pool whose policy chooses
    widths on the host ("seed"), unpinned, not a GPU, or a capture that failed."""
    on_device = pool.fixed_bits is not None or hasattr(pool.policy, "choose_on_device")
    if graphs is None or not on_device or device.type != "cuda" or not pool.pin:
        return None
    return SealGraph.of(pool, graphs, n, device, hot)


class SealGraph:
    """:func:`seal_tails` of up to N units (a pinned pool on a GPU whose widths are chosen there)
    as one CUDA graph: the tail rows gathered, widths chosen, quantized and written at every
    layer, a group of layers at a time (:func:`seal_groups`). Op by op that is ~80 launches a
    layer, ~250 ms of host time a step at 32 layers; replayed, two index copies and one launch.
    A pool of several widths quantizes every unit at each width and keeps its chosen one (its
    counts by width read back at the step's end). Fewer units are padded with -1 (no row read or
    written; their errors dropped). Captured (recorded, not run) once per N (the engine does it
    as it captures a batch's step); kept while the pool's buffers stay where they are and for the
    last few N (a pool that outgrew its space moved them: captured again; its kernels read and
    write the pool by address and row, never by its size, so one grown in place keeps it). A
    capture that fails leaves the seal op by op (a warning, once)."""

    KEEP = 4                                 # graphs kept (batch sizes), each with its memory pool
    # the groups' seals are independent: spread over this many streams in the graph, their
    # writes to the pinned pool overlap (bench_seal_graph.py --streams)
    STREAMS = 4

    def __init__(self, key: tuple, pool: Any, n: int, device: torch.device, hot: HotRows | None = None) -> None:
        self.key = key
        self.tail = torch.zeros(n * pool.block_size, dtype=torch.int64, device=device)   # the inputs
        self.units = torch.zeros(n, dtype=torch.int64, device=device)
        # with hot buffers: each unit's slot table row and block start (0 for padding: reads none)
        self.at = None if hot is None else torch.zeros(2, n, dtype=torch.int64, device=device)
        self.streams = [own_stream(device, f"seal {i}") for i in range(1, self.STREAMS)]
        layers = None if hot is None else hot.layers
        with tables_kept() as self.tables:
            # run once first, sealing nothing (every unit -1): the layers' address tables its
            # gathers and writes read are made (kept here), and their kernels compiled, outside
            # the capture
            _graph_seal(pool, torch.full_like(self.tail, -1), torch.full_like(self.units, -1), self.streams,
                        None if hot is None else (layers, *self.at))
            # uploaded now, as it is captured with a step, not at its first completed block (whose
            # seal's launch took 7.0 ms of host time there on the H100 against 3.7 ms later)
            self.graph, (self.errors, self.counts, self.written) = capture(
                lambda: _graph_seal(pool, self.tail, self.units, self.streams,
                                    None if hot is None else (layers, *self.at)), torch.cuda.graph_pool_handle(),
                replayed_later=True)

    @classmethod
    def of(cls, pool: Any, graphs: dict, n: int, device: torch.device, hot: HotRows | None = None
           ) -> SealGraph | None:
        if graphs.get("failed"):
            return None
        for layer in range(len(pool.layers)):    # the bits' device copies made now, not in the capture
            pool.prepare(layer, device)
        key = (n, device, *(t.data_ptr() for layer in range(len(pool.layers)) for t in pool.buffers(layer)),
               hot.key() if hot is not None else None)
        have = graphs.get((n, device))
        if have is not None and have.key == key:
            return have
        graphs.pop((n, device), None)
        kept = [k for k in graphs if k != "failed"]
        for old in kept[:max(0, len(kept) - cls.KEEP + 1)]:     # the oldest, leaving room for this one
            del graphs[old]
        try:
            have = graphs[(n, device)] = cls(key, pool, n, device, hot)
        except RuntimeError as exc:
            graphs["failed"] = True
            warnings.warn(f"HiSparse: CUDA graph capture of the block seal failed ({_cause(exc)}); blocks are "
                          "sealed op by op from now on (a longer step where tokens complete blocks)",
                          RuntimeWarning, stacklevel=3)
            return None
        return have

    def replay(self, pool: Any, units: torch.Tensor, rows: torch.Tensor, events: QuantEvents,
               where: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[int, QuantEvents]:
        m, n = units.numel(), self.units.numel()
        inputs = [(self.units, units, -1), (self.tail, rows, -1)]
        if self.at is not None:
            assert where is not None, "a seal graph of hot buffers replayed without the rows' places in them"
            inputs += [(self.at[0], where[0], 0), (self.at[1], where[1], 0)]
        for dst, src, pad in inputs:
            padded = torch.full((dst.numel(),), pad, dtype=torch.int64).pin_memory()
            padded[:src.numel()] = src
            dst.copy_(padded, non_blocking=True)
        self.graph.replay()
        events.pending.append(self.errors[:, :m].clone())     # the next replay writes over the graph's own
        if self.counts is not None:                           # several widths: counted on the device
            events.pending_counts.append((pool.widths, self.counts.clone(), unit_bytes(pool)))
            return 0, events
        events.counts[pool.fixed_bits] = 2 * len(pool.layers) * m
        return self.written // n * m, events


def unit_bytes(pool: Any) -> tuple[tuple[int, ...], ...]:
    """Bytes a unit of keys (first) and of values writes at each of the pool's widths: its packed
    rows and its scale / zero pairs, as :func:`store_units` counts them."""
    D, bs = pool.head_dim, pool.block_size
    out = []
    for prefix in ("k", "v"):
        layout = LAYOUT[prefix]
        pairs = 2 * (D if layout == "channel" else bs) * PARAM_DTYPES[layout].itemsize
        out.append(tuple(bs * packed_width(D, w) + pairs for w in pool.widths))
    return tuple(out)


def seal_groups(pool: Any, rows: int) -> list[list[int]]:
    """The layers a seal graph seals together, ``rows`` rows each: groups of about
    :data:`GROUP_BYTES` of float keys and values."""
    each = 2 * rows * pool.head_dim * pool.dtype.itemsize
    n, size = len(pool.layers), max(1, GROUP_BYTES // max(each, 1))
    return [list(range(first, min(first + size, n))) for first in range(0, n, size)]


# A seal graph reads, quantizes and writes the units of a group of layers of about this many bytes
# of float keys and values at once (one gather, one quantization per width, one write of each of
# the pool's tensors), not layer by layer: ~60 kernels a layer made a graph of ~2,000 nodes at 32
# layers, whose launch took 3-6 ms of host time at batch 24 on the H100, and as long on the device
# (~5 us a small kernel). The group's temporaries (a few times this) live in the graph's pool.
GROUP_BYTES = 32 << 20


def _graph_seal(pool: Any, tail_d: torch.Tensor, units_d: torch.Tensor, side: list[torch.cuda.Stream],
                hot: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The device work of :func:`seal_tails`, indices on the device: units (N,) and their tail
    rows (N * block_size,), -1 for none; groups of layers (:func:`seal_groups`) spread over the
    current stream and ``side`` streams (forked from it and joined back); ``hot``: (HotRows's
    layers, each unit's slot table row and block start on the device). Returns (each unit's
    relative error (2 * layers, N), the units by width (a pool of several widths; else None),
    bytes written for N units (a pool of one width))."""
    bs, dev = pool.block_size, units_d.device
    unit_rows = torch.where(units_d[:, None] >= 0, units_d[:, None] * bs + torch.arange(bs, device=dev), -1).reshape(-1)
    errors: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    written = 0
    main = torch.cuda.current_stream(dev)
    streams = [main, *side]
    for st in side:
        st.wait_stream(main)
    for i, layers in enumerate(seal_groups(pool, tail_d.numel())):
        with torch.cuda.stream(streams[i % len(streams)]):
            group_hot = None if hot is None else ([hot[0][layer] for layer in layers], hot[1], hot[2])
            written += _seal_group(pool, layers, tail_d, units_d, unit_rows, errors, counts, group_hot)
    for st in side:
        main.wait_stream(st)
    by_width = torch.stack(counts).view(-1, 2, len(pool.widths)).sum(0) if counts else None   # (k/v, widths)
    return torch.cat(errors), by_width, written


def _seal_group(pool: Any, layers: list[int], tail_d: torch.Tensor, units_d: torch.Tensor, unit_rows: torch.Tensor,
                errors: list, counts: list, hot: tuple | None = None) -> int:
    """The seal of ``layers`` (:func:`_graph_seal`'s indices) on the current stream, their units
    quantized together: each unit's error appended to ``errors`` ((G, N) for keys, then for
    values), and in a pool of several widths the group's keys' and its values' units by width to
    ``counts``; ``hot``: the layers' hot buffers (:func:`_read_group`). Returns the bytes written
    (a pool of one width)."""
    D, bs, dev, G = pool.head_dim, pool.block_size, units_d.device, len(layers)
    written = 0
    for layer in layers:
        pool.prepare(layer, dev)
    kv = _read_group(pool, layers, tail_d, hot)
    for x, prefix in ((kv[0].reshape(-1, bs, D), "k"), (kv[1].reshape(-1, bs, D), "v")):   # (G * N, bs, D)
        layout = LAYOUT[prefix]
        if pool.fixed_bits is not None:
            bits: int | torch.Tensor = pool.fixed_bits
            packed, scale, zero, err = quantize_roundtrip(x, pool.fixed_bits, layout)
            written += packed.numel() + 2 * scale.numel() * scale.element_size()
        else:
            bits, packed, scale, zero, err = _at_chosen_widths(pool, x, layout)
            counts.append(torch.stack([((bits.view(G, -1) == w) & (units_d >= 0)).sum() for w in pool.widths]))
        _write_units(pool, layers, prefix, units_d, unit_rows, bits, packed, scale, zero)
        errors.append(err.view(G, -1))
    return written


def _at_chosen_widths(pool: Any, x: torch.Tensor, layout: str) -> tuple[torch.Tensor, ...]:
    """Units x (N, T, D) quantized each at the width the pool's policy chooses, on the device:
    (widths (N,), packed (N, T, widest row), scale, zero, relative error (N,)); a row past its
    width's bytes is 0 (loads read a unit's own width)."""
    N = x.shape[0]
    bits = pool.policy.choose_on_device(x, layout)
    packed = torch.zeros(*x.shape[:2], pool.packed_bytes, dtype=torch.uint8, device=x.device)
    scale = zero = err = None
    for w in pool.widths:
        p, sc, ze, er = quantize_roundtrip(x, w, layout)
        take = bits == w
        packed[..., :p.shape[-1]] = torch.where(take.view(N, 1, 1), p, packed[..., :p.shape[-1]])
        by_unit = take.view(N, *[1] * (sc.dim() - 1))
        scale = sc if scale is None else torch.where(by_unit, sc, scale)
        zero = ze if zero is None else torch.where(by_unit, ze, zero)
        err = er if err is None else torch.where(take, er, err)
    return bits, packed, scale, zero, err


def _seal(pool: Any, layer: int, parts: list[tuple], together: bool | None) -> tuple[int, QuantEvents]:
    """Quantize and write the units of ``parts`` (:func:`_completed`'s tuples)."""
    events = QuantEvents()
    if not parts:
        return 0, events
    dev = parts[0][1].device
    # on a GPU with a pinned pool the units are quantized and written there, in stream order
    # (the row-copy kernel writes the pinned rows over UVA): no host sync
    if not (dev.type == "cuda" and pool.pin):
        pool._host_visible()
    ku, vu = _units(pool, layer, parts, dev)
    together = dev.type == "cuda" if together is None else together
    written = 0
    for group in [range(len(parts))] if together else [[i] for i in range(len(parts))]:
        units = torch.cat([parts[i][0] for i in group])
        k, v = (torch.cat([x[i] for i in group]) if len(group) > 1 else x[group[0]] for x in (ku, vu))
        kb, vb = pool.policy.choose(k, v)
        for x, bits, prefix in ((k, kb, "k"), (v, vb, "v")):
            written += store_units(pool, layer, prefix, units, x, bits, events)
    return written, events


def _completed(pool: Any, items: list) -> list[tuple]:
    """Per item that completes a block: (units (F*H,), new k, new v (H, new, D) in the pool's
    dtype, tail slot, first position of the first completed block, start)."""
    H, bs = pool.num_kv_heads, pool.block_size
    parts = []
    for block_table, tail_slot, start, k, v in items:
        b0 = start - start % bs
        n_full = (start + k.shape[1]) // bs - b0 // bs
        if n_full == 0:
            continue
        new = b0 + n_full * bs - start                          # new tokens in the completed blocks
        blocks = block_table[torch.arange(b0 // bs, b0 // bs + n_full)]                  # (F,)
        units = (blocks[:, None] * H + torch.arange(H)[None]).reshape(-1)                # (F*H,)
        parts.append((units, k[:, :new].to(dtype=pool.dtype), v[:, :new].to(dtype=pool.dtype), tail_slot, b0,
                      start))
    return parts


def _units(pool: Any, layer: int, parts: list[tuple], dev: torch.device) -> tuple[list, list]:
    """Each part's completed blocks as units (F*H, bs, D) of keys and of values: the first block's
    older tokens from the tails (one gather for every part, where the new tokens are)."""
    H, D, bs = pool.num_kv_heads, pool.head_dim, pool.block_size
    old = [torch.arange(b0, start) for *_, b0, start in parts]
    tail_rows = torch.cat([pool.tail_rows(p[3], torch.arange(H)[:, None], pos[None]).reshape(-1)
                           for p, pos in zip(parts, old)])
    ko = vo = None
    if tail_rows.numel():
        M = tail_rows.numel()
        ko = torch.empty(M, D, dtype=pool.dtype, device=dev)
        vo = torch.empty(M, D, dtype=pool.dtype, device=dev)
        tail_d = to_device(tail_rows, dev)
        pool.prepare(layer, dev)
        pool.load(layer, None, tail_d, ko, vo, torch.arange(M, device=dev), count=False)
    ku, vu, at = [], [], 0
    for (units, k, v, *_), pos in zip(parts, old):
        n_old = H * pos.numel()
        if n_old:
            k = torch.cat([ko[at:at + n_old].view(H, -1, D), k], 1)
            v = torch.cat([vo[at:at + n_old].view(H, -1, D), v], 1)
            at += n_old
        n_full = units.numel() // H
        ku.append(k.reshape(H, n_full, bs, D).transpose(0, 1).reshape(-1, bs, D))
        vu.append(v.reshape(H, n_full, bs, D).transpose(0, 1).reshape(-1, bs, D))
    return ku, vu


def store_units(pool: Any, layer: int, prefix: str, units: torch.Tensor, x: torch.Tensor,
                bits: torch.Tensor, events: QuantEvents, staged: dict | None = None) -> int:
    """Quantize units x (N, bs, D), on any device, at their chosen bits (N,) into the pool.
    staged: the device copies of row and unit indices, kept across calls (by content)."""
    store = pool.layers[layer]
    written = 0
    offs = torch.arange(pool.block_size)
    gpu = x.is_cuda and pool.pin
    bits = bits.cpu()
    for b in sorted(set(bits.tolist())):
        sel = (bits == b).nonzero().squeeze(1)
        every = len(sel) == len(bits)
        out = quantize_roundtrip(x if every else x[to_device(sel, x.device)], b, LAYOUT[prefix])
        u = units[sel]
        rows = (u[:, None] * pool.block_size + offs[None]).reshape(-1)
        # channel pairs (N, D) go to the units' entries, token pairs (N, T) to the rows'
        at = rows if LAYOUT[prefix] == "token" else u
        if gpu:
            _write_units(pool, [layer], prefix, *(_on(t, x.device, staged) for t in (u, rows)), b, *out[:3])
            events.pending.append(out[3])
        else:
            packed, scale, zero, err = (t.cpu() for t in out)
            P = packed.shape[-1]
            store[f"{prefix}_packed"][rows, :P] = packed.reshape(-1, P)
            store[f"{prefix}_scale"][at] = scale.flatten(0, 1) if LAYOUT[prefix] == "token" else scale
            store[f"{prefix}_zero"][at] = zero.flatten(0, 1) if LAYOUT[prefix] == "token" else zero
            store[f"{prefix}_bits"][u] = b
            mirror = pool._bits_on.get((layer, prefix))
            if mirror is not None:
                mirror[u.to(mirror.device)] = b
            events.errors.extend(err.tolist())
        events.counts[b] = events.counts.get(b, 0) + len(u)
        packed, scale = out[0], out[1]
        written += packed.numel() + 2 * scale.numel() * scale.element_size()
    return written


def _on(t: torch.Tensor, dev: torch.device, staged: dict | None) -> torch.Tensor:
    """Host indices t on ``dev``; with ``staged``, one copy per content for every call."""
    if staged is None:
        return to_device(t, dev)
    key = (t.numel(), t.numpy().tobytes())
    if key not in staged:
        staged[key] = to_device(t, dev)
    return staged[key]


def _write_units(pool: Any, layers: list[int], prefix: str, u_d: torch.Tensor, rows_d: torch.Tensor,
                 b: int | torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
    """Write quantized units of ``layers`` (each layer's units u_d (N,) and rows_d (N * block_size,)
    on the device, -1: none; packed, scale and zero of the G * N units, layer by layer) into the
    pinned pool and the bits' device mirror, one row-copy kernel a tensor for every layer, in
    stream order (nothing waits for the device). b: their width, or each unit's (G * N,)."""
    G, N, dev, P = len(layers), u_d.numel(), packed.device, packed.shape[-1]
    stores = [pool.layers[layer] for layer in layers]
    at_d = rows_d if LAYOUT[prefix] == "token" else u_d        # where the scale / zero pairs go
    widths = (torch.full((G, N), b, dtype=torch.uint8, device=dev) if isinstance(b, int)
              else b.to(torch.uint8).view(G, N))
    for src, name, where in ((packed, "packed", rows_d), (scale, "scale", at_d), (zero, "zero", at_d),
                             (widths, "bits", u_d)):
        dsts = [store[f"{prefix}_{name}"][:, :P] if name == "packed" else store[f"{prefix}_{name}"] for store in stores]
        scatter_layers(src.to(dsts[0].dtype).reshape(G, where.numel(), *dsts[0].shape[1:]), dsts, where)
    mirrors = [pool._bits_on.get((layer, prefix)) for layer in layers]
    have = [i for i, mirror in enumerate(mirrors) if mirror is not None]
    if have:
        on = [mirrors[i] for i in have]
        scatter_layers((widths[have] if len(have) < G else widths).to(on[0].dtype), on, u_d)
