"""The telemetry segment as a :class:`easymats.source.Source`: the kind the agent was built for.

Reads go through :class:`easymats.segment.SegmentReader` (bounded: ``max_series`` and
``max_value_bytes`` per read). The producer is the segment's **writer**: the pid in its header,
which is normally the pid in the file name; when the two differ (a file renamed, or linked under
another process's name), the writer is the process whose liveness counts.
"""

from __future__ import annotations

from . import procinfo
from .segment import SegmentReader
from .source import Snapshot

# Reads retried while a publish is in flight; each is a few preads on tmpfs, so this bounds a
# target's read to well under a millisecond even against a writer publishing non-stop.
READ_RETRIES = 16
# What one target may cost per sample: HiSparse publishes ~100 series in a few KiB.
MAX_SERIES = 4096
MAX_VALUE_BYTES = 1 << 20


class SegmentSource:
    """One segment file, opened and checked once: SegmentError unless it is a regular file of
    ours with a valid header whose writer is alive. Its series are read (and may fail) per sample."""

    def __init__(self, path: str, *, proc_root: str = procinfo.PROC_ROOT, max_series: int = MAX_SERIES,
                 max_value_bytes: int = MAX_VALUE_BYTES):
        self.path = path
        self.proc_root = proc_root
        self.reader = SegmentReader(path, max_retries=READ_RETRIES, proc_root=proc_root,
                                    max_series=max_series, max_value_bytes=max_value_bytes)
        try:
            self.pid, self.start_ticks, self.name, self.labels = self.reader.identity()
        except BaseException:
            self.reader.close()
            raise
        self._stat_path = f"{proc_root}/{self.pid}/stat"

    def read(self) -> Snapshot:
        return self.reader.read()

    def alive(self) -> bool:
        """The writer is running, not a zombie, and not a new process that reused its pid."""
        return procinfo.running(self._stat_path, self.start_ticks)

    def close(self) -> None:
        self.reader.close()
