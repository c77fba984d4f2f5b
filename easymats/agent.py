"""The easymats agent: attach to processes, sample them on a fixed schedule, fan the samples out.

Threads, and why each exists:

- the **sampler** reads every target's segment on a drift-free monotonic schedule (tick k runs at
  start + k * interval; a late tick is measured as lag and missed ticks are skipped, never
  bunched), writes the log lines and keeps peaks; segment reads are bounded preads on tmpfs, so
  a dead or busy target cannot hold the others up;
- the **NVML** thread reads GPUs at ``nvml_interval`` (per-process utilization costs ~1.4 ms per
  device), so a slow driver call never delays a sample;
- the **HTTP** thread (a small socketserver handler) renders /metrics from the latest samples;
- the caller's thread runs :meth:`Agent.run`: the live view or summary lines, and signals.

Use from the CLI (``easymats --pid ...``) or as a library::

    agent = Agent(pids=[1234], interval=0.1, output="run.log", listen=("127.0.0.1", 0))
    agent.start()          # or agent.run() to block until the targets are gone
    ...; agent.stop(); agent.wait()
"""

from __future__ import annotations

import collections
import errno
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, Callable, Iterable, TextIO

from .discovery import Discovery
from .exporter import AgentCollector, LagHistogram, make_registry, serve
from .httpserve import BoundedServer
from .liveview import WINDOW_S as view_window_s, LiveView
from .logwriter import LogWriter
from .nvml import Nvml, NvmlSnapshot
from .procmetrics import owner_of
from .segment import control_path, segment_dir
from .source import Source
from .sources.attach import EngineAttach
from .targets import Target

DISCOVERY_INTERVAL_S = 1.0
PROCESS_INTERVAL_S = 1.0  # psutil reads: CPU and RSS move slowly, no need for every tick
# A target whose heartbeat stands still this long (its process alive) is down: hung or stopped.
# Writers publish at least once a second while idle (docs/segment.md 5).
STALE_AFTER_S = 10.0
# /metrics reports a target up only if its last sample is this recent (or 10 intervals).
SAMPLE_MAX_AGE_S = 2.0
# run() owns the process (as the CLI does): the interpreter's thread switch interval drops from
# 5 ms to this, so a sampler tick waiting for the GIL behind busy /metrics threads is late by
# about a millisecond, not by several 5 ms turns.
GIL_SWITCH_INTERVAL_S = 0.001
# After SIGINT/SIGTERM the sampler finishes its tick and stops; one stuck in a system call (a hung
# file system under the log) gets this long before the process exits without it.
STOP_TIMEOUT_S = 5.0



class AgentError(Exception):
    """A problem the user caused and can fix; the message is one line naming the fix."""


