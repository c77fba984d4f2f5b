"""What an engine target costs at 10 Hz: ``--scrape`` of a vLLM endpoint, and SGLang by PID.

    .venv/bin/python benchmarks/bench_engines.py [--seconds 15] [--scrape-targets 1,4] [--json]

1. **Per read, in this process** (one vLLM stand-in with ``--full``: a real vLLM server's
   exposition, ~560 lines / 51 KB per engine, HiSparse series included): wall time of the GET on
   the kept-alive connection; CPU of what a read does (check every line, keep the series the tables
   use, parse those with prometheus_client), of the mapping, of the sample and its log line; and,
   for comparison, of parsing the whole answer (what /metrics does once per answer for the
   pass-through, and what a read did before it kept only what the tables use); 300 reads, p50
   and p99. The stand-in's counters move at 50 Hz, so every read here parses.
2. **The agent as a subprocess** (``--interval 0.1 --output FILE --quiet``), per configuration:
   N scrape targets (one stand-in each), one SGLang stand-in by PID with ``--follow-log`` (2 ranks),
   and for scale one native HiSparse PID target. Agent CPU over ``--seconds`` after a 3 s warm-up
   (per-thread schedstat, as bench_agent.py), divided by the samples taken: **CPU per sample**;
   sample lag p50/p99 and the share of samples that were fresh reads (up, new seq) from the log;
   RSS at the end.
3. **The engine's side**: CPU of the vLLM stand-in (prometheus_client's generate_latest, as vLLM
   serves /metrics) while scraped at 10 Hz, minus the same stand-in not scraped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)

import psutil  # noqa: E402
from bench_agent import cpu_seconds, pct  # noqa: E402
from helpers_engines import start_standin  # noqa: E402
from helpers_prometheus import stop  # noqa: E402
from helpers_targets import free_port, start_target  # noqa: E402


def start(*args: str) -> tuple[subprocess.Popen, list[str]]:
    return start_standin(*args, stderr=subprocess.DEVNULL)


def per_read(reads: int = 300) -> dict:
    from easymats.exporter import AgentCollector, LagHistogram
    from easymats.sources.maps import choose
    from easymats.sources.scrape import ScrapeSource, parse_exposition, split_exposition
    from easymats.sources.target import scrape_target
    from easymats.sources.translate import translate

    proc, (port,) = start("vllm", "--revision", "a", "--kv-cache-metrics", "--full", "--rate", "50")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        src = ScrapeSource(url)
        get_ms, parse_ms, map_ms, full_ms, sizes = [], [], [], [], []
        for _ in range(reads):
            t0 = time.perf_counter()
            status, ctype, body = src.http.get(time.monotonic() + 1.0)
            t1 = time.perf_counter()
            c0 = time.thread_time()
            wanted, _, _ = split_exposition(body, src.wanted)
            fams = parse_exposition(wanted.decode(), ctype)
            c1 = time.thread_time()
            emap = choose(s.name for f in fams for s in f.samples)
            translate(emap, fams)
            c2 = time.thread_time()
            parse_exposition(body.decode(), ctype)
            c3 = time.thread_time()
            get_ms.append((t1 - t0) * 1e3)
            parse_ms.append((c1 - c0) * 1e3)
            map_ms.append((c2 - c1) * 1e3)
            full_ms.append((c3 - c2) * 1e3)
            sizes.append(len(body))
            time.sleep(0.02)
        lines = body.count(b"\n")
        src.close()
        tg = scrape_target(url, name="v", peak_window_s=15.0, timeout_s=0.08)
        tg.reader.wait_first(1.0)
        coll = AgentCollector(lambda: [tg], LagHistogram(), lambda: None, 15.0)
        sample_ms, render_ms = [], []
        for _ in range(100):
            time.sleep(0.1)
            t = time.time()
            c0 = time.thread_time()
            tg.sample(t)
            tg.log_json(t, 0.0)
            c1 = time.thread_time()
            coll.render_text()
            c2 = time.thread_time()
            sample_ms.append((c1 - c0) * 1e3)
            render_ms.append((c2 - c1) * 1e3)
        tg.close()
    finally:
        stop([proc])
    return {"body_bytes": sizes[-1], "body_lines": lines,
            "get_ms_p50": pct(get_ms, 0.5), "get_ms_p99": pct(get_ms, 0.99),
            "parse_cpu_ms_p50": pct(parse_ms, 0.5), "parse_cpu_ms_p99": pct(parse_ms, 0.99),
            "map_cpu_ms_p50": pct(map_ms, 0.5), "full_parse_cpu_ms_p50": pct(full_ms, 0.5),
            "sample_and_log_cpu_ms_p50": pct(sample_ms, 0.5),
            "render_cpu_ms_p50": pct(render_ms, 0.5)}


def agent_run(label: str, args: list[str], seconds: float, workdir: str, watch: list[subprocess.Popen]) -> dict:
    log = os.path.join(workdir, f"{label}.log")
    agent = subprocess.Popen([sys.executable, "-c", "from easymats.cli import main; main()", *args,
                              "--interval", "0.1", "--output", log, "--quiet", "--listen", f"127.0.0.1:{free_port()}"],
                             stderr=subprocess.PIPE, text=True)
    proc = psutil.Process(agent.pid)
    time.sleep(3.0)
    t0 = time.time()
    c0, w0 = cpu_seconds(proc), time.monotonic()
    e0 = [cpu_seconds(psutil.Process(p.pid)) for p in watch]
    time.sleep(seconds)
    c1, w1 = cpu_seconds(proc), time.monotonic()
    e1 = [cpu_seconds(psutil.Process(p.pid)) for p in watch]
    t1 = time.time()
    rss = proc.memory_info().rss
    agent.terminate()
    agent.wait(timeout=15)
    samples = []
    with open(log, encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            if obj["kind"] == "sample" and t0 <= obj["t"] <= t1:
                samples.append(obj)
    fresh = {}
    for s in samples:
        if s["up"]:
            fresh.setdefault(s["target"], set()).add(s["seq"])
    n = len(samples)
    cpu = c1 - c0
    return {"label": label, "targets": len({s["target"] for s in samples}), "samples": n,
            "agent_cpu_pct": 100 * cpu / (w1 - w0), "cpu_ms_per_sample": 1e3 * cpu / max(1, n),
            "lag_ms_p50": 1e3 * pct([s["lag_s"] for s in samples], 0.5),
            "lag_ms_p99": 1e3 * pct([s["lag_s"] for s in samples], 0.99),
            "fresh_share": sum(len(v) for v in fresh.values()) / max(1, n),
            "rss_mb": rss / 2 ** 20,
            "watched_cpu_pct": [100 * (b - a) / (w1 - w0) for a, b in zip(e0, e1)]}


def engine_side(seconds: float) -> dict:
    """CPU of a vLLM stand-in not scraped, then scraped at 10 Hz by the agent."""
    proc, (port,) = start("vllm", "--revision", "a", "--kv-cache-metrics", "--full", "--rate", "50")
    try:
        p = psutil.Process(proc.pid)
        time.sleep(2.0)
        c0, w0 = cpu_seconds(p), time.monotonic()
        time.sleep(seconds)
        idle = 100 * (cpu_seconds(p) - c0) / (time.monotonic() - w0)
        with tempfile.TemporaryDirectory() as d:
            run = agent_run("engine-side", ["--scrape", f"http://127.0.0.1:{port}/metrics"], seconds, d, [proc])
        return {"standin_cpu_pct_not_scraped": idle, "standin_cpu_pct_scraped_10hz": run["watched_cpu_pct"][0],
                "scrape_cost_on_engine_pct": run["watched_cpu_pct"][0] - idle}
    finally:
        stop([proc])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--scrape-targets", default="1,4")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out: dict = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, Python "
                            f"{platform.python_version()}", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "load_avg": os.getloadavg()}
    out["per_read"] = per_read()
    runs = []
    with tempfile.TemporaryDirectory() as d:
        for n in [int(x) for x in args.scrape_targets.split(",")]:
            procs = [start("vllm", "--revision", "ab"[i % 2], "--kv-cache-metrics", "--full", "--rate", "50")
                     for i in range(n)]
            try:
                scrapes = [a for i, (_, (port,)) in enumerate(procs)
                           for a in ("--scrape", f"vllm-{i}=http://127.0.0.1:{port}/metrics")]
                runs.append(agent_run(f"scrape x{n}", scrapes, args.seconds, d, []))
            finally:
                stop([p for p, _ in procs])
        slog = os.path.join(d, "sglang.log")
        sg, (spid, _) = start("sglang", "--tp", "2", "--log", slog)
        try:
            runs.append(agent_run("sglang pid + log", ["--pid", spid, "--follow-log", slog], args.seconds, d, []))
        finally:
            stop([sg])
        native, _ = start_target("decode-0", rate=100, duration=0)
        try:
            runs.append(agent_run("native pid (for scale)", ["--pid", str(native.pid)], args.seconds, d, []))
        finally:
            stop([native])
    out["agent"] = runs
    out["engine_side"] = engine_side(args.seconds)
    out["load_avg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['machine']}; {out['date']}; load {out['load_avg']} -> {out['load_avg_end']}")
    r = out["per_read"]
    print(f"per read of a vLLM /metrics ({r['body_lines']} lines, {r['body_bytes'] / 1024:.0f} KiB): GET "
          f"{r['get_ms_p50']:.2f} ms (p99 {r['get_ms_p99']:.2f}) wall; CPU: select + parse "
          f"{r['parse_cpu_ms_p50']:.2f} ms (p99 {r['parse_cpu_ms_p99']:.2f}), map {r['map_cpu_ms_p50']:.3f} ms, "
          f"sample + log line {r['sample_and_log_cpu_ms_p50']:.3f} ms; whole-answer parse "
          f"{r['full_parse_cpu_ms_p50']:.2f} ms; /metrics share (pass-through parse included) "
          f"{r['render_cpu_ms_p50']:.2f} ms")
    print(f"{'run':<24} {'targets':>7} {'CPU %':>7} {'ms/sample':>10} {'lag p50':>8} {'lag p99':>8} "
          f"{'fresh':>6} {'RSS MB':>7}")
    for a in runs:
        print(f"{a['label']:<24} {a['targets']:>7} {a['agent_cpu_pct']:>7.2f} {a['cpu_ms_per_sample']:>10.3f} "
              f"{a['lag_ms_p50']:>7.2f}m {a['lag_ms_p99']:>7.2f}m {a['fresh_share']:>6.3f} {a['rss_mb']:>7.1f}")
    e = out["engine_side"]
    print(f"engine side (vLLM stand-in): {e['standin_cpu_pct_not_scraped']:.2f} % not scraped, "
          f"{e['standin_cpu_pct_scraped_10hz']:.2f} % scraped at 10 Hz: +{e['scrape_cost_on_engine_pct']:.2f} % "
          "of a core to serve /metrics")


if __name__ == "__main__":
    main()
