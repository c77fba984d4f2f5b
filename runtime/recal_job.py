"""A recalibration's results until they are written, and where its work runs.

:meth:`Recalibrator.start <hi_sparse.recalibration.Recalibrator.start>` returns a job. Its work
(each layer's contexts read and scored, the probes fitted) is done at once, or, for a background
recalibration on a GPU, by a worker thread that queues it on a side stream per device while the
decode steps go on: a launch is a few thousand small kernels (~150-320 ms of host time for 32
layers on the H200), which in the step stalled it 45-65 steps' worth. On a CPU a background
recalibration's work is cut in slices (a layer's scoring, an iteration of the probes' fit) that
the engine runs after each step for about a step's time (:meth:`RecalibrationJob.advance`): SmolLM2's
took 6-9 s in one step of ~0.1 s (benchmarks/bench_recal_cpu.py). Everything the work reads
that later steps change was copied when the job started (recent queries, visibility, block
tables, float tails), so the job reads the state of the step it started at whenever it runs, and
no later append has to wait for it. :meth:`RecalibrationJob.commit` (at a step boundary, or first
when something would free or move what it reads) waits for the worker and the side streams, then
writes anchors and probes.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Generator

import torch

from .host_seal import to_device
from .probe import write_params
from .streams import own_stream

# a worker's fit iterations for each step end, at most (None: as fast as it can queue them), so
# no step carries much of the fit's GPU time: unpaced, the ~100 iterations of a fit at batch 24
# (~0.5 ms of GPU each) ran beside two to four steps, each 1.5-2.6x the median on H100s. At 8 the
# fit of 32 layers still ends inside WORKER_LAG's 32 steps, so its job lands on the same step
# (docs/BENCHMARKS.md, twenty-eighth session). A job that must be committed now (wait) runs the
# rest at once.
FIT_PER_STEP: int | None = 8
TICK_WAIT = 0.05    # seconds a paced worker waits for a step end before it goes on as if one came


class RecalibrationJob:
    """A recalibration's results (anchors per sequence and layer, fitted probe parameters) until
    :meth:`commit` writes them, at a step boundary. Computed at once, by a worker thread on a side
    CUDA stream per device, or in slices between steps (:meth:`run`, ``background``): then
    :meth:`ready` says whether the work and the device finished, and :meth:`commit` waits for
    both (running the slices left)."""

    def __init__(self, reason: str, background: bool = False) -> None:
        self.reason = reason
        # committed later (at a step boundary, or when something would free what it reads)
        self.background = background
        self.anchors: list[tuple] = []                  # (sequences, layer, positions, scores (B, Hkv, A))
        self.fits: list[tuple[list, list[torch.Tensor]]] = []   # (probes, stacked parameters)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.events: list = []
        self.inputs: list = []
        self._worker: threading.Thread | None = None
        self._slices: Generator[int | None, None, None] | None = None    # the work not yet run
        self.left: int | None = None    # its slices left, as the work's last slice said (None: not said)
        self._error: BaseException | None = None
        self.threaded = False           # its work runs (or ran) on a worker thread
        self.reading = True             # its work left reads the host pool (a layer's scoring)
        self.ticks = 0                  # step ends seen (advance): a paced worker's allowance
        self._tick = threading.Event()  # set at a step end, and to hurry a paced worker (wait)
        self._hurry = False             # a paced worker runs the rest at once
        self.due = 0                    # the decode step from whose end it may be committed (the engine's)

    def stream_for(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream of ``device`` (CUDA), made to wait for what the current stream has
        queued until now (the job's inputs are copied there just before)."""
        if device.type != "cuda":
            return None
        stream = own_stream(device, "recalibration")
        stream.wait_stream(torch.cuda.current_stream(device))
        self.streams[device] = stream
        return stream

    @staticmethod
    def on(stream: torch.cuda.Stream | None):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def run(self, work: Generator[int | None, None, None], how: str) -> None:
        """Do ``work`` (slices that queue the job's device work, :meth:`Recalibrator._work
        <hi_sparse.recalibration.Recalibrator._work>`): "now"; on a worker "thread" (gradients off
        there too: the setting is per thread); or in "slices", :meth:`advance` running some after
        each step (a CPU's background job); then record where the side streams are."""
        self._slices = work
        if how == "slices":
            return
        if how == "now":                 # an error raised here, as it happens
            for _ in work:
                pass
            self._slices = None
            self._launched()
            return
        self.threaded = True
        self._worker = threading.Thread(target=self._on_worker, args=(FIT_PER_STEP,), name="hisparse-recalibration")
        self._worker.start()

    def _on_worker(self, per_step: int | None) -> None:
        """The worker: the scoring at once, then, with ``per_step``, the fit's iterations at most that
        many for each step end (:meth:`advance`) since it began, one more step's worth after
        TICK_WAIT without one (a decode that paused); all at once when :meth:`wait` hurries it."""
        ran, since = 0, None           # fit iterations run; the step ends seen when the fit began
        while per_step is not None and self._slices is not None and not self._hurry:
            if not self.reading:
                since = self.ticks if since is None else since
                if ran >= per_step * (self.ticks - since + 1):
                    self._tick.clear()     # then tested again: a step end in between set it
                    spent = ran >= per_step * (self.ticks - since + 1) and not self._hurry
                    if spent and not self._tick.wait(TICK_WAIT):
                        since -= 1
                    continue
                ran += 1
            self._to_the_end(0.0)          # one slice: a layer's scoring, or a fit iteration
        self._to_the_end()

    def _to_the_end(self, seconds: float = math.inf, steps_left: int | None = None) -> None:
        """Run the work's slices until it ends, or while ``seconds`` are not spent: at least one,
        and no more once the slowest so far would not fit in what is left; with ``steps_left``
        (the calls to this that are left, this one included) at least the slices left (as the
        work last said) over those calls, and all at the last. An error ends the work, raised by
        :meth:`wait` (in the thread that steps)."""
        t0, slowest, ran = time.perf_counter(), 0.0, 0
        must = self._share(steps_left)      # slices this call runs at least (None: once the work says)
        try:
            with torch.no_grad():
                while self._slices is not None:
                    t = time.perf_counter()
                    if must is None and ran:
                        must = ran + (self._share(steps_left) or 0)
                    if ran >= (must or 1) and slowest and t - t0 + slowest > seconds:
                        return
                    try:
                        left = next(self._slices)
                        self.left = left if isinstance(left, int) else None
                    except StopIteration:
                        self._slices, self.left = None, 0
                        self._launched()
                    ran += 1
                    slowest = max(slowest, time.perf_counter() - t)
        except Exception as exc:            # raised by wait, in the thread that steps
            self._slices, self._error = None, exc
        except BaseException as exc:        # an interrupt (in the thread that steps): the job is dropped
            self._slices, self._error = None, exc
            raise

    def _share(self, steps_left: int | None) -> float | None:
        """A call's share of the slices left over ``steps_left`` calls (all at the last; None while
        the work has not said how many are left)."""
        if steps_left is None:
            return 1
        if steps_left <= 1:
            return math.inf
        return None if self.left is None else math.ceil(self.left / steps_left)

    def advance(self, seconds: float, steps_left: int | None = None) -> None:
        """Run the work of a job in slices for about ``seconds`` (a decode step's worth, so that no
        step waits much longer than another), and at least its share of what is left when
        ``steps_left`` calls remain before it is due, unless a worker does it."""
        if self._worker is None:
            self._to_the_end(seconds, steps_left)
        else:
            self.ticks += 1
            self._tick.set()

    def release(self, seq_ids: set[int]) -> bool:
        """Before the blocks of sequences ``seq_ids`` are freed: a job in slices runs those that read
        the pool (each layer's scoring), forgets what it would write to those sequences' rows, and
        goes on (its fit, the long part, need not run in the step that frees them: a CPU's request
        that ends soon after its prefill would wait seconds for it). False, doing nothing, for a
        job that must be committed first: a worker's, or one that ended or failed."""
        while self._slices is not None and self._worker is None and self.reading:
            self._to_the_end(0.0)
        if self._slices is None or self._worker is not None:
            return False
        for j, (seqs, i, positions, scores) in enumerate(self.anchors):
            keep = [b for b, s in enumerate(seqs) if s.seq_id not in seq_ids]
            if len(keep) < len(seqs):
                at = to_device(torch.tensor(keep, dtype=torch.int64), positions.device)
                self.anchors[j] = ([seqs[b] for b in keep], i, positions[at], scores[at])
        return True

    def _launched(self) -> None:
        for stream in self.streams.values():
            event = torch.cuda.Event()
            event.record(stream)
            self.events.append(event)

    def ready(self) -> bool:
        """The work and the device finished the job (always, for one computed at once)."""
        if self._slices is not None or (self._worker is not None and self._worker.is_alive()):
            return False
        return all(e.query() for e in self.events)

    def wait(self) -> bool:
        """Until the worker (or the slices left) has queued everything; its error, if it failed,
        raised here. False (nothing to write) for a job whose slices an interrupt (Ctrl-C) broke
        off: that was raised where it happened."""
        if self._worker is not None:
            self._hurry = True
            self._tick.set()
            self._worker.join()
            self._worker = None
        self._to_the_end()
        if self._error is not None:
            error, self._error = self._error, None
            self.anchors, self.fits, self.inputs = [], [], []
            if not isinstance(error, Exception):
                return False
            raise RuntimeError(f"HiSparse: the {self.reason} recalibration failed in the background "
                               f"({type(error).__name__}: {error}); nothing of it was written") from error
        return True

    def commit(self) -> bool:
        """Write the anchors and probe parameters (after the worker and the side streams' work, in
        the current streams' order: steps after this read them). False when there was nothing
        to write (:meth:`wait`)."""
        if not self.wait():
            return False
        for device, stream in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
        _write_anchors(self.anchors)
        for probes, params in self.fits:
            write_params(probes, params)
        if self.streams:   # made on the side streams, read on the current ones: not reused before
            for t in [t for _, _, p, sc in self.anchors for t in (p, sc)] + [t for _, ps in self.fits for t in ps]:
                if t.is_cuda:
                    t.record_stream(torch.cuda.current_stream(t.device))
        self.anchors, self.fits, self.inputs = [], [], []
        return True


