"""Telemetry segment costs beside prometheus_client (issue 2's benchmark).

    .venv/bin/python benchmarks/bench_telemetry.py

Prints, from one run on one machine: one counter increment, ``publish()`` of a 64-series
segment, one reader snapshot of that segment, and prometheus_client's ``Counter.inc()`` in-process
and in multiprocess mode. Each prometheus_client figure comes from a fresh subprocess, because its
mode is fixed when the module is imported (PROMETHEUS_MULTIPROC_DIR must be set before the import).
Every figure is the best of several timeit repeats, per call, including timeit's loop overhead,
timed in CPU time of the calling thread (user + system, so a reader's pread syscalls count):
on a shared 2-core CI machine wall time mostly measures the neighbours.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import timeit

REPEATS = 7
SERIES = 64

TARGETS_NS = {"increment": 100, "publish_64": 20_000, "read_64": 50_000}


def best_ns(stmt: str, namespace: dict, number: int) -> float:
    """Best per-call time of ``stmt`` over REPEATS runs of ``number`` calls, in nanoseconds."""
    times = timeit.repeat(stmt, globals=namespace, number=number, repeat=REPEATS, timer=time.thread_time)
    return min(times) / number * 1e9


def build_segment(directory: str):
    """A segment with SERIES series, mixed as a runtime's would be (2 of them histograms)."""
    from easymats import catalogue, telemetry

    seg = telemetry.open_segment(name="bench", labels={"model": "bench"}, directory=directory)
    made = 0
    for spec in catalogue.runtime_metrics():
        combos: list[dict[str, str]] = [{}]
        for label in spec.labels:
            values = spec.label_values.get(label, ("x",))
            combos = [dict(c, **{label: v}) for c in combos for v in values]
        for labels in combos:
            if spec.type == catalogue.INFO:
                seg.info(spec.name, **labels)
            else:
                getattr(seg, spec.type)(spec.name, **labels)
            made += 1
    # Fill up with per-device gauges, the way a multi-GPU runtime grows its series count.
    gpu = 0
    while made < SERIES:
        seg.gauge("easymats_process_gpu_memory_bytes", target="bench", gpu=str(gpu)).set(gpu)
        gpu += 1
        made += 1
    for _, metric in seg._order:  # give every series a non-trivial value
        if hasattr(metric, "observe"):
            metric.observe(0.003)
        else:
            metric.value = 12345.0
    return seg, made


def bench_easymats() -> dict[str, float]:
    from easymats import segment

    directory = tempfile.mkdtemp(prefix="easymats-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.chmod(directory, 0o700)
    seg, made = build_segment(directory)
    assert made == SERIES and seg.enabled, "the benchmark segment could not be created"
    counter = seg.counter("hisparse_hot_buffer_hits_total")
    ns = {"counter": counter, "seg": seg}
    out = {
        "series": made,
        "increment": best_ns("counter.inc()", ns, 1_000_000),
        "increment_amount": best_ns("counter.inc(5)", ns, 1_000_000),
        "publish_64": best_ns("seg.publish()", ns, 20_000),
    }
    reader = segment.SegmentReader(seg.path)
    snap = reader.read()
    assert len(snap.series) == SERIES
    out["read_64"] = best_ns("reader.read()", {"reader": reader}, 5_000)
    out["read_64_fresh_reader"] = best_ns(
        "segment.read_segment(path)", {"segment": segment, "path": seg.path}, 1_000)
    reader.close()
    seg.close()
    os.rmdir(directory)
    return out


_PROM_CHILD = r"""
import json, os, sys, time, timeit
from prometheus_client import Counter
c = Counter("bench_events", "Events.")
n = 200_000
best = min(timeit.repeat("c.inc()", globals={"c": c}, number=n, repeat=%d, timer=time.thread_time)) / n * 1e9
print(json.dumps({"ns": best, "multiprocess": "PROMETHEUS_MULTIPROC_DIR" in os.environ}))
""" % REPEATS


def bench_prometheus(multiprocess: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("PROMETHEUS_MULTIPROC_DIR", "prometheus_multiproc_dir")}
    with tempfile.TemporaryDirectory(prefix="prom-mp-") as mp_dir:
        if multiprocess:
            env["PROMETHEUS_MULTIPROC_DIR"] = mp_dir  # read when prometheus_client is imported
        out = subprocess.run([sys.executable, "-c", _PROM_CHILD], env=env, capture_output=True,
                             text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["multiprocess"] == multiprocess
    return result["ns"]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    from importlib.metadata import version

    ours = bench_easymats()
    prom_in = bench_prometheus(multiprocess=False)
    prom_mp = bench_prometheus(multiprocess=True)
    print(f"machine: {os.cpu_count()} CPUs, {cpu_model()}; Python {platform.python_version()}; "
          f"prometheus_client {version('prometheus_client')}")
    rows = [
        ("easymats counter.inc()", ours["increment"], TARGETS_NS["increment"]),
        ("easymats counter.inc(5)", ours["increment_amount"], None),
        (f"easymats publish(), {ours['series']} series", ours["publish_64"], TARGETS_NS["publish_64"]),
        (f"easymats reader.read(), {ours['series']} series", ours["read_64"], TARGETS_NS["read_64"]),
        ("easymats read_segment() (open+check+read+close)", ours["read_64_fresh_reader"], None),
        ("prometheus_client Counter.inc() in-process", prom_in, None),
        ("prometheus_client Counter.inc() multiprocess", prom_mp, None),
    ]
    print(f"{'operation':52s} {'per call':>12s} {'target':>10s}  verdict")
    missed = 0
    for label, value, target in rows:
        verdict = ""
        if target is not None:
            ok = value <= target
            missed += not ok
            verdict = "met" if ok else "MISSED"
        print(f"{label:52s} {_fmt(value):>12s} {(_fmt(target) if target else ''):>10s}  {verdict}")
    ratio = prom_in / ours["increment"]
    ok = ratio >= 3
    missed += not ok
    print(f"{'increment vs prometheus_client in-process':52s} {ratio:>11.1f}x {'>= 3x':>10s}  "
          f"{'met' if ok else 'MISSED'}")
    print(f"{'increment vs prometheus_client multiprocess':52s} {prom_mp / ours['increment']:>11.1f}x")
    return 1 if missed else 0


def _fmt(ns: float) -> str:
    return f"{ns:.0f} ns" if ns < 10_000 else f"{ns / 1000:.1f} us"


if __name__ == "__main__":
    sys.exit(main())
