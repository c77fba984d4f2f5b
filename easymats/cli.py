"""The ``easymats`` command line.

``easymats --pid 1234 --interval 0.1 --output run.log`` attaches to a process (the group itself
runs the agent when no subcommand is given). Subcommands are imported only when they are called,
from :data:`LAZY_SUBCOMMANDS`, so ``easymats --help`` stays fast and a missing optional module
breaks only its own command.
"""

from __future__ import annotations

import importlib
import re
import sys
from typing import Any

import click

from .usage import DEFAULT_LISTEN, UsageFailure, check_interval, parse_listen

LAZY_SUBCOMMANDS: dict[str, str] = {
    "ls": "easymats.ls:ls",
    "demo": "easymats.demo:demo",
    "report": "easymats.report.cli:report",
    "doctor": "easymats.report.cli:doctor",
    "recalibrate": "easymats.recalibrate:recalibrate",
}

_PID_LIST_RE = re.compile(r"^[\d,\s]+$")


def _unavailable(name: str, target: str, why: str) -> click.Command:
    def run() -> None:
        raise UsageFailure(f"command {name!r} is not available in this install ({target}: {why})")
    return click.Command(name, callback=run, help=f"(not available: {why})",
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use, from a name -> "module:attr" table."""

    def __init__(self, *args: Any, lazy: dict[str, str], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.commands:
            return self.commands[cmd_name]
        target = self.lazy.get(cmd_name)
        if target is None:
            return None
        module_name, _, attr = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # the module, or something it needs, is not installed
            return _unavailable(cmd_name, target, f"cannot import {exc.name or module_name}")
        command = getattr(module, attr, None)
        if not isinstance(command, click.Command):
            return _unavailable(cmd_name, target, f"{module_name} has no command {attr!r}")
        return command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _join_pid_words(args))

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Listing must not import every subcommand (that is what keeps --help fast).
        rows = [(name, self.commands[name].get_short_help_str() if name in self.commands else "")
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl([(n, h or _LAZY_HELP.get(n, "")) for n, h in rows])


_LAZY_HELP = {
    "ls": "List live and stale telemetry segments on this machine.",
    "demo": "Run a small HiSparse workload with the agent attached.",
    "report": "Analyse an easymats log.",
    "doctor": "Check a log and this machine for common problems.",
    "recalibrate": "Ask a runtime to recalibrate and wait for its acknowledgement.",
}


def _join_pid_words(args: list[str]) -> list[str]:
    """``--pid $(pgrep x)`` unquoted splits into ``--pid 1 2 3``: fold the bare PIDs back in."""
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        out.append(a)
        i += 1
        if a == "--pid" and i < len(args):
            value = args[i]
            i += 1
            while i < len(args) and _PID_LIST_RE.match(args[i]):
                value += "," + args[i]
                i += 1
            out.append(value)
    return out


def parse_pids(values: tuple[str, ...] | list[str]) -> list[int]:
    """PIDs from ``--pid`` values; each may hold several separated by newlines, spaces or commas."""
    pids: list[int] = []
    for value in values:
        for word in re.split(r"[\s,]+", value.strip()):
            if not word:
                continue
            if not word.isdigit() or int(word) <= 0:
                raise UsageFailure(f"--pid {word!r} is not a process id (give a positive number, "
                                   "e.g. --pid $(pgrep -f 'python infer.py'))")
            if int(word) not in pids:
                pids.append(int(word))
    return pids


@click.group(cls=LazyGroup, lazy=LAZY_SUBCOMMANDS, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--pid", "pid_values", multiple=True, metavar="PID",
              help="Process to attach to (repeatable; also what pgrep prints: PIDs separated by "
                   "newlines, spaces or commas).")
@click.option("--children", is_flag=True, help="Also follow descendants that open segments later.")
@click.option("--scrape", "scrapes", multiple=True, metavar="[NAME=]URL",
              help="An engine's Prometheus endpoint to read at every --interval (vLLM, SGLang: "
                   "http://HOST:PORT/metrics); repeatable, mixes with --pid (docs/engines.md).")
@click.option("--scrape-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds a --scrape read (or an engine PID's files) may take; below --interval "
                   "[default: 0.8 x --interval].")
@click.option("--follow-log", "follow_logs", multiple=True, type=click.Path(dir_okay=False), metavar="FILE",
              help="SGLang's log file: read its HiSparse decode line (#gpu token, #cpu token); with "
                   "one --pid it joins that PID's target.")
@click.option("--interval", type=float, default=0.1, show_default=True,
              help="Seconds between samples (0.01..60).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), default=None,
              help="Write every sample to this JSON Lines log (docs/log-format.md).")
@click.option("--max-bytes", type=click.IntRange(min=4096), default=100 * 1024 * 1024,
              show_default=True, help="Rotate the log when it reaches this size.")
@click.option("--backups", type=click.IntRange(min=0), default=5, show_default=True,
              help="Rotated logs to keep (run.log.1 is the newest).")
@click.option("--listen", default=DEFAULT_LISTEN, show_default=True,
              help="Serve Prometheus /metrics on HOST:PORT ('' or 'none' turns it off).")
@click.option("--nvml-interval", type=float, default=1.0, show_default=True,
              help="Seconds between NVML (GPU) samples.")
@click.option("--duration", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop after this many seconds.")
@click.option("--keep-serving", is_flag=True,
              help="Keep running when every target is gone; pick up new segments (without --pid: "
                   "every segment of this user).")
@click.option("--quiet", "-q", is_flag=True, help="No live view and no summary lines.")
@click.option("--peak-window", type=click.FloatRange(min=0, min_open=True), default=15.0,
              show_default=True, help="Seconds over which the *_max peak gauges take their maximum.")
@click.option("--stale-after", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="A target whose heartbeat has not moved for this many seconds while its process "
                   "lives is down (hung or stopped); 0 turns the check off.")
@click.option("--webhook-listen", default=None, metavar="HOST:PORT",
              help="Serve the Alertmanager webhook for recalibration (off by default).")
@click.option("--webhook-token-file", type=click.Path(dir_okay=False), default=None,
              help="File holding the bearer token the webhook requires.")
@click.version_option(package_name="easymats", prog_name="easymats")
@click.pass_context
def main(ctx: click.Context, pid_values: tuple[str, ...], children: bool, scrapes: tuple[str, ...],
         scrape_timeout: float | None, follow_logs: tuple[str, ...], interval: float,
         output: str | None, max_bytes: int, backups: int, listen: str, nvml_interval: float,
         duration: float | None, keep_serving: bool, quiet: bool, peak_window: float,
         stale_after: float, webhook_listen: str | None, webhook_token_file: str | None) -> None:
    """Attach to HiSparse processes by PID (or to vLLM/SGLang with --scrape, an SGLang PID,
    --follow-log): sample their telemetry every --interval, log it, show it live and serve it to
    Prometheus."""
    if ctx.invoked_subcommand is not None:
        return
    pids = parse_pids(pid_values)
    if not pids and not keep_serving and not scrapes and not follow_logs:
        raise UsageFailure("no PID given: easymats --pid PID (e.g. --pid $(pgrep -f 'python infer.py')), "
                           "or --scrape http://HOST:PORT/metrics for a vLLM or SGLang server; "
                           "'easymats ls' lists processes that publish telemetry")
    check_interval(interval)
    check_interval(nvml_interval, "--nvml-interval")
    listen_addr = parse_listen(listen)
    webhook_addr = parse_listen(webhook_listen, "--webhook-listen")
    if webhook_token_file and not webhook_addr:
        raise UsageFailure("--webhook-token-file needs --webhook-listen HOST:PORT")

    from .agent import Agent, AgentError  # imported here: `easymats --help` and `ls` stay light

    try:
        agent = Agent(pids=pids, children=children, interval=interval, output=output,
                      max_bytes=max_bytes, backups=backups, listen=listen_addr,
                      nvml_interval=nvml_interval, duration=duration, keep_serving=keep_serving,
                      view="none" if quiet else "auto", peak_window=peak_window,
                      stale_after=stale_after or None, argv=sys.argv, scrapes=scrapes,
                      follow_logs=follow_logs, scrape_timeout=scrape_timeout)
        agent.open()
        if webhook_addr and webhook_listen:
            try:
                from . import webhook
            except ImportError as exc:
                agent.close()
                raise UsageFailure(f"--webhook-listen is not available in this install "
                                   f"(cannot import {exc.name})") from None
            try:
                webhook.start_webhook(webhook_listen, webhook_token_file, agent)
            except OSError as exc:
                agent.close()
                raise UsageFailure(f"--webhook-listen {webhook_listen}: cannot listen there "
                                   f"({exc.strerror or exc}); choose another HOST:PORT") from None
            except BaseException:
                agent.close()  # e.g. an unreadable token file: stop cleanly, then report it
                raise
    except AgentError as exc:
        raise UsageFailure(str(exc)) from None
    code = agent.run()
    ctx.exit(code)
