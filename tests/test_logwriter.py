"""The JSON Lines log: keys, rotation, and no completed line lost."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers_logformat import validate_line  # noqa: E402
from helpers_targets import start_target  # noqa: E402

from easymats.logwriter import LogWriter, metric_value, series_key  # noqa: E402
from easymats.segment import Histogram  # noqa: E402


def test_series_key_sorts_and_quotes_like_the_text_format():
    assert series_key("a_total", {}) == "a_total"
    assert series_key("m", {"z": "1", "a": 'x"y\\z\nw'}) == 'm{a="x\\"y\\\\z\\nw",z="1"}'


def test_metric_values_are_json_safe():
    assert metric_value(float("nan")) is None
    h = metric_value(Histogram((0.1, 1.0), (1.0, 2.0, 3.0), 4.5))
    assert h == {"bounds": [0.1, 1.0], "counts": [1.0, 2.0, 3.0], "sum": 4.5}


def sample(i: int, pad: int = 200) -> dict:
    return {"v": 1, "kind": "sample", "t": time.time(), "target": "x", "pid": 1, "up": True, "seq": i,
            "lag_s": 0.0, "metrics": {"pad": 0.0, "i": float(i)}, "process": None, "note": "p" * pad}


def read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_rotation_keeps_backups_each_with_header_and_contiguous_lines(tmp_path):
    path = str(tmp_path / "run.log")
    w = LogWriter(path, interval_s=0.1, max_bytes=4096, backups=3, argv=["easymats"])
    for i in range(200):
        w.write_lines([sample(i)])
    w.close()
    files = [f"{path}.3", f"{path}.2", f"{path}.1", path]
    assert all(os.path.exists(p) for p in files) and not os.path.exists(f"{path}.4")
    seqs = []
    for p in files:
        assert os.path.getsize(p) <= 4096
        lines = read(p)
        assert lines[0]["kind"] == "header" and lines[0]["interval_s"] == 0.1
        assert all(validate_line(x) == [] for x in lines)
        seqs += [x["seq"] for x in lines[1:]]
    assert seqs == list(range(seqs[0], 200)), "the kept files hold the newest lines, none missing"
    assert w.rotations >= 3


def test_rotation_without_backups_starts_over(tmp_path):
    path = str(tmp_path / "run.log")
    w = LogWriter(path, interval_s=0.1, max_bytes=4096, backups=0)
    for i in range(100):
        w.write_lines([sample(i)])
    w.close()
    assert not os.path.exists(path + ".1")
    lines = read(path)
    assert lines[0]["kind"] == "header" and lines[-1]["seq"] == 99


def test_appending_to_an_existing_log_adds_a_header(tmp_path):
    path = str(tmp_path / "run.log")
    for _ in range(2):
        w = LogWriter(path, interval_s=0.1)
        w.event("agent_start")
        w.close()
    kinds = [x["kind"] for x in read(path)]
    assert kinds == ["header", "event", "header", "event"]


@pytest.mark.parametrize("bad,problem", [
    ({"v": 1, "kind": "sample", "t": 1.0, "target": "x", "pid": 1, "up": False, "lag_s": 0, "metrics": {}},
     "error"),
    ({"v": 1, "kind": "sample", "t": 1.0, "target": "x", "pid": 1, "up": True, "lag_s": 0,
      "metrics": {"bad key{": 1.0}}, "series name"),
    ({"v": 1, "kind": "sample", "t": 1.0, "target": "x", "pid": 1, "up": True, "lag_s": 0,
      "metrics": {"h": {"bounds": [1], "counts": [1], "sum": 0}}}, "histogram"),
    ({"v": 2, "kind": "header", "t": 1.0, "agent_version": "x", "interval_s": 1, "host": "h", "argv": []}, "v is"),
    ({"v": 1, "kind": "event", "t": 1.0, "target": None, "pid": None, "event": "boom", "detail": ""}, "unknown event"),
])
def test_validator_rejects_bad_lines(bad, problem):
    assert any(problem in e for e in validate_line(bad))


def test_sigkill_of_the_agent_leaves_only_complete_lines(tmp_path):
    target, _ = start_target("decode-0", rate=200, duration=0)
    log = tmp_path / "run.log"
    agent = subprocess.Popen([sys.executable, "-c", "from easymats.cli import main; main()", "--pid",
                              str(target.pid), "--interval", "0.01", "--output", str(log),
                              "--listen", "none", "--quiet"], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while (not log.exists() or log.stat().st_size < 50000) and time.monotonic() < deadline:
            time.sleep(0.05)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
    finally:
        target.send_signal(signal.SIGTERM)
        target.wait()
    raw = log.read_bytes()
    assert raw.endswith(b"\n")
    lines = [json.loads(line) for line in raw.splitlines()]
    assert len(lines) > 20 and all(validate_line(x) == [] for x in lines)


def test_fast_sample_text_parses_to_the_same_line(segment_dir):
    """Target.log_json (hand-built text, reused number texts) == json of Target.log_line."""
    from easymats import telemetry
    from easymats.nvml import ProcessGpuReading
    from easymats.targets import Target

    seg = telemetry.open_segment(name='we"ird\\name', labels={})
    try:
        c = seg.counter("hisparse_tokens_total", phase="decode")
        g = seg.gauge("hisparse_anchor_threshold_ratio")
        h = seg.histogram("hisparse_quant_block_relative_error")
        seg.info("hisparse_runtime_info", version="1", model='m"q', device="cpu")
        tg = Target(os.getpid(), seg.path, peak_window_s=15)
        for i, gv in enumerate([0.1, 0.1, 1e300 * 10, float("nan"), 2.5, 1e-7]):
            c.inc(i)
            g.set(gv)
            h.observe(0.003 * i)
            seg.publish()
            tg.sample(time.time())
            tg.read_process()
            tg.gpu = [ProcessGpuReading("0", os.getpid(), 1e9, None)] if i % 2 else None
            fast = json.loads(tg.log_json(1795990000.123 + i, 0.0001))
            slow = json.loads(json.dumps(tg.log_line(1795990000.123 + i, 0.0001), default=list))
            slow["metrics"] = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                               for k, v in slow["metrics"].items()}
            assert fast == slow, i
            assert validate_line(fast) == []
    finally:
        seg.close()
