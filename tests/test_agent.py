"""The agent end to end: real target processes, the CLI as a subprocess, /metrics over HTTP,
the log validated against docs/log-format.md."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from helpers_agent import finish, read_log, scrape, start_agent, value, wait_for  # noqa: E402
from helpers_targets import free_port, start_target  # noqa: E402


def test_two_targets_metrics_and_log(tmp_path):
    a, _ = start_target("decode-0", duration=3.0)
    b, _ = start_target("decode-1", duration=3.0)
    port = free_port()
    log = tmp_path / "run.log"
    # Unquoted $(pgrep ...) with two matches: the second PID arrives as a separate word.
    agent = start_agent("--pid", str(a.pid), str(b.pid), "--interval", "0.1", "--output", str(log),
                        "--listen", f"127.0.0.1:{port}")
    m = wait_for(lambda: (lambda s: s if value(s, "easymats_samples_total", target="decode-1") else None)(scrape(port)))
    m = wait_for(lambda: (lambda s: s if (value(s, "easymats_samples_total", target="decode-0") or 0) >= 5
                          else None)(scrape(port)))
    assert value(m, "easymats_target_up", target="decode-0") == 1.0
    assert value(m, "easymats_target_up", target="decode-1") == 1.0
    assert value(m, "easymats_target_info", target="decode-0", pid=str(a.pid)) == 1.0
    # The pid is only in the info metric; runtime series carry the declared name.
    assert all("pid" not in lab for lab, _ in m["hisparse_tokens_total"])
    active = value(m, "hisparse_kv_blocks", target="decode-0", state="active")
    peak = value(m, "easymats_kv_active_blocks_max", target="decode-0")
    assert active is not None and peak is not None and peak >= active
    assert value(m, "easymats_device_kv_bytes_max", target="decode-0") >= 8192
    assert value(m, "hisparse_quant_block_relative_error_count", target="decode-0") is not None
    assert value(m, "easymats_process_resident_memory_bytes", target="decode-0") > 1e6
    assert value(m, "easymats_sample_lag_seconds_count") >= 5
    assert not [n for n in m if n.startswith("easymats_gpu_") or "process_gpu" in n]  # no NVML here
    code, out, err = finish(agent)
    a.wait(), b.wait()
    assert code == 0, err
    assert "Traceback" not in err
    lines = read_log(str(log))
    samples = [x for x in lines if x["kind"] == "sample"]
    by_target = {t: [x for x in samples if x["target"] == t] for t in ("decode-0", "decode-1")}
    for t, rows in by_target.items():
        assert len(rows) >= 15, t
        ups = [x for x in rows if x["up"]]
        assert all(x["metrics"]['hisparse_tokens_total{phase="decode"}'] >= 0 for x in ups)
        seqs = [x["seq"] for x in ups]
        assert seqs == sorted(seqs)
        tokens = [x["metrics"]['hisparse_tokens_total{phase="decode"}'] for x in ups]
        assert tokens == sorted(tokens) and tokens[-1] > tokens[0]
        assert rows[-1]["up"] is False and "exited" in rows[-1]["error"]
        # The last sample carries the final publish made at the target's clean exit.
        assert rows[-1]["metrics"]['hisparse_tokens_total{phase="decode"}'] >= tokens[-1]
        hist = rows[-2]["metrics"]["hisparse_step_duration_seconds"]
        assert len(hist["counts"]) == len(hist["bounds"]) + 1
    events = [(x["event"], x["target"]) for x in lines if x["kind"] == "event"]
    assert events[0] == ("agent_start", None) and events[-1] == ("agent_stop", None)
    assert ("down", "decode-0") in events and ("down", "decode-1") in events
    assert out.strip(), "a non-TTY agent prints one summary line per second"


def test_kill9_target_others_continue(tmp_path):
    a, _ = start_target("victim", duration=0)
    b, _ = start_target("survivor", duration=3.0)
    port = free_port()
    log = tmp_path / "run.log"
    agent = start_agent("--pid", f"{a.pid},{b.pid}", "--output", str(log), "--listen", f"127.0.0.1:{port}",
                        "--quiet")
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="victim") == 1.0)
    a.send_signal(signal.SIGKILL)
    a.wait()
    m = wait_for(lambda: (lambda s: s if value(s, "easymats_target_up", target="victim") == 0.0 else None)(
        scrape(port)))
    assert value(m, "easymats_target_up", target="survivor") == 1.0
    before = value(m, "easymats_samples_total", target="survivor")
    m2 = wait_for(lambda: (lambda s: s if value(s, "easymats_samples_total", target="survivor") > before + 3
                           else None)(scrape(port)))
    assert value(m2, "easymats_target_up", target="victim") == 0.0
    code, _, err = finish(agent)
    b.wait()
    assert code == 0, err
    lines = read_log(str(log))
    down = [i for i, x in enumerate(lines) if x["kind"] == "event" and x["event"] == "down" and x["target"] == "victim"]
    assert len(down) == 1
    after = [x for x in lines[down[0]:] if x["kind"] == "sample"]
    assert {x["target"] for x in after} == {"survivor"}, "the dead target is no longer sampled"
    assert len(after) >= 3
    victim = [x for x in lines if x["kind"] == "sample" and x["target"] == "victim"]
    assert victim[-1]["up"] is False and victim[-1]["metrics"], "the last sample keeps the last known metrics"


def test_restart_under_new_pid_with_keep_serving(tmp_path):
    a, _ = start_target("decode-0", duration=0)
    port = free_port()
    log = tmp_path / "run.log"
    agent = start_agent("--pid", str(a.pid), "--keep-serving", "--output", str(log),
                        "--listen", f"127.0.0.1:{port}", "--quiet")
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="decode-0") == 1.0)
    a.send_signal(signal.SIGKILL)
    a.wait()
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="decode-0") == 0.0)
    time.sleep(0.3)
    assert agent.poll() is None, "--keep-serving keeps the agent up with no live target"
    b, _ = start_target("decode-0", duration=0)
    m = wait_for(lambda: (lambda s: s if value(s, "easymats_target_info", target="decode-0", pid=str(b.pid))
                          else None)(scrape(port)))
    assert value(m, "easymats_target_up", target="decode-0") == 1.0
    assert len(m["easymats_target_up"]) == 1, "the restart replaces the old series, one per name"
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    b.send_signal(signal.SIGTERM)
    b.wait()
    assert code == 0, err
    lines = read_log(str(log))
    restarts = [x for x in lines if x["kind"] == "event" and x["event"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["pid"] == b.pid
    assert lines[-1]["kind"] == "event" and lines[-1]["event"] == "agent_stop"
    new = [x for x in lines if x["kind"] == "sample" and x["pid"] == b.pid]
    assert new and all(x["target"] == "decode-0" for x in new)


def test_sigint_loses_no_line_and_rotation_under_load(tmp_path):
    targets = [start_target(f"w{i}", rate=200, duration=0)[0] for i in range(3)]
    log = tmp_path / "run.log"
    agent = start_agent("--pid", " ".join(str(t.pid) for t in targets), "--interval", "0.02",
                        "--output", str(log), "--max-bytes", "60000", "--backups", "2",
                        "--listen", "none", "--quiet")
    wait_for(lambda: os.path.exists(f"{log}.2"), timeout=15)
    time.sleep(0.3)
    agent.send_signal(signal.SIGINT)
    code, _, err = finish(agent)
    for t in targets:
        t.send_signal(signal.SIGTERM)
        t.wait()
    assert code == 0, err
    assert not os.path.exists(f"{log}.3"), "--backups 2 keeps two rotated files"
    files = [f"{log}.2", f"{log}.1", str(log)]  # oldest first
    seen: dict[str, int] = {}
    for path in files:
        assert os.path.getsize(path) <= 60000
        with open(path, "rb") as f:
            raw = f.read()
        assert raw.endswith(b"\n"), f"{path} ends with a cut line"
        lines = read_log(path)
        for x in lines:
            if x["kind"] == "sample" and x["up"]:
                assert x["seq"] >= seen.get(x["target"], 0), "samples stay in order across rotation"
                seen[x["target"]] = x["seq"]
    assert set(seen) == {"w0", "w1", "w2"}
    assert read_log(str(log))[-1]["event"] == "agent_stop"


def test_pid_without_segment_keeps_process_metrics(tmp_path, segment_dir):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        port = free_port()
        agent = start_agent("--pid", str(sleeper.pid), "--listen", f"127.0.0.1:{port}", "--quiet",
                            "--duration", "1.5")
        m = wait_for(lambda: (lambda s: s if value(s, "easymats_process_resident_memory_bytes")
                              else None)(scrape(port)))
        name = f"pid-{sleeper.pid}"
        assert value(m, "easymats_target_up", target=name) == 0.0
        assert value(m, "easymats_process_cpu_seconds_total", target=name) is not None
        code, _, err = finish(agent)
        assert code == 0
        warnings = [line for line in err.splitlines() if "no telemetry segment" in line]
        assert len(warnings) == 1 and segment_dir in warnings[0] and str(sleeper.pid) in warnings[0]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_children_followed_when_they_open_segments_later(tmp_path):
    parent, _ = start_target("launcher", duration=2.5, extra=["--fork-child", "worker-1", "--child-delay", "0.8"])
    log = tmp_path / "run.log"
    agent = start_agent("--pid", str(parent.pid), "--children", "--output", str(log), "--listen", "none",
                        "--quiet")
    code, _, err = finish(agent, timeout=20)
    parent.wait()
    assert code == 0, err
    lines = read_log(str(log))
    attached = {x["target"] for x in lines if x["kind"] == "event" and x["event"] == "attach"}
    assert attached == {"launcher", "worker-1"}
    worker = [x for x in lines if x["kind"] == "sample" and x["target"] == "worker-1" and x["up"]]
    assert len(worker) >= 5 and worker[0]["pid"] != parent.pid


def test_duration_and_first_sample_fast(tmp_path):
    a, _ = start_target("decode-0", duration=0)
    try:
        log = tmp_path / "run.log"
        t0 = time.time()
        agent = start_agent("--pid", str(a.pid), "--output", str(log), "--listen", "none", "--quiet",
                            "--duration", "0.6")
        code, _, err = finish(agent)
        assert code == 0, err
        lines = read_log(str(log))
        samples = [x for x in lines if x["kind"] == "sample"]
        assert 5 <= len(samples) <= 8
        assert all(x["up"] for x in samples)
        # Drift-free schedule: consecutive samples 100 ms apart, no accumulated drift.
        span = samples[-1]["t"] - samples[0]["t"]
        assert abs(span - 0.1 * (len(samples) - 1)) < 0.05
        assert samples[0]["t"] - t0 < 3.0
    finally:
        a.send_signal(signal.SIGTERM)
        a.wait()


def test_keep_serving_without_pid_attaches_every_new_segment(tmp_path):
    port = free_port()
    agent = start_agent("--keep-serving", "--listen", f"127.0.0.1:{port}", "--quiet", "--duration", "6")
    try:
        scrape(port)
        a, _ = start_target("late-0", duration=0)
        try:
            m = wait_for(lambda: (lambda s: s if value(s, "easymats_target_up", target="late-0") == 1.0
                                  else None)(scrape(port)))
            assert value(m, "easymats_target_info", target="late-0", pid=str(a.pid)) == 1.0
        finally:
            a.send_signal(signal.SIGTERM)
            a.wait()
    finally:
        agent.send_signal(signal.SIGTERM)
        code, _, err = finish(agent)
    assert code == 0, err


def test_library_use_and_down_targets_expire(tmp_path):
    """Agent as a library (as the demo uses it): start, resolve_target, stop, wait."""
    from easymats.agent import Agent
    from easymats.segment import control_path

    a, a_path = start_target("keep", duration=0)
    b, _ = start_target("gone", duration=0)
    agent = Agent([a.pid, b.pid], interval=0.05, listen=("127.0.0.1", 0), view="none", keep_serving=True,
                  output=str(tmp_path / "run.log"))
    agent.down_retention_s = 0.5
    agent.start()
    try:
        assert agent.port and agent.port > 0
        wait_for(lambda: {t.name for t in agent.targets if t.up} == {"keep", "gone"})
        assert agent.resolve_target("keep") == control_path(a_path)
        assert agent.resolve_target(str(a.pid)) == control_path(a_path)
        assert agent.resolve_target("nosuch") is None
        b.send_signal(signal.SIGKILL)
        b.wait()
        wait_for(lambda: value(scrape(agent.port), "easymats_target_up", target="gone") == 0.0)
        assert agent.resolve_target("gone") is None
        wait_for(lambda: "gone" not in {t.name for t in agent.targets}, timeout=5)
        assert value(scrape(agent.port), "easymats_target_up", target="gone") is None
        assert agent.first_sample_mono - agent.started_mono < 0.5
    finally:
        agent.stop()
        assert agent.wait(timeout=5)
        a.send_signal(signal.SIGTERM)
        a.wait()
    assert read_log(str(tmp_path / "run.log"))[-1]["event"] == "agent_stop"


def test_two_processes_declaring_one_name_stay_distinct(tmp_path):
    a, _ = start_target("decode-0", duration=0)
    b, _ = start_target("decode-0", duration=0)
    port = free_port()
    agent = start_agent("--pid", f"{a.pid},{b.pid}", "--listen", f"127.0.0.1:{port}", "--quiet")
    try:
        def both_sampled(s):
            # both targets attached and sampled (a target still creating its segment reads up 0)
            up = s.get("easymats_target_up", [])
            sampled = len(up) == 2 and all(v == 1 for _, v in up)
            return s if sampled and len(s.get("hisparse_sequences", [])) == 2 else None

        m = wait_for(lambda: both_sampled(scrape(port)))
        names = {lab["target"] for lab, _ in m["easymats_target_up"]}
        assert "decode-0" in names and len(names) == 2, names
        # one series per target: the two processes' samples did not collapse into one name
        assert {lab["target"] for lab, _ in m["hisparse_sequences"]} == names
    finally:
        agent.send_signal(signal.SIGTERM)
        code, _, err = finish(agent)
        for p in (a, b):
            p.send_signal(signal.SIGTERM)
            p.wait()
    assert code == 0
    assert "declares the target name 'decode-0'" in err
