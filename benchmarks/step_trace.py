"""A torch.profiler timeline of a decode, read per step (stall_profile.py --trace): for the steps
picked (the stalls and a median step), where the step's time went on the thread that ran it (by
the engine's ``hisparse.*`` ranges and by op, CUDA runtime calls such as a synchronize included),
and which GPU kernels and copies ran in it, whichever thread queued them, with the GPU's busy
time. A stall's cause is then read from its numbers beside the median step's, not guessed from
which events it met. The profiler records the ops of the thread that started it only (other
Python threads, such as a recalibration's worker, record none: stall_profile.py names the work
they did during a step from its own timers), but the CUDA calls (launches, copies, waits) and
the device's kernels of every thread: those of threads other than the step's are listed by thread.
That last part did not hold on the H100 (torch 2.11): no window listed another thread's calls,
and the page-locking of the lock-ahead thread (``cudaHostRegister``, back to back after the step's
own growth had ended, while the step's copies waited) showed as the step's own. Read a CUDA call
on the step's thread as possibly another thread's where the engine's ranges do not hold it.

Each step runs inside a range named ``STEP`` (decode_run.decode's ``around``), so its window
is the profiler's own clock. ``write_json`` keeps the picked windows' events for a closer look.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import json
from collections import defaultdict
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, record_function

STEP = "bench.step"
OUTSIDE = "(outside the engine's ranges)"


class StepTrace:
    """A profiler over a decode (a context), each step in :meth:`step`; read with :meth:`report`."""

    def __init__(self, cuda: bool) -> None:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self.prof = torch.profiler.profile(activities=acts)
        self._read: tuple | None = None

    def __enter__(self) -> StepTrace:
        self.prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)

    def step(self, pos: int = 0) -> contextlib.AbstractContextManager:
        return record_function(STEP)

    def _events(self) -> tuple:
        """(the steps' ranges in order, host events sorted by start, device events sorted by start)."""
        if self._read is None:
            events = self.prof.events()
            steps = sorted((e for e in events if e.name == STEP and e.device_type == DeviceType.CPU),
                           key=lambda e: e.time_range.start)
            host = sorted((e for e in events if e.device_type == DeviceType.CPU and e.name != STEP),
                          key=lambda e: e.time_range.start)
            # the device's kernels and copies: not the ranges the profiler mirrors onto its timeline
            # (a record_function's span of the GPU work, "gpu_user_annotation")
            device = sorted((e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation
                             and e.name != STEP and not e.name.startswith("hisparse.")),
                            key=lambda e: e.time_range.start)
            self._read = (steps, host, [e.time_range.start for e in host], device,
                          [e.time_range.start for e in device])
        return self._read

    def _between(self, t0: float, t1: float) -> tuple[list, list]:
        """(host events starting in [t0, t1), device events starting before t1 and ending after t0)."""
        _, host, host_at, device, device_at = self._events()
        # a device event may start before the window: look back a second from its start
        return (host[bisect.bisect_left(host_at, t0):bisect.bisect_left(host_at, t1)],
                [e for e in device[bisect.bisect_left(device_at, t0 - 1e6):bisect.bisect_left(device_at, t1)]
                 if e.time_range.end > t0])

    def window(self, index: int) -> dict:
        """What step ``index`` (0: the first step traced) spent, in microseconds: {"us": its
        length, "phases": its thread's self time by the engine's ranges, "ops": by op (time,
        count), "calls": other threads' CUDA calls by thread and name, "device": the device's
        events clipped to it by name, "busy": their union}."""
        step = self._events()[0][index]
        t0, t1 = step.time_range.start, step.time_range.end
        host, device = self._between(t0, t1)
        phases: dict[str, float] = defaultdict(float)
        ops: dict[str, list] = defaultdict(lambda: [0.0, 0])
        calls: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
        for e in host:
            if e.thread == step.thread:
                phases[phase_of(e)] += e.self_cpu_time_total
                if not e.name.startswith("hisparse."):
                    ops[e.name][0] += e.self_cpu_time_total
                    ops[e.name][1] += 1
            elif e.name.startswith("cu"):       # a CUDA runtime or driver call of another thread
                calls[e.thread][e.name][0] += e.self_cpu_time_total
                calls[e.thread][e.name][1] += 1
        by_name: dict[str, float] = defaultdict(float)
        spans = []
        for e in device:
            a, b = max(e.time_range.start, t0), min(e.time_range.end, t1)
            by_name[e.name] += b - a
            spans.append((a, b))
        return {"us": t1 - t0, "phases": dict(phases), "ops": {k: tuple(v) for k, v in ops.items()},
                "calls": {t: {k: tuple(v) for k, v in c.items()} for t, c in calls.items()},
                "device": dict(by_name), "busy": union(spans)}

    def report(self, picks: dict[int, str], top: int = 6) -> list[str]:
        """Lines for each picked step (index: its title), its time by range, op and device event,
        the ``top`` largest of each."""
        lines = []
        for index, title in picks.items():
            w = self.window(index)
            lines.append(f"{title}: traced {w['us'] / 1e3:.1f} ms")
            lines.append("    its thread, by range: " + biggest(w["phases"], top))
            lines.append("    its thread, by op: " + biggest(counted(w["ops"]), top))
            for thread, calls in sorted(w["calls"].items(), key=lambda tc: -sum(t for t, _ in tc[1].values())):
                lines.append(f"    CUDA calls of thread {thread}: " + biggest(counted(calls), top))
            if w["device"] or w["busy"]:
                lines.append(f"    device busy {w['busy'] / 1e3:.2f} ms: " + biggest(w["device"], top))
        return lines

    def write_json(self, path: str, picks: dict[int, str]) -> None:
        """The events of the picked steps' windows (gzip JSON: per step its title, window and
        events as [name, thread, start, duration, device, range] in microseconds)."""
        out = []
        for index, title in picks.items():
            step = self._events()[0][index]
            t0, t1 = step.time_range.start, step.time_range.end
            host, device = self._between(t0, t1)
            rows = [[e.name, e.thread, round(e.time_range.start - t0, 1), round(e.time_range.elapsed_us(), 1), "cpu",
                     phase_of(e)] for e in host]
            rows += [[e.name, e.device_index, round(e.time_range.start - t0, 1), round(e.time_range.elapsed_us(), 1),
                      "device", ""] for e in device]
            out.append({"title": title, "us": t1 - t0, "events": rows})
        with gzip.open(path, "wt") as f:
            json.dump(out, f)


def phase_of(e: Any) -> str:
    """The innermost of the engine's ranges (``hisparse.*``) around host event ``e`` (itself included)."""
    while e is not None:
        if e.name.startswith("hisparse."):
            return e.name
        e = e.cpu_parent
    return OUTSIDE


def union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def counted(times: dict[str, tuple[float, int]]) -> dict[str, float]:
    """{name: (time, count)} as {'name xcount': time}."""
    return {f"{k} x{n}": t for k, (t, n) in times.items()}


def biggest(times: dict[str, float], top: int) -> str:
    """The ``top`` largest of {name: microseconds}, as 'name 1.23 ms, ...'."""
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return ", ".join(f"{name} {t / 1e3:.2f} ms" for name, t in ranked) or "-"