class Agent:
    def __init__(self, pids: Iterable[int], *, children: bool = False, interval: float = 0.1,
                 output: str | None = None, max_bytes: int = 100 << 20, backups: int = 5,
                 listen: tuple[str, int] | None = None, nvml_interval: float = 1.0,
                 duration: float | None = None, keep_serving: bool = False, view: str = "auto",
                 peak_window: float = 15.0, directory: str | None = None,
                 argv: Iterable[str] = (), out: TextIO | None = None, err: TextIO | None = None,
                 nvml: Nvml | None = None, stale_after: float | None = STALE_AFTER_S,
                 scrapes: Iterable[str] = (), follow_logs: Iterable[str] = (), scrape_timeout: float | None = None):
        self.pids = list(dict.fromkeys(int(p) for p in pids))
        # Engine sources (vLLM/SGLang endpoints, SGLang PIDs, decode logs): easymats/sources/.
        try:
            self.engines = EngineAttach(scrapes, follow_logs, self.pids, interval=interval,
                                        timeout=scrape_timeout, peak_window_s=peak_window)
        except ValueError as exc:
            raise AgentError(str(exc)) from None
        self.children = children
        self.interval = interval
        self.output = output
        self.max_bytes = max_bytes
        self.backups = backups
        self.listen = listen
        self.nvml_interval = nvml_interval
        self.duration = duration
        self.keep_serving = keep_serving
        self.view = view  # auto | table | line | none
        self.peak_window = peak_window
        self.directory = directory or segment_dir()
        self.argv = list(argv)
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.nvml = nvml or Nvml()
        self.discovery = Discovery(self.directory, self.pids, children=children, keep_serving=keep_serving,
                                   peak_window=peak_window, report=self._report, stale_after=stale_after,
                                   engines=self.engines)

        self.lag = LagHistogram()
        self.collector = AgentCollector(lambda: self._targets, self.lag, lambda: self._gpu, peak_window,
                                        log=lambda: self.log,
                                        sample_max_age_s=max(SAMPLE_MAX_AGE_S, 10 * interval),
                                        # Targets, lag, peaks and the log change only within a tick.
                                        version=lambda: (self.ticks, id(self._gpu)))
        self.registry = make_registry(self.collector)  # the webhook may register its own collector
        self.log: LogWriter | None = None
        self.port: int | None = None
        self.started_mono: float | None = None
        self.first_sample_mono: float | None = None
        self.ticks = 0
        self._targets: list[Target] = []  # replaced whole, never mutated in place
        self._gpu: NvmlSnapshot | None = None
        self._stop = threading.Event()
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: BoundedServer | None = None
        self._opened = False
        self._closed = False
        self._warned: set[str] = set()
        self._next_discovery = 0.0
        self._next_process = 0.0
        self._added: collections.deque[Target] = collections.deque()  # from add_source, any thread
        self.failure: str | None = None  # why the agent could not do its job (exit status 1)

    # -- public ------------------------------------------------------------------------------------
    @property
    def targets(self) -> list[Target]:
        return self._targets

    @property
    def down_retention_s(self) -> float:
        """How long a target that went down stays on /metrics (easymats_target_up 0)."""
        return self.discovery.down_retention_s

    @down_retention_s.setter
    def down_retention_s(self, seconds: float) -> None:
        self.discovery.down_retention_s = seconds

    def add_source(self, source: Source) -> Target:
        """Sample ``source`` (any kind of :class:`easymats.source.Source`) as one more target from
        the next tick: exported, logged, bounded and judged up or down like a segment's."""
        tg = Target(source.pid, source=source, peak_window_s=self.peak_window,
                    stale_after_s=self.discovery.stale_after)
        self._added.append(tg)  # the sampler thread owns the target list: it takes it from here
        return tg

    def resolve(self, name: str) -> tuple[str, str] | None:
        """(declared name, control-file path) of the live target declared as ``name`` or with
        that pid; None if no attached target is."""
        wanted = str(name).strip()
        for tg in self._targets:
            if tg.gone or not tg.path:
                continue
            if tg.name == name or str(tg.pid) == wanted:
                return tg.name, control_path(tg.path)
        return None

    def resolve_target(self, name: str) -> str | None:
        """Control-file path of the live target declared as ``name`` (or with that pid)."""
        found = self.resolve(name)
        return found[1] if found else None

    def open(self) -> None:
        """Check the PIDs, attach, open the log and the HTTP server. AgentError on user mistakes."""
        if self._opened:
            return
        self.started_mono = time.monotonic()
        for pid in self.pids:
            self._check_pid(pid)
        if self.output:
            try:
                self.log = LogWriter(self.output, interval_s=self.interval, max_bytes=self.max_bytes,
                                     backups=self.backups, argv=self.argv, warn=self._say)
            except OSError as exc:
                raise AgentError(f"cannot write the log {self.output}: {exc.strerror or exc}; "
                                 "choose another --output") from None
        self._event("agent_start", detail=f"pids={','.join(map(str, self.pids))} "
                    f"interval={self.interval:g} dir={self.directory}")
        self._discover()
        self._attach_engines()
        if self.listen is not None:
            host, port = self.listen
            try:
                self._server, _ = serve(self.registry, host, port)
            except OSError as exc:
                self._close_log()
                if exc.errno == errno.EADDRINUSE:
                    raise AgentError(f"port {port} on {host} is already in use (another easymats?): "
                                     "choose another with --listen HOST:PORT, or --listen none") from None
                raise AgentError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                                 "fix --listen") from None
            self.port = self._server.server_port
        self._opened = True

    def start(self) -> None:
        """Open and start sampling in background threads; returns at once."""
        self.open()
        sampler = threading.Thread(target=self._sampler_loop, name="easymats-sampler", daemon=True)
        self._threads.append(sampler)
        sampler.start()
        if self.nvml_interval > 0:
            t = threading.Thread(target=self._nvml_loop, name="easymats-nvml", daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the sampler has finished (stopped, duration over, or every target gone)."""
        if self._threads:
            self._threads[0].join(timeout)
            if self._threads[0].is_alive():
                return False
        self.close()
        return True

    def run(self) -> int:
        """Sample until stopped (SIGINT/SIGTERM, --duration, or every target gone); exit status:
        0, or 1 when the agent could not do all of its job (the sampler failed or did not stop,
        or log lines were dropped)."""
        restore = self._install_signals()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, GIL_SWITCH_INTERVAL_S))
        try:
            self.start()
            mode = self._view_mode()
            view = LiveView(colour=mode == "table")
            period = 0.25 if mode == "table" else 1.0
            while not self._done.wait(period if mode != "none" else 0.5):
                if self._stop.is_set():
                    break
                if mode == "none":
                    continue
                targets = self._targets
                view.observe(targets, time.monotonic())
                try:
                    if mode == "table":
                        view.draw(self.out, targets, self._title())
                    else:
                        print(view.summary_line(targets, time.strftime("%H:%M:%S")), file=self.out,
                              flush=True)
                except (BrokenPipeError, ValueError):  # the reader of our stdout went away
                    mode = "none"
            if not self.wait(STOP_TIMEOUT_S):
                # Threads are daemons: the process ends without the stuck sampler.
                self.failure = self.failure or f"the sampler did not stop within {STOP_TIMEOUT_S:g} s"
                self._say(self.failure)
        finally:
            restore()
            sys.setswitchinterval(switch)
        return self.exit_status()

    def exit_status(self) -> int:
        code = 1 if self.failure else 0
        if self.log is not None and self.log.dropped_lines:
            self._say(f"{self.log.dropped_lines} lines of the log {self.output} were dropped while it "
                      "could not be written: the log is incomplete")
            code = 1
        return code

    def close(self) -> None:
        """Stop everything and flush the log; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._threads[1:]:
            t.join(timeout=2.0)
        hook = getattr(self, "webhook", None)  # set by easymats.webhook.start_webhook
        if hook is not None and hasattr(hook, "close"):
            hook.close()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._close_log()
        for tg in self._targets:
            tg.close()
        self.nvml.close()

    # -- checks and discovery ------------------------------------------------------------------------
    def _check_pid(self, pid: int) -> None:
        if pid == os.getpid():
            raise AgentError(f"PID {pid} is easymats itself; give the PID of the HiSparse process")
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise AgentError(f"no process with PID {pid} (it may have exited; check with: "
                             f"ps -p {pid})") from None
        except PermissionError:
            raise AgentError(f"permission denied for PID {pid}: it belongs to {owner_of(pid)}; run "
                             f"easymats as that user (segments are readable only by their owner)") from None

    def _attach_engines(self) -> None:
        """Scrape and stand-alone decode-log targets (engine PIDs attach in discovery)."""
        try:
            engines = self.engines.start(taken={tg.name for tg in self._targets})
        except ValueError as exc:
            self._close_log()
            raise AgentError(str(exc)) from None
        for tg in engines:
            self._event("attach", tg, detail=f"{tg.kind} {tg.where}")
        self._targets = [*self._targets, *engines]

    def _say(self, message: str) -> None:
        try:
            print(f"easymats: warning: {message}", file=self.err, flush=True)
        except (OSError, ValueError):  # stderr gone (a closed pipe): the log and /metrics still say it
            pass

    def _warn(self, key: str, message: str) -> None:
        """Say ``message`` once per ``key``."""
        if key in self._warned:
            return
        self._warned.add(key)
        self._say(message)

    def _report(self, key: str, message: str, pid: int | None = None) -> None:
        """Say ``message`` once per ``key``: on stderr and as a ``warning`` event in the log."""
        if key in self._warned:
            return
        self._warn(key, message)
        if self.log is not None:
            self.log.event("warning", pid=pid, detail=message)

    def _discover(self) -> None:
        self._targets, events = self.discovery.scan(self._targets)
        for event, tg, detail in events:
            self._event(event, tg, detail=detail)
        while self._added:
            tg = self._added.popleft()
            self._targets = self._targets + [tg]  # replaced whole: readers keep iterating the old list
            self._event("attach", tg, detail=tg.path or tg.name)

    # -- threads -------------------------------------------------------------------------------------
    def _sampler_loop(self) -> None:
        interval = self.interval
        start = time.monotonic()
        deadline = start + self.duration if self.duration else None
        k = 0
        try:
            while not self._stop.is_set():
                scheduled = start + k * interval
                now = time.monotonic()
                if now < scheduled:
                    if self._stop.wait(scheduled - now):
                        break
                    now = time.monotonic()
                lag = now - scheduled
                self.lag.observe(lag)
                self._tick(now, lag)
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if not self.keep_serving and self._targets and all(tg.gone for tg in self._targets):
                    break
                # Drift-free: the next tick is on the grid; ticks missed while late are skipped.
                k = max(k + 1, int((time.monotonic() - start) / interval) + 1)
        except BaseException as exc:  # a bug must not leave a silent agent behind
            # Nothing is sampled any more: no target may stay "up" on /metrics.
            self.failure = f"internal error in the sampler: {type(exc).__name__}: {exc}"
            for tg in self._targets:
                tg.up = False
            self._say(self.failure)
            import traceback
            traceback.print_exc(file=self.err)
        finally:
            # Stop first: whatever the last event does, stop() and run() must see the end.
            self._stop.set()
            try:
                self._event("agent_stop", detail=f"ticks={self.ticks}")
            finally:
                self._done.set()

    def _tick(self, mono: float, lag: float) -> None:
        t = time.time()
        if mono >= self._next_discovery or self._added:
            self._next_discovery = mono + DISCOVERY_INTERVAL_S
            self._discover()
        read_process = mono >= self._next_process
        if read_process:
            self._next_process = mono + max(PROCESS_INTERVAL_S, self.interval)
        gpu = self._gpu
        lines = []
        downs = []
        for tg in self._targets:
            if tg.gone:
                continue
            try:
                went_down, _ = tg.sample(t, mono)
                if read_process or tg.process is None:
                    tg.read_process()
                if gpu is not None and gpu is not tg.gpu_source:
                    tg.gpu, tg.gpu_source = gpu.for_pid(tg.pid), gpu
                if self.log is not None:
                    lines.append(tg.log_json(t, lag))
            except Exception as exc:  # one target's surprise (a bug) must not stop the others
                tg.up, tg.error = False, f"internal error sampling this target: {type(exc).__name__}: {exc}"
                self._warn(f"bug-{id(tg)}", f"target {tg.name!r}: {tg.error}")
                continue
            if tg.error_kind is not None and tg.error_kind != "busy":
                # A segment that reads badly (bad layout, over budget): named once, not per sample.
                self._report(f"{tg.path}-{tg.error_kind}", f"target {tg.name!r}: {tg.error}", tg.pid)
            if went_down:
                downs.append(tg)
        if self.log is not None:
            self.log.write_text_lines(lines)
        for tg in downs:
            self._event("down", tg, detail=tg.error or "")
            self.discovery.forget_rejections()
        self.ticks += 1
        if self.first_sample_mono is None and self._targets:
            self.first_sample_mono = time.monotonic()

    def _nvml_loop(self) -> None:
        if not self.nvml.available():
            return  # GPU metrics stay absent: no driver here
        start = time.monotonic()
        k = 0
        while not self._stop.is_set():
            self._gpu = self.nvml.read({tg.pid for tg in self._targets if not tg.gone})
            k = max(k + 1, int((time.monotonic() - start) / self.nvml_interval) + 1)
            if self._stop.wait(max(0.0, start + k * self.nvml_interval - time.monotonic())):
                break

    # -- helpers -------------------------------------------------------------------------------------
    def _event(self, event: str, tg: Target | None = None, detail: str = "") -> None:
        if self.log is not None:
            self.log.event(event, target=tg.name if tg else None, pid=tg.pid if tg else None,
                           detail=detail)

    def _close_log(self) -> None:
        if self.log is not None:
            self.log.close()

    def _title(self) -> str:
        where = f"http://{self.listen[0]}:{self.port}/metrics" if self.listen else "off"
        up = sum(1 for tg in self._targets if tg.up)
        return (f"easymats {time.strftime('%H:%M:%S')}  targets up {up}/{len(self._targets)}  "
                f"interval {self.interval:g}s  window {view_window_s:g}s  /metrics {where}  "
                f"log {self.output or 'off'}  (Ctrl-C stops)")

    def _view_mode(self) -> str:
        if self.view != "auto":
            return self.view
        try:
            return "table" if self.out.isatty() else "line"
        except (AttributeError, ValueError):
            return "line"

    def _install_signals(self):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}

        def handler(signum: int, frame: object) -> None:
            self.stop()
            # A second SIGINT/SIGTERM ends the process at once, whatever the agent is doing.
            for sig in previous:
                signal.signal(sig, signal.SIG_DFL)

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)

        def restore() -> None:
            for sig, h in previous.items():
                signal.signal(sig, h)
        return restore
