"""The agent's target kind for engines: an endpoint, an SGLang process, a decode log.

An :class:`EngineTarget` is a :class:`easymats.targets.Target` whose source
(:class:`easymats.source.Source`) is an :class:`~.worker.EngineReader`: the sampler, the log, the
peaks, the live view and the exporter treat it exactly like a segment target. What differs:

- it has no control file (``path`` is None): the webhook cannot ask it to recalibrate, and its
  ``easymats_target_source_info`` says ``control="none"`` so Alertmanager pages instead;
- a scrape target has no local process (``pid`` 0): no process or GPU readings;
- its unmapped series pass through to /metrics (:attr:`passthrough`), and the engine's HiSparse
  series among them are logged beside the catalogue ones;
- it says which catalogue metrics its engine cannot provide (``easymats_target_not_provided_info``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

from .. import procinfo
from ..segment import Histogram
from ..targets import Target
from .base import SourceError
from .decodelog import DecodeLog
from .httpget import parse_url
from .maps import SGLANG, EngineMap, choose
from .mpfiles import MultiprocDir, find_directory
from .translate import Family
from .worker import EngineReader

# Seconds between two searches of /proc/<pid>/maps for a process whose metric files are not there
# yet (a server creates them with its first metric update): cheap enough at start, slower later.
FIND_EVERY_S = 1.0


def default_timeout(interval: float) -> float:
    """A read must end before the next tick: 80 % of the interval, at most 10 s."""
    return min(0.8 * interval, 10.0)


class EngineTarget(Target):
    def __init__(self, name: str, pid: int, source: Any, *, kind: str, peak_window_s: float,
                 timeout_s: float, labels: dict[str, str] | None = None, emap: EngineMap | None = None,
                 proc_root: str = procinfo.PROC_ROOT):
        reader = EngineReader(source, name=name, pid=pid, labels=dict(labels or {}), timeout_s=timeout_s,
                              start_ticks=procinfo.start_ticks(pid, proc_root) or 0 if pid else 0,
                              **({"choose_map": lambda names: emap} if emap else {}))
        super().__init__(pid, source=reader, peak_window_s=peak_window_s, proc_root=proc_root)
        self.kind = kind  # scrape | pid | log
        self.reader = reader
        self.engine_source = source  # what the reader fetches from (endpoint, files, log)
        self.fixed_map = emap

    @property
    def where(self) -> str:
        return self.engine_source.where

    # -- what Target does differently here ---------------------------------------------------------
    def alive(self) -> bool:
        # no local process (a scrape target) is never "exited"; else the process must be running
        return True if not self.pid else procinfo.running(self._stat_path, self.start_ticks)

    def read_process(self) -> None:
        if self.pid:
            super().read_process()

    def sample(self, t: float, mono: float | None = None) -> tuple[bool, str | None]:
        # A segment's heartbeat moves only while its writer lives, so Target.sample skips the
        # /proc check when it moved. An engine snapshot's heartbeat is the time of the read, and
        # an exited engine's files stay readable: check the process at every sample.
        if self.pid and not self.gone and not self.alive():
            self.gone, self.up, self.sample_t = True, False, t
            self.error = f"process {self.pid} exited"
            return True, self.error
        return super().sample(t, mono)

    @property
    def engine_map(self) -> EngineMap | None:
        cur = self.reader.current
        return cur.emap if cur is not None else self.fixed_map

    @property
    def passthrough(self) -> list[Family]:
        """Unmapped families for /metrics: those of the last read, and the ones a scrape does not
        parse at every read (:meth:`ScrapeSource.rest`, parsed here, at /metrics time)."""
        cur = self.reader.current
        if cur is None or cur.translation is None:
            return []
        rest = getattr(self.engine_source, "rest", None)
        return cur.translation.passthrough + rest() if rest is not None else cur.translation.passthrough

    def log_line(self, t: float, lag_s: float, with_metrics: bool = True) -> dict[str, Any]:
        line = super().log_line(t, lag_s, with_metrics)
        cur = self.reader.current
        if with_metrics and cur is not None and cur.translation is not None and "metrics" in line:
            line["metrics"].update(cur.translation.logged)
        return line

    def log_json(self, t: float, lag_s: float) -> str:
        import json

        from ..logwriter import json_safe

        return json.dumps(json_safe(self.log_line(t, lag_s)), separators=(",", ":"))

    def engine_series(self) -> Iterator[tuple[str, dict[str, str], float | Histogram]]:
        """The agent series that describe this engine target (for the exporter)."""
        emap = self.engine_map
        engine = emap.engine if emap else "unknown"
        yield ("easymats_target_source_info",
               {"target": self.name, "engine": engine, "revision": emap.revision if emap else "unknown",
                "via": self.kind, "control": "none"}, 1.0)
        if emap is not None:
            for metric in emap.not_provided():
                yield "easymats_target_not_provided_info", {"target": self.name, "engine": engine,
                                                            "metric": metric}, 1.0


class PidSource:
    """An engine process's prometheus_client multiprocess files (found from its PID), and
    optionally its decode log."""

    kind = "pid"

    def __init__(self, pid: int, directory: str | None, how: str, log: DecodeLog | None = None,
                 proc_root: str = procinfo.PROC_ROOT):
        self.pid = pid
        self.proc_root = proc_root
        self.how = how  # how the directory was found, or why it was not
        self.log = log
        self.mp: MultiprocDir | None = MultiprocDir(directory) if directory else None
        self._next_find = time.monotonic() + FIND_EVERY_S
        self._log_ok_at: float | None = None

    @property
    def where(self) -> str:
        if self.mp is not None:
            return self.mp.directory
        return self.log.where if self.log is not None else f"pid {self.pid}"

    def _find(self) -> None:
        now = time.monotonic()
        if self.mp is not None or now < self._next_find:
            return
        self._next_find = now + FIND_EVERY_S
        directory, self.how = find_directory(self.pid, self.proc_root)
        if directory:
            self.mp = MultiprocDir(directory)

    def fetch(self, deadline: float) -> list[Family]:
        self._find()
        fams: list[Family] = self.mp.read() if self.mp is not None else []
        if self.log is not None:
            try:
                fams = fams + self.log.read()
                self._log_ok_at = time.monotonic()
            except SourceError:
                # A log being rotated may be missing for a moment: only a log that stays
                # unreadable (or never was readable) fails the sample.
                if self._log_ok_at is None or time.monotonic() - self._log_ok_at > self.log.stale_s:
                    raise
        if self.mp is None and not fams:
            raise SourceError(f"no metrics yet: {self.how}")
        return fams

    def close(self) -> None:
        if self.mp is not None:
            self.mp.close()


def _name_from_url(url: str) -> str:
    u = parse_url(url)
    return u.netloc if u.path in ("/metrics", "/") else f"{u.netloc}{u.path}"


def split_scrape_arg(value: str) -> tuple[str | None, str]:
    """``NAME=URL`` or ``URL`` -> (name or None, URL)."""
    head, sep, tail = value.partition("=")
    if sep and "://" not in head and "://" in tail:
        return head.strip() or None, tail.strip()
    return None, value.strip()


def scrape_target(url: str, *, name: str | None, peak_window_s: float, timeout_s: float) -> EngineTarget:
    """A target for ``--scrape [NAME=]URL``; ValueError (naming the fix) for a bad URL."""
    from .scrape import ScrapeSource

    source = ScrapeSource(url)
    return EngineTarget(name or _name_from_url(url), 0, source, kind="scrape", peak_window_s=peak_window_s,
                        timeout_s=timeout_s, labels={"url": url})


def pid_target(pid: int, *, peak_window_s: float, timeout_s: float, log_path: str | None = None,
               proc_root: str = procinfo.PROC_ROOT) -> EngineTarget | None:
    """A target for an engine PID whose multiprocess files are found (or whose decode log is
    given); None when the PID shows neither."""
    directory, how = find_directory(pid, proc_root)
    if directory is None and log_path is None:
        return None
    log = DecodeLog(log_path) if log_path else None
    source = PidSource(pid, directory, how, log, proc_root)
    labels = {"dir": directory} if directory else {}
    if log_path:
        labels["log"] = os.path.abspath(log_path)
    engine = "sglang" if directory is None else _engine_of(directory)
    return EngineTarget(f"{engine}-{pid}", pid, source, kind="pid", peak_window_s=peak_window_s,
                        timeout_s=timeout_s, labels=labels, proc_root=proc_root)


def _engine_of(directory: str) -> str:
    """The engine whose names the directory's files hold ("engine" if unknown), for the target name."""
    try:
        emap = choose(s.name for f in MultiprocDir(directory).read() for s in f.samples)
    except SourceError:
        return "engine"
    return emap.engine if emap else "engine"


def log_target(path: str, *, peak_window_s: float, timeout_s: float) -> EngineTarget:
    """A target for ``--follow-log FILE`` alone (no PID): SGLang's decode log line."""
    base = os.path.basename(path) or path
    return EngineTarget(f"log-{base}", 0, DecodeLog(path), kind="log", peak_window_s=peak_window_s,
                        timeout_s=timeout_s, labels={"log": os.path.abspath(path)}, emap=SGLANG)


class LiveReader:
    """An engine target as ``easymats doctor`` samples it (the interface of a SegmentReader)."""

    def __init__(self, target: EngineTarget):
        self.target = target
        self.path = target.where

    def read(self):
        return self.target.reader.read()

    def check_writer(self) -> None:
        if self.target.pid and not self.target.alive():
            from ..segment import SegmentError

            raise SegmentError("dead_pid", self.path, f"process {self.target.pid} exited")

    def close(self) -> None:
        self.target.close()
