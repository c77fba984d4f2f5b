"""A fleet end to end, every component real and on 127.0.0.1:

    6 "nodes": each its own segment directory, 2-4 reference writers (tests/helpers_targets.py,
    the same target names on every node) and one easymats agent (its own /metrics and webhook port)
      -> an edge Prometheus discovering the agents through file_sd_configs (targets.json from
         alerts/fleet.py), evaluating alerts/rules.yml (per target and per node), cluster="test"
      -> a global Prometheus federating the edge (/federate, alerts/build.py FEDERATE_MATCH,
         honor_labels) and evaluating alerts/fleet_rules.yml
      -> Alertmanager with the per-node routing alerts/fleet.py generates from the same inventory

Shown here: node and fleet rules agree with the raw series; a topic shift on node B's decode-0
fires HiSparseAnchorHitRateLow for node B only, Alertmanager hands it to node B's agent only, only
that runtime recalibrates and recovers, and no other node's counters move; a writer killed on node
C pages for node C only and, restarted, shows as restarted; every query of both dashboards returns
data at its level (detail board on the edge, fleet board on the global Prometheus).

Test-only overrides compress time (1 s scrape and evaluation, a 6 s rate window, 3 s `for`,
Alertmanager's group wait and interval); everything else is the shipped configuration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from alerts import build as rules  # noqa: E402
from alerts import fleet  # noqa: E402
from dashboards import build as dashboards  # noqa: E402
from easymats import thresholds  # noqa: E402
from helpers_prometheus import (Prom, free_port, http_json, logs, poll, queries_without_data,  # noqa: E402
                                start_alertmanager, start_prometheus, stop)

WRITERS = {"node-a": 2, "node-b": 3, "node-c": 4, "node-d": 2, "node-e": 3, "node-f": 2}
SCRAPE_S = 1
RATE_WINDOW = "6s"
FOR_S = 3
RATE_INTERVAL = "4s"
CLUSTER = "test"
TOKEN = "fleet-token"
WRITER = os.path.join(ROOT, "tests", "helpers_targets.py")
ANCHOR = rules.ANCHOR_HIT_RATIO
REQUEST = 'hisparse_recalibrations_total{reason="request"}'


class Node:
    """One node: a private segment directory, its writers and its agent."""

    def __init__(self, name: str, writers: int, tmp, token_file: str, segment_root: str):
        self.name, self.tmp = name, tmp
        self.dir = os.path.join(segment_root, name)  # under the test's private segment directory
        os.mkdir(self.dir, 0o700)
        self.env = {**os.environ, "EASYMATS_SEGMENT_DIR": self.dir}
        self.port, self.hook = free_port(), free_port()
        self.writers = {f"decode-{i}": self.start_writer(f"decode-{i}", seed=i) for i in range(writers)}
        self.agent = subprocess.Popen(
            [sys.executable, "-c", "from easymats.cli import main; main()", "--keep-serving", "--quiet",
             "--interval", "0.1", "--listen", f"127.0.0.1:{self.port}",
             "--webhook-listen", f"127.0.0.1:{self.hook}", "--webhook-token-file", token_file],
            env=self.env, stdout=subprocess.DEVNULL, stderr=open(tmp / f"agent-{name}.log", "w"))

    def start_writer(self, target: str, seed: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, WRITER, "--name", target, "--rate", "10", "--duration", "0",
                                 "--full", "--anchor-hit", "0.9", "--shift-hit", "0.2", "--seed", str(seed)],
                                env=self.env, stdout=subprocess.DEVNULL)

    def inventory_entry(self) -> dict:
        return {"name": self.name, "metrics": f"127.0.0.1:{self.port}",
                "webhook": f"http://127.0.0.1:{self.hook}/alertmanager"}

    def procs(self) -> dict[str, subprocess.Popen]:
        return {f"agent {self.name}": self.agent,
                **{f"{self.name}/{t}": p for t, p in self.writers.items()}}


def configure(tmp, nodes: list[Node], token_file: str, am_port: int, edge_port: int) -> fleet.Inventory:
    """Everything from one inventory, as an operator would: targets, routing, both Prometheus."""
    inv = fleet.parse_inventory({"route_label": "node", "webhook_token_file": token_file,
                                 "nodes": [n.inventory_entry() for n in nodes]})
    (tmp / "targets.json").write_text(json.dumps(fleet.file_sd(inv)))
    am = fleet.alertmanager_config(inv)
    recal = next(r for r in am["route"]["routes"] if r.get("matchers") == ['action="recalibrate"'])
    recal.update(group_wait="0s", group_interval="1s")
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am))
    (tmp / "rules.yml").write_text(rules.render(rules.build_rules(rate_window=RATE_WINDOW, for_override_s=FOR_S)))
    (tmp / "fleet_rules.yml").write_text(rules.render(rules.build_fleet_rules()))
    edge = fleet.edge_prometheus_config(targets_file=str(tmp / "targets.json"),
                                        alertmanagers=[f"127.0.0.1:{am_port}"],
                                        rule_files=[str(tmp / "rules.yml")],
                                        external_labels={"cluster": CLUSTER}, scrape_interval=f"{SCRAPE_S}s")
    (tmp / "edge.yml").write_text(yaml.safe_dump(edge))
    glob = fleet.global_prometheus_config(edges=[f"127.0.0.1:{edge_port}"],
                                          rule_files=[str(tmp / "fleet_rules.yml")],
                                          scrape_interval=f"{SCRAPE_S}s")
    (tmp / "global.yml").write_text(yaml.safe_dump(glob))
    return inv


def firing(prom: Prom, alertname: str) -> list[dict]:
    return [r["metric"] for r in prom.query(f'ALERTS{{alertname="{alertname}", alertstate="firing"}}')]


def test_six_nodes_federation_per_node_recalibration_and_paging(tmp_path, segment_dir):
    t0 = time.time()
    timings: dict[str, float] = {}
    token = tmp_path / "webhook-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    am_port, edge_port, global_port = free_port(), free_port(), free_port()
    # The Prometheus servers first: they take a few seconds before their first scrape.
    nodes: list[Node] = []
    procs: dict[str, subprocess.Popen] = {}
    try:
        nodes = [Node(name, n, tmp_path, str(token), segment_dir) for name, n in WRITERS.items()]
        configure(tmp_path, nodes, str(token), am_port, edge_port)
        procs["edge prometheus"] = start_prometheus(str(tmp_path / "edge.yml"), tmp_path, edge_port, "edge")
        procs["global prometheus"] = start_prometheus(str(tmp_path / "global.yml"), tmp_path, global_port, "global")
        procs["alertmanager"] = start_alertmanager(str(tmp_path / "alertmanager.yml"), tmp_path, am_port)
        for n in nodes:
            procs.update(n.procs())
        edge, glob = Prom(edge_port), Prom(global_port)
        n_targets = sum(WRITERS.values())
        by_name = {n.name: n for n in nodes}
        b, c = by_name["node-b"], by_name["node-c"]

        # 1. Every agent discovered, every node and the fleet healthy, at both levels.
        poll("all six agents up in the edge Prometheus (file_sd)",
             lambda: len(edge.query(f'up{{job="{rules.AGENT_JOB}"}} == 1')) == len(nodes), 60, procs=procs)
        poll(f"{n_targets} targets counted by the node rules and by the global fleet rules",
             lambda: (sum(float(r["value"][1]) for r in edge.query(rules.NODE_TARGETS_UP)) == n_targets
                      and glob.value(f'{rules.CLUSTER_TARGETS_UP}{{cluster="{CLUSTER}"}}') == n_targets
                      and glob.value(f'{rules.CLUSTER_NODES}{{cluster="{CLUSTER}"}}') == len(nodes)),
             60, procs=procs)
        poll("a healthy anchor hit rate on every node, at the edge and federated",
             lambda: (len(edge.query(f"{rules.node_ratio(ANCHOR)} >= {thresholds.ANCHOR_HIT_RATE_MIN}")) == len(nodes)
                      and len(glob.query(f'{rules.node_ratio(ANCHOR)}{{cluster="{CLUSTER}"}} >= '
                                         f"{thresholds.ANCHOR_HIT_RATE_MIN}")) == len(nodes)),
             60, procs=procs)
        timings["healthy at both levels"] = time.time() - t0
        # The fleet ratio is the ratio of summed rates, the same number the raw series give. The
        # global evaluates it from federated node rates one evaluation behind the node ratios
        # polled above, so it is polled too (a loaded machine showed it absent for a moment).
        def fleet_and_raw():
            fleet = glob.value(f'{rules.cluster_ratio(ANCHOR)}{{cluster="{CLUSTER}"}}')
            raw = edge.value(f"sum(rate(hisparse_anchor_hits_total[{RATE_WINDOW}])) / "
                             f"sum(rate(hisparse_anchor_lookups_total[{RATE_WINDOW}]))")
            return (fleet, raw) if fleet is not None and raw is not None and abs(fleet - raw) < 0.05 else None

        poll("the fleet-wide anchor hit rate at the global equal to the raw ratio at the edge", fleet_and_raw,
             30, procs=procs)
        assert not firing(edge, "HiSparseAnchorHitRateLow") and not edge.query(f"{REQUEST} > 0")

        # 2. A topic shift on node B's decode-0 (every node has a decode-0): only B's alert fires,
        #    only B's agent is called, only that runtime recalibrates, and it recovers.
        t_shift = time.time()
        b.writers["decode-0"].send_signal(signal.SIGUSR1)
        alerts = poll("HiSparseAnchorHitRateLow firing for node B",
                      lambda: firing(edge, "HiSparseAnchorHitRateLow"), 30, procs=procs)
        assert [(a["node"], a["target"]) for a in alerts] == [("node-b", "decode-0")], alerts
        timings["shift -> alert firing"] = time.time() - t_shift
        poll("node B's decode-0 recalibrated on request",
             lambda: edge.query(f'{REQUEST[:-1]}, node="node-b", target="decode-0"}} >= 1'), 30, procs=procs)
        timings["shift -> recalibrated"] = time.time() - t_shift
        am_alerts = [a for a in http_json(f"http://127.0.0.1:{am_port}/api/v2/alerts")
                     if a["labels"].get("alertname") == "HiSparseAnchorHitRateLow"]
        assert am_alerts and all({r["name"] for r in a["receivers"]} == {"easymats-recalibrate-node-b"}
                                 for a in am_alerts), am_alerts
        poll("node B's webhook counters in the edge Prometheus", lambda: edge.query(
            'easymats_recalibration_requests_total{node="node-b", target="decode-0"} >= 1'), 15, procs=procs)
        poll("node B's decode-0 to recover",
             lambda: (edge.value(f'{ANCHOR}{{node="node-b", target="decode-0"}}') or 0)
             >= thresholds.ANCHOR_HIT_RATE_MIN, 30, procs=procs)
        poll("the alert to resolve", lambda: not firing(edge, "HiSparseAnchorHitRateLow"), 30, procs=procs)
        timings["shift -> recovered and resolved"] = time.time() - t_shift
        # Nobody else was asked: no request anywhere but B's decode-0, no webhook call on other nodes.
        assert [(r["metric"]["node"], r["metric"]["target"]) for r in edge.query(f"{REQUEST} > 0")] == \
            [("node-b", "decode-0")]
        assert edge.query(f'{REQUEST[:-1]}, node="node-b", target="decode-0"}} == 1')
        assert not edge.query('easymats_webhook_requests_total{node!="node-b"}')
        assert not edge.query('easymats_recalibration_requests_total{node!="node-b"}')
        assert not edge.query('easymats_webhook_requests_total{code!="200"}')

        # 3. A writer dies on node C: the page names node C and that target, nothing else.
        t_kill = time.time()
        c.writers["decode-1"].kill()
        c.writers["decode-1"].wait()
        del procs["node-c/decode-1"]
        down = poll("EasymatsTargetDown firing", lambda: firing(edge, "EasymatsTargetDown"), 30, procs=procs)
        assert [(a["node"], a["target"]) for a in down] == [("node-c", "decode-1")], down
        assert not firing(edge, "EasymatsAgentDown")
        timings["kill -> page"] = time.time() - t_kill
        page = [a for a in http_json(f"http://127.0.0.1:{am_port}/api/v2/alerts")
                if a["labels"].get("alertname") == "EasymatsTargetDown"]
        assert len(page) == 1 and page[0]["labels"]["node"] == "node-c", page
        assert {r["name"] for r in page[0]["receivers"]} == {"default"}, page
        assert glob.value(f'{rules.CLUSTER_TARGETS_UP}{{cluster="{CLUSTER}"}}') is not None
        poll("the fleet count to show one target down",
             lambda: glob.value(f'{rules.CLUSTER_TARGETS_UP}{{cluster="{CLUSTER}"}}') == n_targets - 1,
             30, procs=procs)

        # 4. It restarts (a new process, the same name): up again, and counted as restarted.
        c.writers["decode-1"] = procs["node-c/decode-1"] = c.start_writer("decode-1", seed=11)
        poll("the restarted target up and its restart seen at the global level",
             lambda: (edge.query('easymats_target_up{node="node-c", target="decode-1"} == 1')
                      and glob.query(f'{rules.RESTARTS}{{node="node-c", target="decode-1"}} >= 1')),
             30, procs=procs)
        poll("the page to resolve", lambda: not firing(edge, "EasymatsTargetDown"), 30, procs=procs)
        timings["kill -> restarted, page resolved"] = time.time() - t_kill

        # 5. The dashboards at both levels: every query returns data (GPU ones need NVML).
        has_gpu = bool(edge.query("easymats_gpu_memory_total_bytes"))
        for board, prom in ((dashboards.DASHBOARD_PATH, edge), (dashboards.FLEET_PATH, glob)):
            def missing() -> list[str]:
                empty, gpu_only = queries_without_data(prom, board, t0, RATE_INTERVAL)
                excused = [q for q in gpu_only if not has_gpu or "easymats_process_gpu_" in q]
                return [q for q in empty if q not in excused]
            gaps = missing()
            deadline = time.monotonic() + 15
            while gaps and time.monotonic() < deadline:
                time.sleep(1)
                gaps = missing()
            assert not gaps, f"{os.path.basename(board)} queries without data:\n" + "\n".join(gaps)
        timings["whole test"] = time.time() - t0
        print("\nfleet timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))
    except AssertionError:
        print(logs(tmp_path, ("edge", "global", "alertmanager", *(f"agent-{n}" for n in WRITERS))))
        raise
    finally:
        stop([p for n in nodes for p in n.writers.values()] + [n.agent for n in nodes])
        stop([p for k, p in procs.items() if "prometheus" in k or k == "alertmanager"])
