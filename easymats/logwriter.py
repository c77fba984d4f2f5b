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
from typing import Any, Iterable, Mapping

from . import __version__
from .segment import Histogram

LOG_VERSION = 1


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
    a header line."""

    def __init__(self, path: str, *, interval_s: float, max_bytes: int = 100 << 20, backups: int = 5,
                 argv: Iterable[str] = ()):
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.lines_written = 0
        self.rotations = 0
        self._header = {"v": LOG_VERSION, "kind": "header", "agent_version": __version__,
                        "interval_s": interval_s, "host": socket.gethostname(), "argv": list(argv),
                        "pid": os.getpid()}
        self._lock = threading.Lock()
        self._fd = -1
        self._size = 0
        self._open()

    def _open(self) -> None:
        # Raises OSError for a path the user cannot write: the agent turns it into one line.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._write_now(self._encode({**self._header, "t": time.time()}))

    @staticmethod
    def _encode(obj: Mapping[str, Any]) -> bytes:
        try:
            # The C encoder in one go; a NaN or infinity (rare) takes the slow path below.
            text = _FAST.encode(obj)
        except ValueError:
            text = json.dumps(json_safe(obj), separators=(",", ":"), allow_nan=False)
        return (text + "\n").encode("utf-8")

    def _write_now(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self._size += len(data)

    def _rotate(self) -> None:
        os.close(self._fd)
        self._fd = -1
        if self.backups <= 0:
            os.unlink(self.path)
        else:
            for i in range(self.backups - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self.rotations += 1
        self._open()

    def write_lines(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """Write several lines; each is complete on disk when this returns."""
        self._write_encoded([self._encode(o) for o in objs])

    def _write_encoded(self, encoded: list[bytes]) -> None:
        if not encoded:
            return
        with self._lock:
            if self._fd < 0:
                return
            batch: list[bytes] = []
            size = self._size
            for line in encoded:
                if size + len(line) > self.max_bytes and size > 0:
                    if batch:
                        self._write_now(b"".join(batch))
                        batch = []
                    self._rotate()
                    size = self._size
                batch.append(line)
                size += len(line)
            # One write for the tick's lines: complete lines reach the kernel together.
            self._write_now(b"".join(batch))
            self.lines_written += len(encoded)

    def write_text_lines(self, texts: list[str]) -> None:
        """Like :meth:`write_lines` for lines already encoded as JSON text (no newline)."""
        if not texts:
            return
        data = ("\n".join(texts) + "\n").encode("utf-8")
        with self._lock:
            # The common case, a tick's lines far from the rotation size: one encode, one write.
            if self._fd >= 0 and self._size + len(data) <= self.max_bytes:
                self._write_now(data)
                self.lines_written += len(texts)
                return
        self._write_encoded([(t + "\n").encode("utf-8") for t in texts])

    def write(self, obj: Mapping[str, Any]) -> None:
        self.write_lines([obj])

    def event(self, event: str, *, target: str | None = None, pid: int | None = None,
              detail: str = "") -> None:
        self.write({"v": LOG_VERSION, "kind": "event", "t": time.time(), "target": target, "pid": pid,
                    "event": event, "detail": detail})

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
