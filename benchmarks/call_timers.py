"""Host time spent in some methods of the engine during a benchmark run: each wrapped for the run
and restored after it (bench_prefill.py, stall_profile.py)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator


class CallTimers:
    """Seconds of each call of the wrapped methods, by label (``calls``), and their totals (``spent``)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.spans: dict[str, list[tuple[float, float]]] = defaultdict(list)   # (start, end), perf_counter

    def overlapping(self, t0: float, t1: float) -> list[str]:
        """The labels with a call that ran at some time in [t0, t1] (perf_counter seconds)."""
        return [label for label, spans in self.spans.items() if any(a < t1 and b > t0 for a, b in spans)]

    @property
    def spent(self) -> dict[str, float]:
        return {label: sum(times) for label, times in self.calls.items() if times}

    @contextlib.contextmanager
    def wrap(self, obj, name: str, label: str, sync: Callable[[], None] | None = None,
             elsewhere: str | None = None) -> Iterator[None]:
        """``obj.name`` timed under ``label`` until the context ends (``sync``: called before each
        call's end is read, to count the device work it queued; ``elsewhere``: the label of calls
        from another thread than the one that entered the context)."""
        fn = getattr(obj, name)
        here = threading.get_ident()

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if sync is not None:
                    sync()
                self._note(label if elsewhere is None or threading.get_ident() == here else elsewhere, t0)
        with self._replaced(obj, name, timed):
            yield

    @contextlib.contextmanager
    def wrap_slices(self, obj, name: str, label: str) -> Iterator[None]:
        """``obj.name``, a generator function (work in slices, each a ``next``), with each slice
        timed under ``label`` until the context ends."""
        fn = getattr(obj, name)

        def timed(*a, **kw):
            slices = fn(*a, **kw)
            while True:
                t0 = time.perf_counter()
                try:
                    next(slices)
                except StopIteration as end:
                    self._note(label, t0)
                    return end.value
                self._note(label, t0)
                yield
        with self._replaced(obj, name, timed):
            yield

    def _note(self, label: str, t0: float) -> None:
        t1 = time.perf_counter()
        self.calls[label].append(t1 - t0)
        self.spans[label].append((t0, t1))

    @staticmethod
    @contextlib.contextmanager
    def _replaced(obj, name: str, by) -> Iterator[None]:
        fn = getattr(obj, name)
        setattr(obj, name, by)
        try:
            yield
        finally:
            setattr(obj, name, fn)
