"""benchmarks/step_trace.py, on the CPU: the timeline of a profiled run read per step (what
stall_profile.py --trace prints for each stall), from a real torch.profiler run."""

import gzip
import json
import os
import sys
import threading

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from step_trace import OUTSIDE, STEP, StepTrace, biggest, union  # noqa: E402

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


def test_device_events_and_other_threads_cuda_calls_are_read_in_the_window():
    """A GPU run's events, made by hand as the profiler makes them (no GPU here): kernels clipped
    to the step's window and their union, a CUDA call of another thread listed under it."""
    def ev(i, name, thread, a, b, device=False):
        return FunctionEvent(i, name, thread, a, b, device_type=DeviceType.CUDA if device else DeviceType.CPU)

    step = ev(0, STEP, 1, 100, 200)
    launch = ev(1, "cudaGraphLaunch", 1, 105, 110)
    worker = [ev(2, "cudaLaunchKernel", 77, 120, 124), ev(3, "cudaLaunchKernel", 77, 130, 132),
              ev(4, "cudaMemcpyAsync", 77, 250, 260)]                         # the last after the step
    kernels = [ev(5, "gemm", 0, 90, 130, True),                              # began before the step
               ev(6, "gemm", 0, 120, 140, True), ev(7, "fit_grads", 0, 150, 170, True),
               ev(8, "fit_grads", 0, 190, 230, True)]                        # runs past its end
    # the profiler mirrors a range onto the GPU's timeline (gpu_user_annotation): not a step, not work
    mirrored = [ev(9, STEP, 0, 102, 198, True), ev(10, "hisparse.recalibrate.commit", 0, 110, 120, True)]
    launch.set_cpu_parent(step)
    trace = StepTrace(cuda=False)
    trace.prof = type("Profile", (), {"events": lambda self: [step, launch, *worker, *kernels, *mirrored]})()
    w = trace.window(0)
    assert w["us"] == 100 and w["ops"] == {"cudaGraphLaunch": (5, 1)}
    assert w["calls"] == {77: {"cudaLaunchKernel": (6, 2)}}
    assert w["device"] == {"gemm": 30 + 20, "fit_grads": 20 + 10}
    assert w["busy"] == 40 + 20 + 10                                         # 100-140, 150-170, 190-200
    lines = trace.report({0: "a stall"})
    assert "CUDA calls of thread 77: cudaLaunchKernel x2 0.01 ms" in lines[3]
    assert lines[4].startswith("    device busy 0.07 ms: gemm 0.05 ms, fit_grads 0.03 ms")
