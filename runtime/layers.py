"""Per-layer device state: the hot K/V buffers and the metadata of every engine row.

A sequence owns one *row* in every layer (the same index everywhere): its slice of the hot
buffer (Hkv x S slots of K and of V), its LRU state (a HotBufferBank row) and its metadata (a
RowBank row: key bounds per block and super-block, per-block importance and holes, anchors and
their probabilities, recent queries). A batch of sequences in consecutive rows is one slice of
each, which is what lets one set of kernels decode the whole batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import key_bounds
from .config import HiSparseConfig
from .hot_buffer import HotBufferBank
from .metrics import DeviceCounters
from .probe import ImportanceProbe
from .row_bank import RowBank


@dataclass(frozen=True)
class KVShape:
    """The model's attention shape and the cache's storage geometry."""
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int          # tokens per host block (cache_block_size)
    slots: int               # hot buffer slots per KV head (device_buffer_tokens)
    dtype: torch.dtype       # the stored KV dtype

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def normalize_device(device: torch.device | str) -> torch.device:
    """A device with its index: 'cuda' is the current CUDA device (tensors report cuda:N)."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


def devices_per_layer(devices: Sequence[torch.device | str] | None, num_layers: int,
                  primary: torch.device) -> list[torch.device]:
    """One device per layer (every layer on ``primary`` when None); clear errors for bad input."""
    if devices is None:
        return [primary] * num_layers
    if isinstance(devices, (str, torch.device)) or not hasattr(devices, "__len__"):
        raise ValueError(f"layer_devices must be a list of devices, one per layer, got {devices!r}: "
                         f"pass e.g. ['cuda:0'] * {num_layers}, or None for every layer on device")
    if len(devices) != num_layers:
        raise ValueError(f"layer_devices has {len(devices)} entries but the engine has {num_layers} "
                         f"layers: pass one device per layer, or None for every layer on device")
    try:
        return [normalize_device(d) for d in devices]
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"layer_devices holds something that is not a device ({exc}): pass "
                         "torch.device or strings like 'cuda:1'") from None


class LayerRows:
    """One layer's rows on its device: hot K/V (rows, Hkv, S, D), LRU state, metadata, probe."""

    def __init__(self, index: int, device: torch.device, shape: KVShape, global_tokens: int,
                 recent_queries: int, max_tokens: int, probe: ImportanceProbe, counters: DeviceCounters,
                 switch_device: bool, decode_kernels: bool = False) -> None:
        H, D, S = shape.num_kv_heads, shape.head_dim, shape.slots
        self.index, self.device, self.probe = index, device, probe
        self.counters = counters          # the device's per-step counts (shared by its layers)
        self.k = torch.zeros(0, H, S, D, dtype=shape.dtype, device=device)
        self.v = self.k.clone()
        self.bank = RowBank(device)
        key_bounds.add_kinds(self.bank, H, D, shape.dtype)
        self.bank.add("anchors", (H, global_tokens), torch.int64, -1)
        self.bank.add("anchor_p", (H, global_tokens), torch.float32, -1.0)
        self.bank.add("queries", (recent_queries, shape.num_q_heads, D), torch.float32, 0.0)
        self.hot = HotBufferBank(H, S, device, max_tokens=max_tokens, kernels=decode_kernels)
        # Triton launches on the current CUDA device: a layer on another GPU than the current one
        # runs under its device; otherwise a shared nullcontext keeps the path free of switches
        self._switch = switch_device

    def on_device(self) -> contextlib.AbstractContextManager:
        """The context the layer's work runs in: its CUDA device when layers span several."""
        return torch.cuda.device(self.device) if self._switch else contextlib.nullcontext()

    @property
    def num_rows(self) -> int:
        return self.k.shape[0]

    def grow_rows(self, rows: int) -> None:
        """Hold ``rows`` rows (new ones empty); contents kept."""
        start = self.num_rows
        if rows <= start:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.zeros(rows, *old.shape[1:], dtype=old.dtype, device=self.device)
            new[:start] = old
            setattr(self, name, new)
        self.bank.grow_rows(rows)
        self.hot.grow_rows(rows)

    def reset(self, row: int) -> None:
        """Empty one row (a new sequence takes it)."""
        self.bank.reset(row)
        self.hot.reset(row)

    def copy_row(self, src: int, dst: int, count: int = 1) -> None:
        """Rows [dst, dst + count) become copies of row src: metadata, LRU state and hot K/V."""
        self.bank.copy_row(src, dst, count)
        self.hot.copy_row(src, dst, count)
        for t in (self.k, self.v):
            t[dst:dst + count].copy_(t[src].expand(count, *t.shape[1:]))

    def make_room(self, tokens: int, cfg: HiSparseConfig, staged: bool = False) -> None:
        """Room for ``tokens`` tokens in the key bounds and the token -> slot map, each grown to a
        step key's block count (key_bounds.key_tokens); ``staged``: made ahead (RowBank.stage)."""
        key_bounds.grow(self.bank, tokens, cfg.cache_block_size, cfg.select_block, cfg.bound_group, cfg.max_seq_len,
                        staged)
        self.hot.ensure_tokens(tokens, lambda n: key_bounds.key_tokens(n, cfg.select_block), staged)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a decode step of this layer touches (their addresses key a captured step)."""
        return [*self.bank.t.values(), self.k, self.v, *self.hot.buffers()]

    def memory_bytes(self) -> tuple[int, int]:
        """(data, metadata) bytes on the device: hot K/V; banks, allocated for every row (live or
        free) and sized by the longest sequence."""
        data = sum(t.numel() * t.element_size() for t in (self.k, self.v))
        return data, self.bank.memory_bytes() + self.hot.memory_bytes()
