"""The recalibration loop end to end, with every component real and on 127.0.0.1:

    HiSparse workload (topic shift) -> easymats agent (/metrics, webhook) -> Prometheus (rules
    from alerts/build.py) -> HiSparseAnchorHitRateLow fires -> Alertmanager (alerts/alertmanager.yml)
    -> easymats webhook -> control file -> the runtime recalibrates ("request") -> hit rate recovers

and, against the same live Prometheus, every query of dashboards/hisparse.json returns data.

Test-only overrides compress time: 1 s scrape and rule evaluation, a short rate window and `for`,
Alertmanager's group wait and interval; everything else is the shipped configuration. Needs the
Debian packages prometheus and prometheus-alertmanager (.ci/run installs them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from helpers_prometheus import binary, free_port, http_json, poll, queries_without_data  # noqa: E402

from alerts import build as rules  # noqa: E402
from dashboards import build as dashboards  # noqa: E402
from easymats import thresholds  # noqa: E402

SCRAPE_S = 1
RATE_WINDOW = "6s"  # the rules' 5m window, compressed: at least four scrapes
FOR_S = 3  # every alert's `for`, compressed
RATE_INTERVAL = "4s"  # what Grafana's $__rate_interval becomes at a 1 s scrape interval
TOKEN = "e2e-token"
# Series that only an NVIDIA GPU (NVML) produces: absent, not zero, on a CPU-only machine. The
# per-process ones also need the target to use the GPU, and this workload runs on the CPU.
GPU_METRICS = ("easymats_gpu_", "easymats_process_gpu_")
PROCESS_GPU_METRICS = ("easymats_process_gpu_",)


class Stack:
    """Prometheus and Alertmanager from Debian's packages, on free ports, with temp storage."""

    def __init__(self, tmp, agent_port: int, webhook_port: int):
        self.tmp = tmp
        self.prom_port, self.am_port = free_port(), free_port()
        token = tmp / "webhook-token"
        token.write_text(TOKEN + "\n")
        token.chmod(0o600)
        self.token_file = str(token)
        (tmp / "rules.yml").write_text(rules.render(rules.build_rules(rate_window=RATE_WINDOW,
                                                                       for_override_s=FOR_S)))
        (tmp / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "rule_files": [str(tmp / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.am_port}"]}]}]},
            "scrape_configs": [{"job_name": rules.AGENT_JOB,
                                "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
        }))
        with open(os.path.join(ROOT, "alerts", "alertmanager.yml"), encoding="utf-8") as f:
            am = yaml.safe_load(f)
        hook = next(r for r in am["receivers"] if r["name"] == "easymats-recalibrate")["webhook_configs"][0]
        hook["url"] = f"http://127.0.0.1:{webhook_port}/alertmanager"
        hook["http_config"]["authorization"]["credentials_file"] = self.token_file
        route = next(r for r in am["route"]["routes"] if r["receiver"] == "easymats-recalibrate")
        route.update(group_wait="0s", group_interval="1s")
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am))
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        logs = self.tmp
        self.procs["prometheus"] = subprocess.Popen(
            [binary("prometheus"), f"--config.file={self.tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.prom_port}",
             "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=open(logs / "prometheus.log", "w"))
        self.procs["alertmanager"] = subprocess.Popen(
            [binary("alertmanager", "prometheus-alertmanager"), f"--config.file={self.tmp / 'alertmanager.yml'}",
             f"--storage.path={self.tmp / 'am'}", f"--web.listen-address=127.0.0.1:{self.am_port}",
             "--cluster.listen-address=", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(logs / "alertmanager.log", "w"))

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    # -- Prometheus HTTP API -------------------------------------------------------------------------
    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        out = http_json(f"http://127.0.0.1:{self.prom_port}/api/v1/query?{q}")
        assert out["status"] == "success", out
        return out["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
        out = http_json(f"http://127.0.0.1:{self.prom_port}/api/v1/query_range?{q}")
        assert out["status"] == "success", (expr, out)
        return out["data"]["result"]

    def series(self, selector: str, start: float) -> list[dict]:
        q = urllib.parse.urlencode({"match[]": selector, "start": start})
        return http_json(f"http://127.0.0.1:{self.prom_port}/api/v1/series?{q}")["data"]

    def alertmanager_alerts(self) -> list[dict]:
        return http_json(f"http://127.0.0.1:{self.am_port}/api/v2/alerts")

    def logs(self) -> str:
        out = []
        for name in ("prometheus", "alertmanager"):
            try:
                out.append(f"--- {name}:\n" + (self.tmp / f"{name}.log").read_text()[-3000:])
            except OSError:
                pass
        return "\n".join(out)


def dashboard_queries_without_data(stack: Stack, start: float) -> tuple[list[str], list[str]]:
    """(queries that returned nothing, those of them that only a GPU can answer)."""
    return queries_without_data(stack, dashboards.DASHBOARD_PATH, start, RATE_INTERVAL, GPU_METRICS)


def start_agent(pid: int, agent_port: int, webhook_port: int, token_file: str, log_path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "from easymats.cli import main; main()", "--pid", str(pid), "--quiet",
         "--interval", "0.1", "--listen", f"127.0.0.1:{agent_port}",
         "--webhook-listen", f"127.0.0.1:{webhook_port}", "--webhook-token-file", token_file],
        stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))


def anchor_ratio(stack: Stack, target: str) -> float | None:
    got = stack.query(f'{rules.ANCHOR_HIT_RATIO}{{target="{target}"}}')
    return float(got[0]["value"][1]) if got else None


def firing(stack: Stack, alertname: str, target: str) -> bool:
    return bool(stack.query(f'ALERTS{{alertname="{alertname}", alertstate="firing", target="{target}"}}'))


# -- the workload: the real hi_sparse engine on planted structure with a topic shift ---------------

WORKLOAD_NAME = "e2e-longctx"


def workload_main(name: str, seed: int) -> None:
    """Decode topic-A queries over a context with pinned topic-A anchors; on SIGUSR1 append a
    topic-B segment and decode topic-B queries: the audited anchor hit rate drops until the engine
    recalibrates. Drift and scheduled recalibration are off, so only a request can restore it.
    Short-lived side sequences are prefilled and freed now and then, so blocks recycle."""
    import torch

    from hi_sparse.config import HiSparseConfig
    from hi_sparse.engine import HiSparseEngine
    from hi_sparse.workloads import PlantedWorkload, run_decode, run_prefill

    torch.set_num_threads(1)  # a small model on a shared CI machine: threads only contend
    L, HQ, HKV, D = 1, 4, 2, 32
    cfg = HiSparseConfig(max_seq_len=65536, cache_block_size=16, window_size=16, global_tokens=8,
                         top_k=48, audit_every=1, audit_top_m=8, audit_measure="top_m", drift_floor=0.0,
                         recalibrate_every=10 ** 9, host_kv_bits="auto", prefetch_blocks=1, name=name,
                         seed=seed, host_pool_blocks=4096)  # a bounded pool: the limit panels have data
    wl = PlantedWorkload(HKV, HQ, D, seed=seed)
    eng = HiSparseEngine(cfg, L, HQ, HKV, D, model_name="planted")
    stop, shift = [], []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    signal.signal(signal.SIGUSR1, lambda *a: shift.append(1))
    ids = eng.add_sequences(1)
    seg = wl.segment(1024, topic="A", anchors=8, margin=64)
    qa = wl.topic_query("A")
    run_prefill(eng, ids, seg.k[None], seg.v[None], qa[None, :, None].expand(1, HQ, 1024, D).contiguous())
    print(f"ready {os.getpid()}", flush=True)
    topic, step = "A", 0
    while not stop:
        if shift and topic == "A":
            b = wl.segment(512, topic="B", anchors=8, margin=64)
            run_prefill(eng, ids, b.k[None], b.v[None])
            topic = "B"
        k, v = wl.noise(1)
        run_decode(eng, ids, wl.topic_query(topic)[None, :, None], k[None], v[None])
        step += 1
        if step % 40 == 0:  # a short request comes and goes: its blocks wait out the grace, recycle
            side = eng.add_sequences(1)
            sk, sv = wl.noise(64)
            run_prefill(eng, side, sk[None], sv[None])
            eng.free_sequences(side)
    eng.close()


def start_workload(seed: int = 1, timeout: float = 60.0) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--workload", WORKLOAD_NAME, str(seed)],
                            stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ready "):
            return proc
        if not line and proc.poll() is not None:
            raise AssertionError(f"the workload exited with {proc.returncode} before it was ready")
    proc.kill()
    raise AssertionError(f"the workload was not ready within {timeout:g} s")


def test_topic_shift_alert_recalibrates_through_alertmanager_and_hit_rate_recovers(tmp_path):
    t_start = time.time()
    agent_port, hook_port = free_port(), free_port()
    stack = Stack(tmp_path, agent_port, hook_port)
    stack.start()  # Prometheus needs a few seconds before its first scrape: start it first
    workload = start_workload()
    agent = start_agent(workload.pid, agent_port, hook_port, stack.token_file, tmp_path / "agent.log")
    procs = {"workload": workload, "agent": agent, **stack.procs}
    name = WORKLOAD_NAME
    try:
        # 1. Healthy before the shift: the recording rule sees the pinned topic-A anchors hit.
        poll("a healthy anchor hit rate in Prometheus",
             lambda: (anchor_ratio(stack, name) or 0) >= thresholds.ANCHOR_HIT_RATE_MIN, 45, procs=procs)
        assert not firing(stack, "HiSparseAnchorHitRateLow", name)
        assert not stack.query(f'hisparse_recalibrations_total{{target="{name}", reason="request"}} > 0')

        # 2. Topic shift: the hit rate falls below the line and the alert fires after its `for`.
        workload.send_signal(signal.SIGUSR1)
        t_shift = time.monotonic()
        poll("the hit rate to fall below the threshold",
             lambda: (anchor_ratio(stack, name) or 1) < thresholds.ANCHOR_HIT_RATE_MIN, 30, procs=procs)
        poll("HiSparseAnchorHitRateLow to fire", lambda: firing(stack, "HiSparseAnchorHitRateLow", name),
             30, procs=procs)

        # 3. Alertmanager routes it to easymats; the runtime recalibrates on request and says so.
        poll("the request recalibration in Prometheus",
             lambda: stack.query(f'hisparse_recalibrations_total{{target="{name}", reason="request"}} >= 1'),
             30, procs=procs)
        alerts = stack.alertmanager_alerts()
        ours = [a for a in alerts if a["labels"].get("alertname") == "HiSparseAnchorHitRateLow"]
        assert ours and {r["name"] for r in ours[0]["receivers"]} == {"easymats-recalibrate"}, alerts
        poll("the webhook counters in Prometheus", lambda: stack.query(
            f'easymats_recalibration_requests_total{{target="{name}"}} >= 1'), 15, procs=procs)
        assert stack.query('easymats_webhook_requests_total{code="200"} >= 1')
        assert not stack.query('easymats_webhook_requests_total{code=~"4.."}')

        # 4. The hit rate recovers above the line and the alert resolves, in bounded time.
        poll("the hit rate to recover", lambda: (anchor_ratio(stack, name) or 0) >= thresholds.ANCHOR_HIT_RATE_MIN,
             30, procs=procs)
        poll("the alert to resolve", lambda: not firing(stack, "HiSparseAnchorHitRateLow", name), 30, procs=procs)
        loop_s = time.monotonic() - t_shift
        # Drift and schedule are off in this workload: only the requested recalibration restored it.
        assert not stack.query(f'hisparse_recalibrations_total{{target="{name}", reason=~"drift"}} > 0')
        assert len(stack.query(f'hisparse_recalibrations_total{{target="{name}", reason="request"}} == 1')) == 1

        # 5. Every query of the dashboard returns data from this Prometheus (GPU ones need NVML).
        # The webhook counters are born at the request; increase() over the 4 s rate window needs
        # two of their scrapes, which a loaded machine may not have taken yet: give it a few more.
        has_gpu = bool(stack.query("easymats_gpu_memory_total_bytes"))

        def missing_and_excused() -> tuple[list[str], list[str]]:
            empty, gpu_only = dashboard_queries_without_data(stack, t_start)
            excused = [q for q in gpu_only if not has_gpu or any(m in q for m in PROCESS_GPU_METRICS)]
            return [q for q in empty if q not in excused], excused

        deadline = time.monotonic() + 15
        missing, excused = missing_and_excused()
        while missing and time.monotonic() < deadline:
            time.sleep(1)
            missing, excused = missing_and_excused()
        assert not missing, "dashboard queries without data:\n" + "\n".join(missing)
        print(f"\nshift -> alert -> recalibration -> recovered in {loop_s:.1f} s; whole run "
              f"{time.time() - t_start:.1f} s; GPU queries without data: {len(excused)} "
              f"(NVML {'present' if has_gpu else 'absent'})")
    except AssertionError:
        for expr in (rules.ANCHOR_HIT_RATIO, "hisparse_recalibrations_total", "ALERTS"):
            got = stack.query_range(expr, t_start, time.time(), 2.0)
            print(expr, [(r["metric"].get("reason", r["metric"].get("alertstate")),
                          [round(float(v), 3) for _, v in r["values"]]) for r in got])
        print(stack.logs())
        print((tmp_path / "agent.log").read_text()[-3000:])
        raise
    finally:
        for p in (agent, workload):
            p.terminate()
        for p in (agent, workload):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        stack.stop()


if __name__ == "__main__" and sys.argv[1:2] == ["--workload"]:
    workload_main(sys.argv[2], int(sys.argv[3]))
