"""Heartbeats: a target that stops publishing but stays alive is not up; an idle runtime is.

The segment contract asks writers to publish at least once a second while idle, so that a
reader can tell a hung process (alive, heartbeat still) from an idle one; the reference writer
does it by itself. A still heartbeat older than ``--stale-after`` makes the target down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers_agent import agent_proc, finish, scrape, target_proc, value, wait_for  # noqa: E402
from helpers_targets import free_port  # noqa: E402

from easymats import telemetry  # noqa: E402
from easymats.segment import SegmentReader  # noqa: E402

pytestmark = pytest.mark.fault


def test_a_target_that_stops_publishing_but_lives_is_not_up(procs):
    target, _ = target_proc(procs)
    port = free_port()
    agent = agent_proc(procs, "--pid", str(target.pid), "--listen", f"127.0.0.1:{port}", "--quiet",
                       "--stale-after", "1")
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="decode-0") == 1.0)
    target.send_signal(signal.SIGSTOP)  # alive (its pid, its start time), publishing nothing
    try:
        wait_for(lambda: value(scrape(port), "easymats_target_up", target="decode-0") == 0.0, timeout=8)
    finally:
        target.send_signal(signal.SIGCONT)
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="decode-0") == 1.0, timeout=8)
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    assert code == 0, err


IDLE_RUNTIME = textwrap.dedent("""
    import time
    from easymats import telemetry
    seg = telemetry.open_segment(name="idle-0")
    seg.gauge("hisparse_sequences").set(0)
    seg.publish()
    print(seg.path, flush=True)
    time.sleep(60)   # no decoding, no publish() call: the writer still beats
""")


def test_an_idle_runtime_keeps_its_heartbeat_and_stays_up(procs):
    idle = subprocess.Popen([sys.executable, "-c", IDLE_RUNTIME], stdout=subprocess.PIPE, text=True)
    procs.append(idle)
    path = idle.stdout.readline().strip()
    with SegmentReader(path) as r:
        first = r.read().heartbeat_mono_ns
        time.sleep(2.5)
        assert r.read().heartbeat_mono_ns > first, "a writer beats at least once a second while idle"
    port = free_port()
    agent = agent_proc(procs, "--pid", str(idle.pid), "--listen", f"127.0.0.1:{port}", "--quiet",
                       "--stale-after", "2")
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="idle-0") == 1.0)
    time.sleep(3.0)
    assert value(scrape(port), "easymats_target_up", target="idle-0") == 1.0
    agent.send_signal(signal.SIGTERM)
    finish(agent)


def test_the_idle_heartbeat_stops_with_the_segment(segment_dir):
    seg = telemetry.open_segment(name="w")
    seg.publish()
    path = seg.path
    seg.close()
    assert not os.path.exists(path)
    time.sleep(1.2)  # the beat thread must not recreate or touch anything
    assert os.listdir(segment_dir) == []
