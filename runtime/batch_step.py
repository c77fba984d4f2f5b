"""Running a decode step's body eagerly, or captured once in a CUDA graph and replayed.

A body (decode.py) is a function whose shapes are all known on the host and whose
step-to-step values (token counts, the LRU clock) are read from device tensors, so a CUDA graph
captured once replays it while the host-side key (shapes, buffer addresses) stays the same. On
the CPU, with ``decode_graphs=False`` or layers on several GPUs, bodies run eagerly.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import traceback
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from hi_sparse import kernels

from .streams import own_stream, upload


def _cause(exc: BaseException) -> str:
    """What broke a capture, first: when an op of the body raised, ending the capture raises too
    ("operation failed due to a previous error during capture") with the op's error as context."""
    first = exc.__context__ if exc.__context__ is not None else exc
    own = (os.path.dirname(__file__), os.path.dirname(kernels.__file__))
    where = [f for f in traceback.extract_tb(first.__traceback__) if f.filename.startswith(own)][-1:]
    at = f" at {os.path.basename(where[0].filename)}:{where[0].lineno} ({where[0].name})" if where else ""
    text = f"{type(first).__name__}: {_line(first)}{at}"
    return text if first is exc else f"{text}; then ending the capture: {_line(exc)}"


def _line(exc: BaseException) -> str:
    """An error's first line (torch's CUDA errors go on with generic debugging advice)."""
    return (str(exc).strip().splitlines() or [""])[0]


def _after_failed_capture(stream: torch.cuda.Stream, pool, reset_random: bool = True) -> None:
    """Undo what torch.cuda.graph leaves behind when ending a capture raises: its capture stream
    stays current (later work would run unordered with the caller's stream), the memory pool
    stays registered for allocations, and the CUDA random generator stays in capture mode (every
    later random op on the GPU, sampling included, would raise "Offset increment outside graph
    capture"). Only a capture that ends resets the generator: one tiny capture, in a new pool (the
    failed one cannot take another). Not with ``reset_random`` False: the capture registered a copy
    of the generator's state (:func:`private_random_state`), which no one else reads."""
    torch.cuda.set_stream(stream)
    try:
        torch._C._cuda_endAllocateToPool(stream.device_index, pool)
    except (AttributeError, RuntimeError):     # a torch without it, or the pool already closed
        pass
    if not reset_random:
        return
    try:
        with _capture_lock, torch.cuda.graph(torch.cuda.CUDAGraph()):     # a capture too: one at a time
            torch.zeros(1, device=stream.device).add_(1)
    except RuntimeError:                       # if this fails too, the stream at least comes back
        torch.cuda.set_stream(stream)


class GraphRunner:
    """Runs bodies of one batch: eagerly, or (``graphs``) eagerly the first time a slot's key is
    seen, then captured in a CUDA graph, then replayed while the key stays the same.

    A slot is one body of one layer (e.g. (layer, "attend")); its key is what the captured graph
    depends on beyond the device tensors it reads (shapes, buffer addresses).
    """

    def __init__(self, graphs: bool) -> None:
        self.no_graphs = not graphs
        self.graphs: dict[tuple, tuple[tuple, torch.cuda.CUDAGraph]] = {}   # slot -> (key, graph)
        self.inputs: dict[tuple, list] = {}
        self.outputs: dict[tuple, tuple] = {}
        self.warm: dict[tuple, tuple] = {}    # slot -> the key last run eagerly
        self.pool = None

    def run(self, slot: tuple, key: tuple, body, *args):
        """``body(*args)``, eagerly or through the slot's graph. Tensor arguments are copied into
        buffers the graph reads. Returns the body's output (a tuple of tensors, or None)."""
        if self.no_graphs:
            return body(*args)
        bufs = self.inputs.get(slot)
        if bufs is None or any(isinstance(a, torch.Tensor) and a.shape != b.shape for a, b in zip(args, bufs)):
            bufs = self.inputs[slot] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        for a, b in zip(args, bufs):
            if isinstance(a, torch.Tensor):
                b.copy_(a)
        args = tuple(b if isinstance(b, torch.Tensor) else a for a, b in zip(args, bufs))
        have = self.graphs.get(slot)
        if have is not None and have[0] == key:
            have[1].replay()
            return self.outputs.get(slot)
        if self.warm.get(slot) != key:           # first sight: eager (compiles, cuBLAS workspaces)
            self.warm[slot] = key
            out = body(*args)
            if out is not None:                  # its outputs' shapes size the graph's output buffers
                self.outputs[slot] = tuple(torch.empty_like(o) for o in out)
            return out
        return self._capture(slot, key, body, args)

    def _capture(self, slot: tuple, key: tuple, body, args: tuple):
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()

        def recorded():
            out = body(*args)
            # The graphs share one memory pool, which is safe for what lives only during a
            # replay; outputs outlive it (the caller reads them after later layers' replays), so
            # the graph copies them into buffers allocated outside the pool.
            if out is not None:
                for o, b in zip(out, self.outputs[slot]):
                    b.copy_(o)

        try:
            graph, _ = capture(recorded, self.pool)
        except RuntimeError as exc:   # decode on without graphs rather than stop serving
            warnings.warn(f"HiSparse: CUDA graph capture of the batched decode step failed ({_cause(exc)}); "
                          "this batch decodes without graphs (set decode_graphs=False to silence this)",
                          RuntimeWarning, stacklevel=3)
            self.no_graphs = True
            return body(*args)
        self.graphs[slot] = (key, graph)
        graph.replay()                            # capture records, it does not run
        return self.outputs.get(slot)


