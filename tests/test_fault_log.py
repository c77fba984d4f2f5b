"""Faults of the log file: full disk, file size limit, deleted, rotated by logrotate.

The agent runs as a user runs it (the CLI in a subprocess, a real target process); the faults are
real (a full tmpfs gives ENOSPC, RLIMIT_FSIZE gives EFBIG, real logrotate renames or truncates).
Whatever happens to the log, sampling and /metrics go on, the failure shows on /metrics
(easymats_log_failing, easymats_log_dropped_lines_total) and on stderr once, SIGTERM stops the
agent, and every line that reached the file is a whole, valid line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers_agent import agent_proc, finish, samples_advance, scrape, target_proc, value, wait_for  # noqa: E402
from helpers_faults import file_size_limit, fill, small_filesystem  # noqa: E402
from helpers_logformat import validate_line  # noqa: E402
from helpers_targets import free_port  # noqa: E402

pytestmark = pytest.mark.fault


def lines_of(*paths: str) -> list[dict]:
    """Every line of the files, each checked: whole JSON, valid against docs/log-format.md."""
    out = []
    for path in paths:
        with open(path, "rb") as f:
            raw = f.read()
        assert not raw or raw.endswith(b"\n"), f"{path} ends with a cut line"
        for line in raw.splitlines():
            obj = json.loads(line)
            assert validate_line(obj) == [], (path, obj, validate_line(obj))
            out.append(obj)
    return out


def events(lines: list[dict], name: str) -> list[dict]:
    return [x for x in lines if x["kind"] == "event" and x["event"] == name]


def test_full_disk_the_agent_samples_on_counts_dropped_lines_and_recovers(procs):
    target, _ = target_proc(procs)
    with small_filesystem(192) as fs:
        filler = fill(fs, leave_bytes=24 << 10)
        log = os.path.join(fs, "run.log")
        port = free_port()
        agent = agent_proc(procs, "--pid", str(target.pid), "--interval", "0.05", "--output", log,
                           "--listen", f"127.0.0.1:{port}", "--quiet")
        try:
            wait_for(lambda: value(scrape(port), "easymats_log_failing") == 1.0, timeout=15)
            samples_advance(port)
            m = scrape(port)
            dropped = value(m, "easymats_log_dropped_lines_total")
            assert dropped and dropped > 0
            # still counting
            wait_for(lambda: value(scrape(port), "easymats_log_dropped_lines_total") > dropped, timeout=5)
            os.unlink(filler)  # space again: the agent retries the log every few seconds
            wait_for(lambda: value(scrape(port), "easymats_log_failing") == 0.0, timeout=15)
            samples_advance(port)
        finally:
            agent.send_signal(signal.SIGTERM)
            code, _, err = finish(agent, timeout=15)
        lines = lines_of(log)
        recovered = events(lines, "log_recovered")
        assert len(recovered) == 1 and "No space left on device" in recovered[0]["detail"]
        assert "dropped" in recovered[0]["detail"]
        after = lines[lines.index(recovered[0]):]
        assert [x for x in after if x["kind"] == "sample"], "samples are logged again after recovery"
        assert lines[-1]["kind"] == "event" and lines[-1]["event"] == "agent_stop"
    assert code == 1, "lines were dropped: the exit status says the log is incomplete"
    warnings = [line for line in err.splitlines() if "No space left on device" in line]
    assert len(warnings) == 1 and log in warnings[0], err
    assert "Traceback" not in err


def test_file_size_limit_never_wedges_the_agent_and_sigterm_stops_it(tmp_path, procs):
    target, _ = target_proc(procs)
    log = str(tmp_path / "run.log")
    port = free_port()
    # Every file the agent writes stops at 32 KiB: each later log write fails with EFBIG.
    agent = agent_proc(procs, "--pid", str(target.pid), "--interval", "0.05", "--output", log,
                       "--listen", f"127.0.0.1:{port}", "--quiet", preexec_fn=file_size_limit(32 << 10))
    wait_for(lambda: value(scrape(port), "easymats_log_failing") == 1.0, timeout=15)
    samples_advance(port)
    samples_advance(port)
    t0 = time.monotonic()
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent, timeout=15)
    assert time.monotonic() - t0 < 5.0, "SIGTERM stops the agent promptly"
    assert code == 1
    assert os.path.getsize(log) <= 32 << 10
    lines_of(log)  # whole lines only: a write cut short by the limit was taken back
    assert len([line for line in err.splitlines() if "File too large" in line]) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize("rotation", [[], ["--max-bytes", "40000", "--backups", "2"]],
                         ids=["no-rotation", "own-rotation"])
def test_a_deleted_log_is_noticed_reopened_and_said_so(tmp_path, rotation, procs):
    target, _ = target_proc(procs)
    log = str(tmp_path / "run.log")
    port = free_port()
    agent = agent_proc(procs, "--pid", str(target.pid), "--interval", "0.05", "--output", log,
                       "--listen", f"127.0.0.1:{port}", "--quiet", *rotation)
    try:
        wait_for(lambda: os.path.exists(log) and os.path.getsize(log) > 5000)
        os.unlink(log)
        wait_for(lambda: os.path.exists(log) and os.path.getsize(log) > 0, timeout=5)
        if rotation:  # keep going past the next own rotation: it must not trip over the deleted file
            wait_for(lambda: os.path.exists(f"{log}.1"), timeout=15)
        samples_advance(port)
        assert value(scrape(port), "easymats_log_failing") == 0.0
    finally:
        agent.send_signal(signal.SIGTERM)
        code, _, err = finish(agent)
    assert code == 0, err
    files = [p for p in (f"{log}.2", f"{log}.1", log) if os.path.exists(p)]
    lines = lines_of(*files)
    reopened = events(lines, "log_reopened")
    assert len(reopened) == 1 and "deleted" in reopened[0]["detail"], reopened
    assert lines[-1]["event"] == "agent_stop"
    assert "Traceback" not in err


LOGROTATE_CONF = """
{log} {{
    {mode}
    rotate 3
    missingok
    nocompress
}}
"""


@pytest.mark.parametrize("mode", ["create 0644", "copytruncate"])
def test_logrotate_rotates_the_log_under_a_running_agent(tmp_path, mode, procs):
    logrotate = shutil.which("logrotate") or ("/usr/sbin/logrotate" if os.path.exists("/usr/sbin/logrotate") else None)
    if logrotate is None:
        pytest.skip("logrotate is not installed: apt-get install logrotate (make system-deps does)")
    target, _ = target_proc(procs)
    log = str(tmp_path / "run.log")
    conf = tmp_path / "logrotate.conf"
    conf.write_text(textwrap.dedent(LOGROTATE_CONF.format(log=log, mode=mode)))
    port = free_port()
    agent = agent_proc(procs, "--pid", str(target.pid), "--interval", "0.05", "--output", log,
                       "--listen", f"127.0.0.1:{port}", "--quiet")
    try:
        wait_for(lambda: os.path.exists(log) and os.path.getsize(log) > 5000)
        out = subprocess.run([logrotate, "--force", "--state", str(tmp_path / "state"), str(conf)],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert os.path.exists(f"{log}.1")
        time.sleep(0.5)
        samples_advance(port)
        wait_for(lambda: os.path.getsize(log) > 2000)
    finally:
        agent.send_signal(signal.SIGTERM)
        code, _, err = finish(agent)
    assert code == 0, err
    old, new = lines_of(f"{log}.1"), lines_of(log)
    assert old[0]["kind"] == "header" and new[0]["kind"] == "header", "the new file starts with a header"
    expected = "log_reopened" if mode.startswith("create") else "log_truncated"
    assert len(events(new, expected)) == 1, [x.get("event") for x in new if x["kind"] == "event"]
    assert [x for x in new if x["kind"] == "sample"], "samples go to the new file"
    if mode.startswith("create"):
        # The renamed file got everything up to the rotation; nothing was written into a deleted inode.
        assert [x for x in old if x["kind"] == "sample"]
    assert new[-1]["event"] == "agent_stop"
