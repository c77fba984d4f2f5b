"""Which segments the agent samples, and, for a watched process without one, why not.

Every second the sampler asks :class:`Discovery` to scan the segment directory. A segment of a
watched process (``--pid``, its descendants with ``--children``, every process without ``--pid``)
becomes a :class:`easymats.targets.Target` as soon as its header is valid and its writer alive;
with ``--keep-serving``, so does a segment declaring the name of a target that went down (its
restart). A watched process that has no usable segment is still sampled (process and GPU
metrics) and its target says why in ``error``: the directory is missing or not ours, the file is
a dangling link or garbage, or there simply is none. Each cause is reported once.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from . import procinfo
from .procmetrics import descendants
from .segment import SegmentError, check_directory, pid_of_path
from .sources.attach import EngineAttach, is_engine
from .targets import NO_SEGMENT, Target

# A target that went down stays on /metrics (easymats_target_up 0) this long, so a TargetDown
# alert can fire, then it is dropped: a long-lived --keep-serving sidecar must not grow forever.
DOWN_RETENTION_S = 600.0
# Segment errors that no retry can fix: the file is skipped until its inode changes.
PERMANENT_ERRORS = frozenset({"dead_pid", "pid_reused", "symlink", "not_regular", "bad_owner", "bad_mode",
                              "future_version", "byte_order"})
# A segment being created reads as empty or garbled for a moment: retried at each scan, and
# reported only when it stays unreadable this long.
SETTLE_S = 2.0

# report(key, message, pid): say ``message`` once per ``key`` (stderr and the log).
Reporter = Callable[[str, str, "int | None"], None]
# event(name, target, detail): an attach or restart, for the log.
Events = list[tuple[str, Target, str]]


class Discovery:
    def __init__(self, directory: str, pids: list[int], *, children: bool, keep_serving: bool,
                 peak_window: float, report: Reporter, stale_after: float | None = None,
                 engines: EngineAttach | None = None):
        self.directory = directory
        self.engines = engines  # a watched pid without a segment may be an engine (SGLang's files)
        self.pids = pids
        self.children = children
        self.keep_serving = keep_serving
        self.peak_window = peak_window
        self.stale_after = stale_after
        self.down_retention_s = DOWN_RETENTION_S
        self._report = report
        self._rejected: dict[tuple[str, int], str] = {}  # (path, inode) -> why it is not sampled
        self._failing_since: dict[tuple[str, int], float] = {}
        self._paths_cache: tuple[tuple[int, int], list[str], bool] | None = None
        self.directory_problem: str | None = None
        self._directory_reports = 0

    def watched_pids(self) -> set[int]:
        pids = set(self.pids)
        if self.children:
            for pid in self.pids:
                pids.update(descendants(pid))
        return pids

    def forget_rejections(self) -> None:
        """A target went down: a segment skipped before may be its restart."""
        self._rejected.clear()

    def scan(self, current: list[Target]) -> tuple[list[Target], Events]:
        """The new target list (``current`` is not changed) and the attach/restart events."""
        watched = self.watched_pids()
        # --keep-serving without --pid (and without engine sources): a sidecar for every runtime
        watch_all = not self.pids and not (self.engines is not None and self.engines.active)
        attached = {tg.path for tg in current if tg.path and not tg.gone}
        down_names = {tg.name for tg in current if tg.gone}
        problems: dict[int, str] = {}  # watched pid -> why its segment cannot be sampled
        new: list[Target] = []
        now = time.monotonic()
        for path in self._segment_paths():
            pid = pid_of_path(path)
            if path in attached or pid is None:
                continue
            try:
                ino = os.lstat(path).st_ino  # lstat: a dangling link is a segment to complain about
            except OSError:
                continue
            mine = watch_all or pid in watched
            if (path, ino) in self._rejected:
                if mine:
                    problems[pid] = self._rejected[(path, ino)]
                continue
            if not mine and not (self.keep_serving and down_names):
                continue
            try:
                tg = Target(pid, path, peak_window_s=self.peak_window, stale_after_s=self.stale_after)
            except SegmentError as exc:
                if exc.kind in PERMANENT_ERRORS:
                    self._rejected[(path, ino)] = str(exc)
                    if mine and exc.kind not in ("dead_pid", "pid_reused"):
                        problems[pid] = str(exc)
                        self._report(path, str(exc), pid)
                elif mine:
                    problems[pid] = str(exc)
                    since = self._failing_since.setdefault((path, ino), now)
                    if now - since >= SETTLE_S:
                        self._report(path, str(exc), pid)
                continue
            self._failing_since.pop((path, ino), None)
            if not mine and tg.pid not in watched and tg.name not in down_names:
                tg.close()
                self._rejected[(path, ino)] = "not watched"
                continue
            if tg.pid != pid:
                self._report(f"writer-{path}", f"{path} is named for pid {pid} but written by pid {tg.pid}; "
                             f"sampling it as the target of its writer, pid {tg.pid}", tg.pid)
            self._unique_name(tg, current + new, path)
            new.append(tg)
        new.extend(self._placeholders(current + new, problems))
        current = self._expire(current)
        return self._merge(current, new, down_names)

    def _unique_name(self, tg: Target, others: list[Target], path: str) -> None:
        taken = {t.name for t in others if not t.gone}
        if tg.name not in taken:
            return
        # Two live processes declaring one name would make /metrics invalid (duplicate series):
        # the later one gets its pid appended.
        declared, tg.name = tg.name, f"{tg.name}.{tg.pid}"
        n = 1
        while tg.name in taken:
            tg.name, n = f"{declared}.{tg.pid}.{n}", n + 1
        self._report(f"dup-{path}", f"PID {tg.pid} declares the target name {declared!r}, which a live "
                     f"process already uses; exporting it as {tg.name!r} (give each process its own "
                     "name in open_segment(name=...))", tg.pid)

    def _placeholders(self, targets: list[Target], problems: dict[int, str]) -> list[Target]:
        """Targets for watched pids with no usable segment: an engine process (SGLang's metric
        files) if it shows one, else process and GPU metrics only, with the reason (said once) as
        their error."""
        have = {p for tg in targets if not tg.gone and (tg.path or is_engine(tg)) for p in (tg.pid, tg.named_pid)}
        out: list[Target] = []
        for pid in self.pids:
            if pid in have or not procinfo.pid_exists(pid):
                continue
            engine = self.engines.pid_target(pid, targets) if self.engines is not None else None
            if engine is not None:
                out.append(engine)
                continue
            reason = problems.get(pid) or self.directory_problem
            if reason is None:
                reason = NO_SEGMENT
                self._report(f"noseg-{pid}", f"PID {pid} has no telemetry segment in {self.directory} (is it "
                             "a HiSparse process with telemetry on, and EASYMATS_SEGMENT_DIR the same for "
                             "both?) and no prometheus_client metric files (an SGLang server with "
                             "--enable-metrics?); sampling its process and GPU metrics only", pid)
            placeholder = next((tg for tg in targets if tg.pid == pid and not tg.path and not tg.gone), None)
            if placeholder is not None:
                placeholder.error = reason  # the cause may change (a directory removed, a file fixed)
            elif not any(tg.pid == pid for tg in targets):
                out.append(Target(pid, None, peak_window_s=self.peak_window, error=reason))
        return out

    def _expire(self, current: list[Target]) -> list[Target]:
        now = time.monotonic()  # an interval: a wall-clock step must not drop (or keep) targets
        expired = [tg for tg in current
                   if tg.gone and (tg.sample_mono or now) < now - self.down_retention_s]
        for tg in expired:
            tg.close()
        return [tg for tg in current if tg not in expired]

    @staticmethod
    def _merge(current: list[Target], new: list[Target], down_names: set[str]) -> tuple[list[Target], Events]:
        if not new:
            return current, []
        keep = []
        new_names = {tg.name for tg in new if tg.path}
        real = [tg for tg in new if tg.path or is_engine(tg)]
        new_pids = {tg.named_pid for tg in real} | {tg.pid for tg in real}
        for tg in current:
            if not tg.path and not is_engine(tg) and tg.pid in new_pids:
                continue  # the placeholder's process opened its segment: the real target replaces it
            if tg.gone and tg.name in new_names:
                tg.close()
                continue  # replaced by its restart
            keep.append(tg)
        events: Events = []
        for tg in new:
            if tg.path and tg.name in down_names:
                events.append(("restart", tg, f"{tg.name} is back as pid {tg.pid} ({tg.path})"))
            else:
                events.append(("attach", tg, tg.path or (f"{tg.kind} {tg.where}" if is_engine(tg)
                                                         else "no segment")))
        return keep + new, events

    def _segment_paths(self) -> list[str]:
        """The directory's segment files, listed again only when the directory changed.

        Creating or removing a file changes the directory's mtime, so an unchanged mtime means
        an unchanged listing, with one catch: file times come from a coarse clock, and a file
        created within the same clock tick as the previous change would leave the mtime as it
        was. A listing is therefore reused only once the mtime it was taken at is well in the
        past (100 ms, many ticks of any kernel clock). A directory that is missing, not ours or
        cannot be listed is reported once (again if it comes back and goes again)."""
        try:
            check_directory(self.directory)
            st = os.stat(self.directory)
            key = (st.st_ino, st.st_mtime_ns)
            cached = self._paths_cache
            if cached is not None and cached[0] == key and cached[2]:
                return cached[1]
            settled = time.time_ns() - st.st_mtime_ns > 100_000_000
            names = os.listdir(self.directory)
        except SegmentError as exc:
            return self._directory_failed(str(exc))
        except OSError as exc:
            return self._directory_failed(f"{self.directory}: cannot list the segment directory "
                                          f"({exc.strerror}); run easymats as the user that runs the runtime")
        self.directory_problem = None
        paths = sorted(os.path.join(self.directory, n) for n in names if n.endswith(".seg"))
        self._paths_cache = (key, paths, settled)
        return paths

    def _directory_failed(self, why: str) -> list[str]:
        if why != self.directory_problem:
            self.directory_problem = why
            self._directory_reports += 1
            self._report(f"dir-{self._directory_reports}", why, None)
        self._paths_cache = None
        return []
