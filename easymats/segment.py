"""Reading telemetry segments: the agent's side of the contract (docs/segment.md).

Every way a segment file can be wrong ends in one exception, :class:`SegmentError`, whose
``kind`` says what is wrong and whose message says what to do. The reader never maps the file
(a file truncated under a mapping would kill the reader with SIGBUS); it reads with ``pread``
between two reads of the seqlock word and retries a bounded number of times.
"""

from __future__ import annotations

import glob
import math
import operator
import os
import stat
import struct
import time
from itertools import repeat
from typing import Callable, NamedTuple

from . import layout as L, procinfo

# Re-exported for the reader's callers: where segments live and the limits of a valid one are
# part of the contract (layout.py holds them for the writer, telemetry.py, and this reader alike),
# and the data model is shared with every other kind of source (source.py).
from .layout import (  # noqa: F401
    ENV_DIR,
    MAX_ENTRIES,
    MAX_ENTRY_BYTES,
    MAX_FILE_BYTES,
    MAX_HEADER_BYTES,
    control_path,
    segment_dir,
)
from .source import Histogram, Series, Snapshot, SourceError  # noqa: F401

# Retry pacing while the seq word is odd or moving: yield first, then short sleeps (~5 ms total).
_YIELD_RETRIES = 16
_RETRY_SLEEP_S = 100e-6
# Errors that a concurrent publish cannot cause: reported at once, never retried.
_ALWAYS_REAL = ("io", "empty", "truncated")

# Bound once: the read path runs every sample and these lookups show up in its profile.
_U64_UNPACK = L.U64.unpack
_U64_UNPACK_FROM = L.U64.unpack_from
_tuple_new = tuple.__new__
_dict_copy = dict.copy
_HISTOGRAM = L.TYPE_NAMES[L.TYPE_HISTOGRAM]


class SegmentError(SourceError):
    """A segment that cannot be read. ``kind`` is one of KINDS; the message names the fix."""

    KINDS = (
        "not_found", "empty", "truncated", "bad_magic", "byte_order", "future_version",
        "bad_layout", "symlink", "not_regular", "bad_owner", "bad_mode", "bad_directory",
        "dead_pid", "pid_reused", "busy", "io", "over_budget",
    )

    def __init__(self, kind: str, path: str, message: str):
        assert kind in self.KINDS, kind
        self.kind = kind
        self.path = path
        self.detail = message  # the message without the path, for callers that name it themselves
        super().__init__(f"{path}: {message}")


class SegmentBusy(SegmentError):
    """The writer kept publishing through every retry; try again at the next sample."""

    def __init__(self, path: str, retries: int):
        super().__init__("busy", path, f"segment busy: a publish was in progress on each of {retries} "
                         "reads; the sample is skipped (the next one will retry)")


