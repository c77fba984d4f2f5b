"""The easymats agent's costs at 10 Hz with 1, 16 and 64 live targets (issue 3's benchmark).

    .venv/bin/python benchmarks/bench_agent.py [--targets 1,16,64] [--seconds 10] [--json]

For each target count: start that many real target processes (tests/helpers_targets.py, each
publishing ~35 series at --target-rate Hz through easymats.telemetry), run the agent CLI as a
subprocess (``--interval 0.1 --output FILE --listen 127.0.0.1:PORT --quiet``) and measure

- agent CPU as % of one core (user + system over a steady window after a warm-up),
- sample lag p50/p99 (every tick's ``lag_s`` from the log),
- /metrics render time: HTTP scrape wall time (p50, max over 20 scrapes) and the collector's own
  render time (``AgentCollector`` in-process on the same targets),
- agent RSS at the end,
- start-up to first sample: from ``Popen`` of the agent to the ``t`` of its first sample line.

Beside it, in the same run: prometheus_client's multiprocess mode with the same number of
processes, each keeping the same ~35 series (counters, gauges, two histograms) updated at the same
rate; a collector in this process renders the MultiProcessCollector registry at 10 Hz: its CPU %,
and render time p50/p99.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import psutil  # noqa: E402
from helpers_targets import free_port, start_target  # noqa: E402

TARGETS = {"cpu_pct_1": 0.5, "cpu_pct_64": 5.0, "lag_p99_ms": 10.0, "scrape_ms_64": 20.0, "rss_mb": 60.0,
           "first_sample_s": 0.5}


def use_private_segment_dir() -> str:
    """Targets and agents of this run publish and read in a fresh 0700 directory of their own."""
    seg_dir = tempfile.mkdtemp(prefix="bench-seg-")
    os.chmod(seg_dir, 0o700)
    os.environ["EASYMATS_SEGMENT_DIR"] = seg_dir
    return seg_dir


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def cpu_seconds(proc: psutil.Process) -> float:
    """CPU time of every thread of ``proc``: from /proc/PID/task/*/schedstat (nanoseconds) where
    the kernel has it, else psutil's user + system (clock ticks: 10 ms steps, coarse at 0.5 %)."""
    total, found = 0, False
    try:
        tids = os.listdir(f"/proc/{proc.pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"/proc/{proc.pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
            found = True
        except (OSError, ValueError, IndexError):
            continue
    if found:
        return total / 1e9
    c = proc.cpu_times()
    return c.user + c.system


def bench_agent(n: int, seconds: float, rate: float, workdir: str, log_on: bool = True) -> dict:
    targets = [start_target(f"decode-{i}", rate=rate, duration=0)[0] for i in range(n)]
    log = os.path.join(workdir, f"agent-{n}.log")
    port = free_port()
    try:
        t_start = time.time()
        agent = subprocess.Popen([sys.executable, "-c", "from easymats.cli import main; main()",
                                  "--pid", ",".join(str(t.pid) for t in targets), "--interval", "0.1",
                                  *(["--output", log] if log_on else []), "--listen", f"127.0.0.1:{port}",
                                  "--quiet"],
                                 stderr=subprocess.PIPE, text=True)
        proc = psutil.Process(agent.pid)
        time.sleep(2.0)  # warm-up: imports, first discovery, first NVML probe
        c0, w0 = cpu_seconds(proc), time.monotonic()
        time.sleep(seconds)
        c1, w1 = cpu_seconds(proc), time.monotonic()
        cpu_pct = 100 * (c1 - c0) / (w1 - w0)
        scrapes = []
        for _ in range(20):
            s0 = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                body = r.read()
            scrapes.append(time.perf_counter() - s0)
            time.sleep(0.05)
        rss = proc.memory_info().rss
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=10)
        first_t = None
        lags: dict[float, float] = {}
        with open(log if log_on else os.devnull) as f:
            for line in f:
                obj = json.loads(line)
                if obj.get("kind") == "sample":
                    first_t = first_t if first_t is not None else obj["t"]
                    lags[obj["t"]] = obj["lag_s"]  # one value per tick (all targets share t)
        lag_values = list(lags.values())[20:]  # steady state only
        render = collector_render_ms(targets)
    finally:
        for t in targets:
            t.send_signal(signal.SIGTERM)
        for t in targets:
            t.wait()
    return {"targets": n, "cpu_pct": cpu_pct, "lag_p50_ms": 1e3 * pct(lag_values, 0.5),
            "lag_p99_ms": 1e3 * pct(lag_values, 0.99), "scrape_http_p50_ms": 1e3 * pct(scrapes, 0.5),
            "scrape_http_max_ms": 1e3 * max(scrapes), "render_p50_ms": render, "metrics_bytes": len(body),
            "rss_mb": rss / 2**20, "first_sample_s": (first_t - t_start) if first_t else float("nan")}


def collector_render_ms(procs) -> float:
    """The /metrics body's render time (the agent's fast text path), in this process, on the same targets."""

    from easymats.exporter import AgentCollector, LagHistogram, make_registry
    from easymats.segment import segments_for_pid
    from easymats.targets import Target

    tgs = []
    for p in procs:
        tg = Target(p.pid, segments_for_pid(p.pid)[0], peak_window_s=15)
        tg.sample(time.time())
        tg.read_process()
        tgs.append(tg)
    reg = make_registry(AgentCollector(lambda: tgs, LagHistogram(), lambda: None, 15))
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        reg.render()
        times.append(time.perf_counter() - t0)
    for tg in tgs:
        tg.close()
    return 1e3 * pct(times, 0.5)


MP_WORKER = r"""
import os, random, sys, time
from prometheus_client import Counter, Gauge, Histogram
rate = float(sys.argv[1])
counters = [Counter(f"hisparse_c{i}_total", "c", ["target"]) for i in range(18)]
gauges = [Gauge(f"hisparse_g{i}", "g", ["target"], multiprocess_mode="livesum") for i in range(14)]
h1 = Histogram("hisparse_step_duration_seconds", "h", ["target"],
               buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
h2 = Histogram("hisparse_quant_block_relative_error", "h", ["target"],
               buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5))
name = f"w{os.getpid()}"
cs = [c.labels(name) for c in counters]; gs = [g.labels(name) for g in gauges]
a, b = h1.labels(name), h2.labels(name)
print("ready", flush=True)
period = 1 / rate; t0 = time.monotonic(); k = 0
while True:
    k += 1
    for c in cs: c.inc()
    for g in gs: g.set(random.random())
    a.observe(0.002); b.observe(0.01)
    time.sleep(max(0, t0 + k * period - time.monotonic()))
"""


def bench_multiprocess(n: int, seconds: float, rate: float) -> dict:
    d = tempfile.mkdtemp(prefix="bench-mp-")
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=d)
    workers = [subprocess.Popen([sys.executable, "-c", MP_WORKER, str(rate)], env=env, stdout=subprocess.PIPE,
                                text=True) for _ in range(n)]
    try:
        for w in workers:
            w.stdout.readline()
        code = f"""
import os, time, json, resource
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
reg = CollectorRegistry(); MultiProcessCollector(reg)
generate_latest(reg)
times = []; r0 = resource.getrusage(resource.RUSAGE_SELF); w0 = time.monotonic(); k = 0
while time.monotonic() - w0 < {seconds}:
    k += 1
    t = time.perf_counter(); generate_latest(reg); times.append(time.perf_counter() - t)
    time.sleep(max(0, w0 + k * 0.1 - time.monotonic()))
r1 = resource.getrusage(resource.RUSAGE_SELF); w1 = time.monotonic()
cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / (w1 - w0) * 100
times.sort()
print(json.dumps({{"cpu_pct": cpu, "render_p50_ms": 1e3 * times[len(times)//2],
                  "render_p99_ms": 1e3 * times[min(len(times)-1, int(0.99*len(times)))],
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        res = json.loads(out.stdout)
    finally:
        for w in workers:
            w.kill()
        for w in workers:
            w.wait()
    res["targets"] = n
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description="easymats agent benchmark")
    ap.add_argument("--targets", default="1,16,64")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--target-rate", type=float, default=10.0, help="publishes per second per target")
    ap.add_argument("--no-log", action="store_true", help="run the agent without --output (no lag/first sample)")
    ap.add_argument("--no-multiprocess", action="store_true", help="skip the prometheus_client comparison")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    use_private_segment_dir()
    workdir = tempfile.mkdtemp(prefix="bench-agent-")
    print(f"log: {'off' if args.no_log else 'on'}; "
          f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
          f"python {platform.python_version()}; targets publish at {args.target_rate:g} Hz; agent at 10 Hz")
    results = []
    for n in [int(x) for x in args.targets.split(",")]:
        a = bench_agent(n, args.seconds, args.target_rate, workdir, log_on=not args.no_log)
        m = None if args.no_multiprocess else bench_multiprocess(n, args.seconds, args.target_rate)
        results.append({"agent": a, "multiprocess": m})
        print(f"{n:>3} targets | easymats: cpu {a['cpu_pct']:.2f} % core, lag p50 {a['lag_p50_ms']:.2f} ms "
              f"p99 {a['lag_p99_ms']:.2f} ms, render {a['render_p50_ms']:.2f} ms (HTTP scrape p50 "
              f"{a['scrape_http_p50_ms']:.2f} ms, max {a['scrape_http_max_ms']:.2f} ms, {a['metrics_bytes']} B), "
              f"RSS {a['rss_mb']:.1f} MB, first sample {a['first_sample_s']:.3f} s", flush=True)
        if m is None:
            continue
        print(f"{'':>3}         | prometheus_client multiprocess collecting {n} at 10 Hz: cpu "
              f"{m['cpu_pct']:.2f} % core, render p50 {m['render_p50_ms']:.2f} ms p99 {m['render_p99_ms']:.2f} ms, "
              f"RSS {m['rss_mb']:.1f} MB", flush=True)
    print("targets:", ", ".join(f"{k} <= {v}" for k, v in TARGETS.items()))
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
