"""Per-layer metadata of every engine row, stored as one tensor per kind: (rows, *per-row shape).

A sequence owns one row (the same row as its slice of the hot buffer), so the metadata of a batch
of sequences in consecutive rows is one slice, and a decode step scores, selects and updates the
whole batch with one set of kernels instead of a loop over sequences. One per-row dim of a kind
may grow (e.g. the block count of the key bounds); it grows for every row at once, so the bank is
sized by its longest sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Kind:
    shape: list[int]
    dtype: torch.dtype
    fill: float | int | bool


class RowBank:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.num_rows = 0
        self.t: dict[str, torch.Tensor] = {}
        self._kinds: dict[str, _Kind] = {}

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill) -> None:
        """A kind of per-row tensor of ``shape``; new rows and grown parts hold ``fill``."""
        self._kinds[name] = _Kind(list(shape), dtype, fill)
        self.t[name] = torch.full((self.num_rows, *shape), fill, dtype=dtype, device=self.device)

    def grow_rows(self, rows: int) -> None:
        """Hold at least ``rows`` rows (new rows filled); contents kept."""
        if rows <= self.num_rows:
            return
        for name, k in self._kinds.items():
            new = torch.full((rows, *k.shape), k.fill, dtype=k.dtype, device=self.device)
            new[:self.num_rows] = self.t[name]
            self.t[name] = new
        self.num_rows = rows

    def size(self, name: str, dim: int) -> int:
        return self._kinds[name].shape[dim]

    def grow(self, name: str, dim: int, size: int) -> None:
        """Make per-row dim ``dim`` of kind ``name`` at least ``size`` (new part filled)."""
        k = self._kinds[name]
        old = k.shape[dim]
        if size <= old:
            return
        k.shape[dim] = size
        new = torch.full((self.num_rows, *k.shape), k.fill, dtype=k.dtype, device=self.device)
        new.narrow(dim + 1, 0, old).copy_(self.t[name])
        self.t[name] = new

    def reset(self, row: int) -> None:
        """Fill one row (a new sequence takes it)."""
        for name, k in self._kinds.items():
            self.t[name][row].fill_(k.fill)

    def save(self, row: int) -> dict[str, torch.Tensor]:
        """Copies of one row (a freed sequence keeps them for resume)."""
        return {name: t[row].clone() for name, t in self.t.items()}

    def load(self, row: int, saved: dict[str, torch.Tensor]) -> None:
        """Put saved copies back into a (possibly different, possibly grown) row."""
        for name, x in saved.items():
            dst = self.t[name][row]
            dst.fill_(self._kinds[name].fill)
            dst[tuple(slice(0, s) for s in x.shape)].copy_(x)

    def copy_row(self, src: int, dst: int, count: int = 1) -> None:
        """Rows [dst, dst + count) become copies of row src (forked sequences)."""
        for t in self.t.values():
            t[dst:dst + count].copy_(t[src].expand(count, *t.shape[1:]))

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.t.values())


class RowView:
    """``seq.kmin[layer]``-style access to one kind of a sequence's row in each layer's bank."""

    __slots__ = ("_banks", "_name", "_seq")

    def __init__(self, banks: list[RowBank], name: str, seq) -> None:
        self._banks, self._name, self._seq = banks, name, seq

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self._banks[layer].t[self._name][self._seq.row]

    def __setitem__(self, layer: int, value: torch.Tensor) -> None:
        self._banks[layer].t[self._name][self._seq.row].copy_(value)

    def __len__(self) -> int:
        return len(self._banks)

    def __iter__(self):
        return (self[i] for i in range(len(self._banks)))
