"""``easymats recalibrate --pid N``: ask a runtime to recalibrate by hand and wait for its
acknowledgement (the Alertmanager webhook writes the same request, easymats.webhook).

Exit status: 0 acknowledged; 1 not acknowledged in time, or acknowledged with a failure status;
2 a mistake the user can fix (no such process, no segment, a control file not ours).
"""

from __future__ import annotations

import time
from typing import Any

import click

from .control import RECALIBRATE, ControlFile
from .segment import SegmentError, control_path, read_segment, require_segments
from .usage import UsageFailure

DEFAULT_TIMEOUT_S = 10.0


class RecalibrationFailed(click.ClickException):
    """The request was written but not acknowledged (in time, or successfully): exit status 1."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        click.echo(f"easymats: {self.format_message()}", err=True)


def _control_files(pid: int) -> list[tuple[str, ControlFile]]:
    try:
        paths = require_segments(pid)
    except SegmentError as exc:
        raise UsageFailure(exc.detail) from None
    out = []
    for path in paths:
        try:
            name = read_segment(path).name
        except SegmentError as exc:
            raise UsageFailure(str(exc)) from None
        try:
            out.append((name, ControlFile.open_existing(control_path(path))))
        except FileNotFoundError:
            raise UsageFailure(f"{path} has no control file {control_path(path)}: the runtime does "
                               "not accept requests (or its segment is stale: easymats ls --clean)") from None
        except (OSError, ValueError) as exc:
            raise UsageFailure(f"cannot open {control_path(path)}: {getattr(exc, 'strerror', None) or exc}"
                               " (run easymats as the user that runs the runtime)") from None
    return out


@click.command("recalibrate")
@click.option("--pid", type=click.IntRange(min=1), required=True, help="The HiSparse process.")
@click.option("--reason", default="manual", show_default=True, help="Why (recorded by the runtime).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_TIMEOUT_S,
              show_default=True, help="Seconds to wait for the runtime's acknowledgement.")
def recalibrate(pid: int, reason: str, timeout: float) -> None:
    """Ask a runtime to recalibrate its anchors and probe, and wait for its acknowledgement."""
    files = _control_files(pid)
    t0 = time.monotonic()
    pending = []
    try:
        for name, ctl in files:
            pending.append((name, ctl, ctl.request(RECALIBRATE, reason, "cli")))
        deadline = t0 + timeout
        while pending:
            for item in list(pending):
                name, ctl, req_id = item
                ack_id, _, status = ctl.acked()
                if ack_id >= req_id:
                    pending.remove(item)
                    if status != 0:
                        raise RecalibrationFailed(f"pid {pid} ({name}) acknowledged request #{req_id} "
                                                  f"with failure status {status}; see the runtime's log")
                    click.echo(f"pid {pid} ({name}): recalibration request #{req_id} acknowledged in "
                               f"{(time.monotonic() - t0) * 1000:.0f} ms")
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{n} (request #{r})" for n, _, r in pending)
                raise RecalibrationFailed(
                    f"pid {pid} did not acknowledge {names} within {timeout:g} s: the request stays "
                    "queued; check that the runtime is decoding (it polls its control file between "
                    "steps) and not stopped, or wait longer with --timeout")
            time.sleep(0.01)
    finally:
        for _, ctl in files:
            ctl.close()
