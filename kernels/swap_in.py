"""Swap-in: copy host-pool rows into hot-buffer slots, optionally dequantizing on the way.

On CUDA the source is pinned host memory read by the kernel over UVA (no cudaMemcpy per row).
swap_in:          src (R, W), dst (S, W), src_rows / dst_rows (M,): dst[dst_rows[i]] = src[src_rows[i]]
                  (a source row of -1 copies nothing: fixed-width lists of a graph-captured step).
swap_in_pair:     swap_in of two tensors with the same rows (a layer's K and V) in one launch.
gather_layers:    rows (M,) (or each layer's own, (L, M)) of L tensors (every layer's float tails,
                  recent queries, or the rows a seal reads) into one (L, M, ...) tensor in one
                  launch (a row of -1 reads zeros).
scatter_layers:   its inverse: rows of one (L, M, ...) tensor into L tensors in one launch (a
                  seal's writes of every layer's units into the pool; a row of -1 writes none).
backup_token:     a decode token's K and V rows into the host pool, their pool rows computed in the
                  launch (CUDA or the interpreter only: HostPool.backup is the reference).
swap_in_dequant:  packed (R, P) uint8 rows of `bits`-bit codes (one row = one token's D values,
                  P = ceil(D * bits / 8)) quantized in blocks of rows_per_block rows in a layout
                  (quant.py): scale / zero (R // rows_per_block,) fp32 ("block"), (R // rows_per_block,
                  D) fp16 ("channel") or (R,) fp16 ("token", one pair per row);
                  dst (S, D) float: dst[dst_rows[i]] = code * scale + zero, the pair of row
                  src_rows[i] (its block blk = src_rows[i] // rows_per_block, and column).
swap_in_dequant_pair: swap_in_dequant of a layer's K and V (each its own layout) at the same rows
                  in one launch where both read whole words (4 / 8 bits, D % 8 == 0).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ._dispatch import FLOAT_DTYPES, INDEX_DTYPES, check, device_address, kernel_module, use_triton
from .quant import LAYOUTS, PARAM_DTYPES, SUPPORTED_BITS, packed_width, unpack_codes


def _check_rows(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    check(src_rows.dim() == 1 and dst_rows.dim() == 1 and src_rows.shape == dst_rows.shape,
          f"src_rows and dst_rows must be (M,) of one length, got {tuple(src_rows.shape)} and {tuple(dst_rows.shape)}")
    check(src_rows.dtype in INDEX_DTYPES and dst_rows.dtype in INDEX_DTYPES,
          f"row indices must be int64 (or int32), got {src_rows.dtype} and {dst_rows.dtype}")


def device_path(src: torch.Tensor, dst: torch.Tensor, *index: torch.Tensor) -> bool:
    """Triton only when the source is device memory or pinned host memory the GPU can read."""
    if dst.is_cuda and not src.is_cuda and not src.is_pinned():
        return False          # pageable host memory is not mapped for the GPU: copy through torch
    if src.is_cuda and not dst.is_cuda and not dst.is_pinned():
        return False
    return use_triton(src, dst, *index)


def _present(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs whose source row is not -1 (fixed-width row lists pad with -1)."""
    keep = src_rows >= 0
    if bool(keep.all()):
        return src_rows, dst_rows
    return src_rows[keep], dst_rows[keep.to(dst_rows.device)]


