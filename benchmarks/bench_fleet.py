"""The per-target costs a fleet multiplies: series, samples, bytes per sample, scrape cost.

    .venv/bin/python benchmarks/bench_fleet.py [--seconds 600] [--targets 8] [--json FILE]

One "node": --targets reference writers publishing every runtime series of the catalogue
(tests/helpers_targets.py --full, 10 publishes/s) behind one easymats agent, plus a second agent
with one writer (to separate per-target from per-agent costs). Against them, real Prometheus 2.42
servers from Debian's package, for --seconds:

- an edge Prometheus scraping both agents every 1 s, with alerts/rules.yml, remote-writing to a
  receiver Prometheus (--web.enable-remote-write-receiver): its CPU per ingested sample, its
  scrape_duration_seconds per target, and remote-write bytes per sample on the wire;
- a second Prometheus scraping the same agents every 5 s;
- at the end both write a TSDB snapshot (admin API, head included): bytes of chunks per sample
  and bytes of index per series, at 1 s and at 5 s;
- the agent's /metrics over HTTP: wall time and body bytes with 1 and with N targets, and the
  agent's CPU per scrape; the edge's /federate with alerts/build.py FEDERATE_MATCH: series and
  bytes per node and per target that a global Prometheus pulls.

Prints one JSON object (and writes it to --json); docs/scaling.md derives the fleet figures from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import yaml  # noqa: E402
from helpers_prometheus import stop  # noqa: E402
from helpers_targets import free_port  # noqa: E402

from alerts import build as rules  # noqa: E402
from easymats import cardinality  # noqa: E402

WRITER = os.path.join(ROOT, "tests", "helpers_targets.py")


def get(url: str, data: bytes | None = None, timeout: float = 10.0) -> bytes:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def query(port: int, expr: str) -> list[dict]:
    out = json.loads(get(f"http://127.0.0.1:{port}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
    return out["data"]["result"]


def scalar(port: int, expr: str) -> float:
    got = query(port, expr)
    if len(got) != 1:
        raise RuntimeError(f"{expr} returned {len(got)} series")
    return float(got[0]["value"][1])


def wait(what: str, pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except (OSError, RuntimeError, KeyError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Node:
    def __init__(self, root: str, name: str, targets: int):
        self.dir = os.path.join(root, name)
        os.mkdir(self.dir, 0o700)
        env = {**os.environ, "EASYMATS_SEGMENT_DIR": self.dir}
        self.port = free_port()
        self.writers = [subprocess.Popen([sys.executable, WRITER, "--name", f"decode-{i}", "--rate", "10",
                                          "--duration", "0", "--full", "--seed", str(i)],
                                         env=env, stdout=subprocess.DEVNULL) for i in range(targets)]
        self.agent = subprocess.Popen([sys.executable, "-c", "from easymats.cli import main; main()",
                                       "--keep-serving", "--quiet", "--interval", "0.1",
                                       "--listen", f"127.0.0.1:{self.port}"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.targets = targets

    def metrics(self) -> bytes:
        return get(f"http://127.0.0.1:{self.port}/metrics")

    def procs(self) -> list[subprocess.Popen]:
        return [self.agent, *self.writers]


def scrape_cost(node: Node, n: int = 200) -> dict:
    """HTTP /metrics wall time and body size, and the agent's CPU per scrape (net of its idle)."""
    t0, c0 = time.monotonic(), cpu_s(node.agent.pid)
    time.sleep(5.0)
    idle_rate = (cpu_s(node.agent.pid) - c0) / (time.monotonic() - t0)
    walls, size = [], 0
    t0, c0 = time.monotonic(), cpu_s(node.agent.pid)
    for _ in range(n):
        t = time.perf_counter()
        size = len(node.metrics())
        walls.append(time.perf_counter() - t)
    elapsed, used = time.monotonic() - t0, cpu_s(node.agent.pid) - c0
    return {"targets": node.targets, "wall_ms_p50": statistics.median(walls) * 1e3,
            "agent_cpu_ms_per_scrape": max(0.0, used - idle_rate * elapsed) / n * 1e3, "body_bytes": size}


def prometheus(workdir: str, name: str, port: int, cfg: dict, *extra: str) -> subprocess.Popen:
    path = os.path.join(workdir, f"{name}.yml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return subprocess.Popen([shutil.which("prometheus") or "prometheus", f"--config.file={path}",
                             f"--storage.tsdb.path={os.path.join(workdir, name + '-tsdb')}",
                             f"--web.listen-address=127.0.0.1:{port}", "--web.enable-admin-api",
                             "--log.level=warn", *extra],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, f"{name}.log"), "w"))


