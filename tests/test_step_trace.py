"""benchmarks/step_trace.py, on the CPU: the timeline of a profiled run read per step (what
stall_profile.py --trace prints for each stall), from a real torch.profiler run."""

import gzip
import json
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from step_trace import OUTSIDE, StepTrace, biggest, union  # noqa: E402

from hi_sparse.trace import phase  # noqa: E402


def _mm(n: int) -> None:
    a = torch.randn(64, 64)
    for _ in range(n):
        a = a @ a / 64


def test_each_step_is_read_by_range_op_and_thread(tmp_path):
    with StepTrace(cuda=False) as trace:
        for i in range(3):
            with trace.step(i):
                _mm(2)                          # the model's own ops: outside the engine's ranges
                if i == 1:                      # the "stall": engine work in a range, and a thread beside it
                    with phase("recalibrate.commit"):
                        _mm(5)
                    side = threading.Thread(target=_mm, args=(4,))   # its ops are not recorded
                    side.start()
                    side.join()
    quiet, stall = trace.window(0), trace.window(1)
    assert set(quiet["phases"]) == {OUTSIDE}
    assert stall["phases"]["hisparse.recalibrate.commit"] > 0 and OUTSIDE in stall["phases"]
    assert stall["ops"]["aten::mm"][1] == 7 and quiet["ops"]["aten::mm"][1] == 2    # (self time, count)
    assert stall["busy"] == 0 and not stall["device"]                     # no device events on a CPU
    assert sum(stall["phases"].values()) <= stall["us"]
    lines = trace.report({1: "step 1"})
    assert lines[0].startswith("step 1: traced ") and "hisparse.recalibrate.commit" in lines[1]
    assert "aten::mm x7" in lines[2] and len(lines) == 3          # no device line without device events
    trace.write_json(str(tmp_path / "t.json.gz"), {0: "quiet", 1: "stall"})
    with gzip.open(tmp_path / "t.json.gz", "rt") as f:
        windows = json.load(f)
    assert [w["title"] for w in windows] == ["quiet", "stall"]
    names = [row[0] for row in windows[1]["events"]]
    assert names.count("aten::mm") == 7 and "hisparse.recalibrate.commit" in names
    assert all(0 <= row[2] <= windows[1]["us"] for row in windows[1]["events"])


def test_union_and_ranking():
    assert union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert union([]) == 0
    assert biggest({"a": 1000.0, "b": 3000.0, "c": 2000.0}, 2) == "b 3.00 ms, c 2.00 ms"
    assert biggest({}, 3) == "-"
