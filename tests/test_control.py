"""The control file: agent requests, runtime acknowledgements, coalescing and agent locking."""

import json
import os
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from easymats import layout as L, segment, telemetry
from easymats.control import ControlFile

RUNTIME = textwrap.dedent("""
    import json, sys, time
    from easymats import telemetry
    seg = telemetry.open_segment(name="runtime")
    recal = seg.counter("hisparse_recalibrations_total", reason="request")
    seg.publish()
    print(seg.path, flush=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        req = seg.poll_control(min_interval_s=0.01)
        if req is not None:
            recal.inc()
            seg.publish()
            seg.ack(req, status=7)
            print(json.dumps([req.id, req.action, req.reason, req.requester]), flush=True)
            break
        time.sleep(0.002)
    sys.stdin.read()
""")


def test_request_and_ack_round_trip_across_processes():
    runtime = subprocess.Popen([sys.executable, "-c", RUNTIME], stdout=subprocess.PIPE,
                               stdin=subprocess.PIPE, text=True)
    try:
        path = runtime.stdout.readline().strip()
        agent = ControlFile.open_existing(segment.control_path(path))
        assert agent.acked()[0] == 0
        t0 = time.time_ns()
        req_id = agent.request("recalibrate", reason="anchor hit rate 0.71 < 0.80", requester="alertmanager")
        assert req_id == 1
        seen = json.loads(runtime.stdout.readline())
        assert seen == [1, "recalibrate", "anchor hit rate 0.71 < 0.80", "alertmanager"]
        ack_id, ack_ns, status = agent.acked()
        assert ack_id == req_id and status == 7 and ack_ns >= t0
        # The runtime counted it and published before acknowledging.
        assert segment.read_segment(path).get("hisparse_recalibrations_total", reason="request") == 1.0
    finally:
        runtime.stdin.close()
        runtime.wait(timeout=10)
    assert not os.path.exists(segment.control_path(path)), "close removes the control file"


def test_requests_coalesce_into_the_latest(segment_dir):
    seg = telemetry.open_segment(name="x")
    agent = ControlFile.open_existing(segment.control_path(seg.path))
    assert seg.poll_control() is None
    ids = [agent.request("recalibrate", reason=f"r{i}", requester="a") for i in range(3)]
    assert ids == [1, 2, 3]
    req = seg.poll_control()
    assert (req.id, req.action, req.reason, req.requester) == (3, "recalibrate", "r2", "a")
    assert req.requested_unix_ns > 0
    seg.ack(req)
    assert seg.poll_control() is None
    assert agent.acked()[0] == 3
    assert agent.request("recalibrate") == 4  # ids keep rising after an ack
    assert seg.poll_control().id == 4
    seg.close()


def test_poll_control_rate_limit(segment_dir):
    seg = telemetry.open_segment(name="x")
    agent = ControlFile.open_existing(segment.control_path(seg.path))
    assert seg.poll_control(min_interval_s=10) is None  # reads now, then not for 10 s
    agent.request("recalibrate")
    assert seg.poll_control(min_interval_s=10) is None
    assert seg.poll_control().id == 1  # an unlimited poll reads at once
    seg.close()


