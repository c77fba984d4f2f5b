"""Streaming reader for easymats logs (JSON Lines, docs/log-format.md).

A log is ``run.log`` plus its rotated files ``run.log.1``, ``run.log.2`` ... (higher = older).
:func:`log_files` lists them oldest first and :func:`iter_records` yields one parsed record at a
time, so memory does not grow with the size of the log. Lines that do not parse are counted and
skipped (a crash can only cut the last line of a file); unknown kinds and keys are ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterator, Mapping

LOG_VERSION = 1
MAX_LINE_BYTES = 8 << 20  # a longer "line" is garbage, not a sample: skip it without holding it

_ROTATED_RE = re.compile(r"\.(\d+)$")


class LogError(Exception):
    """A log that cannot be reported on; the message names the fix."""


def log_files(path: str) -> list[str]:
    """``path`` and its rotated siblings ``path.N``, oldest (highest N) first."""
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    rotated: list[tuple[int, str]] = []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise LogError(f"cannot list {directory}: {exc.strerror}") from None
    for name in names:
        if name.startswith(base + "."):
            m = _ROTATED_RE.fullmatch(name[len(base):])
            if m:
                rotated.append((int(m.group(1)), os.path.join(directory, name)))
    files = [p for _, p in sorted(rotated, reverse=True)]
    if os.path.exists(path):
        files.append(path)
    if not files:
        raise LogError(f"no such log: {path} (pass the file given to `easymats --output`)")
    for f in files:
        if os.path.isdir(f):
            raise LogError(f"{f} is a directory; pass the log file written by `easymats --output`")
    return files


# -- series keys: name{a="x",b="y"} in Prometheus text-format quoting ---------------------------

def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def series_key(name: str, labels: Mapping[str, str] | None = None) -> str:
    """The log's key for a series: labels sorted by name, text-format quoting."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{_escape(str(labels[k]))}"' for k in sorted(labels))
    return f"{name}{{{inner}}}"


_KEY_RE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?")
_LABEL_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_key_cache: dict[str, tuple[str, dict[str, str]] | None] = {}


def parse_key(key: str) -> tuple[str, dict[str, str]] | None:
    """``name{a="x"}`` -> ("name", {"a": "x"}); None if the key is not a series name."""
    try:
        return _key_cache[key]
    except KeyError:  # the first time this key is seen
        pass
    out: tuple[str, dict[str, str]] | None = None
    m = _KEY_RE.fullmatch(key)
    if m:
        labels: dict[str, str] = {}
        body, pos, ok = m.group(2) or "", 0, True
        while pos < len(body):
            lm = _LABEL_RE.match(body, pos)
            if not lm or lm.end() == pos:
                ok = False
                break
            labels[lm.group(1)] = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], lm.group(2))
            pos = lm.end()
        if ok:
            out = (m.group(1), labels)
    if len(_key_cache) < 4096:  # the set of series is small; the cap only guards against garbage
        _key_cache[key] = out
    return out


# -- time arguments ------------------------------------------------------------------------------

_REL_RE = re.compile(r"\+(\d+(?:\.\d*)?)([smh]?)")


def parse_time(text: str, log_start: float | None) -> float:
    """Unix seconds from ``text``: a number, an ISO 8601 time (naive = UTC), or ``+90s``/``+5m``/
    ``+1h`` after the first record of the log. Raises ValueError with a usage hint."""
    text = text.strip()
    m = _REL_RE.fullmatch(text)
    if m:
        if log_start is None:
            raise ValueError(f"{text!r} is relative to the log's start, but the log has no records")
        return log_start + float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"cannot read time {text!r}: give unix seconds, an ISO time such as "
                         "2026-11-29T22:00:00Z, or an offset from the log's start such as +5m") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


# -- records -------------------------------------------------------------------------------------

@dataclass(slots=True)
class ReadStats:
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    lines: int = 0
    samples: int = 0
    events: int = 0
    headers: int = 0
    skipped: int = 0  # lines that did not parse
    ignored: int = 0  # unknown kinds, newer versions, other targets, outside the time range
    skipped_where: list[str] = field(default_factory=list)  # first few "file:line" of skipped lines
    skipped_files: list[str] = field(default_factory=list)  # rotated files wholly outside --from/--to
    first_t: float | None = None
    last_t: float | None = None
    header: dict[str, Any] | None = None

    def count(self, kind: str, t: float) -> None:
        """A sample or event record at time ``t`` was read."""
        if kind == "sample":
            self.samples += 1
        else:
            self.events += 1
        if self.first_t is None or t < self.first_t:
            self.first_t = t
        if self.last_t is None or t > self.last_t:
            self.last_t = t


def _skip(stats: ReadStats, path: str, lineno: int) -> None:
    stats.skipped += 1
    if len(stats.skipped_where) < 5:
        stats.skipped_where.append(f"{os.path.basename(path)}:{lineno}")


