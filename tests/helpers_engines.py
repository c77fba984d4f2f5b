"""Stand-in serving engines that speak the real formats, for the engine-source tests.

    python tests/helpers_engines.py vllm --revision a --port 0     # prints "ready <port>"
    python tests/helpers_engines.py sglang --log FILE --tp 2       # prints "ready <pid> <dir>"

**vllm**: an HTTP/1.1 keep-alive server (as uvicorn serves vLLM's /metrics) whose exposition is
built with prometheus_client, the library vLLM uses, in the names and types of one vLLM HiSparse
revision (``a``: host_blocks_used/_total/_usage and pending_spills; ``b``: host_cache_usage_perc
and pending_page_transfers), with vLLM's ``model_name``/``engine`` labels and ``--engines``
data-parallel engines. A workload thread moves the counters: ``--hit-rate`` of the hot-buffer
lookups hit, tokens are generated, the host pool fills and drains. ``--kv-cache-metrics`` adds the
host-block residency histograms. ``--full`` adds the rest of a vLLM v1 server's exposition (its
request latency and size histograms, finish reasons, prefix cache, preemptions: about 1,000 lines
per engine, the size of a real vLLM /metrics), for the cost benchmark. Each new TCP connection is
counted on stderr ("connection N").

**sglang**: a process that, like SGLang, sets PROMETHEUS_MULTIPROC_DIR itself after start-up (so
its start-up environment does not show it), writes real prometheus_client multiprocess files
with ``sglang:`` names (tokenizer counters in this process, scheduler gauges and counters in
``--tp`` child processes with ``tp_rank`` labels: replicas of one pool) and, with ``--log``,
SGLang's HiSparse decode log line every ``--log-every`` seconds.

Both stop on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

VLLM_LABELS = ["model_name", "engine"]
MODEL = "glm-5.1-fp8-standin"


def run_vllm(args: argparse.Namespace) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    reg = CollectorRegistry()
    engines = [str(i) for i in range(args.engines)]

    def per_engine(metric):
        return [metric.labels(MODEL, e) for e in engines]

    running = per_engine(Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                               VLLM_LABELS, registry=reg))
    waiting = per_engine(Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                               VLLM_LABELS, registry=reg))
    kv_usage = per_engine(Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                VLLM_LABELS, registry=reg))
    prompt = per_engine(Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", VLLM_LABELS,
                                registry=reg))
    gen = per_engine(Counter("vllm:generation_tokens", "Number of generation tokens processed.", VLLM_LABELS,
                             registry=reg))
    ttft = per_engine(Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                VLLM_LABELS, buckets=[0.01, 0.1, 1.0, 10.0], registry=reg))
    Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", ["block_size", "num_gpu_blocks"],
          registry=reg).labels("64", "4096").set(1)
    hits = per_engine(Counter("vllm:hisparse_cache_hits", "Number of HiSparse device hot-buffer hits.",
                              VLLM_LABELS, registry=reg))
    misses = per_engine(Counter("vllm:hisparse_cache_misses", "Number of HiSparse device hot-buffer misses.",
                                VLLM_LABELS, registry=reg))
    h2d = per_engine(Counter("vllm:hisparse_host_to_device_bytes",
                             "Bytes transferred from host KV storage to HiSparse hot buffers.", VLLM_LABELS,
                             registry=reg))
    if args.revision == "a":
        used = per_engine(Gauge("vllm:hisparse_host_blocks_used",
                                "HiSparse host KV blocks backing live or cached prefixes.", VLLM_LABELS,
                                registry=reg))
        total = per_engine(Gauge("vllm:hisparse_host_blocks_total", "Total HiSparse host KV blocks (fixed at "
                                 "startup).", VLLM_LABELS, registry=reg))
        usage = per_engine(Gauge("vllm:hisparse_host_blocks_usage",
                                 "HiSparse host KV pool usage. 1 means 100 percent usage.", VLLM_LABELS,
                                 registry=reg))
        pending = per_engine(Gauge("vllm:hisparse_pending_spills",
                                   "HiSparse page transfers enqueued but not yet completed on host.",
                                   VLLM_LABELS, registry=reg))
    else:
        usage = per_engine(Gauge("vllm:hisparse_host_cache_usage_perc",
                                 "HiSparse host KV-cache usage. 1 means 100 percent usage. Evictable cached "
                                 "blocks count as free.", VLLM_LABELS, registry=reg))
        pending = per_engine(Gauge("vllm:hisparse_pending_page_transfers",
                                   "HiSparse page transfers (write-backs and restores) not yet completed.",
                                   VLLM_LABELS, registry=reg))
    residency = []
    if args.kv_cache_metrics:
        for name in ("lifetime", "idle_before_evict", "reuse_gap"):
            residency.append(per_engine(Histogram(
                f"vllm:hisparse_host_block_{name}_seconds", f"Histogram of HiSparse host KV block {name}.",
                VLLM_LABELS, buckets=[0.1, 1.0, 10.0, 60.0], registry=reg)))

    full: list = []
    if args.full:
        full = _vllm_full(reg, engines)

    lock = threading.Lock()
    block_total = args.host_blocks
    state = {"used": [block_total * args.pool_fill] * len(engines)}
    if args.revision == "a":
        for g in total:
            g.set(block_total)

    def workload() -> None:
        rng = random.Random(args.seed)
        period = 1.0 / args.rate
        while True:
            time.sleep(period)
            with lock:
                for i in range(len(engines)):
                    n = 2048
                    h = sum(1 for _ in range(64) if rng.random() < args.hit_rate) * n // 64
                    hits[i].inc(h)
                    misses[i].inc(n - h)
                    h2d[i].inc((n - h) * 1152)
                    gen[i].inc(8)
                    if rng.random() < 0.05:
                        prompt[i].inc(4096)
                        ttft[i].observe(rng.random())
                    running[i].set(rng.randint(4, 8))
                    waiting[i].set(rng.randint(0, 2))
                    kv_usage[i].set(rng.uniform(0.4, 0.6))
                    u = min(block_total, max(0.0, state["used"][i] + rng.choice((-8, 0, 8, 8))))
                    state["used"][i] = u if u < block_total * 0.99 else block_total * args.pool_fill
                    usage[i].set(state["used"][i] / block_total)
                    pending[i].set(rng.randint(0, 3))
                    if args.revision == "a":
                        used[i].set(state["used"][i])
                    for hist in residency:
                        hist[i].observe(rng.uniform(0.05, 30.0))
                    for kind, metric in full:
                        if kind == "histogram":
                            metric[i].observe(rng.expovariate(1.0))
                        elif rng.random() < 0.1:
                            metric[i].inc()

    connections = [0]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn answers

        def setup(self) -> None:
            super().setup()
            connections[0] += 1
            print(f"connection {connections[0]}", file=sys.stderr, flush=True)

        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            with lock:
                body = generate_latest(reg)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    threading.Thread(target=workload, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *a: threading.Thread(target=server.shutdown).start())
    print(f"ready {server.server_address[1]}", flush=True)
    server.serve_forever()


def _vllm_full(reg, engines: list[str]) -> list:
    """The rest of a vLLM v1 exposition (names and bucket counts of vllm/v1/metrics/loggers.py)."""
    from prometheus_client import Counter, Gauge, Histogram

    lab = VLLM_LABELS
    latency = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]
    tokens = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
              1000000]
    ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0, 160.0, 640.0, 2560.0]
    itl = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
    out = []
    for name, buckets in (("e2e_request_latency_seconds", latency), ("request_queue_time_seconds", latency),
                          ("request_inference_time_seconds", latency), ("request_prefill_time_seconds", latency),
                          ("request_decode_time_seconds", latency), ("time_per_output_token_seconds", itl),
                          ("inter_token_latency_seconds", itl), ("request_time_per_output_token_seconds", itl),
                          ("request_prompt_tokens", tokens), ("request_generation_tokens", tokens),
                          ("iteration_tokens_total", tokens), ("request_max_num_generation_tokens", tokens),
                          ("request_params_max_tokens", tokens), ("request_params_n", [1, 2, 5, 10, 20])):
        h = Histogram(f"vllm:{name}", f"Histogram of {name}.", lab, buckets=buckets, registry=reg)
        out.append(("histogram", [h.labels(MODEL, e) for e in engines]))
    out.append(("histogram", [Histogram("vllm:time_to_first_token_seconds_full", "TTFT.", lab, buckets=ttft,
                                        registry=reg).labels(MODEL, e) for e in engines]))
    fin = Counter("vllm:request_success", "Count of successfully processed requests.", lab + ["finished_reason"],
                  registry=reg)
    for reason in ("stop", "length", "abort", "error"):
        out.append(("counter", [fin.labels(MODEL, e, reason) for e in engines]))
    for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_cached",
                 "external_prefix_cache_queries", "external_prefix_cache_hits"):
        c = Counter(f"vllm:{name}", f"{name}.", lab, registry=reg)
        out.append(("counter", [c.labels(MODEL, e) for e in engines]))
    g = Gauge("vllm:num_requests_waiting_by_reason", "Waiting requests by reason.", lab + ["reason"], registry=reg)
    for reason in ("capacity", "deferred"):
        for e in engines:
            g.labels(MODEL, e, reason).set(0)
    return out


def sglang_labels(tp_rank: int) -> dict[str, str]:
    return {"model_name": MODEL, "engine_type": "unified", "tp_rank": str(tp_rank), "pp_rank": "0",
            "moe_ep_rank": "0"}


def run_sglang_scheduler(args: argparse.Namespace) -> None:
    """One scheduler rank: SGLang's scheduler gauges (mostrecent) and counters, and the log."""
    from prometheus_client import Counter, Gauge, Histogram

    labels = sglang_labels(args.tp_rank)
    names = list(labels)

    def gauge(name: str, doc: str):
        return Gauge(name, doc, names, multiprocess_mode="mostrecent").labels(**labels)

    running = gauge("sglang:num_running_reqs", "The number of running requests.")
    used = gauge("sglang:num_used_tokens", "The number of used tokens.")
    usage = gauge("sglang:token_usage", "The token usage.")
    gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.").set(args.pool)
    host_used = gauge("sglang:hicache_host_used_tokens", "HiCache host tokens in use.")
    gauge("sglang:hicache_host_total_tokens", "HiCache host tokens in all.").set(args.host_pool)
    realtime = Counter("sglang:realtime_tokens", "Total number of tokens processed (updated on each log "
                       "interval). mode: prefill_compute, prefill_cache, decode.", names + ["mode"])
    backup = Counter("sglang:hicache_backup_bytes", "HiCache device-to-host bytes.", names).labels(**labels)
    load_back = Counter("sglang:load_back_bytes", "HiCache host-to-device bytes.", names).labels(**labels)
    retracted = Gauge("sglang:num_retracted_reqs", "The number of retracted requests.", names).labels(**labels)
    queue = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", names,
                      buckets=[0.1, 1, 10]).labels(**labels)
    rng = random.Random(args.seed + args.tp_rank)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    log = open(args.log, "a", buffering=1) if args.log and args.tp_rank == 0 else None
    period = 1.0 / args.rate
    step = 0
    t_log = time.monotonic()
    # Values are the same on every rank (replicas of one pool): the rank seeds only the jitter of
    # the histogram, as SGLang's ranks do report the same pool.
    pool_rng = random.Random(args.seed)
    while not stop:
        time.sleep(period)
        step += 1
        n_run = pool_rng.randint(4, 8)
        n_used = pool_rng.randint(args.pool // 4, args.pool // 2)
        h_used = pool_rng.randint(args.host_pool // 4, int(args.host_pool * 0.6))
        running.set(n_run)
        used.set(n_used)
        usage.set(round(n_used / args.pool, 2))
        host_used.set(h_used)
        realtime.labels(**labels, mode="decode").inc(n_run)
        if step % 20 == 0:
            realtime.labels(**labels, mode="prefill_compute").inc(2048)
            realtime.labels(**labels, mode="prefill_cache").inc(512)
        backup.inc(n_run * 656 * 61)
        load_back.inc(pool_rng.randint(0, 64) * 656 * 61)
        retracted.set(0)
        queue.observe(rng.random())
        if log is not None and time.monotonic() - t_log >= args.log_every:
            t_log = time.monotonic()
            gpu = min(args.device_buffer, n_run * 4096)
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"[{stamp} TP0] Decode batch, #running-req: {n_run}, #gpu token: {gpu}, gpu token usage: "
                      f"{gpu / args.device_buffer:.2f}, #cpu token: {h_used}, cpu token usage: "
                      f"{h_used / args.host_pool:.2f}, cuda graph: True, gen throughput (token/s): "
                      f"{n_run / period:.2f}, #queue-req: 0\n")
    if log is not None:
        log.close()


def run_sglang(args: argparse.Namespace) -> None:
    """The server's main process (SGLang's tokenizer manager), then one scheduler per TP rank."""
    directory = args.dir or tempfile.mkdtemp(prefix="sglang-standin-")
    # As SGLang's set_prometheus_multiproc_dir: set after start-up, before prometheus_client loads.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    from prometheus_client import Counter

    names = ["model_name"]
    prompt = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", names).labels(MODEL)
    gen = Counter("sglang:generation_tokens", "Number of generation tokens processed.", names).labels(MODEL)
    children = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "sglang-scheduler",
                                  "--tp-rank", str(r), "--rate", str(args.rate), "--seed", str(args.seed),
                                  "--log", args.log or "", "--log-every", str(args.log_every),
                                  "--pool", str(args.pool), "--host-pool", str(args.host_pool),
                                  "--device-buffer", str(args.device_buffer)])
                for r in range(args.tp)]
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    print(f"ready {os.getpid()} {directory}", flush=True)
    while not stop:
        time.sleep(1.0 / args.rate)
        gen.inc(6)
        prompt.inc(100)
        if any(c.poll() is not None for c in children):
            break
    for c in children:
        c.terminate()
    for c in children:
        c.wait()