def test_long_and_multibyte_fields_are_cut_at_a_character_boundary(segment_dir):
    seg = telemetry.open_segment(name="x")
    agent = ControlFile.open_existing(segment.control_path(seg.path))
    agent.request("recalibrate", reason="é" * 100, requester="x" * 50)
    req = seg.poll_control()
    assert req.reason == "é" * (L.CTL_REASON_FIELD // 2) and req.requester == "x" * L.CTL_REQUESTER_FIELD
    seg.close()


def test_request_half_written_by_a_crashed_agent_is_not_taken(segment_dir):
    seg = telemetry.open_segment(name="x")
    ctl = segment.control_path(seg.path)
    agent = ControlFile.open_existing(ctl)
    agent.request("recalibrate", reason="first")
    fd = os.open(ctl, os.O_RDWR)
    try:  # an agent died between its odd write-sequence word and its request id
        w = L.U64.unpack(os.pread(fd, 8, L.CTL_OFF_WRITE_SEQ))[0]
        assert w % 2 == 0 and w > 0
        os.pwrite(fd, L.U64.pack(w + 1), L.CTL_OFF_WRITE_SEQ)
        os.pwrite(fd, b"half-writ".ljust(L.CTL_REASON_FIELD, b"\0"), L.CTL_OFF_REASON)
    finally:
        os.close(fd)
    assert seg.poll_control() is None
    assert agent.request("recalibrate", reason="second") == 2  # the next agent recovers the file
    req = seg.poll_control()
    assert (req.id, req.reason) == (2, "second")
    seg.close()


AGENT = textwrap.dedent("""
    import json, sys
    from easymats.control import ControlFile
    ctl = ControlFile.open_existing(sys.argv[1])
    sys.stdin.readline()  # start together
    print(json.dumps([ctl.request("recalibrate", reason=sys.argv[2]) for _ in range(int(sys.argv[3]))]))
""")


def test_two_agents_never_hand_out_the_same_id(segment_dir):
    """flock serialises agents: 2 x N concurrent requests get 2N distinct, gap-free ids."""
    seg = telemetry.open_segment(name="x")
    ctl = segment.control_path(seg.path)
    n = 300
    agents = [subprocess.Popen([sys.executable, "-c", AGENT, ctl, name, str(n)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True) for name in ("a", "b")]
    time.sleep(0.5)  # both have imported and opened the file
    for a in agents:
        a.stdin.write("go\n")
        a.stdin.flush()
    ids = []
    for a in agents:
        out, _ = a.communicate(timeout=60)
        assert a.returncode == 0
        got = json.loads(out)
        assert got == sorted(got)
        ids += got
    assert sorted(ids) == list(range(1, 2 * n + 1))
    req = seg.poll_control()
    assert req.id == 2 * n and req.reason in ("a", "b")
    seg.close()


def test_open_existing_refuses_what_is_not_a_control_file(segment_dir, tmp_path):
    seg = telemetry.open_segment(name="x")
    with pytest.raises(ValueError, match="not an easymats control file"):
        ControlFile.open_existing(seg.path)  # a segment, not a control file
    ctl = segment.control_path(seg.path)
    os.chmod(ctl, 0o644)
    with pytest.raises(ValueError, match="0644"):
        ControlFile.open_existing(ctl)
    os.chmod(ctl, 0o600)
    link = tmp_path / "link.ctl"
    os.symlink(ctl, link)
    with pytest.raises(OSError):
        ControlFile.open_existing(str(link))
    with pytest.raises(FileNotFoundError):
        ControlFile.open_existing(os.path.join(segment_dir, "999999.ctl"))
    seg.close()


def test_control_file_layout(segment_dir):
    seg = telemetry.open_segment(name="x")
    ctl = segment.control_path(seg.path)
    assert ctl.endswith(f"{os.getpid()}.ctl")
    ControlFile.open_existing(ctl).request("recalibrate", reason="why", requester="who")
    raw = open(ctl, "rb").read()
    assert len(raw) == L.CONTROL_SIZE
    magic, major, minor, bom, req_seq, ack_seq = struct.unpack_from("<8sHHIQQ", raw)
    assert (magic, major, minor, bom, req_seq, ack_seq) == (b"EZMATCTL", 1, 0, 0x01020304, 1, 0)
    assert raw[L.CTL_OFF_ACTION:L.CTL_OFF_ACTION + 11] == b"recalibrate"
    assert raw[L.CTL_OFF_REASON:L.CTL_OFF_REASON + 4] == b"why\0"
    assert raw[L.CTL_OFF_REQUESTER:L.CTL_OFF_REQUESTER + 4] == b"who\0"
    assert L.U64.unpack_from(raw, L.CTL_OFF_WRITE_SEQ)[0] == 2
    seg.close()
