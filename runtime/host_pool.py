"""The host pool: every token's K/V, in physical blocks, optionally quantized per block.

Rows: one row per (block, KV head, token in block) holds that token's D values, so that
``row = (block_id * Hkv + head) * block_size + offset``; a quantization *unit* is one
(block, head) run of ``block_size`` rows, ``unit = row // block_size``. Per layer:

- unquantized: ``k``, ``v`` (R, D) in the KV dtype;
- quantized: ``k_packed``, ``v_packed`` (R, P_max) uint8 (a unit at b bits uses the first
  ceil(D*b/8) bytes of its rows), per-unit scale / zero (fp32) and bits (uint8). A block is
  quantized when it fills; until then its tokens live in the sequence's float *tail* block
  (``k_tail``/``v_tail`` rows ``(tail_slot * Hkv + head) * block_size + offset``).

Host memory is pinned when the compute device is CUDA (the swap-in kernel reads it over UVA).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from hi_sparse.kernels import packed_width, swap_in, swap_in_dequant

from .quant_policy import make_policy, max_bits, quantize_roundtrip


@dataclass
class QuantEvents:
    """What one write quantized: unit counts by bits and each unit's relative error."""
    counts: dict[int, int] = field(default_factory=dict)
    errors: list[float] = field(default_factory=list)


def _pin(t: torch.Tensor) -> None:
    """Page-lock ``t`` in place for the GPU (cudaHostRegister), unregistered when it is freed.

    torch's pinned allocator rounds every allocation up to a power of two, so a 1.5 GiB layer of
    the pool would lock 2 GiB (a 96 GiB pool ~128 GiB, more than the lent host has); registering
    the exact pages keeps what is locked equal to what is reported.
    """
    import weakref

    cudart = torch.cuda.cudart()
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    err = cudart.cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"could not page-lock {size / 2**30:.1f} GiB of host memory for the KV pool "
                           f"(cudaHostRegister error {int(err)}): lower host_pool_blocks or host_kv_bits, "
                           "or raise the locked-memory limit (ulimit -l)")
    weakref.finalize(t, _unpin, ptr, size)   # the pool holds the base tensor until it grows


def _unpin(ptr: int, size: int) -> None:
    """Unregister pages _pin locked (the tensor is being freed). This fails inside a CUDA graph
    capture of this thread (the batched decode captures with the collector off for that reason)
    or of another thread in global mode: then say so, as the pages stay locked."""
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err:
        warnings.warn(f"HiSparse: could not unlock {size / 2**20:.1f} MiB of freed KV pool memory "
                      f"(cudaHostUnregister error {err}; a CUDA graph capture in global mode was underway "
                      "in another thread?): the pages stay page-locked until the process exits",
                      RuntimeWarning, stacklevel=2)


class HostPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, pin: bool, host_kv_bits=None, error_budget: float = 0.02) -> None:
        self.L, self.H, self.D, self.bs = num_layers, num_kv_heads, head_dim, block_size
        self.dtype, self.pin = dtype, pin
        self.policy = make_policy(host_kv_bits, error_budget)
        self.quantized = self.policy is not None
        # one width for every unit: loads need not read the units' bits back first
        self.fixed_bits = int(host_kv_bits) if self.quantized and host_kv_bits not in ("auto", "budget") else None
        self._device_wrote = False  # a GPU kernel wrote pinned rows: sync before the CPU reads them
        self.P = packed_width(head_dim, max_bits(host_kv_bits)) if self.quantized else 0
        self.num_blocks = 0
        self.num_tail = 0
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self._alloc(0, 0)

    # -- storage -------------------------------------------------------------------------------
    def _empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        if self.pin and t.numel():
            _pin(t)
        return t

    def _alloc(self, blocks: int, tails: int) -> None:
        rows, units, trows = blocks * self.H * self.bs, blocks * self.H, tails * self.H * self.bs
        for store in self.layers:
            if self.quantized:
                spec = {"k_packed": ((rows, self.P), torch.uint8), "v_packed": ((rows, self.P), torch.uint8),
                        "k_scale": ((units,), torch.float32), "k_zero": ((units,), torch.float32),
                        "v_scale": ((units,), torch.float32), "v_zero": ((units,), torch.float32),
                        "k_bits": ((units,), torch.uint8), "v_bits": ((units,), torch.uint8),
                        "k_tail": ((trows, self.D), self.dtype), "v_tail": ((trows, self.D), self.dtype)}
            else:
                spec = {"k": ((rows, self.D), self.dtype), "v": ((rows, self.D), self.dtype)}
            for name, (shape, dt) in spec.items():
                new = self._empty(shape, dt)
                old = store.get(name)
                if old is not None and old.shape[0]:
                    new[: old.shape[0]] = old
                store[name] = new
        self.num_blocks, self.num_tail = blocks, tails

    def grow(self, blocks: int | None = None, tails: int | None = None) -> None:
        """Resize to at least ``blocks`` blocks and ``tails`` tail slots (contents kept)."""
        self._alloc(max(self.num_blocks, blocks or 0), max(self.num_tail, tails or 0))

    def bytes(self) -> tuple[int, int]:
        """(data bytes, metadata bytes) held: K/V rows and tails vs scales, zeros and bits."""
        data = meta = 0
        for store in self.layers:
            for name, t in store.items():
                n = t.numel() * t.element_size()
                if name.endswith(("scale", "zero", "bits")):
                    meta += n
                else:
                    data += n
        return data, meta

    # -- addressing ----------------------------------------------------------------------------
    def rows(self, block_table: torch.Tensor, heads: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Main-pool rows of tokens ``pos`` at KV heads ``heads`` (broadcastable int64 tensors)."""
        # A hole (-1: streaming mode overwrote the block) would index out of range; read block 0
        # instead. Every caller masks holes out (selection never picks them; the audit,
        # recalibration and prefill drop them through the visibility mask).
        blk = block_table[pos // self.bs].clamp_min(0)
        return (blk * self.H + heads) * self.bs + pos % self.bs

    def tail_rows(self, tail_slot: int, heads: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return (tail_slot * self.H + heads) * self.bs + pos % self.bs

    # -- writes (eager backup of new tokens) ---------------------------------------------------
    def write(self, layer: int, block_table: torch.Tensor, tail_slot: int, start: int,
              k: torch.Tensor, v: torch.Tensor) -> tuple[int, QuantEvents]:
        """Store new tokens at positions [start, start+T). k, v: (Hkv, T, D).

        Returns (bytes written to host, quantization events).
        """
        store, H, bs = self.layers[layer], self.H, self.bs
        T = k.shape[1]
        heads = torch.arange(H)[:, None]
        events = QuantEvents()
        self._host_visible()
        if not self.quantized:
            k, v = k.to("cpu", self.dtype), v.to("cpu", self.dtype)
            pos = torch.arange(start, start + T)[None]
            rows = self.rows(block_table, heads, pos).reshape(-1)
            store["k"].index_copy_(0, rows, k.reshape(-1, self.D))
            store["v"].index_copy_(0, rows, v.reshape(-1, self.D))
            return 2 * k.numel() * k.element_size(), events
        # quantized: complete the tail block, quantize every full block where the tokens are (on a
        # GPU: Triton, and only the packed result crosses to the host), keep the remainder
        k, v = k.to(dtype=self.dtype), v.to(dtype=self.dtype)
        b0 = start - start % bs
        if start > b0:
            old = self.tail_rows(tail_slot, heads, torch.arange(b0, start)[None]).reshape(-1)
            k = torch.cat([store["k_tail"][old].view(H, -1, self.D).to(k.device), k], 1)
            v = torch.cat([store["v_tail"][old].view(H, -1, self.D).to(v.device), v], 1)
        n_full = k.shape[1] // bs
        written = 0
        if n_full:
            blocks = block_table[torch.arange(b0 // bs, b0 // bs + n_full)]              # (F,)
            units = (blocks[:, None] * H + torch.arange(H)[None]).reshape(-1)             # (F*H,)
            ku = k[:, : n_full * bs].reshape(H, n_full, bs, self.D).transpose(0, 1).reshape(-1, bs, self.D)
            vu = v[:, : n_full * bs].reshape(H, n_full, bs, self.D).transpose(0, 1).reshape(-1, bs, self.D)
            kb, vb = self.policy.choose(ku, vu)
            for x, bits, prefix in ((ku, kb, "k"), (vu, vb, "v")):
                written += self._store_units(store, prefix, units, x, bits, events)
        rem = k.shape[1] - n_full * bs
        if rem:
            tpos = torch.arange(b0 + n_full * bs, b0 + n_full * bs + rem)[None]
            trows = self.tail_rows(tail_slot, heads, tpos).reshape(-1)
            store["k_tail"].index_copy_(0, trows, k[:, n_full * bs:].reshape(-1, self.D).cpu())
            store["v_tail"].index_copy_(0, trows, v[:, n_full * bs:].reshape(-1, self.D).cpu())
            written += 2 * rem * H * self.D * k.element_size()
        return written, events

    def _store_units(self, store: dict, prefix: str, units: torch.Tensor, x: torch.Tensor,
                     bits: torch.Tensor, events: QuantEvents) -> int:
        """Quantize units x (N, bs, D), on any device, at their chosen bits (N,) into the pool."""
        written = 0
        offs = torch.arange(self.bs)
        for b in sorted(set(bits.tolist())):
            sel = (bits == b).nonzero().squeeze(1).cpu()
            packed, scale, zero, err = (t.cpu() for t in quantize_roundtrip(x[sel.to(x.device)], b))
            u = units[sel]
            rows = (u[:, None] * self.bs + offs[None]).reshape(-1)
            P = packed.shape[-1]
            store[f"{prefix}_packed"][rows, :P] = packed.reshape(-1, P)
            store[f"{prefix}_scale"][u] = scale
            store[f"{prefix}_zero"][u] = zero
            store[f"{prefix}_bits"][u] = b
            events.counts[b] = events.counts.get(b, 0) + len(u)
            events.errors.extend(err.tolist())
            written += packed.numel() + 8 * len(u)
        return written

    def _host_visible(self) -> None:
        """Wait for device writes into the pinned pool before the CPU reads or rewrites rows."""
        if self._device_wrote:
            torch.cuda.synchronize()
            self._device_wrote = False

    def backup_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    tail: bool = False) -> int:
        """Write new tokens' rows from where they are: k, v (M, D), rows (M,) of the main pool
        (unquantized) or of the tail blocks (``tail``: quantized pools, tokens of unfilled blocks).

        On a GPU the kernel writes the pinned rows over UVA, in stream order (no host sync); the
        CPU waits for it only before it next reads the pool itself. Returns bytes written.
        """
        store = self.layers[layer]
        names = ("k_tail", "v_tail") if tail else ("k", "v")
        if tail != self.quantized:
            raise ValueError("bug: tail rows are for quantized pools, main rows for unquantized ones")
        idx = torch.arange(rows.numel(), device=k.device)
        for name, x in zip(names, (k, v)):
            swap_in(x.to(self.dtype), idx, store[name], rows)
        return self.backed_up(layer, k, tail)

    def backed_up(self, layer: int, k: torch.Tensor, tail: bool) -> int:
        """The bookkeeping of a backup_rows of k's rows, also for a caller that replays it from a
        CUDA graph (where its Python does not run): device writes into the pinned pool are noted;
        returns the bytes written."""
        if k.is_cuda and self.pin:
            self._device_wrote = True
        return 2 * k.numel() * self.layers[layer]["k_tail" if tail else "k"].element_size()

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every layer, head and token; packed rows with their scale, zero and
        bits) from physical blocks ``src`` to ``dst`` (a forked sequence's own copy)."""
        if not src:
            return
        self._host_visible()
        H, bs = self.H, self.bs
        if src == list(range(src[0], src[0] + len(src))) and dst == list(range(dst[0], dst[0] + len(dst))):
            # consecutive blocks (a fresh or sized pool): one slice copy per tensor
            for store in self.layers:
                for name, t in store.items():
                    if not name.endswith("_tail"):
                        per = H if name.endswith(("scale", "zero", "bits")) else H * bs
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
                per_unit = name.endswith(("scale", "zero", "bits"))
                i, o = (units_s, units_d) if per_unit else (rows_s, rows_d)
                t.index_copy_(0, o, t.index_select(0, i))

    def copy_tail(self, src: int, dst: int) -> None:
        """Copy the float tail block of tail slot ``src`` to slot ``dst`` (quantized pools)."""
        if not self.quantized:
            return
        self._host_visible()
        n = self.H * self.bs
        for store in self.layers:
            for name in ("k_tail", "v_tail"):
                store[name][dst * n:(dst + 1) * n] = store[name][src * n:(src + 1) * n]

    # -- reads (swap-in, audit, recalibration) -------------------------------------------------
    def load(self, layer: int, rows: torch.Tensor, tail_rows: torch.Tensor, dst_k: torch.Tensor,
             dst_v: torch.Tensor, dst_rows: torch.Tensor, dst_tail_rows: torch.Tensor) -> int:
        """Copy (dequantizing) host rows into dst (S, D) at dst rows; returns bytes read.

        ``rows`` index the main pool, ``tail_rows`` the tail blocks (quantized pools only).
        """
        store = self.layers[layer]
        if not self.quantized:
            swap_in(store["k"], rows, dst_k, dst_rows)
            swap_in(store["v"], rows, dst_v, dst_rows)
            return 2 * rows.numel() * self.D * store["k"].element_size()
        nbytes = 0
        if tail_rows.numel():
            if not store["k_tail"].is_pinned():
                tail_rows = tail_rows.cpu()  # pageable tail blocks are copied by torch on the host
            swap_in(store["k_tail"], tail_rows, dst_k, dst_tail_rows)
            swap_in(store["v_tail"], tail_rows, dst_v, dst_tail_rows)
            nbytes += 2 * tail_rows.numel() * self.D * store["k_tail"].element_size()
        if rows.numel():
            for prefix, dst in (("k", dst_k), ("v", dst_v)):
                if self.fixed_bits is not None:   # every unit at one width: no read-back of bits
                    groups = [(self.fixed_bits, rows, dst_rows)]
                else:
                    row_bits = store[f"{prefix}_bits"][(rows // self.bs).cpu()]
                    groups = []
                    for b in row_bits.unique().tolist():
                        sel = (row_bits == b).nonzero().squeeze(1).to(rows.device)
                        groups.append((b, rows[sel], dst_rows[sel.to(dst_rows.device)]))
                for b, r, d in groups:
                    P = packed_width(self.D, b)
                    swap_in_dequant(store[f"{prefix}_packed"][:, :P], store[f"{prefix}_scale"],
                                    store[f"{prefix}_zero"], b, self.bs, r, dst, d)
                    nbytes += r.numel() * P + 8 * r.numel()
        return nbytes

    def read(self, layer: int, block_table: torch.Tensor, tail_slot: int, full_blocks: int,
             heads: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of tokens ``pos`` at ``heads`` (broadcast to a common shape S) -> two (*S, D) tensors
        on ``device`` (default: the host).

        ``full_blocks``: blocks of the sequence that are complete (quantized pools keep the rest
        in the tail). Used by prefill attention, the audit and recalibration. On a CUDA device
        the rows are gathered by the GPU straight from the pinned pool (no host-side gather).
        """
        if device is None or torch.device(device).type == "cpu":
            self._host_visible()
        heads, pos = torch.broadcast_tensors(heads, pos)
        shape = pos.shape
        heads, pos = heads.reshape(-1), pos.reshape(-1)
        # read in the stored dtype (swap-in copies without converting), convert once at the end
        out_k = torch.empty(pos.numel(), self.D, dtype=self.dtype, device=device)
        out_v = torch.empty(pos.numel(), self.D, dtype=self.dtype, device=device)
        idx = torch.arange(pos.numel(), device=device)
        empty = torch.empty(0, dtype=torch.int64)
        if self.quantized:
            in_tail = pos // self.bs >= full_blocks
            t = in_tail.nonzero().squeeze(1)
            m = (~in_tail).nonzero().squeeze(1)
            self.load(layer, self.rows(block_table, heads[m], pos[m]),
                      self.tail_rows(tail_slot, heads[t], pos[t]), out_k, out_v, idx[m.to(idx.device)],
                      idx[t.to(idx.device)])
        else:
            self.load(layer, self.rows(block_table, heads, pos), empty, out_k, out_v, idx, empty)
        out_k, out_v = out_k.to(dtype), out_v.to(dtype)
        return out_k.view(*shape, self.D), out_v.view(*shape, self.D)
