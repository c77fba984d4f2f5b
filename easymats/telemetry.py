"""The telemetry writer: what a runtime uses to publish its counters (docs/segment.md).

    from easymats import telemetry
    seg = telemetry.open_segment(name="decode-0", labels={"model": "llama-8b"})
    seg.counter("hisparse_hot_buffer_hits_total").inc(5)
    seg.gauge("hisparse_kv_blocks", state="active").set(12)
    seg.histogram("hisparse_quant_block_relative_error").observe(0.01)
    seg.publish()                 # one consistent snapshot under the seqlock
    req = seg.poll_control()      # None, or a ControlRequest(id, action, reason); then seg.ack(req)
    seg.close()                   # removes the segment and control file

Updates (``inc``, ``set``, ``observe``) touch only Python objects; ``publish`` copies every value
into the shared segment in one write under a seqlock. A segment nobody published for
:data:`IDLE_BEAT_S` is published by a background thread (the contract's "at least once a second
while idle", so that an agent can tell an idle process from a hung one). The writer never breaks
its host program: if the segment cannot be created it warns once and carries on as a no-op
publisher.
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import stat
import struct
import threading
import time
import warnings
from typing import Any, Mapping, Sequence

from . import catalogue, layout as L, procinfo
from .control import ControlFile, ControlRequest
from .layout import ENV_DIR, MAX_ENTRIES, MAX_FILE_BYTES, control_path, segment_dir

__all__ = ["open_segment", "Segment", "Counter", "Gauge", "Histogram", "ControlRequest",
           "ControlFile", "TelemetryWarning"]

DEFAULT_CAPACITY = 512
DEFAULT_VALUE_SLOTS = 8192
IDLE_BEAT_S = 0.5  # a segment not published this long is published by the beat thread


class TelemetryWarning(RuntimeWarning):
    """The segment could not be created or written; metrics keep working in memory only."""


class Counter:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0.0:  # a float literal keeps CPython's float-compare fast path
            raise ValueError(f"a counter only goes up; got inc({amount})")
        self.value += amount


class Gauge:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def set(self, value: float) -> None:
        self.value = float(value)

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0.0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = 0
        for b in self.bounds:  # at most ~15 bounds: a linear scan beats bisect's call overhead
            if value <= b:
                break
            i += 1
        self.counts[i] += 1.0
        self.sum += value

    def observe_counts(self, counts: Sequence[float], total: float) -> None:
        """Many observations at once, already bucketed: counts[i] of them in bucket i (as
        :meth:`observe` places a value: the first bound it is <= to; the last bucket past every
        bound), ``total`` their sum."""
        if len(counts) != len(self.counts):
            raise ValueError(f"{len(counts)} bucket counts for a histogram of {len(self.counts)} buckets "
                             f"({len(self.bounds)} bounds and the one past them)")
        for i, c in enumerate(counts):
            self.counts[i] += float(c)
        self.sum += total


def _write_at(mm: mmap.mmap, offset: int, data: bytes) -> None:
    mm[offset:offset + len(data)] = data


class Segment:
    """A process's telemetry segment. Create with :func:`open_segment`."""

    def __init__(self, name: str, labels: Mapping[str, str] | None, directory: str | None,
                 capacity: int, value_slots: int):
        self.name = name
        self.labels = dict(labels or {})
        self.path: str | None = None
        self.control: ControlFile | None = None
        self._pid = os.getpid()
        # Reentrant: a publish that fails tears the segment down while holding it.
        self._lock = threading.RLock()
        self._series: dict[tuple, Counter | Gauge | Histogram] = {}
        self._order: list[tuple[str, Counter | Gauge | Histogram]] = []  # (type, metric) in value-slot order
        self._capacity = capacity
        self._slots_capacity = value_slots
        self._slots_used = 0
        self._mm: mmap.mmap | None = None
        self._fd = -1
        self._seq = 0
        self._generation = 0
        self._pack: struct.Struct | None = None
        self._warned = False
        self._next_control_poll = 0.0
        self._last_publish = time.monotonic()
        name_b = name.encode("utf-8")
        if len(name_b) > L.NAME_FIELD or not name:
            raise ValueError(f"segment name {name!r} must be 1..{L.NAME_FIELD} bytes of UTF-8")
        size = L.HEADER_SIZE + capacity * L.ENTRY_SIZE + value_slots * 8
        if not (1 <= capacity <= MAX_ENTRIES and value_slots >= 1 and size <= MAX_FILE_BYTES):
            raise ValueError(f"capacity={capacity}, value_slots={value_slots}: need 1..{MAX_ENTRIES} "
                             f"entries, >= 1 value slot and a file of at most {MAX_FILE_BYTES} bytes "
                             f"(this would be {size})")
        self._labels_raw = L.encode_labels({k: str(v) for k, v in self.labels.items()}, L.LABELS_FIELD)
        try:
            self._create(directory or segment_dir())
        except OSError as exc:
            self._disable(f"cannot create telemetry segment in {directory or segment_dir()}: "
                          f"{exc.strerror or exc}; metrics stay in memory only (set {ENV_DIR} to a "
                          "writable tmpfs directory to publish)")

    # -- creation ------------------------------------------------------------------------------
    def _create(self, directory: str) -> None:
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(directory)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise OSError(0, f"{directory} is not a real directory")
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise OSError(0, f"{directory} must be owned by uid {os.geteuid()} with mode 0700 "
                          f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
        pid = self._pid
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for n in range(64):
            path = os.path.join(directory, f"{pid}.seg" if n == 0 else f"{pid}.{n}.seg")
            try:
                fd = os.open(path, flags, 0o600)
                break
            except FileExistsError:
                if _stale_own_file(path):
                    try:
                        os.unlink(path)
                        os.unlink(control_path(path))
                    except FileNotFoundError:
                        pass
                    fd = os.open(path, flags, 0o600)
                    break
        else:
            raise OSError(0, f"64 segments already open for pid {pid}")
        try:
            os.fchmod(fd, 0o600)  # the umask may have taken bits away; never adds any
            values_off = L.HEADER_SIZE + self._capacity * L.ENTRY_SIZE
            size = values_off + self._slots_capacity * 8
            os.ftruncate(fd, size)
            # Reserve every page now: a write through the mapping into a hole of a full tmpfs
            # raises SIGBUS and kills the host; here it is an ENOSPC we can turn into a warning.
            _allocate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        now = time.time_ns()
        header = L.HEADER_STRUCT.pack(
            L.SEGMENT_MAGIC, L.MAJOR, L.MINOR, L.BYTE_ORDER_MARK, L.HEADER_SIZE, L.ENTRY_SIZE, pid,
            procinfo.start_ticks(pid) or 0, procinfo.boot_id(), 0, now, time.monotonic_ns(), 0,
            0, self._capacity, L.HEADER_SIZE, values_off, 0, self._slots_capacity * 8,
            self.name.encode("utf-8"), self._labels_raw, now)
        _write_at(mm, 0, header)
        self._mm, self._fd, self.path = mm, fd, path
        self._values_off = values_off
        self.control = ControlFile.create(control_path(path))
        _LIVE.add(self)
        _start_beat()

    def _disable(self, why: str) -> None:
        if not self._warned:
            warnings.warn(why, TelemetryWarning, stacklevel=3)
            self._warned = True
        self._teardown(unlink=True)

    @property
    def enabled(self) -> bool:
        """True while the segment is published to shared memory."""
        return self._mm is not None

    # -- series --------------------------------------------------------------------------------
    def _series_for(self, name: str, type_: str, labels: dict[str, str]) -> Any:
        """The Counter, Gauge or Histogram (as ``type_`` says) of these labels; the public
        :meth:`counter`, :meth:`gauge` and :meth:`histogram` give it its precise type."""
        key = (name, tuple(sorted(labels.items())))
        metric = self._series.get(key)
        if metric is not None:
            return metric
        spec = catalogue.get(name)
        if spec.type != type_:
            raise catalogue.UnknownMetricError(f"metric {name} is a {spec.type} in the catalogue, "
                                               f"not a {type_}: use seg.{spec.type}({name!r}, ...)")
        labels = {k: str(v) for k, v in labels.items()}
        catalogue.check_labels(spec, labels)
        if type_ == catalogue.HISTOGRAM:
            metric = Histogram(spec.buckets)
        elif type_ == catalogue.COUNTER:
            metric = Counter()
        else:
            metric = Gauge()
        with self._lock:
            existing = self._series.get(key)  # another thread may have created it meanwhile
            if existing is not None:
                return existing
            self._add_entry(spec, labels, metric)
            self._series[key] = metric
        return metric

    def _add_entry(self, spec: catalogue.MetricSpec, labels: dict[str, str],
                   metric: Counter | Gauge | Histogram) -> None:
        type_code = L.TYPE_CODES[spec.type]
        n_buckets = len(spec.buckets) if spec.type == catalogue.HISTOGRAM else 0
        slots = L.value_slots(type_code, n_buckets)
        index = len(self._order)
        if index >= self._capacity or self._slots_used + slots > self._slots_capacity:
            raise RuntimeError(f"telemetry segment is full ({self._capacity} series); open it with a "
                               "larger capacity: telemetry.open_segment(..., capacity=N)")
        slot = self._slots_used
        self._order.append((spec.type, metric))
        self._slots_used += slots
        self._pack = None
        if self._mm is None:
            return
        entry = L.ENTRY_STRUCT.pack(type_code, 0, n_buckets, 0, self._values_off + slot * 8,
                                    spec.name.encode(), L.encode_labels(labels, L.ENTRY_LABELS_FIELD),
                                    spec.unit.encode())
        mm = self._mm
        self._begin(mm)
        _write_at(mm, L.HEADER_SIZE + index * L.ENTRY_SIZE, entry)
        if n_buckets:
            _write_at(mm, self._values_off + slot * 8, struct.pack(f"<{n_buckets}d", *spec.buckets))
        self._generation += 1
        _write_at(mm, L.OFF_LAYOUT_GENERATION, L.U64.pack(self._generation))
        _write_at(mm, L.OFF_ENTRY_COUNT, L.U32.pack(index + 1))
        _write_at(mm, L.OFF_VALUES_USED, L.U64.pack(self._slots_used * 8))
        self._end(mm)

    def counter(self, name: str, **labels: str) -> Counter:
        return self._series_for(name, catalogue.COUNTER, labels)

    def gauge(self, name: str, **labels: str) -> Gauge:
        return self._series_for(name, catalogue.GAUGE, labels)

    def histogram(self, name: str, **labels: str) -> Histogram:
        return self._series_for(name, catalogue.HISTOGRAM, labels)

    def info(self, name: str, **labels: str) -> None:
        """Set an info metric (value 1) with these labels."""
        self._series_for(name, catalogue.INFO, labels).set(1.0)

    # -- publishing ----------------------------------------------------------------------------
    def _begin(self, mm: mmap.mmap) -> None:
        self._seq += 1  # odd: a write is in progress
        _write_at(mm, L.OFF_SEQ, L.U64.pack(self._seq))

    def _end(self, mm: mmap.mmap) -> None:
        self._seq += 1
        _write_at(mm, L.OFF_SEQ, L.U64.pack(self._seq))

    def publish(self) -> None:
        """Copy every value into the segment as one consistent snapshot and beat the heartbeat."""
        if self._mm is None or os.getpid() != self._pid:
            return
        with self._lock:
            mm = self._mm
            if mm is None:  # closed meanwhile (by the host, or the beat thread's failed publish)
                return
            vals: list[float] = []
            append, extend = vals.append, vals.extend
            for _, m in self._order:
                if isinstance(m, Histogram):
                    extend(m.bounds)
                    extend(m.counts)
                    append(m.sum)
                else:
                    append(m.value)
            if self._pack is None:
                self._pack = struct.Struct(f"<{len(vals)}d")
            self._last_publish = time.monotonic()
            try:
                self._begin(mm)
                # Written in place while seq is odd: a reader that overlaps discards what it read.
                self._pack.pack_into(mm, self._values_off, *vals)
                mm[L.OFF_HEARTBEAT_UNIX_NS:L.OFF_HEARTBEAT_MONO_NS + 8] = struct.pack(
                    "<QQ", time.time_ns(), time.monotonic_ns())
                self._end(mm)
            except (ValueError, OSError, BufferError) as exc:  # e.g. a map closed under us
                self._disable(f"telemetry segment {self.path} could not be written ({exc}); "
                              "metrics stay in memory only")

    # -- control -------------------------------------------------------------------------------
    def poll_control(self, min_interval_s: float = 0.0) -> ControlRequest | None:
        """The pending control request, if any. Cheap; ``min_interval_s`` rate-limits the reads."""
        if self.control is None or os.getpid() != self._pid:
            return None
        if min_interval_s:
            now = time.monotonic()
            if now < self._next_control_poll:
                return None
            self._next_control_poll = now + min_interval_s
        return self.control.pending()

    def ack(self, request: ControlRequest, status: int = 0) -> None:
        if self.control is not None:
            self.control.ack(request, status)

    # -- teardown ------------------------------------------------------------------------------
    def _teardown(self, unlink: bool) -> None:
        mm, fd, path = self._mm, self._fd, self.path
        self._mm, self._fd = None, -1
        if self.control is not None:
            self.control.close(unlink=unlink)
            self.control = None
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass
        if fd >= 0:
            os.close(fd)
        if unlink and path and os.getpid() == self._pid:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        _LIVE.discard(self)

    def close(self) -> None:
        """Publish a last time, then remove the segment and its control file."""
        if self._mm is not None:
            self.publish()
        with self._lock:  # not while the beat thread publishes into the mapping
            self._teardown(unlink=True)

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _allocate(fd: int, size: int) -> None:
    """Allocate ``size`` bytes of ``fd`` (ENOSPC/EFBIG now rather than SIGBUS later)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        # A file system without fallocate: touch every page with a real write instead.
        zeros = bytes(mmap.PAGESIZE)
        for off in range(0, size, mmap.PAGESIZE):
            os.pwrite(fd, zeros[:min(mmap.PAGESIZE, size - off)], off)


def _stale_own_file(path: str) -> bool:
    """A file named with our pid that an earlier process with the same pid left behind.

    Anything that is not our own live segment (a crashed run's file, garbage, a planted link) is
    stale and may be replaced; the caller then unlinks the name, which never follows a link.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        h = L.HEADER_STRUCT.unpack(os.pread(fd, L.HEADER_STRUCT.size, 0))
    except (OSError, struct.error):
        return True
    finally:
        os.close(fd)
    me = os.getpid()
    return h[6] != me or h[7] != (procinfo.start_ticks(me) or 0) or h[8] != procinfo.boot_id()


# Strong references: a segment stays published until close() or exit, even if the program
# dropped its handle (``open_segment(...).counter(...)``), and atexit still removes its files.
_LIVE: "set[Segment]" = set()


_beat_pid = 0  # the process whose beat thread runs (a forked child starts its own)


def _start_beat() -> None:
    global _beat_pid
    if _beat_pid == os.getpid():
        return
    _beat_pid = os.getpid()
    threading.Thread(target=_beat, name="easymats-telemetry-beat", daemon=True).start()


def _beat() -> None:
    """Publish every live segment of this process that went :data:`IDLE_BEAT_S` without one.

    An idle runtime (no decode steps, so no publish calls) then still moves its heartbeat. A
    process stopped or hung hard enough to stall this thread (SIGSTOP, a GIL held in C) does not."""
    me = os.getpid()
    while _beat_pid == me:
        time.sleep(IDLE_BEAT_S)
        now = time.monotonic()
        for seg in list(_LIVE):
            try:
                if now - seg._last_publish >= IDLE_BEAT_S:
                    seg.publish()
            except Exception:  # never fail the host program (e.g. during interpreter shutdown)
                pass


@atexit.register
def _close_all() -> None:
    for seg in list(_LIVE):
        try:
            seg.close()
        except Exception:  # never fail the host program's exit
            pass


def _after_fork_in_child() -> None:
    # The child inherits the parent's mapping: it must never publish into the parent's segment
    # (nor remove it at exit). Its metrics keep working in memory; it may open its own segment.
    for seg in list(_LIVE):
        seg._mm = None
        seg.control = None
        seg._lock = threading.RLock()  # another thread may have held it at the fork
    _LIVE.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_segment(name: str, labels: Mapping[str, str] | None = None, *, directory: str | None = None,
                 capacity: int = DEFAULT_CAPACITY, value_slots: int = DEFAULT_VALUE_SLOTS) -> Segment:
    """Create this process's telemetry segment in the segment directory.

    ``name`` is the target name the agent exports (e.g. "decode-0"); ``labels`` are constant
    labels describing the process. Never raises for I/O problems: see :class:`TelemetryWarning`.
    """
    return Segment(name, labels, directory, capacity, value_slots)
