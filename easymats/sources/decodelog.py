"""SGLang's decode log line, followed in a file (``easymats --follow-log FILE``).

With HiSparse on, SGLang's scheduler logs every ``--decode-log-interval`` decode steps (40 by
default) a line like::

    [2026-04-10 12:00:01 DP0 TP0] Decode batch, #running-req: 8, #gpu token: 32768, gpu token usage: 0.50,
    #cpu token: 262144, cpu token usage: 0.25, cuda graph: True, gen throughput (token/s): 1234.56, #queue-req: 0

(one line; format of ``PoolStats.get_decode_usage_msg_parts`` in
``python/sglang/srt/managers/scheduler_runtime_checker_mixin.py`` and ``log_decode_stats`` in
``scheduler_metrics_mixin.py``, 2026). The HiSparse part (``#gpu token`` ... ``cpu token usage``)
is nowhere else: SGLang exports no metric for it. Each field becomes a sample named
``sglang_log:<field>`` (easymats' names for what the log says), with a ``dp_rank`` label when the
line's prefix names a data-parallel rank. Values are levels at the time of the line: a field whose
last line is older than ``stale_s`` is dropped, so an idle engine (no decode, no line) shows no
data rather than its last busy numbers.
"""

from __future__ import annotations

import os
import re
import time

from .base import SourceError
from .maps import LOG_PREFIX
from .translate import Family, Sample

# Field name in the log -> sample name.
FIELDS = {
    "#running-req": "running_reqs",
    "#gpu token": "gpu_tokens",
    "gpu token usage": "gpu_token_usage",
    "#cpu token": "cpu_tokens",
    "cpu token usage": "cpu_token_usage",
    "gen throughput (token/s)": "gen_throughput",
    "#queue-req": "queue_reqs",
}
HELP = {
    "running_reqs": "Running requests, from SGLang's decode log line.",
    "gpu_tokens": "Tokens in the HiSparse device hot buffers ('#gpu token' of SGLang's decode log).",
    "gpu_token_usage": "HiSparse device buffer usage, 0..1, two decimals ('gpu token usage').",
    "cpu_tokens": "Tokens in the HiSparse host pool ('#cpu token' of SGLang's decode log).",
    "cpu_token_usage": "HiSparse host pool usage, 0..1, two decimals ('cpu token usage').",
    "gen_throughput": "Generation throughput in tokens per second over the last decode log interval.",
    "queue_reqs": "Requests waiting in the queue, from SGLang's decode log line.",
}
_FIELD = re.compile("(" + "|".join(map(re.escape, FIELDS)) + r"):\s*(-?[0-9]+(?:\.[0-9]+)?)")
_DP = re.compile(r"^\[[^\]]*?\bDP(\d+)\b[^\]]*\]")
MAX_READ = 1 << 20  # more than this new since the last read: jump to the tail (only the last line matters)
TAIL = 64 << 10


def parse_line(line: str) -> tuple[str | None, dict[str, float]] | None:
    """(data-parallel rank or None, {sample suffix: value}) of a HiSparse decode line, else None."""
    if "Decode batch" not in line or "#gpu token" not in line:
        return None
    values = {}
    for m in _FIELD.finditer(line):
        values[FIELDS[m.group(1)]] = float(m.group(2))
    if "gpu_tokens" not in values or "cpu_tokens" not in values:
        return None
    dp = _DP.match(line)
    return (dp.group(1) if dp else None), values


class DecodeLog:
    """Follows one log file: new lines since the last read; rotation and truncation handled."""

    kind = "log"

    def __init__(self, path: str, stale_s: float = 15.0):
        self.where = path
        self.path = path
        self.stale_s = stale_s
        self.lines = 0  # HiSparse decode lines parsed
        self._ino: int | None = None
        self._offset = 0
        self._partial = b""
        self._midline = False  # the next data starts inside a line (a jump to the tail)
        self._latest: dict[str | None, tuple[float, dict[str, float]]] = {}  # dp -> (monotonic, values)

    def _read_new(self) -> list[bytes]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise SourceError(f"{self.path}: no such log file (point --follow-log at the file SGLang's "
                              "output goes to, e.g. python -m sglang.launch_server ... 2>&1 | tee FILE)") from None
        except OSError as exc:
            raise SourceError(f"{self.path}: cannot read the log ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            first = self._ino is None
            if st.st_ino != self._ino or st.st_size < self._offset:
                # A new file (rotated) or a truncated one: from its start; the very first open
                # starts near the end, since only the latest lines say what is true now.
                self._ino, self._partial = st.st_ino, b""
                self._offset = max(0, st.st_size - TAIL) if first else 0
                self._midline = self._offset > 0
            if st.st_size - self._offset > MAX_READ:
                self._offset, self._partial, self._midline = st.st_size - TAIL, b"", True
            data = os.pread(fd, st.st_size - self._offset, self._offset) if st.st_size > self._offset else b""
        finally:
            os.close(fd)
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an unfinished last line waits for its end
        if self._midline and (lines or self._partial):
            # Started inside a line: its end is not a line (its prefix, the DP rank, is cut off).
            if lines:
                lines.pop(0)
                self._midline = False
        return lines

    def read(self) -> list[Family]:
        now = time.monotonic()
        for raw in self._read_new():
            got = parse_line(raw.decode("utf-8", "replace"))
            if got is not None:
                self._latest[got[0]] = (now, got[1])
                self.lines += 1
        for dp in [dp for dp, (t, _) in self._latest.items() if now - t > self.stale_s]:
            del self._latest[dp]
        by_field: dict[str, list[Sample]] = {}
        for dp, (_, values) in sorted(self._latest.items(), key=lambda kv: kv[0] or ""):
            labels = {"dp_rank": dp} if dp is not None else {}
            for suffix, value in values.items():
                by_field.setdefault(suffix, []).append(Sample(LOG_PREFIX + suffix, dict(labels), value))
        return [Family(LOG_PREFIX + suffix, "gauge", HELP[suffix], samples) for suffix, samples in by_field.items()]

    def fetch(self, deadline: float) -> list[Family]:
        return self.read()

    def close(self) -> None:
        pass
