"""Per-layer metadata of every engine row, stored as one tensor per kind: (rows, *per-row shape).

A sequence owns one row (the same row as its slice of the hot buffer), so the metadata of a batch
of sequences in consecutive rows is one slice, and a decode step scores, selects and updates the
whole batch with one set of kernels instead of a loop over sequences. One per-row dim of a kind
may grow (e.g. the block count of the key bounds); it grows for every row at once, so the bank is
sized by its longest sequence.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_VIEW = threading.local()


@contextlib.contextmanager
def staged_view() -> Iterator[None]:
    """In this thread, banks (and hot buffers' token maps) show the growth staged ahead
    (:meth:`RowBank.stage`) as if it had happened: a coming step is captured on another thread
    (step_graph.py) with the buffers it will have while this key's steps go on with theirs."""
    _VIEW.staged = True
    try:
        yield
    finally:
        _VIEW.staged = False


def in_staged_view() -> bool:
    return getattr(_VIEW, "staged", False)


@contextlib.contextmanager
def fills_together() -> Iterator[None]:
    """In this thread, the tensors :func:`full` makes are filled at the end, a few launches for all
    (one or two per device, dtype and value), not one each: staging every layer's banks for a key
    captured ahead made ~225 tensors in a step at 32 layers (5.8 ms of its host time under the
    profiler on an H100)."""
    outer = getattr(_VIEW, "fills", None)
    _VIEW.fills = [] if outer is None else outer
    try:
        yield
    finally:
        if outer is None:
            pending, _VIEW.fills = _VIEW.fills, None
            _fill_all(pending)


def full(shape: tuple[int, ...], fill, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.full``, its fill deferred inside :func:`fills_together`: for a tensor nothing reads or
    writes until then (a staged one)."""
    pending = getattr(_VIEW, "fills", None)
    if pending is None:
        return torch.full(shape, fill, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype, device=device)
    pending.append((t, fill))
    return t


def _fill_all(pending: list[tuple[torch.Tensor, object]]) -> None:
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t, fill in pending:
        if t.numel():
            groups.setdefault((t.device, t.dtype, fill), []).append(t)
    for (_, dtype, fill), ts in groups.items():
        if dtype == torch.bool and fill:
            for t in ts:
                t.fill_(True)
            continue
        torch._foreach_zero_(ts)
        if fill:
            torch._foreach_add_(ts, fill)


class GrowthCopies:
    """The copies a growth staged ahead (:meth:`RowBank.stage`, a hot buffer's staged token map)
    makes when it comes: each old tensor's contents into the start of its staged tensor, recorded
    at the staging (:meth:`recording`) as (staged tensor, old tensor, dim). ``graph``: those copies
    captured in one CUDA graph, off the step's thread (step_graph.py), which
    :func:`growth_copies` replays for them at the growth: at 32 layers ~250 copy launches, ~2 ms
    of the key change's step. ``retire``: called with the graph once replayed (its teardown off
    the step's thread). ``replayed``: whether it was."""

    def __init__(self) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.graph = None
        self.retire = None
        self.replayed = False

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """In this thread, stagings note the copies their growths will make here."""
        _VIEW.staging = self.copies
        try:
            yield
        finally:
            _VIEW.staging = None

    def run(self) -> None:
        """The copies, one launch each (what the graph records)."""
        for dst, src, dim in self.copies:
            _copy_in(dst, src, dim)

    def matches(self, copies: list[tuple[torch.Tensor, torch.Tensor, int]]) -> bool:
        """Whether ``copies`` are the recorded ones: the same tensors (not only addresses: a freed
        one's may be reused) in the same order."""
        return len(copies) == len(self.copies) and all(
            d is d0 and s is s0 and n == n0 for (d, s, n), (d0, s0, n0) in zip(copies, self.copies))


def note_staged(dst: torch.Tensor, src: torch.Tensor, dim: int) -> None:
    """A staging's copy to come (:class:`GrowthCopies`): ``src`` into the start of ``dst`` along ``dim``."""
    noted = getattr(_VIEW, "staging", None)
    if noted is not None:
        noted.append((dst, src, dim))


def copy_in(dst: torch.Tensor, src: torch.Tensor, dim: int) -> None:
    """A growth's copy of the old contents ``src`` into the start of its new tensor ``dst`` along
    ``dim``: now, or at the end of a :func:`growth_copies` block, with the others."""
    pending = getattr(_VIEW, "copies", None)
    if pending is None:
        _copy_in(dst, src, dim)
    else:
        pending.append((dst, src, dim))


def _copy_in(dst: torch.Tensor, src: torch.Tensor, dim: int) -> None:
    dst.narrow(dim, 0, src.shape[dim]).copy_(src)


@contextlib.contextmanager
def growth_copies(ahead: GrowthCopies | None) -> Iterator[list]:
    """In this thread, the growths' copies (:func:`copy_in`) wait for the block's end (nothing in
    it may read or write the grown tensors), where ``ahead``'s graph replays them in one launch if
    they are exactly the ones it recorded, else they run one by one. Yields the block's copies."""
    _VIEW.copies = done = []
    try:
        yield done
    finally:
        _VIEW.copies = None
        if ahead is not None and ahead.graph is not None and done and ahead.matches(done):
            ahead.graph.replay()
            ahead.replayed = True
            if ahead.retire is not None:
                ahead.retire(ahead.graph)
            ahead.graph = None
        else:
            for dst, src, dim in done:
                _copy_in(dst, src, dim)


@dataclass
class _Kind:
    shape: list[int]
    dtype: torch.dtype
    fill: float | int | bool


class RowBank:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.num_rows = 0
        self._t: dict[str, torch.Tensor] = {}
        self._kinds: dict[str, _Kind] = {}
        self._staged: dict[str, torch.Tensor] = {}     # stage(): by kind, filled, not in use yet

    @property
    def t(self) -> dict[str, torch.Tensor]:
        """Every kind's tensor (rows, *per-row shape); in a :func:`staged_view`, the staged ones."""
        if self._staged and in_staged_view():
            return {**self._t, **self._staged}
        return self._t

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, fill) -> None:
        """A kind of per-row tensor of ``shape``; new rows and grown parts hold ``fill``."""
        self._kinds[name] = _Kind(list(shape), dtype, fill)
        self._t[name] = torch.full((self.num_rows, *shape), fill, dtype=dtype, device=self.device)

    def grow_rows(self, rows: int) -> None:
        """Hold at least ``rows`` rows (new rows filled); contents kept."""
        if rows <= self.num_rows:
            return
        self._staged.clear()                 # (staged for the rows there were)
        for name, k in self._kinds.items():
            new = torch.full((rows, *k.shape), k.fill, dtype=k.dtype, device=self.device)
            new[:self.num_rows] = self._t[name]
            self._t[name] = new
        self.num_rows = rows

    def size(self, name: str, dim: int) -> int:
        staged = self._staged.get(name) if self._staged and in_staged_view() else None
        return self._kinds[name].shape[dim] if staged is None else staged.shape[dim + 1]

    def _grown(self, name: str, dim: int, size: int) -> tuple[int, ...] | None:
        """Kind ``name``'s shape with per-row dim ``dim`` grown to ``size``; None if not larger."""
        k = self._kinds[name]
        if size <= k.shape[dim]:
            return None
        shape = list(k.shape)
        shape[dim] = size
        return (self.num_rows, *shape)

    def grow(self, name: str, dim: int, size: int) -> None:
        """Make per-row dim ``dim`` of kind ``name`` at least ``size`` (new part filled), into the
        tensor :meth:`stage` made for that size if there is one."""
        shape = self._grown(name, dim, size)
        if shape is None:
            return
        staged = self._staged.pop(name, None)
        k = self._kinds[name]
        k.shape[dim] = size
        new = staged if staged is not None and tuple(staged.shape) == shape else \
            torch.full(shape, k.fill, dtype=k.dtype, device=self.device)
        copy_in(new, self._t[name], dim + 1)
        self._t[name] = new

    def stage(self, name: str, dim: int, size: int) -> None:
        """Make, now, the tensor a later :meth:`grow` of ``name`` to ``size`` will take: filled,
        the contents copied at that grow (they change until then: that copy noted for a
        :class:`GrowthCopies` recording), seen before it only in a :func:`staged_view`. Kept if
        staged already at that size."""
        shape = self._grown(name, dim, size)
        if shape is None:
            return
        have = self._staged.get(name)
        if have is None or tuple(have.shape) != shape:
            k = self._kinds[name]
            have = self._staged[name] = full(shape, k.fill, dtype=k.dtype, device=self.device)
        note_staged(have, self._t[name], dim + 1)

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
        return sum(t.numel() * t.element_size() for t in (*self._t.values(), *self._staged.values()))


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
