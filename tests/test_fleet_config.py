"""alerts/fleet.py: the inventory is checked, and what it generates is valid for the real tools
(amtool, promtool) and routes each node's recalibration to that node only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from helpers_prometheus import amtool_route, binary  # noqa: E402

from alerts import build as rules, fleet  # noqa: E402

EXAMPLE = os.path.join(ROOT, "alerts", "fleet.example.yml")


def _inventory(**over) -> dict:
    data = {"webhook_token_file": "/t", "nodes": [
        {"name": "node-a", "metrics": "10.0.0.1:9464", "webhook": "http://10.0.0.1:9465/alertmanager"},
        {"name": "node-b", "metrics": "10.0.0.2:9464", "webhook": "http://10.0.0.2:9465/alertmanager"}]}
    data.update(over)
    return data


@pytest.mark.parametrize("change, message", [
    ({"nodes": []}, "non-empty list"),
    ({"route_label": "target"}, "route_label 'target'"),
    ({"webhook_token_file": None}, "no webhook_token_file"),
    ({"nodes": [{"name": "a", "metrics": "h:1"}]}, "lacks webhook"),
    ({"nodes": [{"name": "a b", "metrics": "h:1", "webhook": "http://h:2/"}]}, "letters, digits"),
    ({"nodes": [{"name": "a", "metrics": "http://h:1", "webhook": "http://h:2/"}]}, "not HOST:PORT"),
    ({"nodes": [{"name": "a", "metrics": "h:1", "webhook": "h:2"}]}, "not an http"),
    ({"nodes": [{"name": "a", "metrics": "h:1", "webhook": "http://h:2/"}] * 2}, "appears twice"),
    ({"nodes": [{"name": "a", "metrics": "h:1", "webhook": "http://h:2/", "labels": {"node": "x"}}]},
     "without 'node'"),
])
def test_a_bad_inventory_is_refused_with_the_fix(change, message):
    with pytest.raises(fleet.InventoryError, match=message):
        fleet.parse_inventory(_inventory(**change))


def test_cli_writes_configs_that_prometheus_and_alertmanager_accept(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "alerts", "fleet.py"), EXAMPLE, "--out", str(out),
                           "--cluster", "east"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    check = subprocess.run([binary("amtool"), "check-config", str(out / "alertmanager.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    for name in ("prometheus-edge.yml", "prometheus-global.yml"):
        check = subprocess.run([binary("promtool"), "check", "config", str(out / name)],
                               capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    edge = yaml.safe_load((out / "prometheus-edge.yml").read_text())
    assert edge["global"]["external_labels"] == {"cluster": "east"}
    assert edge["scrape_configs"][0]["file_sd_configs"] == [{"files": ["targets.json"]}]
    glob = yaml.safe_load((out / "prometheus-global.yml").read_text())
    job = glob["scrape_configs"][0]
    assert job["metrics_path"] == "/federate" and job["honor_labels"] is True
    assert job["params"]["match[]"] == list(rules.FEDERATE_MATCH)
    targets = json.loads((out / "targets.json").read_text())
    assert {t["labels"]["node"] for t in targets} == {"gpu-node-01", "gpu-node-02"}


def test_cli_names_a_bad_inventory_without_a_traceback(tmp_path):
    bad = tmp_path / "inv.yml"
    bad.write_text("nodes: [{name: a}]\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "alerts", "fleet.py"), str(bad), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 2 and "lacks metrics, webhook" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("route_label", ["node", "pod"])
def test_each_nodes_recalibration_reaches_that_node_only(tmp_path, route_label):
    inv = fleet.parse_inventory(_inventory(route_label=route_label))
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(fleet.alertmanager_config(inv)))

    def route(*labels: str) -> str:
        return amtool_route(str(path), *labels)

    recal = ("alertname=HiSparseAnchorHitRateLow", "action=recalibrate", "target=decode-0")
    assert route(*recal, f"{route_label}=node-b") == "easymats-recalibrate-node-b"
    assert route(*recal, f"{route_label}=node-a") == "easymats-recalibrate-node-a"
    # A node the inventory lacks goes to people, never to another node's runtime.
    assert route(*recal, f"{route_label}=node-z") == "default"
    assert route("alertname=EasymatsTargetDown", "target=decode-0", f"{route_label}=node-b") == "default"
    cfg = yaml.safe_load(path.read_text())
    hooks = {r["name"]: r["webhook_configs"][0] for r in cfg["receivers"] if r.get("webhook_configs")}
    assert hooks["easymats-recalibrate-node-b"]["url"] == "http://10.0.0.2:9465/alertmanager"
    assert hooks["easymats-recalibrate-node-b"]["http_config"]["authorization"]["credentials_file"] == "/t"
    assert hooks["easymats-recalibrate-node-b"]["send_resolved"] is False
    assert fleet.RECALIBRATE_RECEIVER not in hooks  # the single-box receiver is replaced, not kept
