"""CUDA streams the runtime owns: one per (device, role), never shared with anyone else's work.

``torch.cuda.Stream()`` hands out streams from a pool of 32 per device and priority, round robin:
the 33rd stream a process asks for is the first one again. Two roles on one CUDA stream is a bug
the moment one of them captures a graph: whatever another thread queues there meanwhile (a
background recalibration's reads) is recorded into the capture, which then fails ("capturing
stream has unjoined work": most likely what broke a seal capture in the H200 gpu suite) or,
worse, replays that work at every step. So the runtime's side streams are made here with the
driver's ``cuStreamCreateWithPriority`` (non-blocking, like torch's), once per process, and
wrapped as ``torch.cuda.ExternalStream``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

import torch

from hi_sparse.kernels._dispatch import cuda_driver, driver_check, primary_context

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
_lock = threading.Lock()
_NON_BLOCKING = 1                    # CU_STREAM_NON_BLOCKING: no implicit sync with the null stream


def own_stream(device: torch.device | int, role: str, high: bool = False) -> torch.cuda.Stream:
    """The runtime's stream for ``role`` on CUDA ``device`` (made at the first call); ``high``: at
    the device's greatest priority (its kernels' blocks are scheduled before those of streams of
    the default priority, a background recalibration's), else at the default one."""
    index = device if isinstance(device, int) else device.index
    if index is None:
        index = torch.cuda.current_device()
    with _lock:
        stream = _streams.get((index, role))
        if stream is None:
            stream = _streams[(index, role)] = _create(index, high)
        return stream


@contextlib.contextmanager
def first_in_line(device: torch.device) -> Iterator[None]:
    """Work queued in the block runs on the device's high-priority stream, in the current stream's
    order (after what it queued before, before what it queues after): a replayed decode step's
    kernels go before a background recalibration's where both wait for the GPU's SMs."""
    current = torch.cuda.current_stream(device)
    high = own_stream(device, "steps", high=True)
    high.wait_stream(current)
    with torch.cuda.stream(high):
        yield
    current.wait_stream(high)


def _create(index: int, high: bool) -> torch.cuda.Stream:
    """A new CUDA stream of its own on device ``index``; a pooled torch stream where the driver
    library cannot be loaded (not Linux)."""
    torch.cuda.init()
    try:
        cuda_driver()
    except OSError:
        return torch.cuda.Stream(index, priority=-1 if high else 0)
    raw, least, greatest, doing = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int(), "making a side stream"
    with primary_context(index, doing) as cuda:       # torch's context
        driver_check(cuda.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
                     "cuCtxGetStreamPriorityRange", doing)
        driver_check(cuda.cuStreamCreateWithPriority(ctypes.byref(raw), _NON_BLOCKING, greatest if high else least),
                     "cuStreamCreateWithPriority", doing)
    return torch.cuda.ExternalStream(raw.value, device=torch.device("cuda", index))


def upload(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> bool:
    """Upload a captured graph's executable to the device on ``stream`` (cuGraphUpload), which its
    first replay would otherwise do in the step that replays it: for a graph captured ahead on
    another thread. False where that cannot be done here (no driver library, a torch without
    ``raw_cuda_graph_exec``, a driver error): the first replay then uploads it, as before."""
    try:
        cuda = cuda_driver()
        handle = graph.raw_cuda_graph_exec()
        return cuda.cuGraphUpload(ctypes.c_void_p(handle), ctypes.c_void_p(stream.cuda_stream)) == 0
    except (OSError, AttributeError, RuntimeError, TypeError, ValueError):
        return False