def start_standin(*args: str, stderr=subprocess.PIPE) -> tuple[subprocess.Popen, list[str]]:
    """This script as a process with ``args``; (it, the words of its "ready" line) once it serves.
    A long run should pass stderr=subprocess.DEVNULL: nobody drains the pipe."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args],
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        why = proc.stderr.read() if proc.stderr is not None and proc.poll() is not None else ""
        raise AssertionError(f"stand-in {args} did not start: {line!r} {why}")
    return proc, line.split()[1:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vllm")
    v.add_argument("--revision", choices=("a", "b"), default="a")
    v.add_argument("--port", type=int, default=0)
    v.add_argument("--engines", type=int, default=1)
    v.add_argument("--rate", type=float, default=50.0)
    v.add_argument("--hit-rate", type=float, default=0.8)
    v.add_argument("--host-blocks", type=int, default=8192)
    v.add_argument("--pool-fill", type=float, default=0.5)
    v.add_argument("--kv-cache-metrics", action="store_true")
    v.add_argument("--full", action="store_true")
    v.add_argument("--seed", type=int, default=1)
    for name in ("sglang", "sglang-scheduler"):
        s = sub.add_parser(name)
        s.add_argument("--dir", default=None)
        s.add_argument("--log", default=None)
        s.add_argument("--log-every", type=float, default=0.3)
        s.add_argument("--tp", type=int, default=2)
        s.add_argument("--tp-rank", type=int, default=0)
        s.add_argument("--rate", type=float, default=20.0)
        s.add_argument("--pool", type=int, default=400000)
        s.add_argument("--host-pool", type=int, default=2000000)
        s.add_argument("--device-buffer", type=int, default=65536)
        s.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.cmd == "vllm":
        run_vllm(args)
    elif args.cmd == "sglang":
        run_sglang(args)
    else:
        run_sglang_scheduler(args)


if __name__ == "__main__":
    main()
