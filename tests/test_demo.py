"""``easymats demo`` end to end: a real workload child, the real agent, /metrics over HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from easymats import catalogue
from easymats.demo_summary import collect, summarise, threshold_findings, windowed_hit_rate
from easymats.segment import segments_for_pid

sys.path.insert(0, os.path.dirname(__file__))
from helpers_targets import free_port, private_segment_dir  # noqa: E402

EASYMATS = os.path.join(os.path.dirname(sys.executable), "easymats")


def _scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of /metrics by sample name: [(labels, value), ...]."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _nontrivial(spec: catalogue.MetricSpec, scrapes: list[dict]) -> bool:
    """Did the metric show real activity at some scrape: a counter above 0, a gauge that
    changed or sat above 0, a histogram with observations, an info metric present?"""
    if spec.type == catalogue.HISTOGRAM:
        return any(v > 0 for s in scrapes for _, v in s.get(spec.name + "_count", []))
    values = [v for s in scrapes for _, v in s.get(spec.name, [])]
    if spec.type == catalogue.INFO:
        return bool(values)
    if spec.type == catalogue.COUNTER:
        return any(v > 0 for v in values)
    return any(v > 0 for v in values) and (len(set(values)) > 1 or spec.name.endswith("capacity_tokens"))


@pytest.fixture(scope="module")
def synthetic_demo(tmp_path_factory) -> SimpleNamespace:
    """One 20-second `easymats demo --synthetic` (the real HiSparse workloads on a random-weight
    transformers model; test_setup runs the real model), /metrics scraped every 0.5 s while it
    ran: its exit status, output, scrapes and log."""
    tmp = tmp_path_factory.mktemp("demo")
    segments = private_segment_dir()       # the autouse fixture is per test; this run serves two
    port, log = free_port(), tmp / "demo.log"
    proc = subprocess.Popen([EASYMATS, "demo", "--duration", "20", "--listen", f"127.0.0.1:{port}",
                             "--output", str(log), "--quiet", "--synthetic"], cwd=tmp,
                            env=dict(os.environ, EASYMATS_SEGMENT_DIR=segments),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    scrapes: list[dict] = []
    try:
        deadline = time.monotonic() + 200
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                scrapes.append(_scrape(port))
            except OSError:
                pass  # not serving yet (the workload is loading torch) or already closed
            time.sleep(0.5)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return SimpleNamespace(returncode=proc.returncode, out=out, err=err, scrapes=scrapes, log=log)


@pytest.mark.slow
def test_easymats_demo_runs_logs_and_serves_every_runtime_metric(synthetic_demo):
    out, err, scrapes, log = synthetic_demo.out, synthetic_demo.err, synthetic_demo.scrapes, synthetic_demo.log
    assert synthetic_demo.returncode == 0, err
    assert "easymats demo summary" in out

    missing = [spec.name for spec in catalogue.runtime_metrics() if not _nontrivial(spec, scrapes)]
    assert not missing, f"runtime metrics without activity on /metrics: {missing}"
    # The two workload targets were up at the same scrape.
    ups = [{lbl["target"] for lbl, v in s.get("easymats_target_up", []) if v == 1} for s in scrapes]
    assert any({"demo-generate", "demo-longctx"} <= u for u in ups)

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    targets = collect(lines)
    assert {"demo-generate", "demo-longctx"} <= set(targets)
    for name in ("demo-generate", "demo-longctx"):
        assert len(targets[name].samples) >= 50  # ~10 Hz for most of 20 s
    # The planted topic shift: the audited anchor hit rate dips and a recalibration restores it.
    rates = [r for _, r in windowed_hit_rate(targets["demo-longctx"], 32)]
    assert len(rates) >= 3 and min(rates) < rates[-1]
    assert "anchor hit rate" in summarise(lines)


@pytest.mark.slow
def test_report_on_the_demo_log(synthetic_demo, tmp_path):
    """The demo's log produces a full report: the workloads audit anchors, recycle blocks and
    swap tokens in, so those series have numbers."""
    assert synthetic_demo.returncode == 0, synthetic_demo.err
    out, pngs = tmp_path / "demo.html", tmp_path / "png"
    p = subprocess.run([EASYMATS, "report", str(synthetic_demo.log), "--out", str(out), "--png", str(pngs)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    m = re.search(r"(\d+) samples of (\d+) target\(s\)", p.stdout)
    assert m and int(m.group(1)) >= 50 and int(m.group(2)) >= 1, p.stdout
    page = out.read_text()
    for title in ("Anchor hit rate", "Hot buffer hit rate", "Active blocks", "Decode tokens/s"):
        assert re.search(rf"<td>{title}</td><td>[\d.]+", page), title
    assert len(os.listdir(pngs)) >= 6 and page.count("data:image/png;base64,") == len(os.listdir(pngs))
    assert "Findings</h2>" in page


def _wait_for_samples(log, targets: set[str], proc: subprocess.Popen, timeout_s: float) -> None:
    """Until the log holds a sample with metrics from each of ``targets``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists():
            seen = set(collect(json.loads(line) for line in log.read_text().splitlines()
                               if line.endswith("}")))
            if targets <= seen:
                return
        time.sleep(0.5)
    raise AssertionError(f"no samples of {targets} in {log} (demo exit status {proc.poll()})")


@pytest.mark.slow
def test_sigint_stops_a_demo_started_with_sigint_ignored(tmp_path, segment_dir):
    """A background job of a script (or nohup, or CI) starts with SIGINT ignored, and its children
    inherit that. Before the fix the workload child ignored the SIGINT that easymats demo sent
    it: 20 s wait, SIGKILL, exit status 1, segments left behind."""
    log = tmp_path / "demo.log"
    proc = subprocess.Popen([EASYMATS, "demo", "--synthetic", "--duration", "120", "--listen", "none",
                             "--output", str(log), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        _wait_for_samples(log, {"demo-generate", "demo-longctx"}, proc, 180)
        child = next(json.loads(line)["pid"] for line in log.read_text().splitlines()
                     if '"sample"' in line and '"pid"' in line)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert stopped_in < 15, f"took {stopped_in:.1f} s to stop"
    assert not segments_for_pid(child, segment_dir)
    assert "easymats demo summary" in out


def test_each_demo_run_gets_its_own_log(tmp_path):
    """A second run appended to the first run's log before: the summary mixed two runs (two
    pids, a false "Target restarted"). Now the default name is per run, and an --output that
    already holds a log is refused before anything starts."""
    from easymats.demo import _fresh_log_path

    old = tmp_path / "demo.log"
    old.write_text('{"kind": "sample"}\n')
    res = subprocess.run([EASYMATS, "demo", "--synthetic", "--output", str(old), "--listen", "none"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "already holds a log" in res.stderr and "give a new path" in res.stderr
    assert old.read_text() == '{"kind": "sample"}\n'  # untouched
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        first = _fresh_log_path(None)
        open(first, "w").close()
        second = _fresh_log_path(None)
    finally:
        os.chdir(cwd)
    assert first.startswith("easymats-demo-") and first.endswith(".log") and first != second


def test_summary_names_thresholds_a_run_crossed():
    lines = threshold_findings({"prefetch_efficiency": 0.45, "anchor_hit_rate": 0.9,
                                "hot_buffer_hit_rate": None})
    assert len(lines) == 1
    assert "prefetch efficiency 45%" in lines[0] and "floor of 85%" in lines[0]
    assert "HiSparsePrefetchEfficiencyLow" in lines[0]
