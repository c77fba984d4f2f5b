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


_SERIES_KEY_RE = None


def validate_line(obj: Any) -> list[str]:
    """Problems of one parsed log line against docs/log-format.md (v1); [] when it conforms.

    Unknown keys are allowed (readers ignore them); unknown kinds are reported, since this
    writer never produces them."""
    import re

    global _SERIES_KEY_RE
    if _SERIES_KEY_RE is None:
        _SERIES_KEY_RE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*"'
                                    r'(,[a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*")*)\})?$')
    errs: list[str] = []
    if not isinstance(obj, dict):
        return ["line is not a JSON object"]
    if obj.get("v") != LOG_VERSION:
        errs.append(f"v is {obj.get('v')!r}, not {LOG_VERSION}")
    if not isinstance(obj.get("t"), (int, float)):
        errs.append("t is not a number")
    kind = obj.get("kind")

    def need(key: str, types: tuple, nullable: bool = False) -> None:
        if key not in obj:
            errs.append(f"{kind} line lacks {key!r}")
        elif not (isinstance(obj[key], types) or (nullable and obj[key] is None)):
            errs.append(f"{kind}.{key} has type {type(obj[key]).__name__}")

    if kind == "header":
        need("agent_version", (str,))
        need("interval_s", (int, float))
        need("host", (str,))
        need("argv", (list,))
    elif kind == "event":
        need("event", (str,))
        need("target", (str,), nullable=True)
        need("pid", (int,), nullable=True)
        need("detail", (str,))
        if obj.get("event") not in ("attach", "down", "restart", "agent_start", "agent_stop"):
            errs.append(f"unknown event {obj.get('event')!r}")
    elif kind == "sample":
        need("target", (str,))
        need("pid", (int,))
        need("up", (bool,))
        need("lag_s", (int, float))
        need("metrics", (dict,))
        if obj.get("up") is False and not isinstance(obj.get("error"), str):
            errs.append("a sample with up=false must say why in 'error'")
        if "seq" in obj and not isinstance(obj["seq"], int):
            errs.append("sample.seq is not an integer")
        for key, value in (obj.get("metrics") or {}).items():
            if not _SERIES_KEY_RE.match(key):
                errs.append(f"metrics key {key!r} is not a series name")
            if isinstance(value, dict):
                b, c = value.get("bounds"), value.get("counts")
                if not isinstance(b, list) or not isinstance(c, list) or len(c) != len(b) + 1 \
                        or not isinstance(value.get("sum"), (int, float)):
                    errs.append(f"histogram {key} must have bounds, counts (len(bounds)+1) and sum")
            elif value is not None and not isinstance(value, (int, float)):
                errs.append(f"metric {key} has type {type(value).__name__}")
        proc = obj.get("process")
        if proc is not None and not (isinstance(proc, dict) and isinstance(proc.get("cpu_seconds"), (int, float))
                                     and isinstance(proc.get("rss_bytes"), int)):
            errs.append("process must be null or {cpu_seconds, rss_bytes}")
        if "gpu" in obj:
            if not isinstance(obj["gpu"], list) or not all(isinstance(g, dict) and isinstance(g.get("gpu"), str)
                                                           for g in obj["gpu"]):
                errs.append("gpu must be a list of {gpu, memory_bytes, utilization_ratio}")
    else:
        errs.append(f"unknown kind {kind!r}")
    return errs