# One capture at a time, whatever the thread (step_graph.py captures a coming key on another
# thread): the collector's pause (_no_collection) and the generator's reset after a failed capture
# are the process's, not a thread's. (A seal capture that broke with two captures at once on the
# H200, "capturing stream has unjoined work", was most likely two roles on one pooled stream,
# which streams.py ends: the lock did not stop it.)
_capture_lock = threading.Lock()
_blas = threading.local()


@contextlib.contextmanager
def _no_collection() -> Iterator[None]:
    """Python's cyclic collector off during a capture (captures hold _capture_lock: one at a time,
    so one ending does not turn it back on under another)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def private_random_state(device: torch.device) -> Iterator[None]:
    """The device's default CUDA generator on a copy of its state, then back on its own. A capture
    begun in between registers the copy, so the generator's own state never enters capture mode:
    while that capture goes on in another thread, random ops of this one (a sampling decode's
    multinomial) still run (a capturing state rejects them: "Offset increment outside graph
    capture"). The captured step draws no random numbers, so the copy is never advanced."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    own = gen.graphsafe_get_state()
    gen.graphsafe_set_state(gen.clone_state())
    try:
        yield
    finally:
        gen.graphsafe_set_state(own)


def _ready_blas(stream: torch.cuda.Stream) -> None:
    """This thread's cuBLAS and cuBLASLt handles and their workspaces on ``stream``, made now: a
    capture may not create them (a new thread's capture failed on the H200 with
    CUBLAS_STATUS_NOT_INITIALIZED in cublasCreate). Once per thread and stream."""
    if getattr(_blas, "stream", None) is stream:
        return
    with torch.cuda.stream(stream):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.ones(8, 8, dtype=dtype, device=stream.device)
            torch.nn.functional.linear(x, x, x[0])
            torch.mm(x, x)
    _blas.stream = stream


_ahead: ThreadPoolExecutor | None = None


def ahead_thread() -> ThreadPoolExecutor:
    """The one thread every capture ahead runs on (step_graph.py), made at first use: its cuBLAS
    handles and workspaces, bound to its stream once (:func:`warm_blas`), serve every capture;
    a new thread per capture bound them again (on the H100 the step that starts one waited ~5 ms
    under the profiler for its capture to begin)."""
    global _ahead
    if _ahead is None:
        _ahead = ThreadPoolExecutor(1, thread_name_prefix="hisparse-capture-ahead")
    return _ahead


def reset_off_step(graph: torch.cuda.CUDAGraph) -> None:
    """Destroy ``graph`` on the capture-ahead thread, between its captures, not in the step that
    dropped it (cudaGraphExecDestroy took 1.2-1.3 ms of a step on an H100). As when a step drops
    it: a replay still running completes (CUDA frees an executable graph in flight at its end)."""
    ahead_thread().submit(graph.reset)


def warm_blas(device: torch.device) -> None:
    """The cuBLAS handles a capture ahead takes made now (:func:`_ready_blas` on the "capture
    ahead" stream), on the thread the captures ahead run on (:func:`ahead_thread`). Its step
    waits for the capture to begin, and the first one, making them, took 157-269 ms on the H200
    (later ones < 16 ms)."""
    ahead_thread().submit(_ready_blas, own_stream(device, "capture ahead")).result()


def capture(fn, pool, begun=None, replayed_later: bool = False) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn()`` recorded (not run) in a new CUDA graph allocating from ``pool``: (graph, what fn
    returned). On a failure the capture is undone (_after_failed_capture) and the error raised.
    ``begun()``, when given, is called once the capture has begun, by a capture in another thread
    than the steps', under :func:`private_random_state` until then. A graph captured ahead (with
    ``begun``) or ``replayed_later`` (not in the step that captures it) is uploaded now: its first
    replay would do that in the step that replays it.

    Recorded on a side stream ordered after the current one, like ``torch.cuda.graph`` but
    without what it does first: a device-wide synchronize (which waited for a background
    recalibration's side stream: 0.8 s on the H200 at batch 24), a full garbage collection and
    emptying the allocator's cache (the steps after would allocate again)."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream()
    stream = own_stream(current.device, "capture ahead" if begun is not None else "capture")
    if begun is not None:
        _ready_blas(stream)
    stream.wait_stream(current)
    # A collection during the capture would run CUDA calls a capture forbids (unregistering a
    # dropped pool's pinned pages, destroying an old engine's graphs) and break it; other
    # threads' CUDA calls (thread_local) may go on.
    try:
        with _capture_lock, _no_collection(), torch.cuda.stream(stream):
            graph.capture_begin(pool, capture_error_mode="thread_local")
            try:
                if begun is not None:
                    begun()
                out = fn()
            finally:
                graph.capture_end()
    except RuntimeError:
        _after_failed_capture(current, pool, reset_random=begun is None)
        raise
    current.wait_stream(stream)
    if begun is not None or replayed_later:     # its first replay, in a step, need not upload it
        upload(graph, stream)   # (after the wait: the current stream's later work does not wait for it)
    return graph, out
