"""The agent's side of engine sources: which engine targets to create, and when.

:class:`EngineAttach` is what :class:`easymats.agent.Agent` holds: the ``--scrape`` and
``--follow-log`` arguments, checked when the agent is built (a bad URL is the user's mistake and
is said at once), the targets for them at :meth:`start`, and for each ``--pid`` without a
telemetry segment a try at an engine process (SGLang's multiprocess files), repeated while that
PID stays a plain process target, since a server creates its files with its first metric update.
"""

from __future__ import annotations

import time
from typing import Iterable, TypeGuard

from ..targets import Target
from .httpget import parse_url
from .target import EngineTarget, default_timeout, log_target, pid_target, scrape_target, split_scrape_arg

# How often a PID that shows no engine files yet is looked at again: each look reads
# /proc/<pid>/maps of the process tree. Often at first (a server starting up), then rarely.
RETRY_FAST_S, RETRY_SLOW_S, FAST_FOR_S = 1.0, 10.0, 60.0


class EngineAttach:
    def __init__(self, scrapes: Iterable[str] = (), follow_logs: Iterable[str] = (), pids: Iterable[int] = (),
                 *, interval: float = 0.1, timeout: float | None = None, peak_window_s: float = 15.0):
        self.interval = interval
        self.timeout_s = default_timeout(interval) if timeout is None else timeout
        if not 0 < self.timeout_s < interval:
            raise ValueError(f"--scrape-timeout {self.timeout_s:g} must be above 0 and below --interval "
                             f"{interval:g}: a read still running at the next tick would delay it")
        self.peak_window_s = peak_window_s
        self.scrapes: list[tuple[str | None, str]] = []
        names = set()
        for arg in scrapes:
            name, url = split_scrape_arg(arg)
            parse_url(url)  # ValueError naming the fix
            if name is not None and name in names:
                raise ValueError(f"--scrape {arg!r}: the name {name!r} is given twice; give each endpoint "
                                 "its own NAME=URL")
            if name:
                names.add(name)
            self.scrapes.append((name, url))
        self.follow_logs = list(dict.fromkeys(follow_logs))
        pids = list(pids)
        # One --pid and one --follow-log: the log belongs to that process's target. Otherwise each
        # log is a target of its own (nothing says which process wrote it).
        self.log_for_pid: dict[int, str] = {}
        if len(pids) == 1 and len(self.follow_logs) == 1:
            self.log_for_pid[pids[0]] = self.follow_logs[0]
        self._first_try: dict[int, float] = {}
        self._next_try: dict[int, float] = {}

    @property
    def active(self) -> bool:
        """Whether engine sources were asked for (then no segment is attached implicitly)."""
        return bool(self.scrapes or self.follow_logs)

    def start(self, taken: Iterable[str] = ()) -> list[EngineTarget]:
        """The scrape and stand-alone log targets, named apart from the ``taken`` names of targets
        already attached; each has made (or timed out) its first read."""
        out: list[EngineTarget] = []
        taken = set(taken)
        for name, url in self.scrapes:
            tg = scrape_target(url, name=name, peak_window_s=self.peak_window_s, timeout_s=self.timeout_s)
            tg.name = _unique(tg.name, taken)
            out.append(tg)
        for path in self.follow_logs:
            if path in self.log_for_pid.values():
                continue
            tg = log_target(path, peak_window_s=self.peak_window_s, timeout_s=self.timeout_s)
            tg.name = _unique(tg.name, taken)
            out.append(tg)
        deadline = time.monotonic() + self.timeout_s
        for tg in out:  # the reads run in parallel: the first sample has data, not "waiting"
            tg.reader.wait_first(max(0.0, deadline - time.monotonic()))
        return out

    def pid_target(self, pid: int, current: Iterable[Target]) -> EngineTarget | None:
        """An engine target for ``pid`` if it shows one now (and has none yet), else None."""
        if any(isinstance(tg, EngineTarget) and tg.pid == pid and not tg.gone for tg in current):
            return None
        now = time.monotonic()
        if now < self._next_try.get(pid, 0.0):
            return None
        first = self._first_try.setdefault(pid, now)
        self._next_try[pid] = now + (RETRY_FAST_S if now - first < FAST_FOR_S else RETRY_SLOW_S)
        tg = pid_target(pid, peak_window_s=self.peak_window_s, timeout_s=self.timeout_s,
                        log_path=self.log_for_pid.get(pid))
        if tg is not None:
            tg.reader.wait_first(self.timeout_s)
        return tg


def is_engine(tg: object) -> TypeGuard[EngineTarget]:
    return isinstance(tg, EngineTarget)


def _unique(name: str, taken: set[str]) -> str:
    out, n = name, 1
    while out in taken:
        n += 1
        out = f"{name}.{n}"
    taken.add(out)
    return out
