"""The runtime's reader of its control file: a recalibration request is taken once and acknowledged
when done; an unknown action is acknowledged as refused; without a segment nothing is read."""

import time

from easymats import telemetry
from easymats.segment import control_path
from hi_sparse.control import POLL_INTERVAL_S, REFUSED, ControlReader


def _poll_until(reader: ControlReader, want: bool, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reader.recalibration_requested() == want:
            return True
        time.sleep(POLL_INTERVAL_S / 2)
    return False


def test_a_recalibration_request_is_taken_once_and_acknowledged_when_done(segment_dir):
    seg = telemetry.open_segment("control-reader")
    reader = ControlReader(seg)
    agent = telemetry.ControlFile.open_existing(control_path(seg.path))
    assert not reader.recalibration_requested()
    req = agent.request("recalibrate", reason="AnchorHitRateLow", requester="test")
    assert _poll_until(reader, True)
    assert agent.acked()[0] != req                      # not before the recalibration is done
    reader.acknowledge()
    assert agent.acked()[0] == req and agent.acked()[2] == 0
    time.sleep(POLL_INTERVAL_S)
    assert not reader.recalibration_requested()          # the same request is not taken twice
    seg.close()


def test_an_unknown_action_is_acknowledged_as_refused(segment_dir):
    seg = telemetry.open_segment("control-refuse")
    reader = ControlReader(seg)
    agent = telemetry.ControlFile.open_existing(control_path(seg.path))
    req = agent.request("defragment", reason="test", requester="test")
    deadline = time.monotonic() + 2.0
    while agent.acked()[0] != req and time.monotonic() < deadline:
        assert not reader.recalibration_requested()
        time.sleep(POLL_INTERVAL_S / 2)
    assert agent.acked()[0] == req and agent.acked()[2] == REFUSED
    seg.close()


def test_without_a_segment_nothing_is_requested():
    reader = ControlReader(None)
    assert not reader.recalibration_requested()
    reader.acknowledge()                                 # nothing pending: a no-op
