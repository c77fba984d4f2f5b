"""The agent under load (issue 17): concurrent scrapers of /metrics, then a burst of webhook calls.

    .venv/bin/python benchmarks/bench_load.py [--scrapers 50] [--seconds 30] [--targets 1]
                                              [--webhook-requests 500] [--json]

Everything is real and runs as deployed: ``--targets`` target processes (tests/helpers_targets.py,
~35 series each, publishing at 100 Hz through easymats.telemetry), the agent CLI as a subprocess
(``--interval 0.1 --output LOG --listen ... --webhook-listen ... --quiet``), and the clients in
this process on one asyncio loop (cheap on a 2-core machine: no thread per client).

1. **Scrapers**: ``--scrapers`` clients each scrape /metrics back to back (a new connection per
   scrape, as Prometheus does with HTTP/1.0 servers) for ``--seconds``; a scrape fails when it
   errors, answers other than 200, or takes over 10 s (Prometheus' default scrape timeout).
   Reported: scrape latency p50/p99/max and count, errors, the agent's CPU (all threads, from
   /proc schedstat) and RSS, the sampler's lag p50/p99/max over the same window (every tick's
   ``lag_s`` in the log), and the kernel's ListenOverflows counter during the window.
2. **Webhook burst**: ``--webhook-requests`` POSTs of distinct firing recalibration alerts, all
   connections opened at once; each must be answered (200: written into the control file) within
   30 s. Reported: answered, status codes, latency p50/p99/max, requests found in the control file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import psutil  # noqa: E402
from bench_agent import pct, use_private_segment_dir  # noqa: E402
from helpers_targets import free_port, start_target  # noqa: E402

TOKEN = "bench-load-token"
SCRAPE_TIMEOUT_S = 10.0
WEBHOOK_TIMEOUT_S = 30.0
TARGETS = {"scrape_p99_ms": 50.0, "scrape_errors": 0, "lag_p99_ms": 10.0, "webhook_unanswered": 0,
           "webhook_p99_ms": 1000.0}


async def http(port: int, request: bytes, timeout: float) -> tuple[int, int]:
    """(status, body bytes) of one request on a fresh connection."""
    async def go() -> tuple[int, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            await writer.drain()
            data = await reader.read()  # the server closes after the answer
        finally:
            writer.close()
        head, _, body = data.partition(b"\r\n\r\n")
        return int(head.split(b" ", 2)[1]), len(body)
    return await asyncio.wait_for(go(), timeout)


async def scrapers(port: int, n: int, seconds: float) -> tuple[list[float], list[str]]:
    latencies: list[float] = []
    errors: list[str] = []
    request = b"GET /metrics HTTP/1.0\r\nHost: bench\r\n\r\n"
    end = time.monotonic() + seconds

    async def one() -> None:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                status, size = await http(port, request, SCRAPE_TIMEOUT_S)
                if status != 200 or size < 1000:
                    errors.append(f"status {status}, {size} bytes")
            except (OSError, asyncio.TimeoutError, ValueError, IndexError) as exc:
                errors.append(type(exc).__name__)
            latencies.append(time.perf_counter() - t0)
    await asyncio.gather(*(one() for _ in range(n)))
    return latencies, errors


def alert_body(i: int) -> bytes:
    return json.dumps({"version": "4", "status": "firing", "receiver": "easymats", "groupKey": "{}",
                       "alerts": [{"status": "firing", "fingerprint": f"load{i}", "startsAt": "2026-12-01T00:00:00Z",
                                   "labels": {"alertname": "HiSparseAnchorHitRateLow", "action": "recalibrate",
                                              "target": "decode-0"}}]}).encode()


async def webhook_burst(port: int, n: int) -> tuple[list[float], dict[str, int]]:
    latencies: list[float] = []
    codes: dict[str, int] = {}

    async def one(i: int) -> None:
        body = alert_body(i)
        request = (f"POST / HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                   ).encode() + body
        t0 = time.perf_counter()
        try:
            status, _ = await http(port, request, WEBHOOK_TIMEOUT_S)
            key = str(status)
            latencies.append(time.perf_counter() - t0)
        except (OSError, asyncio.TimeoutError, ValueError, IndexError) as exc:
            key = type(exc).__name__
        codes[key] = codes.get(key, 0) + 1
    await asyncio.gather(*(one(i) for i in range(n)))
    return latencies, codes


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system time of the whole process, threads that already ended included (one thread
    serves each connection: per-thread counters would miss every finished one)."""
    c = proc.cpu_times()
    return c.user + c.system


def listen_overflows() -> int:
    with open("/proc/net/netstat") as f:
        rows = [line.split() for line in f if line.startswith("TcpExt:")]
    return int(dict(zip(rows[0][1:], rows[1][1:])).get("ListenOverflows", 0))


def lags_between(log: str, t0: float, t1: float) -> list[float]:
    per_tick: dict[float, float] = {}
    with open(log) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("kind") == "sample" and t0 <= obj["t"] <= t1:
                per_tick[obj["t"]] = obj["lag_s"]  # one value per tick (all targets share t)
    return list(per_tick.values())


def requests_in_control_file(seg_path: str) -> int:
    """request_seq of the target's control file (docs/segment.md 6): requests ever written."""
    with open(seg_path[:-4] + ".ctl", "rb") as f:
        return struct.unpack_from("<Q", f.read(24), 16)[0]


