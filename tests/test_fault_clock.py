"""Wall-clock jumps under a running agent (an NTP step, a VM resumed): intervals are monotonic.

The agent's CLOCK_REALTIME is moved an hour back or forward with libfaketime (its monotonic clock
is not, as on a real machine); every interval the agent keeps (the sampling schedule, the peak
windows, how long a down target stays on /metrics) must not move with it.
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
from helpers_faults import jumping_clock_env  # noqa: E402
from helpers_targets import free_port  # noqa: E402

pytestmark = pytest.mark.fault


PEAK_RUNTIME = textwrap.dedent("""
    import time
    from easymats import telemetry
    seg = telemetry.open_segment(name="peaky")
    active = seg.gauge("hisparse_kv_blocks", state="active")
    active.set(500)
    seg.publish()
    print("ready", flush=True)
    t0 = time.monotonic()
    while True:
        active.set(500 if time.monotonic() - t0 < 3.0 else 10)
        seg.publish()
        time.sleep(0.01)
""")


@pytest.mark.parametrize("jump", ["-3600", "+3600"])
def test_wall_clock_jumps_change_no_interval(tmp_path, procs, jump):
    """The agent's wall clock jumps an hour: sampling keeps its 10 Hz, a peak leaves its window
    on time, and a target that went down stays on /metrics for its retention, not 0 s or 2 h."""
    offset = str(tmp_path / "faketime")
    env = jumping_clock_env(offset)
    peaky = subprocess.Popen([sys.executable, "-c", PEAK_RUNTIME], stdout=subprocess.PIPE, text=True)
    procs.append(peaky)
    assert peaky.stdout.readline().strip() == "ready"
    victim, _ = target_proc(procs, "victim")
    port = free_port()
    agent = agent_proc(procs, "--pid", f"{peaky.pid},{victim.pid}", "--listen", f"127.0.0.1:{port}", "--quiet",
                       "--peak-window", "2", "--keep-serving", env=env)
    wait_for(lambda: value(scrape(port), "easymats_kv_active_blocks_max", target="peaky") == 500.0)
    victim.send_signal(signal.SIGKILL)
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="victim") == 0.0)
    # The 500 ends 3 s after the start; the jump comes while it is still in the 2 s window.
    wait_for(lambda: value(scrape(port), "hisparse_kv_blocks", target="peaky", state="active") == 10.0)
    with open(offset, "w") as f:
        f.write(jump + "\n")
    time.sleep(0.3)
    before = value(scrape(port), "easymats_samples_total", target="peaky")
    time.sleep(2.0)
    m = scrape(port)
    taken = value(m, "easymats_samples_total", target="peaky") - before
    assert 12 <= taken <= 26, f"{taken} samples in 2 s at 10 Hz"
    assert value(m, "easymats_kv_active_blocks_max", target="peaky") == 10.0, "the 500 left its 2 s window"
    assert value(m, "easymats_target_up", target="victim") == 0.0, "still on /metrics within its retention"
    lag = value(m, "easymats_sample_lag_seconds_sum") / value(m, "easymats_sample_lag_seconds_count")
    assert lag < 0.05, lag
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    assert code == 0, err
