"""How fast the easymats webhook answers Alertmanager (issue 7: "answers fast").

    .venv/bin/python benchmarks/bench_webhook.py [--requests 2000]

A real webhook (easymats.webhook.Webhook behind its threaded HTTP server) on 127.0.0.1 resolves
one real telemetry segment opened in this process. Over one keep-alive connection it measures the
HTTP round trip of

- new firing alerts (each a distinct fingerprint: validated, and its request written into the
  control file before the answer),
- repeats of one alert (the idempotent path Alertmanager's repeat_interval takes),
- unauthenticated calls (401).

Many concurrent requests against the agent as deployed: benchmarks/bench_load.py.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from easymats import telemetry, webhook  # noqa: E402
from easymats.segment import control_path  # noqa: E402

TOKEN = "bench-token"


def body(fingerprint: str) -> bytes:
    return json.dumps({"version": "4", "status": "firing", "receiver": "easymats-recalibrate",
                       "groupKey": "{}", "alerts": [{
                           "status": "firing", "fingerprint": fingerprint, "startsAt": "2026-11-29T22:00:00Z",
                           "labels": {"alertname": "HiSparseAnchorHitRateLow", "action": "recalibrate",
                                      "target": "bench-0"}}]}).encode()


def timed(conn: http.client.HTTPConnection, payloads, token: str | None) -> list[float]:
    out = []
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    for data in payloads:
        t0 = time.perf_counter()
        conn.request("POST", "/alertmanager", body=data, headers=headers)
        resp = conn.getresponse()
        resp.read()
        out.append(time.perf_counter() - t0)
        assert resp.status in (200, 401), resp.status
    return out


def summary(name: str, xs: list[float]) -> str:
    xs = sorted(xs)
    p = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3  # noqa: E731
    return f"{name:<22} n={len(xs):5d}  p50 {p(0.5):6.3f} ms  p99 {p(0.99):6.3f} ms  max {xs[-1] * 1e3:6.2f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    args = ap.parse_args()
    directory = tempfile.mkdtemp(prefix="easymats-bench-")
    os.chmod(directory, 0o700)
    seg = telemetry.open_segment(name="bench-0", directory=directory)
    ctl = control_path(seg.path)
    hook = webhook.Webhook(lambda name: ("bench-0", ctl) if name == "bench-0" else None, TOKEN).serve("127.0.0.1", 0)
    conn = http.client.HTTPConnection("127.0.0.1", hook.port, timeout=10)
    try:
        timed(conn, [body(f"warm{i}") for i in range(50)], TOKEN)
        t0 = time.perf_counter()
        new = timed(conn, [body(f"fp{i}") for i in range(args.requests)], TOKEN)
        sent = time.perf_counter() - t0
        repeat = timed(conn, [body("fp0")] * args.requests, TOKEN)
        denied = timed(conn, [body("fp0")] * min(args.requests, 500), None)
    finally:
        conn.close()
        hook.close()
        seg.close()
    print(f"# bench_webhook on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()})")
    print(summary("new alert (written)", new))
    print(summary("repeat (idempotent)", repeat))
    print(summary("no token (401)", denied))
    print(f"{args.requests} new alerts answered and written in {sent:.3f} s "
          f"({hook.counts()['recalibrations_by_target'].get('bench-0', 0)} requests written in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
