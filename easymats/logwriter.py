"""The JSON Lines log (docs/log-format.md): header, sample and event lines, rotated by size.

Every line is handed to the kernel in one ``os.write`` on an O_APPEND descriptor as soon as it is
made, so a SIGINT, SIGTERM or even SIGKILL of the agent loses no completed line: at worst the
last line of a file is cut short, which readers skip.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from . import __version__
from .segment import Histogram

LOG_VERSION = 1
RETRY_S = 2.0  # a log that failed is tried again this often


def escape_label_value(value: str) -> str:
    """Prometheus text-format quoting of a label value."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def series_key(name: str, labels: Mapping[str, str]) -> str:
    """``name`` or ``name{a="x",b="y"}`` with labels sorted by name, as in the text format."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{escape_label_value(str(labels[k]))}"' for k in sorted(labels))
    return f"{name}{{{inner}}}"


def _num(x: float) -> float | None:
    # JSON has no NaN/Inf: write null rather than emit a line strict parsers reject.
    return x if math.isfinite(x) else None


_FAST = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (JSON has no NaN or Infinity)."""
    if isinstance(obj, float):
        return _num(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def metric_value(value: float | Histogram) -> Any:
    if isinstance(value, Histogram):
        return {"bounds": [_num(b) for b in value.bounds], "counts": [_num(c) for c in value.counts],
                "sum": _num(value.sum)}
    return _num(value)


class LogWriter:
    """Appends lines to ``path``; when the next line would pass ``max_bytes`` it rotates:
    path -> path.1 -> path.2 ... (higher is older, ``backups`` kept) and starts the new file with
    a header line.

    The log never stops its caller. A write that fails (full disk, file size limit, I/O error, a
    directory gone) is taken back to the last whole line, its lines are dropped and counted
    (:attr:`dropped_lines`), :attr:`failing` says why, and the file is tried again every
    :data:`RETRY_S` seconds; the first line that gets through is a ``log_recovered`` event saying
    how many were lost. Before each write the open file is checked against the path: a log that
    was deleted or renamed (logrotate's ``create``) is reopened and one truncated in place
    (``copytruncate``) starts again with a header, each with an event saying so. ``warn`` gets
    one message when the log starts failing and one when it recovers.
    """

    def __init__(self, path: str, *, interval_s: float, max_bytes: int = 100 << 20, backups: int = 5,
                 argv: Iterable[str] = (), warn: Callable[[str], None] | None = None):
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.lines_written = 0
        self.rotations = 0
        self.dropped_lines = 0
        self.failing: str | None = None  # why the last write failed; None while the log works
        self._warn = warn
        self._header = {"v": LOG_VERSION, "kind": "header", "agent_version": __version__,
                        "interval_s": interval_s, "host": socket.gethostname(), "argv": list(argv),
                        "pid": os.getpid()}
        self._lock = threading.Lock()
        self._fd = -1
        self._id = (0, 0)  # (st_dev, st_ino) of the open file
        self._size = 0
        self._closed = False
        self._pending: list[bytes] = []  # header and event lines owed to the current file
        self._retry_at = 0.0
        self._failing_since = 0.0
        self._dropped_before = 0
        # Raises OSError for a path the user cannot write: the agent turns it into one line.
        self._open_file()
        try:
            self._write_all(self._header_line())
        except OSError:
            self._close_file()
            raise

    # -- the file ------------------------------------------------------------------------------------
    def _open_file(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        st = os.fstat(self._fd)
        self._id, self._size = (st.st_dev, st.st_ino), st.st_size

    def _close_file(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def _header_line(self) -> bytes:
        return self._encode({**self._header, "t": time.time()})

    def _event_line(self, event: str, detail: str) -> bytes:
        return self._encode({"v": LOG_VERSION, "kind": "event", "t": time.time(), "target": None,
                             "pid": None, "event": event, "detail": detail})

    def _check_file(self) -> None:
        """Make the open file the one at ``path`` again, owing a header and an event when it was
        deleted, renamed or truncated by someone else. OSError when it cannot be opened."""
        if self._fd < 0:  # a rotation or reopen that failed: the new file is owed its header
            self._open_file()
            self._pending = [self._header_line(), *self._pending[1:]]
            return
        try:
            st: os.stat_result | None = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._id:
            why = ("was deleted" if st is None else "was renamed or replaced (rotated by another tool)")
            self._close_file()
            self._open_file()
            self._pending = [self._header_line(), self._event_line(
                "log_reopened", f"{self.path} {why} while the agent wrote it; this new file continues it")]
            return
        size = st.st_size  # the open file itself: its (dev, inode) was checked above
        if size < self._size:
            self._pending = [self._header_line(), self._event_line(
                "log_truncated", f"{self.path} was truncated from {self._size} to {size} bytes while the "
                "agent wrote it (logrotate copytruncate?); the log continues here")]
        self._size = size

    def _write_all(self, data: bytes) -> None:
        """Append ``data``; on failure take back what part of it got in (the file keeps whole
        lines) and raise."""
        start = self._size
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise
        self._size += len(data)

    def _rotate(self) -> None:
        self._close_file()
        # A file someone else removed or renamed in between is simply not there to move.
        if self.backups <= 0:
            _remove(self.path)
        else:
            for i in range(self.backups - 1, 0, -1):
                _rename(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            _rename(self.path, f"{self.path}.1")
        self.rotations += 1
        self._open_file()
        self._write_all(self._header_line())

    # -- writing -------------------------------------------------------------------------------------
    @staticmethod
    def _encode(obj: Mapping[str, Any]) -> bytes:
        try:
            # The C encoder in one go; a NaN or infinity (rare) takes the slow path below.
            text = _FAST.encode(obj)
        except ValueError:
            text = json.dumps(json_safe(obj), separators=(",", ":"), allow_nan=False)
        return (text + "\n").encode("utf-8")

    def _append(self, head: bytes, data: bytes, n: int) -> None:
        """Write ``head`` (owed header/events) and ``data`` (``n`` lines), rotating on the way;
        counts the lines written as each piece lands. OSError from the first piece that fails."""
        if self._size + len(head) + len(data) <= self.max_bytes:
            # The common case, far from the rotation size: one write for the tick's lines.
            self._write_all(head + data)
            self.lines_written += n
            return
        buf, count = [head], 0
        size = self._size + len(head)
        for line in data.split(b"\n")[:-1]:
            line += b"\n"
            if size + len(line) > self.max_bytes and size > 0:
                self._write_all(b"".join(buf))
                self.lines_written += count
                buf, count = [], 0
                self._rotate()
                size = self._size
            buf.append(line)
            count += 1
            size += len(line)
        self._write_all(b"".join(buf))
        self.lines_written += count

    def _write(self, data: bytes, n: int) -> None:
        with self._lock:
            if self._closed:
                return
            if self.failing is not None and time.monotonic() < self._retry_at:
                self.dropped_lines += n
                return
            before = self.lines_written
            try:
                self._check_file()
                recovered = b""
                if self.failing is not None:
                    lost = self.dropped_lines - self._dropped_before
                    recovered = self._event_line("log_recovered", (
                        f"the log could not be written for {time.monotonic() - self._failing_since:.1f} s "
                        f"({self.failing}): {lost} lines dropped"))
                self._append(b"".join(self._pending) + recovered, data, n)
            except OSError as exc:
                self._fail(exc, n - (self.lines_written - before))
                return
            self._pending = []
            if self.failing is not None:
                lost = self.dropped_lines - self._dropped_before
                self.failing = None
                if self._warn is not None:
                    self._warn(f"the log {self.path} is written again ({lost} lines were dropped)")

    def _fail(self, exc: OSError, lost: int) -> None:
        self.dropped_lines += lost
        self._retry_at = time.monotonic() + RETRY_S
        if self.failing is None:
            self._failing_since = time.monotonic()
            self._dropped_before = self.dropped_lines - lost
            reason = exc.strerror or str(exc)
            self.failing = reason
            if self._warn is not None:
                self._warn(f"cannot write the log {self.path}: {reason}; sampling and /metrics go on, "
                           f"dropped lines are counted (easymats_log_dropped_lines_total) and the log "
                           f"is retried every {RETRY_S:g} s")

    def write_lines(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """Write several lines; each is complete on disk when this returns (or counted dropped)."""
        encoded = [self._encode(o) for o in objs]
        if encoded:
            self._write(b"".join(encoded), len(encoded))

    def write_text_lines(self, texts: list[str]) -> None:
        """Like :meth:`write_lines` for lines already encoded as JSON text (no newline)."""
        if texts:
            self._write(("\n".join(texts) + "\n").encode("utf-8"), len(texts))

    def write(self, obj: Mapping[str, Any]) -> None:
        self.write_lines([obj])

    def event(self, event: str, *, target: str | None = None, pid: int | None = None,
              detail: str = "") -> None:
        self.write({"v": LOG_VERSION, "kind": "event", "t": time.time(), "target": target, "pid": pid,
                    "event": event, "detail": detail})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._fd >= 0:
                try:
                    os.fsync(self._fd)
                except OSError:
                    pass
                self._close_file()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rename(src: str, dst: str) -> None:
    try:
        os.replace(src, dst)
    except FileNotFoundError:
        pass
