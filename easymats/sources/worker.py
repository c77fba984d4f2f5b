"""Run one engine source in its own thread, so that no source can delay a sample of another.

The sampler never waits on an engine. At each tick it takes the result of the read it asked for
at the previous tick and asks for the next one (:meth:`EngineReader.read`). The worker thread
reads under a deadline below the interval, maps the answer through the tables and builds the
:class:`~easymats.segment.Snapshot` the agent's target consumes, so a healthy source gives exactly
one fresh snapshot per tick. A read that failed, or that has not finished when the next tick
comes, makes that tick's sample fail with the reason (the target goes ``up 0``); the other
targets' samples are untouched, and nothing stale is ever returned as a fresh sample.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, NamedTuple

from ..segment import SegmentError, Snapshot
from .base import Source, SourceError
from .maps import EngineMap, choose
from .translate import Family, Translation, translate


class Result(NamedTuple):
    snapshot: Snapshot | None
    translation: Translation | None
    emap: EngineMap | None
    error: str | None


class EngineReader:
    """The reader an engine target samples through: ``read()`` never blocks on the source."""

    def __init__(self, source: Source, *, name: str, pid: int, labels: dict[str, str], timeout_s: float,
                 start_ticks: int = 0, choose_map: Callable[[set[str]], EngineMap | None] = choose):
        self.source = source
        self.name = name
        self.pid = pid
        self.labels = labels
        self.timeout_s = timeout_s
        self.start_ticks = start_ticks
        self.choose_map = choose_map
        self.created_unix_ns = time.time_ns()
        self.current: Result | None = None  # the result of the last successful read()
        self.reads = 0  # reads the worker finished (ok or not)
        self._lock = threading.Lock()
        self._go = threading.Event()
        self._stop = False
        self._in_flight = True  # the first read is asked for at once
        self._result: Result | None = None
        self._taken: Result | None = None
        self._done = threading.Event()
        self._gen = 0
        self._layout: tuple | None = None
        self._map_cache: tuple[frozenset[str], EngineMap | None] | None = None
        self._translated: tuple[list[Family], Translation, EngineMap | None] | None = None
        self._thread = threading.Thread(target=self._loop, name=f"easymats-engine-{name}", daemon=True)
        self._go.set()
        self._thread.start()

    # -- the sampler's side ------------------------------------------------------------------------
    def read(self) -> Snapshot:
        """The snapshot of the read asked for at the previous call; asks for the next one.

        SegmentError when that read failed (kind "io") or has not finished ("busy"): the message is
        the reason, shown as the target's error, ``easymats_target_up`` 0.
        """
        with self._lock:
            result = self._result
            fresh = result is not None and result is not self._taken
            self._taken = result
            in_flight = self._in_flight
            if not in_flight and not self._stop:
                self._in_flight = True
                self._go.set()
        if result is None:
            raise SegmentError("busy", self.source.where, "waiting for the first answer")
        if not fresh:  # "busy": the next tick may well have it (doctor keeps sampling on busy)
            raise SegmentError("busy", self.source.where,
                               f"no answer within the {self.timeout_s * 1000:.0f} ms timeout (the read "
                               "is still running)" if in_flight else "no new answer since the last sample")
        if result.error is not None or result.snapshot is None:
            raise SegmentError("io", self.source.where, result.error or "no snapshot")
        self.current = result
        return result.snapshot

    # -- the rest of easymats.source.Source ---------------------------------------------------------
    path: str | None = None  # no file to read and no control file beside one: engines have no control channel

    def alive(self) -> bool:
        """The producer's liveness is the target's to judge (EngineTarget.alive checks its pid)."""
        return True

    def wait_first(self, timeout: float) -> bool:
        """Wait until the first read finished (or ``timeout``); True if it did."""
        return self._done.wait(timeout)

    def close(self) -> None:
        with self._lock:
            self._stop = True
        self._go.set()
        self._thread.join(timeout=max(1.0, 2 * self.timeout_s))
        try:
            self.source.close()
        except Exception:
            pass

    # -- the worker's side -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._go.wait()
            self._go.clear()
            if self._stop:
                return
            result = self._read_once()
            with self._lock:
                self._result = result
                self._in_flight = False
                self.reads += 1
            self._done.set()

    def _read_once(self) -> Result:
        t0 = time.monotonic()
        try:
            fams = self.source.fetch(t0 + self.timeout_s)
            emap, tr = self._translate(fams)
        except SourceError as exc:
            return Result(None, None, None, str(exc))
        except Exception as exc:  # a bug, or a source failing in a way nobody foresaw: say so
            return Result(None, None, None, f"internal error reading the source: {type(exc).__name__}: "
                          f"{exc}")
        now_mono = time.monotonic_ns()
        layout = tuple((s.name, tuple(sorted(s.labels.items()))) for s in tr.series)
        if layout != self._layout:
            self._layout = layout
            self._gen += 1
        seq = 2 * (self.reads + 1)
        snap = Snapshot(self.source.where, self.pid, self.name, dict(self.labels), self.start_ticks,
                        self.created_unix_ns, time.time_ns(), now_mono, seq, self._gen, tr.series)
        return Result(snap, tr, emap, None)

    def _translate(self, fams: list[Family]) -> tuple[EngineMap | None, Translation]:
        cached = self._translated
        if cached is not None and cached[0] is fams:
            return cached[2], cached[1]  # the source returned the same parse: the same mapping
        names = frozenset(s.name for f in fams for s in f.samples)
        mc = self._map_cache
        if mc is None or mc[0] != names:
            mc = self._map_cache = (names, self.choose_map(set(names)))
        tr = translate(mc[1], fams)
        self._translated = (fams, tr, mc[1])
        return mc[1], tr
