"""Host memory for the KV pool that a GPU reads and writes over UVA: page-locked (pinned) exactly,
and reserved ahead so that a pool tensor grows in place (:class:`Space`), its next growth's pages
locked ahead on a thread (:func:`lock_ahead`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import math
import mmap
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

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
        self.size = len(mm)                                     # bytes reserved (a growth asks often)
        self.pin, self.locked, self.ranges = pin, 0, []
        self._lock = threading.Lock()                           # the steps' thread and lock_ahead's
        self.coming: tuple | None = None    # (shape, dtype, bytes): the view the growth locked ahead for takes
        self.ready: tuple | None = None     # (shape, dtype, that view), made once its pages are locked
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
        return nbytes <= self.size

    def view(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The tensor of ``shape`` at the start of the space (contents kept from smaller views):
        the one made ahead (:meth:`make_ready`) if it is that one."""
        ready = self.ready
        if ready is not None and ready[0] == tuple(shape) and ready[1] == dtype:
            self.ready = None
            return ready[2]
        n = math.prod(shape) * dtype.itemsize
        self.lock_to(n)
        return self.base[:n].view(dtype).view(shape)

    def expect(self, shape: tuple, dtype: torch.dtype) -> int:
        """A growth will take the view of ``shape`` (:meth:`make_ready`); its bytes."""
        self.coming = (tuple(shape), dtype, math.prod(shape) * dtype.itemsize)
        return self.coming[2]

    def make_ready(self) -> None:
        """Make the view a growth will take (``coming``, as :func:`lock_ahead`'s caller set it)
        now, if its pages are locked: that growth, in a decode step, then makes none (at 32 layers
        a growth's ~256 views took ~1 ms of the step's host time)."""
        if self.coming is None:
            return
        shape, dtype, n = self.coming
        if self._chunk(n, None)[0] <= self.locked:
            self.ready = (shape, dtype, self.base[:n].view(dtype).view(shape))

    def lock_to(self, nbytes: int, most: int | None = None) -> bool:
        """Page-lock the space's first ``nbytes`` (whole pages, within the space) if not yet, at
        most ``most`` bytes more in this call. Returns whether pages are left to lock."""
        if not self.pin:
            return False
        with self._lock:
            goal, end = self._chunk(nbytes, most)
            if end > self.locked:
                ptr = self.base.data_ptr() + self.locked
                _register(ptr, end - self.locked)
                self.ranges.append((ptr, end - self.locked))
                self.locked = end
            return self.locked < goal

    def _chunk(self, nbytes: int, most: int | None) -> tuple[int, int]:
        """(the end of the whole pages ``nbytes`` takes, within the space; the end of the next
        chunk of at most ``most`` bytes past what is locked (at least a page), all with None)."""
        page = mmap.PAGESIZE
        goal = min(self.size, -(-nbytes // page) * page)
        return goal, goal if most is None else min(goal, self.locked + max(page, most // page * page))

    def populate(self, nbytes: int, most: int) -> None:
        """Fault in (without writing: their contents stay) the next ``most`` bytes of pages that
        :meth:`lock_to` ``nbytes`` would lock, so that its registration only pins them: the
        registration holds a lock of the driver's that a decode step's CUDA calls wait for,
        faulting in does not. Does nothing where the kernel cannot (Linux before 5.14)."""
        start = self.locked
        _, end = self._chunk(nbytes, most)
        if end > start and _madvise is not None:    # (an error, e.g. EINVAL before 5.14: the lock faults them in)
            _madvise(ctypes.c_void_p(self.base.data_ptr() + start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE)


_locker: ThreadPoolExecutor | None = None
# lock ahead a chunk at a time, pausing between chunks when LOCK_DUTY < 1: a registration holds a
# lock of the driver's that the decode step's launches and copies wait for (on an H100 at batch 24
# one job's 27 registrations of ~0.2-2 ms each, back to back, made the step after a growth 33 ms,
# 6x its median). Paced at 0.2 on an H200 the locking ran beside ~80 steps and slowed 19 of them
# 1.5-2.6x (93 ms in all): not paced by default (stall_profile.py --lock-duty to compare)
LOCK_CHUNK = 1 << 20         # bytes one registration locks ahead at most
LOCK_DUTY = 1.0              # the share of the wall time the locker registers (it waits the rest)
_MADV_POPULATE_WRITE = 23    # linux/mman.h, since Linux 5.14
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if sys.platform == "linux" else None
_madvise = getattr(_libc, "madvise", None)


class LockJob:
    """One :func:`lock_ahead`'s work, queued on the locker thread: ``result()`` waits for it;
    ``stop()`` ends it early (a newer job that covers it was queued)."""

    def __init__(self, spaces: list[tuple[Space, int]], device: torch.device) -> None:
        self.spaces, self.device = spaces, device
        self.stopped = threading.Event()
        self.future: Future | None = None

    def result(self, timeout: float | None = None) -> None:
        assert self.future is not None
        with contextlib.suppress(CancelledError):     # replaced before it began: nothing to wait for
            self.future.result(timeout)

    def stop(self) -> None:
        self.stopped.set()
        if self.future is not None:
            self.future.cancel()             # not started yet: it never runs

    def run(self) -> None:
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for space, n in self.spaces:
                more = True
                while more and not self.stopped.is_set():
                    space.populate(n, LOCK_CHUNK)
                    began = time.perf_counter()
                    try:
                        more = space.lock_to(n, LOCK_CHUNK)
                    except RuntimeError:
                        return
                    self.stopped.wait((time.perf_counter() - began) * (1 / LOCK_DUTY - 1))
                if not more:
                    space.make_ready()


def lock_ahead(spaces: list[tuple[Space, int]], device: torch.device, replaces: LockJob | None = None) -> LockJob:
    """Page-lock each space's first n bytes, ``(space, n)``, on a thread of its own, while the steps
    go on: a pool's next growth then finds its pages locked (cudaHostRegister in the step took
    28-188 ms on the H200). The pages become resident now, not at the growth: a chunk
    (LOCK_CHUNK) at a time, each faulted in before its registration, with pauses between them
    where LOCK_DUTY < 1 (off by default: measured worse). ``replaces``: an earlier
    job of the same pool, stopped (whatever of it is left, this one locks, as it covers it). A
    registration that fails here is left to the growth, which tries again and says why."""
    global _locker
    if _locker is None:
        _locker = ThreadPoolExecutor(1, thread_name_prefix="hisparse-pin")
    if replaces is not None:
        replaces.stop()
    job = LockJob(spaces, device)
    job.future = _locker.submit(job.run)
    return job


def _register(ptr: int, size: int) -> None:
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"could not page-lock {size / 2**30:.1f} GiB of host memory for the KV pool "
                           f"(cudaHostRegister error {int(err)}): lower host_pool_blocks or host_kv_bits, "
                           "or raise the locked-memory limit (ulimit -l)")


def _unpin_all(ranges: list[tuple[int, int]]) -> None:
    for ptr, size in ranges:
        _unpin(ptr, size)