def reference_swap_in(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    src_rows, dst_rows = _present(src_rows, dst_rows)
    rows = src.index_select(0, src_rows.to(src.device).long())
    dst.index_copy_(0, dst_rows.to(dst.device).long(), rows.to(dst.device, dst.dtype))


def _row_params(p: torch.Tensor, idx: torch.Tensor, rows_per_block: int, layout: str) -> torch.Tensor:
    """The scale (or zero) of rows idx (M,) as fp32, broadcastable to their (M, D) values."""
    p = p.to(idx.device).float()
    if layout == "token":
        return p[idx, None]
    pairs = p[idx // rows_per_block]
    return pairs[:, None] if layout == "block" else pairs            # (M, 1) or a channel's (M, D)


def reference_swap_in_dequant(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                              rows_per_block: int, src_rows: torch.Tensor, dst: torch.Tensor,
                              dst_rows: torch.Tensor, layout: str = "block") -> None:
    d = dst.shape[1]
    src_rows, dst_rows = _present(src_rows, dst_rows)
    idx = src_rows.to(packed.device).long()
    codes = unpack_codes(packed.index_select(0, idx), bits, d).float()        # (M, D)
    x = codes * _row_params(scale, idx, rows_per_block, layout) + _row_params(zero, idx, rows_per_block, layout)
    dst.index_copy_(0, dst_rows.to(dst.device).long(), x.to(dst.device, dst.dtype))


def _check_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    check(src.dim() == 2 and dst.dim() == 2,
          f"src and dst must be 2-D (rows, W), got {tuple(src.shape)} and {tuple(dst.shape)}")
    check(src.shape[1] == dst.shape[1], f"row widths differ: src W={src.shape[1]}, dst W={dst.shape[1]}")
    check(src.dtype == dst.dtype, f"src dtype {src.dtype} differs from dst dtype {dst.dtype}")


def _check_pair(a: torch.Tensor, b: torch.Tensor, dst_a: torch.Tensor, dst_b: torch.Tensor) -> None:
    _check_copy(a, dst_a)
    _check_copy(b, dst_b)
    check(a.shape[1] == b.shape[1] and a.dtype == b.dtype,
          f"a pair's rows differ: {a.shape[1]} {a.dtype} and {b.shape[1]} {b.dtype}")


def swap_in(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst[dst_rows[i]] = src[src_rows[i]] in place. src (R, W), dst (S, W): on CUDA either may be
    pinned host memory (host -> device: swap-in; device -> host: the batched decode's backup)."""
    _check_copy(src, dst)
    _check_rows(src_rows, dst_rows)
    if src_rows.numel() == 0:
        return
    if device_path(src, dst, src_rows, dst_rows):
        kernel_module("_swap_in_triton").swap_in(src, src_rows, dst, dst_rows)
        return
    reference_swap_in(src, src_rows, dst, dst_rows)


def swap_in_pair(src_a: torch.Tensor, src_b: torch.Tensor, src_rows: torch.Tensor, dst_a: torch.Tensor,
                 dst_b: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """:func:`swap_in` of src_a into dst_a and of src_b into dst_b at the same rows, in one launch
    where Triton runs (a layer's keys and values): rows of one width and dtype."""
    _check_pair(src_a, src_b, dst_a, dst_b)
    _check_rows(src_rows, dst_rows)
    if src_rows.numel() == 0:
        return
    if device_path(src_a, dst_a, src_rows, dst_rows) and device_path(src_b, dst_b):
        kernel_module("_swap_in_triton").swap_in_pair(src_a, src_b, src_rows, dst_a, dst_b, dst_rows)
        return
    reference_swap_in(src_a, src_rows, dst_a, dst_rows)
    reference_swap_in(src_b, src_rows, dst_b, dst_rows)


_TABLES: dict[tuple, torch.Tensor] = {}     # the layers' address tables by (device, their addresses)
_KEPT: list[dict[tuple, torch.Tensor]] = []   # those of the tables_kept() blocks open


@contextmanager
def tables_kept() -> Iterator[dict[tuple, torch.Tensor]]:
    """Every address table :func:`gather_layers` and :func:`scatter_layers` use in the block (on
    any thread), by key: a CUDA graph that calls them reads its tables at each replay, and its
    owner keeps them (the cache below drops tables). Make them before a capture, in the block (a
    run outside the capture): none is made while a stream captures."""
    used: dict[tuple, torch.Tensor] = {}
    _KEPT.append(used)
    try:
        yield used
    finally:
        _KEPT.remove(used)


def _layer_table(ts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(L,) int64 on ``device``: where a kernel there reads or writes each tensor, made once per
    set of addresses (a host pool grows in place: its layers keep theirs)."""
    key = (device, *(t.data_ptr() for t in ts))
    table = _TABLES.get(key)
    for used in _KEPT:
        table = used.get(key, table)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a layers' address table is made outside a CUDA graph capture: run the "
                               "captured code once before it (host_seal.SealGraph does)")
        if len(_TABLES) >= 64:
            _TABLES.clear()
        table = torch.tensor([device_address(t, device) for t in ts], dtype=torch.int64)
        # through a pinned copy: one from pageable memory would wait for the stream's queued work
        table = _TABLES[key] = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
    for used in _KEPT:
        used[key] = table
    return table


def _dense_row(t: torch.Tensor) -> bool:
    """A row of t (all dims but the first) is one contiguous run of its elements."""
    return t.shape[0] == 0 or t[0].is_contiguous()


def _word(ts: list[torch.Tensor], row_bytes: int) -> int:
    """The widest word (4, 2 or 1 bytes) the tensors' rows of ``row_bytes`` move in: whole words
    at aligned addresses, one row stride, each row one contiguous run; 0 where they are not alike."""
    first = ts[0]
    if not all(t.stride(0) == first.stride(0) and _dense_row(t) for t in ts):
        return 0
    stride = first.stride(0) * first.element_size()
    return next(w for w in (4, 2, 1)
                if row_bytes % w == 0 and stride % w == 0 and all(t.data_ptr() % w == 0 for t in ts))


def _word_rows(srcs: list[torch.Tensor]) -> bool:
    """The sources' rows are contiguous runs of 32-bit words at aligned addresses, one stride."""
    return _word(srcs, srcs[0].shape[1:].numel() * srcs[0].element_size()) == 4


def _layer_rows(rows: torch.Tensor, layers: int, name: str) -> None:
    check(rows.dtype in INDEX_DTYPES and (rows.dim() == 1 or (rows.dim() == 2 and rows.shape[0] == layers)),
          f"{name}' rows must be (M,) or ({layers}, M) int64 (or int32), got {tuple(rows.shape)} {rows.dtype}")


def _alike(ts: list[torch.Tensor], name: str) -> None:
    check(len(ts) > 0, f"{name} needs at least one layer")
    first = ts[0]
    check(all(t.shape[1:] == first.shape[1:] and t.dtype == first.dtype for t in ts),
          f"{name}' layers must share their row shape and dtype, got "
          f"{sorted({(tuple(t.shape[1:]), t.dtype) for t in ts}, key=str)}")


def gather_layers(srcs: list[torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
    """out[l, i] = srcs[l][rows[i]] (zeros where the row is -1) -> (L, M, *row shape) on rows'
    device, of L sources (R_l, *row shape) of one row shape and dtype, on the device or in pinned
    host memory; rows (M,), or (L, M): each layer's own. One launch where Triton runs (sources of
    whole-word, contiguous rows at one stride): a recalibration's copy of every layer's float
    tails or recent queries, a seal's read of its layers' rows."""
    _alike(srcs, "gather_layers")
    _layer_rows(rows, len(srcs), "gather_layers")
    first, M, dev = srcs[0], rows.shape[-1], rows.device
    out = torch.empty((len(srcs), M, *first.shape[1:]), dtype=first.dtype, device=dev)
    if M and _word_rows(srcs) and all(device_path(t, out, rows) for t in srcs):
        kernel_module("_swap_in_triton").gather_layers(_layer_table(srcs, dev), srcs, rows.contiguous(),
                                                       out.view(len(srcs), M, -1))
        return out
    idx = rows.long().clamp_min(0).expand(len(srcs), M)
    for layer, t in enumerate(srcs):
        out[layer] = t.index_select(0, idx[layer].to(t.device)).to(dev)
    return out.masked_fill_((rows < 0).view(-1, M, *[1] * (first.dim() - 1)), 0)


def scatter_layers(src: torch.Tensor, dsts: list[torch.Tensor], rows: torch.Tensor) -> None:
    """dsts[l][rows[i]] = src[l, i] in place (a row of -1 writes nothing): L destinations (R_l,
    *row shape) of one row shape and dtype, on the device or in pinned host memory, src (L, M, *row
    shape) on the device; rows (M,), or (L, M): each layer's own. One launch where Triton runs
    (destinations at one row stride, each row contiguous): a seal's writes of its layers' units
    into the host pool."""
    _alike(dsts, "scatter_layers")
    _layer_rows(rows, len(dsts), "scatter_layers")
    first, L, M = dsts[0], len(dsts), rows.shape[-1]
    check(tuple(src.shape) == (L, M, *first.shape[1:]) and src.dtype == first.dtype,
          f"scatter_layers' src must be ({L}, {M}, *{tuple(first.shape[1:])}) {first.dtype}, got "
          f"{tuple(src.shape)} {src.dtype}")
    if M == 0:
        return
    flat = src.reshape(L, M, -1).contiguous()
    word = _word(dsts, flat.shape[-1] * flat.element_size())
    # (one layer: swap_in's launch, without an address table to make for its destination)
    if word and L > 1 and all(device_path(flat, t, rows) for t in dsts):
        kernel_module("_swap_in_triton").scatter_layers(_layer_table(dsts, src.device), dsts, rows.contiguous(),
                                                        flat, word)
        return
    rows = rows.expand(L, M)
    for layer, t in enumerate(dsts):
        r = rows[layer]
        take = torch.where(r >= 0, torch.arange(M, device=r.device), -1)
        swap_in(flat[layer], take, t.view(t.shape[0], -1), r)


def backup_token(k: torch.Tensor, v: torch.Tensor, dst_k: torch.Tensor, dst_v: torch.Tensor, start: torch.Tensor,
                 block_size: int, tail_units: torch.Tensor | None = None, tables: torch.Tensor | None = None) -> None:
    """A decode token of B sequences into the host pool in one launch, its rows computed there: k, v
    (B * Hkv, W) (row b * Hkv + h: sequence b at KV head h) at positions start (B,), with
    ``o = start[b] % block_size``: into the float tails dst_k, dst_v at row tail_units[b, h] + o
    (tail_units (B, Hkv): HostPool.tail_units; quantized pools), or into the main pool at row
    (tables[b, start[b] // block_size] * Hkv + h) * block_size + o (tables (B, W); a hole, -1,
    reads block 0, as HostPool.main_rows). Only where :func:`device_path` holds (CUDA, or the
    Triton interpreter): HostPool.backup is the reference."""
    _check_pair(k, v, dst_k, dst_v)
    check((tail_units is None) != (tables is None), "pass tail_units (quantized pools) or tables, not both")
    units = tail_units if tail_units is not None else tables
    assert units is not None
    B = start.shape[0]
    check(start.dim() == 1 and B > 0 and k.shape[0] % B == 0 and units.dim() == 2 and units.shape[0] == B,
          f"start must be (B,) and k (B * Hkv, W), got {tuple(start.shape)}, {tuple(k.shape)}, {tuple(units.shape)}")
    check(tail_units is None or units.shape[1] == k.shape[0] // B,
          f"tail_units must be (B, Hkv), got {tuple(units.shape)} for {k.shape[0] // B} heads")
    check(start.dtype in INDEX_DTYPES and units.dtype in INDEX_DTYPES, "start and the rows must be integer")
    check(device_path(k, dst_k, start, units) and device_path(v, dst_v), "backup_token runs where Triton does")
    kernel_module("_swap_in_triton").backup_token(k, v, dst_k, dst_v, start, units, tail_units is not None,
                                                  block_size)


def _check_dequant(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                   rows_per_block: int, dst: torch.Tensor, layout: str) -> None:
    """swap_in_dequant's checks of one tensor's rows, pairs and destination."""
    check(bits in SUPPORTED_BITS, f"bits={bits} unsupported; use one of {SUPPORTED_BITS}")
    check(layout in LAYOUTS, f"layout={layout!r} unknown; use one of {LAYOUTS}")
    check(packed.dim() == 2 and packed.dtype == torch.uint8,
          f"packed must be (R, P) uint8, got {tuple(packed.shape)} {packed.dtype}")
    check(dst.dim() == 2 and dst.dtype in FLOAT_DTYPES, f"dst must be (S, D) float, got {tuple(dst.shape)} {dst.dtype}")
    d = dst.shape[1]
    check(packed.shape[1] == packed_width(d, bits),
          f"packed rows hold {packed.shape[1]} bytes but D={d} at {bits} bits needs {packed_width(d, bits)}")
    check(isinstance(rows_per_block, int) and rows_per_block > 0,
          f"rows_per_block must be a positive int, got {rows_per_block!r}")
    nblk = packed.shape[0] // rows_per_block
    want = {"block": f"({nblk},) (one per block of {rows_per_block} rows)",
            "channel": f"({nblk}, {d}) (one per column of each block of {rows_per_block} rows)",
            "token": f"({packed.shape[0]},) (one per row)"}[layout]
    ok = {"block": lambda t: t.dim() == 1 and t.shape[0] >= nblk,
          "channel": lambda t: t.dim() == 2 and t.shape[0] >= nblk and t.shape[1] == d,
          "token": lambda t: t.dim() == 1 and t.shape[0] >= packed.shape[0]}[layout]
    check(ok(scale) and scale.shape == zero.shape and scale.dtype == zero.dtype == PARAM_DTYPES[layout],
          f"scale and zero of layout {layout!r} must be {want} {PARAM_DTYPES[layout]}, got {tuple(scale.shape)} "
          f"{scale.dtype} and {tuple(zero.shape)} {zero.dtype}")


def _dequant_on_device(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, src_rows: torch.Tensor,
                       dst: torch.Tensor, dst_rows: torch.Tensor) -> bool:
    """Whether the Triton kernel runs: rows and their pairs where the GPU reads them."""
    gpu_readable = all(t.is_cuda or t.is_pinned() for t in (scale, zero)) or not dst.is_cuda
    return device_path(packed, dst, src_rows, dst_rows) and gpu_readable


def swap_in_dequant(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                    rows_per_block: int, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor,
                    layout: str = "block") -> None:
    """Fused swap-in and dequantization of quantized host rows into dst (S, D) float, in place."""
    _check_dequant(packed, scale, zero, bits, rows_per_block, dst, layout)
    _check_rows(src_rows, dst_rows)
    if src_rows.numel() == 0:
        return
    if _dequant_on_device(packed, scale, zero, src_rows, dst, dst_rows):
        kernel_module("_swap_in_triton").swap_in_dequant(packed, scale, zero, bits, rows_per_block,
                                                         src_rows, dst, dst_rows, layout)
        return
    reference_swap_in_dequant(packed, scale, zero, bits, rows_per_block, src_rows, dst, dst_rows, layout)


def swap_in_dequant_pair(packed_k: torch.Tensor, scale_k: torch.Tensor, zero_k: torch.Tensor, layout_k: str,
                         packed_v: torch.Tensor, scale_v: torch.Tensor, zero_v: torch.Tensor, layout_v: str,
                         bits: int, rows_per_block: int, src_rows: torch.Tensor, dst_k: torch.Tensor,
                         dst_v: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """:func:`swap_in_dequant` of keys (packed_k, their pairs in layout_k) into dst_k and of values
    into dst_v at the same rows (a layer of a pool of one bit width), in one launch where Triton
    runs and both read whole words (4 / 8 bits, D % 8 == 0), else in one call each."""
    _check_dequant(packed_k, scale_k, zero_k, bits, rows_per_block, dst_k, layout_k)
    _check_dequant(packed_v, scale_v, zero_v, bits, rows_per_block, dst_v, layout_v)
    _check_rows(src_rows, dst_rows)
    if src_rows.numel() == 0:
        return
    if (_dequant_on_device(packed_k, scale_k, zero_k, src_rows, dst_k, dst_rows)
            and _dequant_on_device(packed_v, scale_v, zero_v, src_rows, dst_v, dst_rows)):
        kernel_module("_quant_triton").dequantize_rows_pair(packed_k, scale_k, zero_k, layout_k, packed_v, scale_v,
                                                            zero_v, layout_v, bits, rows_per_block, src_rows,
                                                            dst_k, dst_v, dst_rows)
        return
    swap_in_dequant(packed_k, scale_k, zero_k, bits, rows_per_block, src_rows, dst_k, dst_rows, layout_k)
    swap_in_dequant(packed_v, scale_v, zero_v, bits, rows_per_block, src_rows, dst_v, dst_rows, layout_v)


def swap_plan(both: torch.Tensor, miss: torch.Tensor, loaded: torch.Tensor, slots: torch.Tensor,
              pslots: torch.Tensor, head_rows: torch.Tensor, tables: torch.Tensor, seq: torch.Tensor,
              kv_head: torch.Tensor, n_head: torch.Tensor, tail: torch.Tensor | None, block_size: int,
              num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A decode step's swap-in rows in one Triton launch (runtime/decode.py ``_swap_rows`` is the
    reference): for each selected then prefetched token of each row (``both`` (R, K + P); the
    copied ones where ``miss`` (R, K) / ``loaded`` (R, P)), its host row, in the main pool (the
    row of block ``tables[seq[r], token // block_size]``, KV head ``kv_head[r]``, in the layout of
    host_pool.block_rows) or with ``tail`` (R, 1) (quantized pools) in the float tail when it lies
    in the row's unfilled last block (``n_head`` (R, 1) tokens), -1 where nothing is copied, and
    its hot-buffer row ``head_rows[r] + slot``. Flat (R * (K + P),) int64 each."""
    check(use_triton(both), "swap_plan runs on CUDA (or the Triton interpreter)")
    return kernel_module("_swap_in_triton").swap_plan(both, miss, loaded, slots, pslots, head_rows, tables, seq,
                                                      kv_head, n_head, tail, block_size, num_kv_heads)
