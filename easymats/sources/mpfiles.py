"""prometheus_client's multiprocess files, read read-only and torn-read safe (SGLang by PID).

SGLang always runs prometheus_client in multiprocess mode: every process of the server (the
tokenizer manager, one scheduler per rank, the detokenizer) keeps its metric values in files
``counter_<pid>.db``, ``gauge_<mode>_<pid>.db``, ``histogram_<pid>.db`` and ``summary_<pid>.db``
in one directory, each mapped into the process with mmap. ``/metrics`` merges them on request;
easymats reads the same files directly, at the sampling interval, without asking the server.

**File layout** (prometheus_client ``mmap_dict.py``, unchanged from 0.7 to 0.26 at least)::

    offset 0   u32  used: bytes of the file in use, header included (native order: little endian)
    offset 4   4 bytes of padding
    offset 8   entries, back to back, up to ``used``:
               i32     n: length of the key
               n bytes key: UTF-8 JSON [metric name, sample name, {labels}, help text]
               spaces  padding so that 4 + n + padding is a multiple of 8 (8 spaces when it
                       already is)
               f64     value
               f64     timestamp (unix seconds; set by mostrecent gauges, else 0)

Entries are only appended; a writer fills an entry before it raises ``used``, and writes each
value and timestamp together in one 16-byte slice assignment. There is no lock and no version.
The file starts at 64 KiB and doubles (truncate, remap) when full.

**Reading.** A file is read with ``pread`` (never mapped: a file shrunk under a mapping would kill
the reader with SIGBUS) up to ``used``, twice. A value whose 16 bytes differ between the two reads
was being written: it is read again until two reads in a row agree (a bounded number of times).
Keys are parsed once per file and offset.

What that guarantees: each 8-byte field is 8-aligned, so it is always one whole value the writer
wrote. The pair is not guaranteed: a 16-byte copy is not an atomic store (an entry at 56 mod 64
crosses a cache line), and a writer stopped between its halves leaves a value and a timestamp of
two successive writes for as long as it is stopped; no number of reads can tell. Read once, one or
two entries in a million come apart under a writer that never pauses; with the re-reads one did in
dozens of CI runs. Only ``mostrecent`` gauges use the timestamp (every other writer stores 0): such
a gauge may then be merged by its previous write's time for one sample.

**Merging** follows prometheus_client's ``MultiProcessCollector``: counters, summaries and
histogram buckets are summed over files (buckets are stored per bucket and made cumulative here,
with ``_count``), gauges by their mode (``mostrecent``: the value with the latest timestamp;
``all``/``liveall``: one series per process with a ``pid`` label, as SGLang's own /metrics shows).
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
from typing import Iterator

from .. import procinfo
from ..procmetrics import descendants
from .base import SourceError
from .translate import Family, Sample

DB_NAME = re.compile(r"^(counter|histogram|summary|gauge_([a-z]+))_(\d+)\.db$")
GAUGE_MODES = ("all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum",
               "mostrecent", "livemostrecent")
ENV_NAMES = ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")
MAX_FILES = 1024  # prometheus_client never deletes a dead process's files; beyond this, say so
MAX_FILE_BYTES = 256 << 20
READ_ATTEMPTS = 8

_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_DD = struct.Struct("<dd")


class DbFile:
    """One ``*.db`` file: its entries' keys parsed once, values read consistently each time."""

    def __init__(self, path: str, typ: str, mode: str | None, pid: str):
        self.path = path
        self.typ = typ  # counter | gauge | histogram | summary
        self.mode = mode  # the gauge's multiprocess mode
        self.pid = pid
        self._ino: int | None = None
        self._entries: list[tuple[tuple, int]] = []  # (parsed key, offset of the value)
        self._parsed_to = 8  # entries before this offset are in _entries
        self.retries = 0

    def read(self) -> list[tuple[tuple, float, float]]:
        """[(key, value, timestamp)] of a consistent read; FileNotFoundError if it is gone.

        The file is opened for each read, not kept open: a descriptor would go on reading a file
        that prometheus_client deleted (``mark_process_dead``) or that a new process replaced."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except PermissionError:
            raise SourceError(f"{self.path}: permission denied; run easymats as the engine's user") from None
        except OSError as exc:
            raise SourceError(f"{self.path}: cannot open ({exc.strerror})") from None
        try:
            ino = os.fstat(fd).st_ino
            if ino != self._ino:  # a new file under this name: parse its keys from the start
                self._ino, self._entries, self._parsed_to = ino, [], 8
            return self._read(fd)
        finally:
            os.close(fd)

    def _read(self, fd: int) -> list[tuple[tuple, float, float]]:
        for attempt in range(READ_ATTEMPTS):
            head = os.pread(fd, 8, 0)
            if len(head) < 8:
                return []  # created, not initialised yet: no entries
            used = _U32.unpack_from(head)[0]
            if used == 0:
                return []
            if used < 8 or used > MAX_FILE_BYTES:
                raise SourceError(f"{self.path}: used size {used} is out of range: not a prometheus_client "
                                  "multiprocess file, or a corrupt one")
            a = os.pread(fd, used, 0)
            if len(a) == used and _U32.unpack_from(a)[0] == used:
                break
            if len(a) < used and os.fstat(fd).st_size < used:
                # prometheus_client grows the file before it raises `used`: never smaller than it.
                raise SourceError(f"{self.path}: used size {used} is beyond the file's end: corrupt")
            self.retries += 1  # grew between the two reads: read again
        else:
            raise SourceError(f"{self.path}: changed size on each of {READ_ATTEMPTS} reads; skipped this sample")
        self._parse_keys(a, used)
        b = os.pread(fd, used, 0)
        unpack = _DD.unpack_from
        if a == b:
            return [(key, *unpack(a, at)) for key, at in self._entries]
        # Some values changed between the two reads: a value read while its writer copied it could
        # mix two writes. Such a value is read again until two reads in a row agree.
        out = []
        for key, at in self._entries:
            value = a[at:at + 16]
            if value != b[at:at + 16]:
                value = self._settled(fd, at, b[at:at + 16])
            out.append((key, *unpack(value)))
        return out

    def _settled(self, fd: int, at: int, last: bytes) -> bytes:
        for _ in range(READ_ATTEMPTS):
            self.retries += 1
            now = os.pread(fd, 16, at)
            if now == last:
                return now
            last = now
        raise SourceError(f"{self.path}: a value changed on each of {READ_ATTEMPTS} reads; skipped this sample")

    def _parse_keys(self, data: bytes, used: int) -> None:
        """Parse the entries appended since the last read (keys never change once written)."""
        if used < self._parsed_to:  # shrank: another file now (the old one was replaced)
            self._entries, self._parsed_to = [], 8
        pos = self._parsed_to
        entries = self._entries
        while pos < used:
            if pos + 4 > used:
                raise SourceError(f"{self.path}: entry at {pos} runs past the used size {used}: corrupt")
            n = _I32.unpack_from(data, pos)[0]
            value_at = pos + 4 + n + (8 - (n + 4) % 8)
            if n <= 0 or value_at + 16 > used:
                raise SourceError(f"{self.path}: entry at {pos} has a bad key length {n}: corrupt")
            try:
                metric, name, labels, help_text = json.loads(data[pos + 4:pos + 4 + n].decode("utf-8"))
                if not isinstance(labels, dict) or not isinstance(name, str) or not isinstance(metric, str):
                    raise ValueError("not [metric, name, labels, help]")
            except (ValueError, UnicodeDecodeError) as exc:
                raise SourceError(f"{self.path}: entry at {pos} has an unreadable key ({exc}): corrupt") from None
            key = (str(metric), name, tuple(sorted((str(k), str(v)) for k, v in labels.items())), str(help_text))
            entries.append((key, value_at))
            pos = value_at + 16
        self._parsed_to = pos


def _le_value(le: str) -> float:
    try:
        return float(le)
    except ValueError:
        return float("inf")


def _go_float(x: float) -> str:
    """A bucket bound as prometheus_client writes it: 1.0, 0.25, +Inf."""
    if x == float("inf"):
        return "+Inf"
    return repr(float(x))


def merge(files: list[tuple[DbFile, list[tuple[tuple, float, float]]]]) -> list[Family]:
    """Families from the entries of every file, merged as MultiProcessCollector does."""
    fams: dict[str, tuple[str, str]] = {}  # metric -> (type, help)
    values: dict[tuple[str, str, tuple], float] = {}  # (metric, sample, labels) -> value
    stamps: dict[tuple[str, str, tuple], float] = {}
    buckets: dict[tuple[str, tuple], dict[float, float]] = {}  # (metric, labels without le) -> le -> n
    for f, entries in files:
        for (metric, name, labels, help_text), value, ts in entries:
            if metric not in fams:
                fams[metric] = (f.typ, help_text)
            if f.typ == "gauge":
                mode = f.mode or "all"
                if mode in ("all", "liveall"):
                    key = (metric, name, labels + (("pid", f.pid),))
                    values[key] = value
                    continue
                key = (metric, name, labels)
                prev = values.get(key)
                if mode.endswith("min"):
                    values[key] = value if prev is None or value < prev else prev
                elif mode.endswith("max"):
                    values[key] = value if prev is None or value > prev else prev
                elif mode.endswith("sum"):
                    values[key] = (prev or 0.0) + value
                else:  # mostrecent: the latest timestamp wins
                    if prev is None or ts > stamps.get(key, float("-inf")):
                        values[key], stamps[key] = value, ts
            elif f.typ == "histogram" and name.endswith("_bucket"):
                le = next((v for k, v in labels if k == "le"), None)
                if le is None:
                    continue
                rest = tuple(kv for kv in labels if kv[0] != "le")
                b = buckets.setdefault((metric, rest), {})
                bound = _le_value(le)
                b[bound] = b.get(bound, 0.0) + value
            else:  # counters, summaries, histogram _sum
                key = (metric, name, labels)
                values[key] = values.get(key, 0.0) + value
    samples: dict[str, list[Sample]] = {m: [] for m in fams}
    for (metric, name, labels), value in values.items():
        samples[metric].append(Sample(name, dict(labels), value))
    for (metric, labels), per_le in buckets.items():
        acc = 0.0
        for bound in sorted(per_le):
            acc += per_le[bound]
            samples[metric].append(Sample(metric + "_bucket", {**dict(labels), "le": _go_float(bound)}, acc))
        samples[metric].append(Sample(metric + "_count", dict(labels), acc))
    return [Family(m, typ, help_text, samples[m]) for m, (typ, help_text) in fams.items() if samples[m]]


class MultiprocDir:
    """Every ``*.db`` file of one directory, read and merged on each :meth:`read`."""

    def __init__(self, directory: str):
        self.directory = directory
        self._files: dict[str, DbFile] = {}

    def paths(self) -> list[str]:
        return sorted(glob.glob(os.path.join(glob.escape(self.directory), "*.db")))

    def read(self) -> list[Family]:
        try:
            paths = self.paths()
        except OSError as exc:
            raise SourceError(f"{self.directory}: cannot list ({exc})") from None
        if not paths:
            if not os.path.isdir(self.directory):
                raise SourceError(f"{self.directory}: the metrics directory is gone (the engine exited or "
                                  "restarted with a new one)")
            raise SourceError(f"{self.directory}: no *.db metric files yet (SGLang writes them once "
                              "--enable-metrics is on and the first request was served)")
        if len(paths) > MAX_FILES:
            raise SourceError(f"{self.directory}: {len(paths)} metric files (more than {MAX_FILES}): "
                              "prometheus_client keeps every dead process's files; restart the engine "
                              "with an empty PROMETHEUS_MULTIPROC_DIR")
        seen = set(paths)
        for gone in [p for p in self._files if p not in seen]:
            del self._files[gone]
        got = []
        for path in paths:
            f = self._files.get(path)
            if f is None:
                m = DB_NAME.match(os.path.basename(path))
                if m is None:
                    continue  # not one of prometheus_client's files
                typ = "gauge" if m.group(1).startswith("gauge_") else m.group(1)
                mode = m.group(2)
                if typ == "gauge" and mode not in GAUGE_MODES:
                    continue
                f = self._files[path] = DbFile(path, typ, mode, m.group(3))
            try:
                got.append((f, f.read()))
            except FileNotFoundError:
                del self._files[path]  # a live* gauge file removed by mark_process_dead
        return merge(got)

    @property
    def retries(self) -> int:
        return sum(f.retries for f in self._files.values())

    def close(self) -> None:
        self._files.clear()


# -- finding the directory from a PID ----------------------------------------------------------------

def _maps_db_paths(pid: int, proc_root: str) -> Iterator[tuple[str, int]]:
    """(path, inode) of every mapped prometheus_client ``*.db`` file of ``pid``."""
    with open(f"{proc_root}/{pid}/maps", "rb") as f:
        for line in f:
            if not line.rstrip().endswith(b".db"):
                continue
            parts = line.split(None, 5)
            if len(parts) < 6:
                continue
            path = parts[5].rstrip(b"\n").decode("utf-8", "replace")
            if DB_NAME.match(os.path.basename(path)):
                try:
                    yield path, int(parts[4])
                except ValueError:
                    continue


def _reachable(pid: int, path: str, inode: int | None, proc_root: str) -> str | None:
    """``path`` as this process can open it: as is when it is the same file (same mount
    namespace), else through ``/proc/<pid>/root`` (a sidecar container sharing the PID namespace)."""
    for candidate in (path, f"{proc_root}/{pid}/root{path}"):
        try:
            st = os.stat(candidate)
        except OSError:
            continue
        if inode is None or st.st_ino == inode:
            return candidate
    return None


def _environ_dir(pid: int, proc_root: str) -> str | None:
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        name, _, value = item.partition(b"=")
        if name.decode("latin-1") in ENV_NAMES and value:
            return value.decode("utf-8", "replace")
    return None


def find_directory(pid: int, proc_root: str = procinfo.PROC_ROOT) -> tuple[str | None, str]:
    """The multiprocess directory of ``pid`` or a descendant, and how it was found (or why not).

    First the ``*.db`` files mapped into the process and its children (``/proc/<pid>/maps``: the
    server sets ``PROMETHEUS_MULTIPROC_DIR`` itself, after start-up, so its environment does not
    show it), then ``PROMETHEUS_MULTIPROC_DIR`` in their start-up environments.
    """
    pids = [pid] + descendants(pid)
    denied = []
    counts: dict[str, int] = {}
    for p in pids:
        try:
            for path, inode in _maps_db_paths(p, proc_root):
                where = _reachable(p, path, inode, proc_root)
                if where is not None:
                    d = os.path.dirname(where)
                    counts[d] = counts.get(d, 0) + 1
        except PermissionError:
            denied.append(p)
        except OSError:
            continue
    if counts:
        best = max(counts, key=lambda d: counts[d])
        return best, f"mapped *.db files of pid {pid} and its children"
    for p in pids:
        env_dir = _environ_dir(p, proc_root)
        if env_dir:
            where = _reachable(p, env_dir, None, proc_root)
            if where is not None and glob.glob(os.path.join(glob.escape(where), "*.db")):
                return where, f"PROMETHEUS_MULTIPROC_DIR of pid {p}"
    if denied:
        return None, (f"cannot read /proc/{denied[0]}/maps (permission denied): run easymats as the "
                      "engine's user")
    return None, (f"pid {pid} and its children map no prometheus_client *.db files and set no "
                  "PROMETHEUS_MULTIPROC_DIR")