def _read_lines(path: str) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) per line; None for a line longer than MAX_LINE_BYTES (skipped unread)."""
    with open(path, "rb") as f:
        lineno = 0
        while True:
            line = f.readline(MAX_LINE_BYTES)
            if not line:
                return
            lineno += 1
            if len(line) == MAX_LINE_BYTES and not line.endswith(b"\n"):
                while True:  # drain the rest of the monster line without keeping it
                    more = f.readline(MAX_LINE_BYTES)
                    if not more or more.endswith(b"\n"):
                        break
                yield lineno, None
                continue
            yield lineno, line


def peek_header(files: list[str]) -> dict[str, Any] | None:
    """The header line of the oldest file, if its first readable line is one."""
    for path in files:
        for _, line in _read_lines(path):
            try:
                obj = json.loads(line) if line is not None else None
            except ValueError:
                obj = None
            return obj if isinstance(obj, dict) and obj.get("kind") == "header" else None
    return None


def first_time(files: list[str]) -> float | None:
    """The time of the first record of the oldest file (for ``+5m`` style arguments)."""
    for path in files:
        for _, line in _read_lines(path):
            if line is None:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("t"), (int, float)):
                return float(obj["t"])
    return None


def _time_of(line: bytes) -> float | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    t = obj.get("t") if isinstance(obj, dict) else None
    return float(t) if isinstance(t, (int, float)) else None


def file_span(path: str, tail_bytes: int = 1 << 16) -> tuple[float | None, float | None]:
    """(first, last) record time of one file, reading only its head and its tail."""
    first = last = None
    for _, line in _read_lines(path):
        if line is not None and (first := _time_of(line)) is not None:
            break
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            tail = f.read().split(b"\n")
    except OSError:
        return first, None
    for line in reversed(tail[1:] if size > tail_bytes else tail):
        if line.strip() and (last := _time_of(line)) is not None:
            break
    return first, last


def _outside(path: str, t_from: float | None, t_to: float | None) -> bool:
    """A rotated file wholly outside the time range is skipped unread (records are in time order)."""
    if t_from is None and t_to is None:
        return False
    first, last = file_span(path)
    return (t_from is not None and last is not None and last < t_from) or \
        (t_to is not None and first is not None and first > t_to)


def _record(line: bytes) -> dict[str, Any] | None:
    """The JSON object of a log line with a finite time ``t``; None for anything else."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), (int, float)) or \
            not math.isfinite(obj["t"]):  # Python's json reads Infinity/NaN: no time at all
        return None
    return obj


def _well_formed(obj: dict[str, Any], kind: str, target: Any) -> bool:
    """A sample names its target and carries a metrics object; agent-wide events (agent_start,
    agent_stop) carry target null."""
    if not isinstance(target, str) and (kind == "sample" or target is not None):
        return False
    return kind != "sample" or isinstance(obj.get("metrics") or {}, dict)


def iter_records(files: list[str], stats: ReadStats, *, target: str | None = None,
                 t_from: float | None = None, t_to: float | None = None) -> Iterator[dict[str, Any]]:
    """Yield sample and event records (dicts as in the log) in file order, filtered.

    ``stats`` is filled in as the generator runs. Header lines update ``stats.header``.
    """
    # A byte pre-filter for --target, only where the name has one possible JSON spelling.
    plain = target is not None and target.isascii() and json.dumps(target)[1:-1] == target
    needle = json.dumps(target).encode() if plain else None
    stats.files = list(files)
    for path in files:
        if _outside(path, t_from, t_to):
            stats.skipped_files.append(path)
            continue
        try:
            stats.bytes += os.path.getsize(path)
        except OSError:
            pass
        for lineno, line in _read_lines(path):
            stats.lines += 1
            if line is None:
                _skip(stats, path, lineno)
                continue
            if not line.strip():
                continue
            # Cheap pre-filter: a line for another target does not contain this one's JSON string.
            if needle is not None and needle not in line and b'"header"' not in line:
                stats.ignored += 1
                continue
            obj = _record(line)
            if obj is None:
                _skip(stats, path, lineno)
                continue
            kind = obj.get("kind")
            if obj.get("v", LOG_VERSION) != LOG_VERSION:
                stats.ignored += 1
                continue
            if kind == "header":
                stats.headers += 1
                if stats.header is None:
                    stats.header = obj
                continue
            if kind not in ("sample", "event"):
                stats.ignored += 1
                continue
            tgt = obj.get("target")
            if not _well_formed(obj, kind, tgt):
                _skip(stats, path, lineno)
                continue
            t = float(obj["t"])
            if (target is not None and tgt is not None and tgt != target) or \
                    (t_from is not None and t < t_from) or (t_to is not None and t > t_to):
                stats.ignored += 1
                continue
            stats.count(kind, t)
            yield obj
