"""Host memory for the KV pool that a GPU reads and writes over UVA: page-locked (pinned) exactly,
and reserved ahead so that a pool tensor grows in place (:class:`Space`), its next growth's pages
locked ahead on a thread (:func:`lock_ahead`)."""

from __future__ import annotations

import math
import mmap
import sys
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch


def pin(t: torch.Tensor) -> None:
    """Page-lock ``t`` in place for the GPU (cudaHostRegister), unregistered when it is freed.

    torch's pinned allocator rounds every allocation up to a power of two, so a 1.5 GiB layer of
    the pool would lock 2 GiB (a 96 GiB pool ~128 GiB, more than the lent host has); registering
    the exact pages keeps what is locked equal to what is reported.
    """
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    _register(ptr, size)
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


RESERVE = 16                 # a pool tensor's address space: this many times its size when made
RESERVE_LEAST = 1 << 30      # ... and at least this many bytes (address space only: none backed)
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)


class Space:
    """Virtual memory reserved for one pool tensor (RESERVE times its size when made, none of it
    backed until written), in which the tensor grows in place: the same address, nothing copied,
    so a captured decode step that reads or writes it keeps working after a growth (a move is a new
    key: a capture), and nothing that reads it (a running recalibration) need finish first.
    Page-locked as it grows when ``pin`` (whole pages: two registrations may not share one)."""

    def __init__(self, mm: mmap.mmap, pin: bool) -> None:
        self.base = torch.frombuffer(mm, dtype=torch.uint8)    # keeps the mapping while a view lives
        self.pin, self.locked, self.ranges = pin, 0, []
        self._lock = threading.Lock()                           # the steps' thread and lock_ahead's
        if pin:
            weakref.finalize(mm, _unpin_all, self.ranges)       # when the last view is gone

    @classmethod
    def make(cls, nbytes: int, pin: bool) -> Space | None:
        """A space for a tensor of ``nbytes``; None when there is nothing to hold or the system
        refuses the reservation (strict overcommit): the tensor is then allocated as it is."""
        if not nbytes:
            return None
        page = mmap.PAGESIZE
        size = -(-max(RESERVE * nbytes, RESERVE_LEAST) // page) * page
        try:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        except (OSError, ValueError, OverflowError):
            return None
        return cls(mm, pin)

    def holds(self, nbytes: int) -> bool:
        return nbytes <= self.base.numel()

    def view(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The tensor of ``shape`` at the start of the space (contents kept from smaller views)."""
        n = math.prod(shape) * dtype.itemsize
        self.lock_to(n)
        return self.base[:n].view(dtype).view(shape)

    def lock_to(self, nbytes: int) -> None:
        """Page-lock the space's first ``nbytes`` (whole pages, within the space) if not yet."""
        if not self.pin:
            return
        end = min(self.base.numel(), -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        with self._lock:
            if end > self.locked:
                ptr = self.base.data_ptr() + self.locked
                _register(ptr, end - self.locked)
                self.ranges.append((ptr, end - self.locked))
                self.locked = end


_locker: ThreadPoolExecutor | None = None


def lock_ahead(spaces: list[tuple[Space, int]], device: torch.device) -> Future:
    """Page-lock each space's first n bytes, ``(space, n)``, on a thread of its own, while the steps
    go on: a pool's next growth then finds its pages locked (cudaHostRegister in the step took
    28-188 ms on the H200). The pages become resident now, not at the growth. A registration that
    fails here is left to the growth, which tries again and says why."""
    global _locker
    if _locker is None:
        _locker = ThreadPoolExecutor(1, thread_name_prefix="hisparse-pin")

    def work() -> None:
        with torch.cuda.device(device):
            for space, n in spaces:
                try:
                    space.lock_to(n)
                except RuntimeError:
                    return

    return _locker.submit(work)


def _register(ptr: int, size: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"could not page-lock {size / 2**30:.1f} GiB of host memory for the KV pool "
                           f"(cudaHostRegister error {int(err)}): lower host_pool_blocks or host_kv_bits, "
                           "or raise the locked-memory limit (ulimit -l)")


def _unpin_all(ranges: list[tuple[int, int]]) -> None:
    for ptr, size in ranges:
        _unpin(ptr, size)
