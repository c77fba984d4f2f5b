"""What a source gives the agent: snapshots of series, or an error that says why not.

The agent samples **sources**. A telemetry segment is one kind (:class:`easymats.segment_source.
SegmentSource`); any other kind (an HTTP endpoint, another runtime's files) implements
:class:`Source` and is sampled, exported, logged, bounded and judged up or down exactly the same
way by :class:`easymats.targets.Target`:

- ``read()`` returns one consistent :class:`Snapshot` or raises :class:`SourceError` (a short
  ``kind`` and a message that names the fix); it must return within a bounded time and should
  bound what it reads (``max_series``, ``max_value_bytes``: raise ``SourceError("over_budget",
  ...)`` beyond them);
- ``alive()`` says whether the producer still exists (a process: running, and not a new process
  that reused its pid); False ends the target ("down", process exited);
- ``name`` and ``labels`` identify it (the ``target`` label and easymats_target_info), known when
  it is opened; ``pid`` is the producing process (for process and GPU metrics; 0 when there is
  none), ``path`` what is read (file or URL; the control file sits beside a segment), and
  ``close()`` frees it.

A target is *up* while reads succeed and the snapshot's heartbeat moves (a source with no
heartbeat of its own reports the time of its read as ``heartbeat_mono_ns``). ``alive()`` is asked
only while the heartbeat stands still: a moving heartbeat proves the producer was alive moments
ago. Plug a source in with ``Agent.add_source(source)`` (tests/test_fault_agent.py has a
twenty-line example that is sampled, exported, failed and ended like a segment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol


class SourceError(Exception):
    """A sample that could not be taken. ``kind`` is a short word (``bad_layout``,
    ``over_budget``, ``io``, ...); the message says what is wrong and what to do."""

    kind = "error"


class Source(Protocol):
    # Read-only properties, so that a source may hold a narrower type (a segment's path is always
    # a str, an engine reader's always None) or a plain attribute.
    @property
    def path(self) -> str | None: ...

    @property
    def pid(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def labels(self) -> dict[str, str]: ...

    def read(self) -> "Snapshot": ...

    def alive(self) -> bool: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class Histogram:
    """A histogram's value in a snapshot. Not frozen: a read builds one per histogram series and
    a frozen dataclass takes twice as long to construct. Treat it as read-only."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]  # per bucket, not cumulative; the last is the +Inf bucket
    sum: float

    @property
    def count(self) -> float:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, float]]:
        out, acc = [], 0.0
        for bound, c in zip(self.bounds + (float("inf"),), self.counts):
            acc += c
            out.append((bound, acc))
        return out


class Series(NamedTuple):
    """One series of a snapshot. A NamedTuple, not a dataclass: a read builds one per series and
    a frozen dataclass costs ~1.5 us to construct against ~0.15 us for a tuple."""

    name: str
    type: str  # counter | gauge | histogram | info
    unit: str
    labels: dict[str, str]  # a fresh dict per snapshot: callers may keep or change it
    value: float | Histogram


class Snapshot:
    """One consistent read of a source (a segment, or any other kind).

    A source that has its series at hand passes them as ``series``. The segment reader instead
    passes the raw values and a ``builder``, and ``series`` is built on first access: the
    agent's sampler formats its log line and peaks straight from ``values`` (the raw values
    area, one float per 8-byte slot) and ``value_slots`` (per series: first slot and bucket
    count), so a sample that nobody inspects series by series costs no Series or Histogram
    objects. ``values`` and ``value_slots`` are None for a snapshot built from a series list.
    """

    __slots__ = ("path", "pid", "name", "labels", "start_ticks", "created_unix_ns", "heartbeat_unix_ns",
                 "heartbeat_mono_ns", "seq", "layout_generation", "retries", "values", "value_slots",
                 "_series", "_builder")
    _FIELDS = ("path", "pid", "name", "labels", "start_ticks", "created_unix_ns", "heartbeat_unix_ns",
               "heartbeat_mono_ns", "seq", "layout_generation", "series", "retries")

    def __init__(self, path: str, pid: int, name: str, labels: dict[str, str], start_ticks: int,
                 created_unix_ns: int, heartbeat_unix_ns: int, heartbeat_mono_ns: int, seq: int,
                 layout_generation: int, series: list[Series] | None = None, retries: int = 0,
                 builder: Callable[[tuple[float, ...]], list[Series]] | None = None):
        self.path = path
        self.pid = pid
        self.name = name
        self.labels = labels
        self.start_ticks = start_ticks
        self.created_unix_ns = created_unix_ns
        self.heartbeat_unix_ns = heartbeat_unix_ns
        self.heartbeat_mono_ns = heartbeat_mono_ns
        self.seq = seq
        self.layout_generation = layout_generation
        self.retries = retries
        self._series = series if series is not None or builder is not None else []
        self._builder = builder
        self.values: tuple[float, ...] | None = None
        self.value_slots: tuple[tuple[int, int], ...] | None = None

    @property
    def series(self) -> list[Series]:
        s = self._series
        if s is None:  # built from the raw values on first use (any thread: the result is the same)
            builder, values = self._builder, self.values
            assert builder is not None and values is not None, "a snapshot without series has a builder and values"
            s = self._series = builder(values)
        return s

    @series.setter
    def series(self, value: list[Series]) -> None:
        self._series = value

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self._FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaces

    def __repr__(self) -> str:
        return "Snapshot(" + ", ".join(f"{f}={getattr(self, f)!r}" for f in self._FIELDS) + ")"

    def get(self, name: str, **labels: str) -> float | Histogram | None:
        for s in self.series:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
        return None