def check_directory(path: str) -> None:
    """The directory must be a real directory owned by us and not group/world-writable."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SegmentError("not_found", path, "segment directory does not exist; no HiSparse "
                           f"process has published here (set {ENV_DIR} if the runtime uses another)") from None
    if stat.S_ISLNK(st.st_mode):
        raise SegmentError("bad_directory", path, "segment directory is a symbolic link; remove it "
                           "(the writer recreates it with mode 0700)")
    if not stat.S_ISDIR(st.st_mode):
        raise SegmentError("bad_directory", path, "segment directory is not a directory")
    if st.st_uid != os.geteuid():
        raise SegmentError("bad_directory", path, f"segment directory is owned by uid {st.st_uid}, "
                           f"not by you (uid {os.geteuid()}); run easymats as that user")
    if st.st_mode & 0o022:
        raise SegmentError("bad_directory", path, f"segment directory mode is {stat.S_IMODE(st.st_mode):04o}: "
                           "group or world can write it; chmod 700 it")


class _Layout(NamedTuple):
    """What a read needs from the entry table, parsed once per layout generation.

    Column lists (one item per entry) let a read build every Series in C-level map/zip calls:
    on a 64-series segment that halves the cost of a Python loop over entries.
    """

    key: tuple  # (layout generation, entry count, values offset, values used, entry size)
    values: struct.Struct  # unpacks the live span of the values area (slot 0 .. last slot in use)
    names: list[str]
    types: list[str]
    units: list[str]
    labels: list[dict[str, str]]
    scalars: Callable[[tuple], tuple]  # values -> one float per entry (histograms: a placeholder)
    histograms: list[tuple[int, int, int]]  # (entry index, first slot, bucket count)
    slots: tuple[tuple[int, int], ...]  # per entry: (first slot, bucket count)

    def build(self, values: tuple[float, ...]) -> list[Series]:
        """The Series list of one read, from its unpacked values."""
        series = list(map(_tuple_new, repeat(Series), zip(
            self.names, self.types, self.units, map(_dict_copy, self.labels), self.scalars(values))))
        for i, slot, b in self.histograms:
            hist = Histogram(values[slot:slot + b], values[slot + b:slot + 2 * b + 1], values[slot + 2 * b + 1])
            series[i] = series[i]._replace(value=hist)
        return series


def _scalar_getter(slots: list[int]) -> Callable[[tuple], tuple]:
    if len(slots) > 1:
        return operator.itemgetter(*slots)
    if slots:  # itemgetter of one index returns the item itself, not a 1-tuple
        only = slots[0]
        return lambda values: (values[only],)
    return lambda values: ()


class SegmentReader:
    """Reads one segment file repeatedly. Open once, call :meth:`read` per sample.

    A read is: seq word, header, (entry table when the layout generation changed), values, seq
    word again; equal and even means a consistent snapshot, else it retries (``max_retries``,
    then :class:`SegmentBusy`). A validation failure seen while the seq word moved is a torn read
    and is retried too; only a failure on a quiet segment is reported.
    """

    def __init__(self, path: str, *, max_retries: int = 64, check_writer: bool = True,
                 proc_root: str = procinfo.PROC_ROOT, max_series: int = L.MAX_ENTRIES,
                 max_value_bytes: int = L.MAX_FILE_BYTES):
        self.path = path
        self.max_retries = max_retries
        self.proc_root = proc_root
        # What one read may cost (a budget, not validity): more series, or live values spanning
        # more bytes, is "over_budget".
        self.max_series = max_series
        self.max_value_bytes = max_value_bytes
        self._fd = -1
        self._layout: _Layout | None = None
        self._refused: tuple[tuple, SegmentError] | None = None  # (layout key, over-budget error)
        self._checked_bounds: tuple[tuple, tuple] | None = None  # (layout key, histogram bounds)
        self._ident: tuple[bytes, bytes, str, dict[str, str]] | None = None
        self._valid_header: tuple[bytes, bytes] | None = None
        self._open()
        if check_writer:
            try:
                self.check_writer()
            except SegmentError:
                self.close()
                raise

    # -- opening and validation ----------------------------------------------------------------
    def _open(self) -> None:
        path = self.path
        check_directory(os.path.dirname(os.path.abspath(path)))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise SegmentError("not_found", path, "no such segment; the process may have exited") from None
        except OSError as exc:
            if os.path.islink(path):
                raise SegmentError("symlink", path, "segment is a symbolic link; refusing to follow it "
                                   "(remove it: segments are regular files)") from None
            raise SegmentError("io", path, f"cannot open segment: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SegmentError("not_regular", path, "segment is not a regular file")
            # Even root refuses another user's file: a segment is trusted input only from its owner.
            if st.st_uid != os.geteuid():
                raise SegmentError("bad_owner", path, f"segment is owned by uid {st.st_uid}, not by you "
                                   f"(uid {os.geteuid()}); run easymats as the runtime's user")
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise SegmentError("bad_mode", path, f"segment mode is {stat.S_IMODE(st.st_mode):04o}; "
                                   "segments must be 0600 (owner only): the writer is not a conforming one")
        except SegmentError:
            os.close(fd)
            raise
        self._fd = fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SegmentReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _pread(self, size: int, offset: int) -> bytes:
        try:
            data = os.pread(self._fd, size, offset)
        except OSError as exc:
            raise SegmentError("io", self.path, f"read failed: {exc.strerror}") from None
        if len(data) != size:
            if offset == 0 and not data:
                raise SegmentError("empty", self.path, "segment is empty: the writer has not "
                                   "initialised it (or crashed while creating it); remove it")
            raise SegmentError("truncated", self.path, f"segment truncated: needed {size} bytes at offset "
                               f"{offset}, file has {offset + len(data)}")
        return data

    def _seq(self) -> int:
        return _U64_UNPACK(self._pread(8, L.OFF_SEQ))[0]

    def _header(self, raw: bytes | None = None) -> tuple:
        """The header (read now, or ``raw``) as a tuple of HEADER_STRUCT's fields, validated."""
        if raw is None:
            raw = self._pread(L.HEADER_SIZE, 0)
        h = L.HEADER_STRUCT.unpack_from(raw)
        # The structural fields (magic..boot id, layout generation..values capacity) change only
        # with the layout: validate them once per distinct value, not on every read.
        key = (raw[:L.OFF_SEQ], raw[L.OFF_LAYOUT_GENERATION:L.OFF_NAME])
        if key != self._valid_header:
            self._validate_header(raw, h)
            self._valid_header = key
        return h

    def _validate_header(self, raw: bytes, h: tuple) -> None:
        if raw[:8] != L.SEGMENT_MAGIC:
            raise SegmentError("bad_magic", self.path, f"not an easymats segment (magic {raw[:8]!r}); "
                               "only files written by an easymats segment writer belong here")
        (_, major, minor, bom, hdr_size, entry_size, pid, start, boot, seq, hb_unix, hb_mono, gen,
         count, capacity, table_off, values_off, values_used, values_cap, name, labels, created) = h
        if bom != L.BYTE_ORDER_MARK:
            raise SegmentError("byte_order", self.path, f"byte-order mark {bom:#x}: segment was written "
                               "big-endian or is corrupt; version 1 segments are little-endian")
        if major != L.MAJOR:
            raise SegmentError("future_version", self.path, f"segment version {major}.{minor}; this easymats "
                               f"reads {L.MAJOR}.x: upgrade easymats" if major > L.MAJOR else
                               f"segment version {major}.{minor} is not supported (this easymats reads "
                               f"{L.MAJOR}.x); upgrade the runtime's segment writer")
        if not (L.HEADER_SIZE <= hdr_size <= MAX_HEADER_BYTES and hdr_size % 8 == 0):
            raise SegmentError("bad_layout", self.path, f"header size {hdr_size} out of range "
                               f"({L.HEADER_SIZE}..{MAX_HEADER_BYTES}, a multiple of 8)")
        if not (L.ENTRY_SIZE <= entry_size <= MAX_ENTRY_BYTES and entry_size % 8 == 0):
            raise SegmentError("bad_layout", self.path, f"entry size {entry_size} out of range "
                               f"({L.ENTRY_SIZE}..{MAX_ENTRY_BYTES}, a multiple of 8)")
        if not (0 <= count <= capacity <= MAX_ENTRIES):
            raise SegmentError("bad_layout", self.path, f"entry count {count} / capacity {capacity} out of "
                               f"range (count <= capacity <= {MAX_ENTRIES})")
        table_end = table_off + capacity * entry_size
        if table_off < hdr_size or table_off % 8 or values_off < table_end or values_off % 8:
            raise SegmentError("bad_layout", self.path, f"entry table at {table_off} / values at {values_off} "
                               "overlap the header or each other, or are not 8-byte aligned")
        if values_used > values_cap or values_used % 8 or values_off + values_cap > MAX_FILE_BYTES:
            raise SegmentError("bad_layout", self.path, f"values area {values_used} of {values_cap} bytes at "
                               f"{values_off} out of range (used <= capacity, multiple of 8, file <= "
                               f"{MAX_FILE_BYTES} bytes)")
        if pid <= 0:
            raise SegmentError("bad_layout", self.path, f"writer pid {pid} is not a pid")

    def identity(self) -> tuple[int, int, str, dict[str, str]]:
        """(writer pid, start ticks, name, labels) from the header, validated: all of them are
        written once, before the first publish, so no seqlock is needed to read them."""
        h = self._header()
        name, labels = self._identity(h[19], h[20])
        return h[6], h[7], name, dict(labels)

    def check_writer(self) -> None:
        """Raise SegmentError(dead_pid | pid_reused) unless the writing process is still alive."""
        h = self._header()
        pid, start, boot = h[6], h[7], h[8]
        if boot != bytes(16) and boot != procinfo.boot_id(self.proc_root):
            raise SegmentError("dead_pid", self.path, f"segment of pid {pid} is from an earlier boot; "
                               "it is stale: remove it (easymats ls --clean)")
        found = procinfo.stat_state(f"{self.proc_root}/{pid}/stat")
        if found is None or found[0] in (b"Z", b"X", b"x"):  # a zombie has exited too
            raise SegmentError("dead_pid", self.path, f"writer pid {pid} is not running: the segment is "
                               "stale (the process crashed); remove it (easymats ls --clean)")
        now_start = found[1]
        if start and now_start != start:
            raise SegmentError("pid_reused", self.path, f"pid {pid} now belongs to another process (start "
                               f"time {now_start} != {start}): the segment is stale; remove it")

    def _layout_for(self, h: tuple) -> _Layout:
        entry_size, gen, count, table_off, values_off, values_used = h[5], h[12], h[13], h[15], h[16], h[17]
        key = (gen, count, values_off, values_used, entry_size)
        if self._layout is not None and self._layout.key == key:
            return self._layout
        if self._refused is not None and self._refused[0] == key:
            raise self._refused[1]  # over budget: not worth parsing the table again every sample
        if count > self.max_series:
            self._refuse(key, f"{count} series; easymats samples at most {self.max_series} per target")
        raw = self._pread(count * entry_size, table_off) if count else b""
        entries = []
        seen: dict[tuple, int] = {}
        slots_total = values_used // 8
        span = 0  # slots from the start of the values area to the end of the last one in use
        for i in range(count):
            type_code, _, buckets, _, value_off, name_b, labels_b, unit_b = L.ENTRY_STRUCT.unpack_from(
                raw, i * entry_size)
            where = f"entry {i}"
            if type_code not in L.TYPE_NAMES:
                raise SegmentError("bad_layout", self.path, f"{where}: unknown type code {type_code}")
            if buckets > L.MAX_BUCKETS or (buckets and type_code != L.TYPE_HISTOGRAM):
                raise SegmentError("bad_layout", self.path, f"{where}: bucket count {buckets} out of range")
            rel = value_off - values_off
            n_slots = L.value_slots(type_code, buckets)
            if rel < 0 or rel % 8 or rel // 8 + n_slots > slots_total:
                raise SegmentError("bad_layout", self.path, f"{where}: value offset {value_off} lies outside "
                                   "the used values area")
            try:
                name = L.decode_text(name_b)
                unit = L.decode_text(unit_b)
                labels = L.decode_labels(labels_b)
            except (UnicodeDecodeError, ValueError) as exc:
                raise SegmentError("bad_layout", self.path, f"{where}: undecodable name or labels ({exc})") from None
            if not L.METRIC_NAME_RE.match(name):
                raise SegmentError("bad_layout", self.path, f"{where}: {name!r} is not a metric name")
            if type_code == L.TYPE_HISTOGRAM and "le" in labels:
                raise SegmentError("bad_layout", self.path, f"{where}: histogram {name} has an 'le' label, "
                                   "which its buckets need for themselves")
            series_key = (name, tuple(sorted(labels.items())))
            if series_key in seen:
                raise SegmentError("bad_layout", self.path, f"{where}: {name}{labels or ''} is a duplicate "
                                   f"of entry {seen[series_key]}; a series appears once")
            seen[series_key] = i
            span = max(span, rel // 8 + n_slots)
            entries.append((name, L.TYPE_NAMES[type_code], unit, labels, rel // 8, buckets))
        if span * 8 > self.max_value_bytes:
            self._refuse(key, f"its {count} series span {span * 8} bytes of values; easymats reads at most "
                         f"{self.max_value_bytes} per target and sample")
        layout = _Layout(key, struct.Struct(f"<{span}d"), [e[0] for e in entries],
                         [e[1] for e in entries], [e[2] for e in entries], [e[3] for e in entries],
                         _scalar_getter([e[4] for e in entries]),
                         [(i, e[4], e[5]) for i, e in enumerate(entries) if e[1] is _HISTOGRAM],
                         tuple((e[4], e[5]) for e in entries))
        return layout  # read() caches it once the seq word proves the table was not torn

    def _refuse(self, key: tuple, what: str) -> None:
        err = SegmentError("over_budget", self.path, f"over budget: {what} (a HiSparse runtime publishes "
                           "about a hundred series in a few KiB: is this a runaway or foreign writer?)")
        self._refused = (key, err)
        raise err

    def _check_histograms(self, layout: _Layout, values: tuple[float, ...]) -> None:
        """Bounds finite and strictly ascending (checked once per distinct bounds), counts >= 0."""
        hists = layout.histograms
        if not hists:
            return
        bounds = tuple(values[s:s + b] for _, s, b in hists)
        checked = self._checked_bounds
        if checked is None or checked[0] != layout.key or checked[1] != bounds:
            for (i, _, _), bb in zip(hists, bounds):
                if not all(math.isfinite(x) for x in bb) or any(x >= y for x, y in zip(bb, bb[1:])):
                    raise SegmentError("bad_layout", self.path, f"entry {i}: histogram {layout.names[i]} has "
                                       f"bounds {list(bb)}: they must be finite and strictly ascending "
                                       "(+Inf is the implicit last bucket)")
            self._checked_bounds = (layout.key, bounds)
        for i, s, b in hists:
            counts = values[s + b:s + 2 * b + 1]
            if min(counts) < 0.0 or not math.isfinite(sum(counts)):
                raise SegmentError("bad_layout", self.path, f"entry {i}: histogram {layout.names[i]} has bucket "
                                   f"counts {list(counts)}: a count is never negative, NaN or infinite")

    def _identity(self, name_b: bytes, labels_b: bytes) -> tuple[str, dict[str, str]]:
        """The segment's name and labels, decoded once (they never change for one writer)."""
        ident = self._ident
        if ident is None or ident[0] != name_b or ident[1] != labels_b:
            try:
                ident = (name_b, labels_b, L.decode_text(name_b), L.decode_labels(labels_b))
            except (UnicodeDecodeError, ValueError) as exc:
                raise SegmentError("bad_layout", self.path,
                                   f"undecodable segment name or labels ({exc})") from None
            self._ident = ident
        return ident[2], ident[3]

    def read(self) -> Snapshot:
        """One consistent snapshot; SegmentBusy after ``max_retries`` torn reads."""
        if self._fd < 0:
            raise SegmentError("io", self.path, "reader is closed")
        for attempt in range(self.max_retries + 1):
            if attempt:
                # Let a writer that was preempted mid-publish finish: yield first; if it stays
                # busy (a loaded machine), sleep 100 us a try, bounding a read to ~5 ms in all.
                if attempt <= _YIELD_RETRIES:
                    os.sched_yield()
                else:
                    time.sleep(_RETRY_SLEEP_S)
            # The header holds the seq word: one pread gives both (then values, then seq again).
            # Everything before the seq word is fixed at creation and everything after it is
            # copied after it, so this is the seqlock's "seq, then data" order in one syscall.
            try:
                raw_h = os.pread(self._fd, L.HEADER_SIZE, 0)
            except OSError as exc:
                raise SegmentError("io", self.path, f"read failed: {exc.strerror}") from None
            if len(raw_h) != L.HEADER_SIZE:
                self._seq()  # a short file: the same errors as a seq-word read first
                raw_h = self._pread(L.HEADER_SIZE, 0)
            seq = _U64_UNPACK_FROM(raw_h, L.OFF_SEQ)[0]
            if seq & 1:
                continue
            try:
                h = self._header(raw_h)
                layout = self._layout_for(h)
                name, labels = self._identity(h[19], h[20])
                span = layout.values.size  # only the live series: not all of a declared area
                raw = self._pread(span, h[16]) if span else b""
            except SegmentError as exc:
                # Fields read while a writer changed them can look invalid: only a failure on a
                # quiet segment (seq unchanged) is real. I/O errors and truncation are always real.
                if exc.kind not in _ALWAYS_REAL and self._seq() != seq:
                    continue
                raise
            if self._seq() != seq:
                continue
            self._layout = layout
            values = layout.values.unpack(raw)
            self._check_histograms(layout, values)
            snap = Snapshot(self.path, h[6], name, dict(labels), h[7], h[21], h[10], h[11], seq, h[12],
                            None, attempt, layout.build)  # series built from values on first use
            snap.values = values
            snap.value_slots = layout.slots
            return snap
        raise SegmentBusy(self.path, self.max_retries)


def read_segment(path: str, *, check_writer: bool = True) -> Snapshot:
    """Open, read one snapshot and close."""
    with SegmentReader(path, check_writer=check_writer) as r:
        return r.read()


def segment_paths(directory: str | None = None) -> list[str]:
    """Every ``*.seg`` file in the segment directory (no validation)."""
    d = directory or segment_dir()
    return sorted(glob.glob(os.path.join(glob.escape(d), "*.seg")))


def pid_of_path(path: str) -> int | None:
    """The pid a segment file name claims: ``<pid>.seg`` or ``<pid>.<n>.seg``."""
    base = os.path.basename(path)
    head = base.split(".", 1)[0]
    return int(head) if head.isdigit() else None


def segments_for_pid(pid: int, directory: str | None = None) -> list[str]:
    return [p for p in segment_paths(directory) if pid_of_path(p) == pid]


def require_segments(pid: int, directory: str | None = None) -> list[str]:
    """Segment paths of the running process ``pid``; SegmentError naming the fix when it has none.

    kind "dead_pid": no process with that pid; kind "not_found": the process publishes no segment
    in the directory searched.
    """
    d = directory or segment_dir()
    paths = segments_for_pid(pid, d)
    if paths:
        return paths
    if not procinfo.pid_exists(pid):
        raise SegmentError("dead_pid", d, f"no process with pid {pid}: give the pid of a running "
                           "HiSparse process ('easymats ls' lists them)")
    raise SegmentError("not_found", d, f"pid {pid} has no telemetry segment in {d}: is it a HiSparse "
                       "process with telemetry on? If it publishes elsewhere, set "
                       f"{ENV_DIR} to that directory ('easymats ls' lists segments)")