def _write_anchors(anchors: list) -> None:
    """Each layer's anchors (sequences, layer, positions, scores, in the banks' dtypes) into the
    sequences' bank rows: a layer whose sequences sit in consecutive rows (a batch's, unless some
    had no anchors to keep) as a slice, all such slices in one launch per kind and device (a
    commit of 32 layers made 64 index copies in its step); others by an index copy each."""
    made: dict[tuple, torch.Tensor] = {}                     # the rows of one batch, made once
    grouped: dict[tuple, tuple[list, list]] = {}
    for seqs, i, positions, scores in anchors:
        if not seqs:
            continue
        bank = seqs[0].banks[i].t
        first, n = seqs[0].row, len(seqs)
        if all(s.row == first + j for j, s in enumerate(seqs)):
            for name, src in (("anchors", positions), ("anchor_p", scores)):
                dst, srcs = grouped.setdefault((name, src.device, src.dtype), ([], []))
                dst.append(bank[name][first:first + n])
                srcs.append(src)
            continue
        at = (positions.device, *(s.row for s in seqs))
        rows = made.get(at)
        if rows is None:
            rows = made[at] = to_device(torch.tensor(at[1:], dtype=torch.int64), positions.device)
        bank["anchors"].index_copy_(0, rows, positions)
        bank["anchor_p"].index_copy_(0, rows, scores)
    for dst, srcs in grouped.values():
        torch._foreach_copy_(dst, srcs)
