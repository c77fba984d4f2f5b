"""Engine targets end to end, every component real and on 127.0.0.1:

    vLLM stand-ins (both naming revisions, HTTP /metrics) and an SGLang stand-in (multiprocess
    files by PID, decode log) -> easymats agent (--scrape, --pid, --follow-log, /metrics, log)
    -> Prometheus (rules from alerts/build.py) -> recording rules, alerts; dashboard queries

Checked: every dashboard query that applies to an engine (its runtime metrics are all provided by
that engine's mapping table) returns data for that engine's target, and every one that does not
returns that target from the panel's "not provided" query instead; the hot-buffer and pool
alerts fire on an engine whose hit rate and pool are bad; the agent's log gives ``easymats
report`` its numbers. Time is compressed as in test_e2e_alerting.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_e2e_alerting import GPU_METRICS, RATE_INTERVAL, Stack, firing, free_port, poll  # noqa: E402
from test_engine_sources import start_standin, stop  # noqa: E402

from alerts import build as rules  # noqa: E402
from dashboards import build as dashboards  # noqa: E402
from easymats import thresholds  # noqa: E402
from easymats.sources import maps  # noqa: E402

# Agent series that need something these engine targets do not have.
NEEDS_LOCAL_PROCESS = ("easymats_process_",)  # a scrape target has no process on this machine
NEEDS_WEBHOOK = ("easymats_webhook_requests_total",)  # only with --webhook-listen


def panel_queries(b: dict):
    """(panel title, refId, expr, instant) of every panel query."""
    for p in b["panels"]:
        for t in p.get("targets", []) or []:
            yield p["title"], t["refId"], t["expr"], bool(t.get("instant"))


def with_target(expr: str, target: str) -> str:
    """A panel query as Grafana sends it for one target, every other variable at "All"."""
    expr = expr.replace('target=~"$target"', f'target=~"{target}"').replace("$__rate_interval", RATE_INTERVAL)
    return re.sub(r"\$\w+", ".*", expr)


def has_data(stack: Stack, expr: str, instant: bool, start: float) -> bool:
    if instant:
        return bool(stack.query(expr))
    return bool(stack.query_range(expr, start, time.time()))


@pytest.mark.slow
def test_engine_targets_through_prometheus_rules_alerts_dashboards_and_report(tmp_path, board):
    t_start = time.time()
    agent_port = free_port()
    stack = Stack(tmp_path, agent_port, free_port())
    stack.start()
    # vllm-a thrashes (30 % hot-buffer hits) with a nearly full host pool; vllm-b is healthy.
    va, (pa,) = start_standin("vllm", "--revision", "a", "--hit-rate", "0.3", "--pool-fill", "0.97",
                              "--host-blocks", "8192")
    vb, (pb,) = start_standin("vllm", "--revision", "b", "--hit-rate", "0.9", "--kv-cache-metrics")
    slog = tmp_path / "sglang.log"
    sg, (spid, _) = start_standin("sglang", "--tp", "2", "--log", str(slog))
    log = tmp_path / "agent-run.log"
    agent = subprocess.Popen(
        [sys.executable, "-c", "from easymats.cli import main; main()", "--pid", spid, "--follow-log", str(slog),
         "--scrape", f"vllm-a=http://127.0.0.1:{pa}/metrics", "--scrape", f"vllm-b=http://127.0.0.1:{pb}/metrics",
         "--interval", "0.1", "--quiet", "--output", str(log), "--listen", f"127.0.0.1:{agent_port}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "agent.err", "w"))
    procs = {"agent": agent, "vllm-a": va, "vllm-b": vb, "sglang": sg, **stack.procs}
    sglang = f"sglang-{spid}"
    targets = {"vllm-a": maps.VLLM_A, "vllm-b": maps.VLLM_B, sglang: maps.SGLANG}
    try:
        # 1. Recording rules from mapped counters and gauges.
        def ratio(record: str, target: str) -> float | None:
            got = stack.query(f'{record}{{target="{target}"}}')
            return float(got[0]["value"][1]) if got else None

        poll("hot-buffer hit ratios of both vLLM targets", lambda: ratio(rules.HOT_BUFFER_RATIO, "vllm-a")
             and ratio(rules.HOT_BUFFER_RATIO, "vllm-b"), 45, procs=procs)
        assert 0.15 < ratio(rules.HOT_BUFFER_RATIO, "vllm-a") < 0.45
        assert ratio(rules.HOT_BUFFER_RATIO, "vllm-b") > 0.8
        poll("the pool headroom of vllm-a and SGLang", lambda: ratio(rules.FREE_BLOCKS_RATIO, "vllm-a") is not None
             and ratio(rules.FREE_BLOCKS_RATIO, sglang) is not None, 30, procs=procs)
        assert ratio(rules.FREE_BLOCKS_RATIO, "vllm-a") < thresholds.KV_FREE_BLOCKS_RATIO_MIN
        assert ratio(rules.FREE_BLOCKS_RATIO, "vllm-b") is None  # revision b: a usage ratio only

        # 2. The alerts that apply fire on the bad engine, not on the healthy one.
        poll("HiSparseHotBufferThrashing on vllm-a", lambda: firing(stack, "HiSparseHotBufferThrashing", "vllm-a"),
             30, procs=procs)
        poll("HiSparseKVBlocksExhausted on vllm-a", lambda: firing(stack, "HiSparseKVBlocksExhausted", "vllm-a"),
             30, procs=procs)
        assert not firing(stack, "HiSparseHotBufferThrashing", "vllm-b")
        assert not stack.query('ALERTS{alertname="EasymatsTargetDown"}')

        # 3. Every dashboard query that applies to an engine has data for its target; every one that
        #    does not lists the target in the panel's "not provided" query.
        b = board
        np_of = {title: (expr, inst) for title, ref, expr, inst in panel_queries(b)
                 if ref == dashboards.NOT_PROVIDED_REF}

        def check() -> tuple[list[str], int, int]:
            problems, applied, not_provided = [], 0, 0
            for title, ref, expr, instant in panel_queries(b):
                if ref == dashboards.NOT_PROVIDED_REF or any(m in expr for m in GPU_METRICS + NEEDS_WEBHOOK):
                    continue
                metrics = dashboards.runtime_metrics_of(expr)
                for target, emap in targets.items():
                    if not metrics and target.startswith("vllm") and any(m in expr for m in NEEDS_LOCAL_PROCESS):
                        continue
                    if "target" not in expr:  # agent-level (sampling lag): one check is enough
                        if target != sglang:
                            continue
                    lacking = set(metrics) & set(emap.not_provided())
                    if not lacking:
                        applied += 1
                        if not has_data(stack, with_target(expr, target), instant, t_start):
                            problems.append(f"{title} {ref} for {target}: no data")
                        continue
                    not_provided += 1
                    np_expr, np_instant = np_of[title]
                    got = stack.query(with_target(np_expr, target))
                    named = {r["metric"].get("metric") for r in got}
                    if not lacking <= named:
                        problems.append(f"{title} for {target}: 'not provided' lists {sorted(named)}, "
                                        f"expected {sorted(lacking)}")
            return problems, applied, not_provided

        deadline = time.monotonic() + 20
        problems, applied, not_provided = check()
        while problems and time.monotonic() < deadline:
            time.sleep(1)
            problems, applied, not_provided = check()
        assert not problems, "\n".join(problems)
        assert applied >= 25 and not_provided >= 25, (applied, not_provided)
        for name in ("job", "instance", "target"):
            query = next(v for v in b["templating"]["list"] if v["name"] == name)["query"]
            assert stack.series(with_target(dashboards._label_values_selector(query), ".*"), t_start)
        got = {r["metric"]["target"] for r in stack.query("easymats_target_up == 1")}
        assert got == set(targets), got
    except AssertionError:
        print(stack.logs())
        print((tmp_path / "agent.err").read_text()[-3000:])
        raise
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            agent.kill()
        for p in (va, vb, sg):
            stop(p)
        stack.stop()

    # 4. The report reads the agent's log of engine targets: the thrashing engine's hot-buffer hit
    #    rate, and what it could not judge.
    out = subprocess.run([sys.executable, "-c", "from easymats.cli import main; main()", "report", str(log),
                          "--no-plots", "--out", str(tmp_path / "report.html")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3 target(s)" in out.stdout
    assert "vllm-a: not judged" in out.stdout and "anchor hit rate" in out.stdout
    page = (tmp_path / "report.html").read_text()
    assert "vllm-a" in page and sglang in page and "Hot buffer hit rate" in page
    print(f"\nengine e2e: {applied} applicable dashboard queries with data, {not_provided} 'not provided' "
          f"answers, whole run {time.time() - t_start:.1f} s")