def run(args: argparse.Namespace, workdir: str) -> dict:
    started = [start_target(f"decode-{i}", rate=100, duration=0) for i in range(args.targets)]
    procs = [p for p, _ in started]
    log = os.path.join(workdir, "agent.log")
    token = os.path.join(workdir, "token")
    with open(token, "w") as f:
        f.write(TOKEN)
    port, hook_port = free_port(), free_port()
    agent = subprocess.Popen([args.agent_python, "-P", "-c", "from easymats.cli import main; main()",
                              "--pid", ",".join(str(p.pid) for p in procs), "--interval", "0.1",
                              "--output", log, "--listen", f"127.0.0.1:{port}", "--quiet",
                              "--webhook-listen", f"127.0.0.1:{hook_port}", "--webhook-token-file", token],
                             stderr=subprocess.PIPE, text=True)
    try:
        proc = psutil.Process(agent.pid)
        time.sleep(2.0)  # imports, first discovery
        overflow0, c0, w0, t0 = listen_overflows(), cpu_seconds(proc), time.monotonic(), time.time()
        latencies, errors = asyncio.run(scrapers(port, args.scrapers, args.seconds))
        c1, w1, t1, overflow1 = cpu_seconds(proc), time.monotonic(), time.time(), listen_overflows()
        rss = proc.memory_info().rss
        hook_lat, codes = asyncio.run(webhook_burst(hook_port, args.webhook_requests))
        written = requests_in_control_file(started[0][1])
        agent.send_signal(signal.SIGTERM)
        _, err = agent.communicate(timeout=15)
        lags = lags_between(log, t0, t1)
    finally:
        if agent.poll() is None:
            agent.kill()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait()
    answered = sum(v for k, v in codes.items() if k.isdigit())
    return {
        "scrapers": args.scrapers, "seconds": args.seconds, "targets": args.targets,
        "scrapes": len(latencies), "scrape_p50_ms": 1e3 * pct(latencies, 0.5),
        "scrape_p99_ms": 1e3 * pct(latencies, 0.99), "scrape_max_ms": 1e3 * max(latencies),
        "scrape_errors": len(errors), "error_kinds": sorted(set(errors))[:5],
        "agent_cpu_pct": 100 * (c1 - c0) / (w1 - w0), "agent_rss_mb": rss / 2**20,
        "lag_ticks": len(lags), "lag_p50_ms": 1e3 * pct(lags, 0.5), "lag_p99_ms": 1e3 * pct(lags, 0.99),
        "lag_max_ms": 1e3 * max(lags) if lags else float("nan"),
        "listen_overflows": overflow1 - overflow0,
        "webhook_requests": args.webhook_requests, "webhook_answered": answered,
        "webhook_unanswered": args.webhook_requests - answered, "webhook_codes": codes,
        "webhook_p50_ms": 1e3 * pct(hook_lat, 0.5), "webhook_p99_ms": 1e3 * pct(hook_lat, 0.99),
        "webhook_max_ms": 1e3 * max(hook_lat) if hook_lat else float("nan"),
        "control_file_requests": written, "agent_stderr": err.strip()[-500:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapers", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--targets", type=int, default=1)
    ap.add_argument("--webhook-requests", type=int, default=500)
    ap.add_argument("--agent-python", default=sys.executable,
                    help="interpreter that runs the agent (another install of easymats, to compare)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    use_private_segment_dir()
    workdir = tempfile.mkdtemp(prefix="bench-load-")
    load = os.getloadavg()
    r = run(args, workdir)
    print(f"# bench_load on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}), "
          f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{r['scrapers']} scrapers x {r['seconds']:g} s, {r['targets']} target(s): {r['scrapes']} scrapes, "
          f"p50 {r['scrape_p50_ms']:.1f} ms, p99 {r['scrape_p99_ms']:.1f} ms, max {r['scrape_max_ms']:.1f} ms, "
          f"errors {r['scrape_errors']} {r['error_kinds'] or ''}")
    print(f"agent: CPU {r['agent_cpu_pct']:.1f} % of a core, RSS {r['agent_rss_mb']:.1f} MB; sampler lag over "
          f"{r['lag_ticks']} ticks p50 {r['lag_p50_ms']:.2f} ms, p99 {r['lag_p99_ms']:.2f} ms, max "
          f"{r['lag_max_ms']:.2f} ms; listen overflows {r['listen_overflows']}")
    print(f"webhook: {r['webhook_requests']} concurrent requests, {r['webhook_answered']} answered "
          f"{r['webhook_codes']}, p50 {r['webhook_p50_ms']:.1f} ms, p99 {r['webhook_p99_ms']:.1f} ms, max "
          f"{r['webhook_max_ms']:.1f} ms; {r['control_file_requests']} requests in the control file")
    if r["agent_stderr"]:
        print(f"agent stderr: {r['agent_stderr']}")
    ok = (r["scrape_p99_ms"] <= TARGETS["scrape_p99_ms"] and r["scrape_errors"] == 0
          and r["lag_p99_ms"] <= TARGETS["lag_p99_ms"] and r["webhook_unanswered"] == 0
          and r["webhook_p99_ms"] <= TARGETS["webhook_p99_ms"])
    print("targets:", ", ".join(f"{k} <= {v}" for k, v in TARGETS.items()), "->", "met" if ok else "NOT met")
    if args.json:
        print(json.dumps(r, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
