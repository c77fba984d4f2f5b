"""The host pool: every token's K/V, in physical blocks, optionally quantized per block.

Rows: one row per (block, KV head, token in block) holds that token's D values, so that
``row = (block_id * Hkv + head) * block_size + offset`` (:meth:`HostPool.unit_rows` plus the
offset: the one place that formula lives); a quantization *unit* is one (block, head) run of
``block_size`` rows, ``unit = row // block_size``. Per layer:

- unquantized: ``k``, ``v`` (R, D) in the KV dtype;
- quantized: ``k_packed``, ``v_packed`` (R, P_max) uint8 (a unit at b bits uses the first
  ceil(D*b/8) bytes of its rows), bits per unit (uint8), and fp16 scale / zero points in the
  layouts of ``quant_policy.LAYOUT``: keys one pair per channel of a unit (``k_scale`` (U, D)),
  values one per token (``v_scale`` (R,)). A block is quantized when it fills
  (:meth:`HostPool.seal`); until then its tokens live in the sequence's float *tail* block
  (``k_tail``/``v_tail``, the same formula with the tail slot as the block).

Host memory is pinned when the compute device is CUDA: the swap-in kernel reads it, and the backup
of new tokens writes it, over UVA, in stream order and without a host sync. Each tensor lives in a
reserved address range it grows in place (:class:`Space`): a growing pool keeps its addresses,
which a captured decode step holds, until it outgrows the reservation.
"""

from __future__ import annotations

import math

import torch

from hi_sparse.kernels import PARAM_DTYPES, gather_layers, packed_width, swap_in, swap_in_dequant
from hi_sparse.kernels.swap_in import backup_token, device_path, swap_in_dequant_pair, swap_in_pair

from .host_seal import HotRows, QuantEvents, seal_graph, seal_many, seal_tails, to_device as _to_device
from .pinned import Space, lock_ahead, pin
from .quant_policy import ADAPTIVE, BITS, LAYOUT, make_policy, max_bits
from .trace import phase

__all__ = ["HostPool", "QuantEvents"]


class HostPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, pin: bool, host_kv_bits=None, error_budget: float | None = None) -> None:
        self.num_kv_heads, self.head_dim, self.block_size = num_kv_heads, head_dim, block_size
        self.dtype, self.pin = dtype, pin
        self.before_grow = None              # called before a resize (the engine settles reads)
        self.policy = make_policy(host_kv_bits, error_budget)
        self.quantized = self.policy is not None
        # one width for every unit: loads need not look the units' bits up
        self.fixed_bits = int(host_kv_bits) if self.quantized and host_kv_bits not in ADAPTIVE else None
        self._device_wrote = False  # a GPU kernel wrote pinned rows: sync before the CPU reads them
        self.packed_bytes = packed_width(head_dim, max_bits(host_kv_bits)) if self.quantized else 0
        self.widths = tuple(b for b in BITS if b <= max_bits(host_kv_bits)) if self.quantized else ()
        self.num_blocks = 0
        self.num_tail = 0
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self._spaces: list[dict[str, Space | None]] = [{} for _ in range(num_layers)]   # by tensor, as layers
        # device copies of each layer's unit bits (mixed widths on a GPU): {(layer, "k"/"v"): tensor}
        self._bits_on: dict[tuple[int, str], torch.Tensor] = {}
        self._row_bytes: dict[torch.device, torch.Tensor] = {}   # bits -> bytes a packed row reads
        self._seal_graphs: dict = {}         # host_seal.SealGraph by (units, device)
        self.locking = None                  # the last lock_ahead's job
        self._alloc(0, 0)

    # -- storage -------------------------------------------------------------------------------
    def _empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        if self.pin and t.numel():
            pin(t)
        return t

    def _spec(self, blocks: int, tails: int) -> dict[str, tuple[tuple, torch.dtype]]:
        """Every tensor of a layer: its shape and dtype for ``blocks`` blocks and ``tails`` tail slots."""
        H, D, bs, P = self.num_kv_heads, self.head_dim, self.block_size, self.packed_bytes
        rows, units, trows = blocks * H * bs, blocks * H, tails * H * bs
        if not self.quantized:
            return {"k": ((rows, D), self.dtype), "v": ((rows, D), self.dtype)}
        pairs = {"channel": (units, D), "token": (rows,)}
        return {"k_packed": ((rows, P), torch.uint8), "v_packed": ((rows, P), torch.uint8),
                **{f"{x}_{p}": (pairs[LAYOUT[x]], PARAM_DTYPES[LAYOUT[x]])
                   for x in ("k", "v") for p in ("scale", "zero")},
                "k_bits": ((units,), torch.uint8), "v_bits": ((units,), torch.uint8),
                "k_tail": ((trows, D), self.dtype), "v_tail": ((trows, D), self.dtype)}

    def _moves(self, blocks: int, tails: int) -> bool:
        """Whether growing to ``blocks`` and ``tails`` moves a tensor in use (outgrows its space)."""
        need = {name: (shp, math.prod(shp) * dt.itemsize) for name, (shp, dt) in self._spec(blocks, tails).items()}
        for store, spaces in zip(self.layers, self._spaces):
            for name, t in store.items():
                shape, n = need[name]
                if t.shape != shape and t.numel():
                    space = spaces.get(name)
                    if space is None or not space.holds(n):
                        return True
        return False

    def _alloc(self, blocks: int, tails: int) -> None:
        moved = False
        spec = self._spec(blocks, tails)
        for store, spaces in zip(self.layers, self._spaces):
            for name, (shape, dt) in spec.items():
                old, space = store.get(name), spaces.get(name)
                if old is not None and old.shape == shape:
                    continue             # more tail slots leave the main pool where it is
                nbytes = math.prod(shape) * dt.itemsize
                if space is not None and space.holds(nbytes):
                    store[name] = space.view(shape, dt)      # grown in place: the same address
                    continue
                space = spaces[name] = Space.make(nbytes, self.pin)
                new = space.view(shape, dt) if space is not None else self._empty(shape, dt)
                if old is not None and old.shape[0]:
                    new[: old.shape[0]] = old
                    moved = True
                store[name] = new
        if blocks != self.num_blocks:
            self._bits_on.clear()    # rebuilt at the next prepare
        if moved:
            self._seal_graphs = {k: v for k, v in self._seal_graphs.items() if k == "failed"}  # moved buffers
        self.num_blocks, self.num_tail = blocks, tails

    def grow(self, blocks: int | None = None, tails: int | None = None) -> None:
        """Resize to at least ``blocks`` blocks and ``tails`` tail slots (contents kept): in place,
        unless a tensor outgrows its reserved space and moves."""
        blocks, tails = max(self.num_blocks, blocks or 0), max(self.num_tail, tails or 0)
        # the old buffers go (a move, or the bits' device copies of a pool of several widths,
        # made again): whatever the device still reads finishes first
        remade = bool(self._bits_on) and blocks > self.num_blocks
        if self.before_grow is not None and (remade or self._moves(blocks, tails)):
            self.before_grow()
        with phase("host_pool.grow"):
            self._alloc(blocks, tails)

    def lock_ahead(self, blocks: int) -> None:
        """Page-lock, on a thread, the pages a growth to ``blocks`` blocks will take in place
        (pinned.lock_ahead), and make its views there (Space.make_ready): that growth, in a
        decode step, then has none to lock or make. ``locking``: the last such job (a
        pinned.LockJob), which replaces the one before (a growth since has taken that one's pages)."""
        if not self.pin or blocks <= self.num_blocks:
            return
        spec = self._spec(blocks, self.num_tail)
        todo = [(space, n) for store, spaces in zip(self.layers, self._spaces) for name, space in spaces.items()
                if space is not None and tuple(store[name].shape) != spec[name][0]   # (what the growth changes)
                and space.holds(n := space.expect(*spec[name]))]
        self.locking = lock_ahead(todo, torch.device("cuda", torch.cuda.current_device()), replaces=self.locking)

    def bytes(self) -> tuple[int, int]:
        """(data bytes, metadata bytes) held: K/V rows and tails vs scales, zeros and bits."""
        sizes = [(name.endswith(("scale", "zero", "bits")), t.numel() * t.element_size())
                 for store in self.layers for name, t in store.items()]
        return sum(n for meta, n in sizes if not meta), sum(n for meta, n in sizes if meta)

    def buffers(self, layer: int) -> list[torch.Tensor]:
        """Every tensor a load or backup of the layer touches (their addresses key a captured step)."""
        on = self._bits_on
        return [*self.layers[layer].values(), *(on[(layer, p)] for p in ("k", "v") if (layer, p) in on)]

    # -- addressing ----------------------------------------------------------------------------
    def unit_rows(self, block: torch.Tensor | int, head: torch.Tensor | int) -> torch.Tensor | int:
        """The first row of unit (``block``, ``head``): a token's row is this plus its offset in the
        block, ``pos % block_size`` (broadcastable int64 tensors, or ints)."""
        return (block * self.num_kv_heads + head) * self.block_size

    def row_of(self, block: torch.Tensor | int, head: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The row of token ``pos`` at KV head ``head`` in physical block (or tail slot) ``block``
        (broadcastable int64 tensors)."""
        return self.unit_rows(block, head) + pos % self.block_size

    def main_rows(self, tables: torch.Tensor, head: torch.Tensor, pos: torch.Tensor,
                  seq: torch.Tensor | None = None) -> torch.Tensor:
        """Main-pool rows of tokens pos (R, ...) at KV heads ``head`` (broadcastable to pos): of the
        sequence whose block table is row r of tables (R, W), or row seq[r] (seq (R, 1))."""
        return self.block_rows(tables, head, pos // self.block_size, pos % self.block_size, seq)

    def block_rows(self, tables: torch.Tensor, head: torch.Tensor, logical: torch.Tensor, offset: torch.Tensor,
                   seq: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`main_rows` of tokens given as (logical block, offset in it), for a caller that
        needs those anyway (the decode step: a token of the unfilled block is read from the tail)."""
        # A hole (-1: streaming mode overwrote the block) would index out of range; read block 0
        # instead. Every caller masks holes out (selection never picks them; the audit,
        # recalibration and prefill drop them through the visibility mask).
        if seq is None:
            blk = tables.gather(1, logical.reshape(logical.shape[0], -1)).view(logical.shape)
        else:
            blk = tables[seq, logical]
        return self.unit_rows(blk.clamp_min(0), head) + offset

    def tail_units(self, tail_slots: torch.Tensor) -> torch.Tensor:
        """The first rows (B, Hkv) of the units of B sequences' tail slots (B,) (:meth:`backup`)."""
        return self.unit_rows(tail_slots[:, None], torch.arange(self.num_kv_heads, device=tail_slots.device))

    def tail_rows(self, tail_slots: torch.Tensor | int, head: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rows of tokens pos in the float tail blocks ``tail_slots`` (quantized pools)."""
        return self.row_of(tail_slots, head, pos)

    def tail_block_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The rows of the float tail blocks ``slots`` (B,) int64, every head and offset: (B, Hkv,
        block) on slots' device, what :meth:`read_tails` reads (the same at every layer)."""
        dev = slots.device
        return self.tail_rows(slots[:, None, None], torch.arange(self.num_kv_heads, device=dev)[:, None],
                              torch.arange(self.block_size, device=dev))

    def read_tails(self, layers: list[int], rows: torch.Tensor) -> torch.Tensor:
        """The keys in float tail rows ``rows`` (:meth:`tail_block_rows`, -1 where none is read;
        quantized pools) of each of ``layers`` -> (L, *rows.shape, D) in the stored dtype on rows'
        device (zeros at -1): one gather of all the layers."""
        if rows.device.type == "cpu":
            self._host_visible()
        k = gather_layers([self.layers[layer]["k_tail"] for layer in layers], rows.reshape(-1))
        return k.view(len(layers), *rows.shape, self.head_dim)

    # -- writes --------------------------------------------------------------------------------
    def backup(self, layer: int, tables: torch.Tensor, tail_units: torch.Tensor | None, start: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens from where they are: k, v (B, Hkv, T, D) at positions start (B,) + t
        of B sequences (block tables (B, W); tail_units (B, Hkv): their tail slots' units,
        :meth:`tail_units`, for quantized pools), without a host sync. Unquantized: every token
        into the main pool. Quantized: the tokens of each sequence's unfilled last block into its
        tail (the blocks they complete go through :meth:`seal` first).

        On a GPU the kernel writes the pinned rows over UVA, in stream order; the CPU waits for it
        only before it next reads the pool itself (:meth:`note_device_writes`).
        """
        B, H, T, D = k.shape
        store = self.layers[layer]
        names = ("k_tail", "v_tail") if self.quantized else ("k", "v")
        k, v = (x.to(self.dtype).reshape(-1, D) for x in (k, v))                               # (B*H*T, D)
        if T == 1 and device_path(k, store[names[0]], start):
            # a decode token where Triton runs: K and V in one launch, the rows computed in it
            backup_token(k, v, store[names[0]], store[names[1]], start, self.block_size,
                         tail_units if self.quantized else None, None if self.quantized else tables)
            return
        # a decode token (T == 1) is at start itself: no position arithmetic in the captured step
        pos = start[:, None] if T == 1 else start[:, None] + torch.arange(T, device=k.device)     # (B, T)
        keep = None
        if self.quantized:
            rows = tail_units[:, :, None] + pos[:, None] % self.block_size                        # (B, H, T)
            if T > 1:
                # tokens of the blocks they complete would share tail rows with later ones (seal
                # stored them); a decode token that completes its block is written to the tail
                # too: that step reads the block from there (batch_state.tail_block), and a planned
                # step seals it from there after its forward
                keep = (pos >= (start + T)[:, None] // self.block_size * self.block_size)[:, None].expand(B, H, T)
        else:
            heads = torch.arange(H, device=k.device)[None, :, None]
            rows = self.main_rows(tables, heads, pos[:, None].expand(B, H, T))
        src = torch.arange(B * H * T, device=k.device)
        if keep is not None:
            src = torch.where(keep.reshape(-1), src, -1)
        for name, x in zip(names, (k, v)):
            swap_in(x, src, store[name], rows.reshape(-1))

    def backup_bytes(self, starts: list[int], new_tokens: int) -> int:
        """Bytes :meth:`backup` writes for sequences at positions ``starts`` (host arithmetic)."""
        elt = torch.empty(0, dtype=self.dtype).element_size()
        per_token = 2 * self.num_kv_heads * self.head_dim * elt
        if not self.quantized:
            return per_token * new_tokens * len(starts)
        bs = self.block_size
        return per_token * sum(p + new_tokens - max(p, (p + new_tokens) // bs * bs) for p in starts)

    def note_device_writes(self, device: torch.device) -> None:
        """A backup from ``device`` ran (also one a CUDA graph replayed, where its Python did not)."""
        if device.type == "cuda" and self.pin:
            self._device_wrote = True

    def seal(self, layer: int, block_table: torch.Tensor, tail_slot: int, start: int,
             k: torch.Tensor, v: torch.Tensor) -> tuple[int, QuantEvents]:
        """Quantize the blocks that new tokens k, v (Hkv, T, D) at positions [start, start + T)
        complete (the older tokens of the first come from the tail), on the tokens' device;
        the rest of the tokens is :meth:`backup`'s. Returns (bytes written, quantization events)."""
        return self.seal_many(layer, [(block_table, tail_slot, start, k, v)])

    def seal_many(self, layer: int, items: list[tuple[torch.Tensor, int, int, torch.Tensor, torch.Tensor]],
                  together: bool | None = None) -> tuple[int, QuantEvents]:
        """:meth:`seal` for several sequences at once (host_seal.seal_many)."""
        return seal_many(self, layer, items, together)

    def seal_tails(self, items: list[tuple[int, int]], device: torch.device, graphs: bool = False,
                   room: int = 0, hot: HotRows | None = None) -> tuple[int, QuantEvents]:
        """Seal, at every layer, blocks whose tokens are all in their float tails (host_seal.seal_tails);
        graphs: by a captured CUDA graph for up to ``room`` blocks where it can; ``hot``: the rows
        the layers' hot buffers hold read there."""
        return seal_tails(self, items, device, self._seal_graphs if graphs else None, room, hot)

    def ready_seal(self, items: int, device: torch.device, hot: HotRows | None = None) -> None:
        """Capture the graph :meth:`seal_tails` of ``items`` blocks replays, if it would use one."""
        seal_graph(self, self._seal_graphs, items * self.num_kv_heads, device, hot)

    @staticmethod
    def _per_unit(name: str) -> bool:
        """Whether a quantized pool's tensor ``name`` has one entry per unit (else one per row)."""
        return name.endswith("_bits") or (name.endswith(("_scale", "_zero")) and LAYOUT[name[0]] != "token")

    def _host_visible(self) -> None:
        """Wait for device writes into the pinned pool before the CPU reads or rewrites rows."""
        if self._device_wrote:
            torch.cuda.synchronize()
            self._device_wrote = False

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every layer, head and token; packed rows with their scale, zero and
        bits) from physical blocks ``src`` to ``dst`` (a forked sequence's own copy)."""
        if not src:
            return
        self._host_visible()
        H, bs = self.num_kv_heads, self.block_size
        self._bits_on.clear()        # rebuilt at the next prepare
        if src == list(range(src[0], src[0] + len(src))) and dst == list(range(dst[0], dst[0] + len(dst))):
            # consecutive blocks (a fresh or sized pool): one slice copy per tensor
            for store in self.layers:
                for name, t in store.items():
                    if not name.endswith("_tail"):
                        per = H if self._per_unit(name) else H * bs
                        t[dst[0] * per:(dst[0] + len(dst)) * per].copy_(t[src[0] * per:(src[0] + len(src)) * per])
            return
        s, d = torch.tensor(src), torch.tensor(dst)
        units_s = (s[:, None] * H + torch.arange(H)).reshape(-1)
        units_d = (d[:, None] * H + torch.arange(H)).reshape(-1)
        rows_s = (units_s[:, None] * bs + torch.arange(bs)).reshape(-1)
        rows_d = (units_d[:, None] * bs + torch.arange(bs)).reshape(-1)
        for store in self.layers:
            for name, t in store.items():
                if name.endswith("_tail"):
                    continue
                i, o = (units_s, units_d) if self._per_unit(name) else (rows_s, rows_d)
                t.index_copy_(0, o, t.index_select(0, i))

    def copy_tail(self, src: int, dst: int) -> None:
        """Copy the float tail block of tail slot ``src`` to slot ``dst`` (quantized pools)."""
        if not self.quantized:
            return
        self._host_visible()
        n = self.num_kv_heads * self.block_size
        for store in self.layers:
            for name in ("k_tail", "v_tail"):
                store[name][dst * n:(dst + 1) * n] = store[name][src * n:(src + 1) * n]

    # -- reads (swap-in, audit, recalibration) -------------------------------------------------
    def prepare(self, layer: int, device: torch.device) -> None:
        """Make what a load on ``device`` reads available there: a pool of mixed bit widths keeps a
        copy of its units' bits on each GPU that loads (refreshed by seal as units fill). Call
        before a load that may be captured in a CUDA graph."""
        if not self.quantized or self.fixed_bits is not None:
            return
        if device.type == "cuda" and device.index is None:     # "cuda": the current one, as tensors say
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._row_bytes:
            sizes = [packed_width(self.head_dim, b) for b in range(max(BITS) + 1)]
            self._row_bytes[device] = torch.tensor(sizes, device=device)
        if device.type != "cuda":
            return
        for prefix in ("k", "v"):
            if (layer, prefix) not in self._bits_on:
                self._bits_on[(layer, prefix)] = self.layers[layer][f"{prefix}_bits"].to(device)

    def _pair_bytes(self, prefix: str) -> int:
        """Bytes of scale and zero point a row of keys / values reads (its share of a unit's
        per-channel pairs, or its own per-token pair)."""
        per_unit = 4 * self.head_dim if LAYOUT[prefix] == "channel" else 4 * self.block_size
        return -(-per_unit // self.block_size)

    def _unit_bits(self, layer: int, prefix: str, device: torch.device) -> torch.Tensor:
        return self._bits_on[(layer, prefix)] if device.type == "cuda" else self.layers[layer][f"{prefix}_bits"]

    def row_bytes(self, layer: int) -> tuple[int, int] | None:
        """Bytes :meth:`load` reads per main-pool row and per tail row (K and V together; a
        quantized row: the packed codes and its share of the scale / zero pairs), or None where
        they depend on the unit (a pool of mixed bit widths: load counts those itself)."""
        store, D = self.layers[layer], self.head_dim
        if not self.quantized:
            return 2 * D * store["k"].element_size(), 0
        if self.fixed_bits is None:
            return None
        row = 2 * packed_width(D, self.fixed_bits) + self._pair_bytes("k") + self._pair_bytes("v")
        return row, 2 * D * store["k_tail"].element_size()

    def _uniform_row_bytes(self, layer: int) -> tuple[int, int]:
        sizes = self.row_bytes(layer)
        if sizes is None:
            raise RuntimeError("a pool of mixed bit widths has no uniform row size")
        return sizes

    def load(self, layer: int, rows: torch.Tensor | None, tail_rows: torch.Tensor | None, dst_k: torch.Tensor,
             dst_v: torch.Tensor | None, dst_rows: torch.Tensor, count: bool = True) -> torch.Tensor | None:
        """Copy (dequantizing) host rows into dst (S, D) at dst_rows (M,), without a host sync.

        rows (M,) index the main pool, tail_rows (M,) the tail blocks (quantized pools; None
        otherwise); -1 where an entry comes from the other one, or from neither. A pool of mixed
        bit widths dequantizes once per width, each launch taking the rows of its units. Returns
        the bytes read, a 0-dim int64 tensor on rows' device; with ``count`` False None where
        :meth:`row_bytes` lets the caller count them (a mixed pool always counts). ``dst_v`` None:
        the keys only (a read of the context to score it), nothing counted (None); ``rows`` None:
        the tails' rows only (a seal's read), nothing counted.
        """
        store, D = self.layers[layer], self.head_dim
        keys, count = dst_v is None, count and dst_v is not None
        if not self.quantized:
            _rows_of(store["k"], store["v"], rows, dst_k, dst_v, dst_rows)
            return (rows >= 0).sum() * self._uniform_row_bytes(layer)[0] if count else None
        _rows_of(store["k_tail"], store["v_tail"], tail_rows, dst_k, dst_v, dst_rows)
        if rows is None:        # (no main-pool rows: each width's dequantization would launch over none)
            return None
        tail_bytes = 2 * D * store["k_tail"].element_size()
        if self.fixed_bits is not None:
            P = packed_width(D, self.fixed_bits)
            if keys:
                swap_in_dequant(store["k_packed"][:, :P], store["k_scale"], store["k_zero"], self.fixed_bits,
                                self.block_size, rows, dst_k, dst_rows, LAYOUT["k"])
                return None
            # keys and values in one launch: twice the reads in flight over PCIe, one launch less
            swap_in_dequant_pair(store["k_packed"][:, :P], store["k_scale"], store["k_zero"], LAYOUT["k"],
                                 store["v_packed"][:, :P], store["v_scale"], store["v_zero"], LAYOUT["v"],
                                 self.fixed_bits, self.block_size, rows, dst_k, dst_v, dst_rows)
            if not count:
                return None
            row, tail_bytes = self._uniform_row_bytes(layer)
            return ((tail_rows >= 0) * tail_bytes + (rows >= 0) * row).sum()   # one count in the captured step
        nbytes = (tail_rows >= 0).sum() * tail_bytes
        if rows.device.type != "cuda":
            self.prepare(layer, rows.device)      # (on a GPU the caller did, outside any capture)
        for prefix, dst in (("k", dst_k),) if keys else (("k", dst_k), ("v", dst_v)):
            args = (store[f"{prefix}_scale"], store[f"{prefix}_zero"])
            bits = self._unit_bits(layer, prefix, rows.device)[rows.clamp(min=0) // self.block_size].long()
            for b in self.widths:
                P = packed_width(D, b)
                swap_in_dequant(store[f"{prefix}_packed"][:, :P], *args, b, self.block_size,
                                torch.where(bits == b, rows, -1), dst, dst_rows, LAYOUT[prefix])
            row = self._row_bytes[rows.device][bits] + self._pair_bytes(prefix)
            nbytes = nbytes + torch.where(rows >= 0, row, 0).sum()
        return None if keys else nbytes

    def read(self, layer: int, block_table: torch.Tensor, tail_slot: int | torch.Tensor,
             full_blocks: int | torch.Tensor, heads: torch.Tensor, pos: torch.Tensor,
             dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
             values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K, V of tokens ``pos`` at ``heads`` (broadcast to a common shape S) -> two (*S, D) tensors
        on ``device`` (default: the host). block_table: (W,) on the host; or the tables (B, W) of
        B sequences, whose tokens S's first dimension indexes (B, ...), with their tail slots
        and full blocks as (B,) tensors on the host (ints where the same).

        ``full_blocks``: blocks of the sequence that are complete (quantized pools keep the rest
        in the tail). Used by prefill attention, the audit and recalibration. On a CUDA device
        the rows are gathered by the GPU straight from the pinned pool (no host-side gather).
        ``values`` False: the keys only (V is None), half the reads.
        """
        device = torch.device("cpu") if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:     # "cuda": the current one, by index
            device = torch.device("cuda", torch.cuda.current_device())
        tables = block_table[None] if block_table.dim() == 1 else block_table
        per_seq = [t.reshape(-1, 1) if isinstance(t, torch.Tensor) else t for t in (tail_slot, full_blocks)]
        if device.type == "cpu":
            self._host_visible()
        else:       # the row arithmetic runs where the gather does: no pageable copy, no host sync
            heads, pos, tables = (_to_device(t, device) for t in (heads, pos, tables))
            per_seq = [_to_device(t, device) if isinstance(t, torch.Tensor) else t for t in per_seq]
        tail_slots, full = per_seq
        self.prepare(layer, device)
        heads, pos = torch.broadcast_tensors(heads, pos)
        shape = pos.shape
        heads, pos = heads.reshape(tables.shape[0], -1), pos.reshape(tables.shape[0], -1)
        # read in the stored dtype (swap-in copies without converting), convert once at the end
        out_k = torch.empty(pos.numel(), self.head_dim, dtype=self.dtype, device=device)
        out_v = torch.empty(pos.numel(), self.head_dim, dtype=self.dtype, device=device) if values else None
        rows = self.main_rows(tables, heads, pos)
        tail = None
        if self.quantized:
            in_tail = pos // self.block_size >= full
            tail = torch.where(in_tail, self.tail_rows(tail_slots, heads, pos), -1).reshape(-1)
            rows = torch.where(in_tail, -1, rows)
        idx = torch.arange(pos.numel(), device=device)
        self.load(layer, rows.reshape(-1), tail, out_k, out_v, idx, count=False)
        out_k = out_k.to(dtype).view(*shape, self.head_dim)
        return out_k, None if out_v is None else out_v.to(dtype).view(*shape, self.head_dim)


def _rows_of(src_k: torch.Tensor, src_v: torch.Tensor, rows: torch.Tensor, dst_k: torch.Tensor,
             dst_v: torch.Tensor | None, dst_rows: torch.Tensor) -> None:
    """Rows of K and V in one launch (swap_in_pair), or of K alone where dst_v is None."""
    if dst_v is None:
        swap_in(src_k, rows, dst_k, dst_rows)
    else:
        swap_in_pair(src_k, src_v, rows, dst_k, dst_v, dst_rows)
