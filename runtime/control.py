"""Requests from the agent: the runtime's reader of its segment's control file (docs/segment.md).

The agent (the Alertmanager webhook, or ``easymats recalibrate``) writes a request into the
process's ``<pid>.ctl``; the engine reads it at the end of a step through the segment's public
API (``poll_control``, ``ack``), at most every ``POLL_INTERVAL_S``, recalibrates and acknowledges
it. A request for an action the runtime does not know is acknowledged as refused (status 1).
"""

from __future__ import annotations

from easymats import telemetry

POLL_INTERVAL_S = 0.05     # the file is read at most this often (a read is a few syscalls)
REFUSED = 1


class ControlReader:
    def __init__(self, segment: telemetry.Segment | None) -> None:
        self._segment = segment
        self._pending: telemetry.ControlRequest | None = None

    def recalibration_requested(self) -> bool:
        """Whether a new recalibration request arrived since the last poll (rate-limited)."""
        if self._segment is None:
            return False
        request = self._segment.poll_control(min_interval_s=POLL_INTERVAL_S)
        if request is None:
            return False
        if request.action != "recalibrate":
            self._segment.ack(request, status=REFUSED)
            return False
        self._pending = request
        return True

    def acknowledge(self) -> None:
        """The requested recalibration is done: acknowledge the request (if one is pending)."""
        if self._pending is not None and self._segment is not None:
            self._segment.ack(self._pending)
        self._pending = None

    def close(self) -> None:
        self._segment = None
