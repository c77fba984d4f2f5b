"""`easymats report` and `easymats doctor` as a user runs them: the CLI in a subprocess, real
target processes (tests/helpers_targets.py), a real agent run, real HTML and PNG files."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import helpers_logs as H  # noqa: E402
from helpers_targets import start_target  # noqa: E402

EASYMATS = [sys.executable, "-c", "from easymats.cli import main; main()"]
NO_MATPLOTLIB = [sys.executable, "-c",
                 "import sys; sys.modules['matplotlib'] = None; from easymats.cli import main; main()"]


def run(*args: str, cmd=EASYMATS, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("easymats: "), p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def restart_log(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "run.log")
    H.write_scenario(path, "target_restart", 200.0)
    return path


def test_report_writes_self_contained_page_and_pngs(restart_log, tmp_path):
    out, pngs = tmp_path / "r.html", tmp_path / "png"
    p = run("report", restart_log, "--out", str(out), "--png", str(pngs))
    assert p.returncode == 0, p.stderr
    assert "[critical] decode-0: Target restarted 1 time(s)" in p.stdout
    page = out.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:|//|file:)""", page)  # nothing fetched from elsewhere
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    files = sorted(os.listdir(pngs))
    assert len(images) == len(files) >= 8
    assert all(base64.b64decode(b)[:8] == b"\x89PNG\r\n\x1a\n" for b in images)
    assert "decode-0-anchor_hit_rate.png" in files
    # the summary table and the finding with its evidence and change
    for needle in ("<th>p50</th>", "<th>p99</th>", "<th>max</th>", "time past threshold", "Anchor hit rate",
                   "Target restarted", "pid 4242 -&gt; 5242", "Change: Investigate the crash"):
        assert needle in page, needle


def test_report_time_window_and_target(restart_log, tmp_path):
    out = tmp_path / "r.html"
    # before the restart at +100 s only: a clean window
    p = run("report", restart_log, "--out", str(out), "--no-plots", "--from", "+10s", "--to", "+90s",
            "--target", "decode-0")
    assert p.returncode == 0, p.stderr
    assert "No findings: healthy." in p.stdout and "801 samples" in p.stdout  # both ends inclusive
    assert "<img" not in out.read_text()


def test_report_usage_errors(restart_log, tmp_path):
    one_line_error(run("report", str(tmp_path / "missing.log")), "no such log", "--output")
    one_line_error(run("report", restart_log, "--from", "yesterday"), "--from/--to", "+5m")
    one_line_error(run("report", restart_log, "--from", "+2m", "--to", "+1m"), "must be before")
    one_line_error(run("report", restart_log, "--target", "decode-9"), "decode-9", "targets in the log: decode-0")
    empty = tmp_path / "empty.log"
    empty.write_text("garbage\n")
    one_line_error(run("report", str(empty), "--no-plots"), "no sample lines", "1 unreadable")
    one_line_error(run("report", restart_log, "--out", str(tmp_path / "nodir" / "r.html"), "--no-plots"),
                   "cannot write")


def test_report_without_matplotlib_says_how_to_install(restart_log, tmp_path):
    one_line_error(run("report", restart_log, "--out", str(tmp_path / "r.html"), cmd=NO_MATPLOTLIB),
                   "pip install 'easymats[report]'")
    p = run("report", restart_log, "--out", str(tmp_path / "r.html"), "--no-plots", cmd=NO_MATPLOTLIB)
    assert p.returncode == 0 and "Target restarted" in p.stdout


def test_report_package_imports_nothing_heavy():
    code = ("import sys; import easymats.report.cli, easymats.report.findings, easymats.report.html, "
            "easymats.report.live; bad = [m for m in ('torch', 'transformers', 'triton', 'matplotlib', "
            "'numpy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


# -- doctor on live processes -------------------------------------------------------------------------

def test_doctor_healthy_target():
    proc, _ = start_target("decode-0", duration=8.0)
    try:
        p = run("doctor", "--pid", str(proc.pid), "--window", "2")
    finally:
        proc.terminate()
        proc.wait()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "No findings: healthy." in p.stdout
    assert re.search(r"(1[89]|2[0-2]) samples over", p.stdout), p.stdout


def test_doctor_finds_low_anchor_hit_rate():
    proc, _ = start_target("decode-0", duration=8.0, extra=["--anchor-hit", "0.3"])
    try:
        p = run("doctor", "--pid", str(proc.pid), "--window", "2")
    finally:
        proc.terminate()
        proc.wait()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "decode-0: Anchor hit rate is low" in p.stdout
    m = re.search(r"worst (\d+\.\d) %", p.stdout)
    assert m and 15.0 < float(m.group(1)) < 40.0, p.stdout  # measured from the live counters
    assert "change: Recalibrate" in p.stdout


def test_doctor_usage_errors(segment_dir):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        one_line_error(run("doctor", "--pid", str(sleeper.pid)), f"pid {sleeper.pid} has no telemetry segment",
                       segment_dir)
    finally:
        sleeper.kill()
        sleeper.wait()
    one_line_error(run("doctor", "--pid", str(sleeper.pid)), f"no process with pid {sleeper.pid}")


# -- a log from a real agent run -----------------------------------------------------------------------

def test_report_on_a_real_agent_log(tmp_path):
    """The agent samples a real target at 10 Hz; the report reads that log, counts every sample and
    measures the hit rate the target was told to produce."""
    proc, _ = start_target("decode-0", duration=4.0, extra=["--anchor-hit", "0.5"])
    log = tmp_path / "agent.log"
    agent = subprocess.run([*EASYMATS, "--pid", str(proc.pid), "--interval", "0.1", "--output", str(log),
                            "--quiet", "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=30)
    proc.wait()
    assert agent.returncode == 0, agent.stderr
    with open(log) as f:
        lines = [json.loads(x) for x in f]
    n_samples = sum(1 for x in lines if x["kind"] == "sample" and x["target"] == "decode-0")
    assert n_samples >= 20
    out = tmp_path / "r.html"
    p = run("report", str(log), "--out", str(out), "--png", str(tmp_path / "png"), "--window", "1")
    assert p.returncode == 0, p.stderr
    assert f"{n_samples} samples of 1 target(s)" in p.stdout
    page = out.read_text()
    row = re.search(r"<td>Anchor hit rate</td><td>([\d.]+) %</td>", page)
    assert row and 40.0 < float(row.group(1)) < 60.0, row  # the target audits 50 % hits
    assert page.count("data:image/png;base64,") >= 6


def test_doctor_reports_a_target_that_exits_mid_window():
    import threading

    proc, _ = start_target("decode-0", duration=1.0)
    reaper = threading.Thread(target=proc.wait)  # as a real parent would: no zombie left behind
    reaper.start()
    p = run("doctor", "--pid", str(proc.pid), "--window", "4")
    reaper.join()
    assert p.returncode == 1, p.stdout + p.stderr
    assert "decode-0 went down during the window" in p.stdout


def test_live_diagnosis_from_real_snapshots():
    """What the agent's live view would do: feed segment snapshots, ask for the most urgent finding."""
    from easymats.report.live import LiveDiagnosis
    from easymats.segment import SegmentReader

    proc, path = start_target("decode-0", duration=6.0, extra=["--anchor-hit", "0.2"])
    live = LiveDiagnosis(horizon_s=2.0, window_s=1.0)
    try:
        with SegmentReader(path) as r:
            t0 = time.time()
            while time.time() - t0 < 2.5:
                live.feed_snapshot(r.read(), "decode-0")
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait()
    line = live.urgent()
    assert line is not None and line.startswith("decode-0: Anchor hit rate is low"), line