def snapshot_stats(workdir: str, name: str, port: int) -> dict:
    """Snapshot the TSDB (head included) and measure its one block: chunk bytes, index bytes."""
    out = json.loads(get(f"http://127.0.0.1:{port}/api/v1/admin/tsdb/snapshot", data=b""))
    snap = os.path.join(workdir, f"{name}-tsdb", "snapshots", out["data"]["name"])
    samples = series = chunk_bytes = index_bytes = 0
    for block in os.listdir(snap):
        with open(os.path.join(snap, block, "meta.json")) as f:
            stats = json.load(f)["stats"]
        samples += stats["numSamples"]
        series += stats["numSeries"]
        cdir = os.path.join(snap, block, "chunks")
        chunk_bytes += sum(os.path.getsize(os.path.join(cdir, c)) for c in os.listdir(cdir))
        index_bytes += os.path.getsize(os.path.join(snap, block, "index"))
    return {"samples": samples, "series": series, "chunk_bytes": chunk_bytes, "index_bytes": index_bytes,
            "bytes_per_sample": chunk_bytes / samples, "index_bytes_per_series": index_bytes / series}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0, help="how long the servers scrape")
    ap.add_argument("--targets", type=int, default=8, help="targets behind the node's agent (GPUs)")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-fleet-")
    os.chmod(root, 0o700)
    node, single = Node(root, "node", args.targets), Node(root, "single", 1)
    edge_port, slow_port, recv_port = free_port(), free_port(), free_port()
    rules_path = os.path.join(root, "rules.yml")
    with open(rules_path, "w") as f:
        f.write(rules.render(rules.build_rules()))
    targets = [f"127.0.0.1:{node.port}", f"127.0.0.1:{single.port}"]
    job = {"job_name": rules.AGENT_JOB, "static_configs": [{"targets": targets, "labels": {"node": "n1"}}]}
    servers = [
        prometheus(root, "receiver", recv_port, {"global": {"scrape_interval": "1m"}},
                   "--web.enable-remote-write-receiver"),
        prometheus(root, "edge", edge_port, {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [rules_path],
            "scrape_configs": [job],
            "remote_write": [{"url": f"http://127.0.0.1:{recv_port}/api/v1/write"}]}),
        prometheus(root, "slow", slow_port, {"global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
                                            "scrape_configs": [job]}),
    ]
    procs = servers + node.procs() + single.procs()
    try:
        wait("both agents scraped", lambda: scalar(edge_port, f'count(up{{job="{rules.AGENT_JOB}"}} == 1)') == 2)
        wait("every target on /metrics", lambda: len(cardinality.count_by_target(node.metrics().decode())) ==
             args.targets + 1)
        counts = cardinality.count_by_target(node.metrics().decode())
        cost_1, cost_n = scrape_cost(single), scrape_cost(node)

        # process_cpu_seconds_total of the edge itself comes from its own /metrics, not a scrape.
        def edge_self() -> dict[str, float]:
            text = get(f"http://127.0.0.1:{edge_port}/metrics").decode()
            want = ("process_cpu_seconds_total", "prometheus_tsdb_head_samples_appended_total",
                    "prometheus_remote_storage_bytes_total", "prometheus_remote_storage_samples_total")
            got = dict.fromkeys(want, 0.0)
            for line in text.splitlines():
                name = line.split("{")[0].split(" ")[0]
                if name in got:
                    got[name] += float(line.rsplit(" ", 1)[1])
            return got

        t0, e0 = time.monotonic(), edge_self()
        deadline = t0 + args.seconds
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[:3]} exited with {p.returncode}")
            time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        elapsed, e1 = time.monotonic() - t0, edge_self()
        d = {k: e1[k] - e0[k] for k in e0}
        scrape_ms = {r["metric"]["instance"]: float(r["value"][1]) * 1e3 for r in
                     query(edge_port, f'avg_over_time(scrape_duration_seconds{{job="{rules.AGENT_JOB}"}}[1m])')}
        fed = get(f"http://127.0.0.1:{edge_port}/federate?"
                  + urllib.parse.urlencode([("match[]", m) for m in rules.FEDERATE_MATCH]))
        fed_series = [line for line in fed.decode().splitlines() if line and not line.startswith("#")]
        fed_by_target = sum(1 for s in fed_series if 'target="' in s)
        tsdb_1s = snapshot_stats(root, "edge", edge_port)
        tsdb_5s = snapshot_stats(root, "slow", slow_port)
        n = args.targets
        result = {
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, Python "
                       f"{platform.python_version()}, load {os.getloadavg()[0]:.1f}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["benchmarks/bench_fleet.py", *sys.argv[1:]]),
            "seconds": round(elapsed),
            "series_per_target_metrics": counts["decode-0"],
            "series_per_target_catalogue": {"no_gpu": cardinality.series_per_target(0),
                                            "one_gpu": cardinality.series_per_target(1)},
            "series_per_agent": {"measured_no_gpu": counts[""],
                                 "catalogue_8_gpus": cardinality.series_per_agent(8)},
            "scrape_agent": {"1_target": cost_1, f"{n}_targets": cost_n,
                             "per_target_wall_ms": (cost_n["wall_ms_p50"] - cost_1["wall_ms_p50"]) / (n - 1),
                             "per_target_agent_cpu_ms": (cost_n["agent_cpu_ms_per_scrape"]
                                                         - cost_1["agent_cpu_ms_per_scrape"]) / (n - 1),
                             "per_target_body_bytes": (cost_n["body_bytes"] - cost_1["body_bytes"]) / (n - 1)},
            "prometheus_scrape_ms": {"1_target": scrape_ms.get(f"127.0.0.1:{single.port}"),
                                     f"{n}_targets": scrape_ms.get(f"127.0.0.1:{node.port}")},
            "edge_ingest": {"samples_per_s": d["prometheus_tsdb_head_samples_appended_total"] / elapsed,
                            "cpu_cores": d["process_cpu_seconds_total"] / elapsed,
                            "cpu_us_per_sample": d["process_cpu_seconds_total"] * 1e6
                            / max(1.0, d["prometheus_tsdb_head_samples_appended_total"])},
            "remote_write_bytes_per_sample": d["prometheus_remote_storage_bytes_total"]
            / max(1.0, d["prometheus_remote_storage_samples_total"]),
            "tsdb_1s": tsdb_1s, "tsdb_5s": tsdb_5s,
            "federate": {"series_total": len(fed_series), "series_per_target": fed_by_target / (n + 1),
                         "series_per_node_other": len(fed_series) - fed_by_target,
                         "bytes": len(fed), "note": "edge scrapes 2 agents (n and 1 targets) as one node"},
        }
    finally:
        stop(procs)
        shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
