"""The generated Grafana dashboard: current, built from the catalogue and the thresholds, valid PromQL."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from alerts import build as rules, promql  # noqa: E402
from dashboards import build  # noqa: E402
from easymats import thresholds  # noqa: E402


@pytest.fixture(scope="module")
def fleet() -> dict:
    with open(build.FLEET_PATH, encoding="utf-8") as f:
        return json.load(f)


def concrete(expr: str, rate_interval: str = "1m") -> str:
    """A dashboard query with Grafana's variables replaced the way Grafana does for "All"."""
    return build.with_all_variables(expr, rate_interval)


def test_dashboard_json_is_generated_and_current():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "dashboards", "build.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_check_fails_on_stale_json(tmp_path, capsys):
    stale = tmp_path / "hisparse.json"
    stale.write_text(build.render(build.build_dashboard()).replace("0.65", "0.6"))
    assert build.main(["--check", "--output", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err


def test_check_names_unknown_metrics_and_unknown_recording_rules(board):
    bad = json.loads(json.dumps(board))
    bad["panels"][1]["targets"][0]["expr"] = 'rate(hisparse_anchor_hit_total{job=~"$job"}[5m])'
    bad["panels"][2]["targets"][0]["expr"] = "target:hisparse_nothing:ratio_rate5m"
    found = build.problems(bad)
    assert any("'hisparse_anchor_hit_total'" in p for p in found), found
    assert any("'target:hisparse_nothing:ratio_rate5m'" in p for p in found), found
    assert build.problems(board) == []


def test_schema_panels_and_layout(board):
    assert board["schemaVersion"] == 41 and board["uid"] == build.UID
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    kinds = {p["type"] for p in board["panels"]}
    assert kinds <= {"row", "timeseries", "table"} and "graph" not in kinds
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
    titles = {p["title"] for p in board["panels"]}
    for wanted in ("Anchor hit rate", "Hot buffer hit rate", "Prefetch efficiency", "KV blocks by state",
                   "Block recycle rate", "Block density", "Quantization error quantiles",
                   "Quantized blocks by bit width", "KV memory by tier and kind", "Decode step latency",
                   "GPU utilization", "Sampling lag", "Targets up"):
        assert wanted in titles


def test_variables_and_every_query_filters_on_them(board):
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "job", "node", "instance", "target"]
    for where, expr in build.queries(board):
        if where.startswith("variable"):
            continue
        assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr and 'node=~"$node"' in expr, where
    for p in board["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"


def test_threshold_lines_are_the_alert_thresholds(board):
    by_title = {p["title"]: p for p in board["panels"]}
    expected = {
        "Anchor hit rate": ("HiSparseAnchorHitRateLow", thresholds.ANCHOR_HIT_RATE_MIN),
        "Prefetch efficiency": ("HiSparsePrefetchEfficiencyLow", thresholds.PREFETCH_EFFICIENCY_MIN),
        "Hot buffer hit rate": ("HiSparseHotBufferThrashing", thresholds.HOT_BUFFER_HIT_RATE_MIN),
        "Block recycle rate": ("HiSparseBlockRecycleSlow", thresholds.BLOCK_RECYCLE_RATE_MIN),
        "Free blocks": ("HiSparseKVBlocksExhausted", thresholds.KV_FREE_BLOCKS_RATIO_MIN),
        "Quantization error quantiles": ("HiSparseQuantErrorHigh", thresholds.QUANT_ERROR_P99_MAX),
        "Sampling lag": ("EasymatsSamplingLagHigh", thresholds.SAMPLE_LAG_P99_MAX_S),
    }
    alert_exprs = {a.alert: a.expr for a in rules.alert_rules()}
    assert {t.alert for t in thresholds.THRESHOLDS} == {a for a, _ in expected.values()}
    for title, (alert, limit) in expected.items():
        steps = by_title[title]["fieldConfig"]["defaults"]["thresholds"]["steps"]
        assert [s["value"] for s in steps] == [None, limit], title
        # The panel plots the very series the alert compares with the same number.
        series = by_title[title]["targets"][0]["expr"].split("{")[0]
        assert alert_exprs[alert].startswith(series), (title, series)
        assert by_title[title]["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"


def test_blocks_panel_shows_the_pool_limit_as_an_unstacked_line(board):
    """The limit is what exhaustion is judged against: drawn over the stacked states, not on them."""
    panel = next(p for p in board["panels"] if p["title"] == "KV blocks by state")
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    ref = next(t["refId"] for t in panel["targets"] if "hisparse_kv_blocks_limit" in t["expr"])
    props = next(o["properties"] for o in panel["fieldConfig"]["overrides"]
                 if o["matcher"] == {"id": "byFrameRefID", "options": ref})
    assert {"id": "custom.stacking", "value": {"group": "A", "mode": "none"}} in props
    # The free-blocks panel plots headroom against that limit, the series the alert compares.
    free = next(p for p in board["panels"] if p["title"] == "Free blocks")
    assert free["targets"][0]["expr"].startswith(rules.FREE_BLOCKS_RATIO)
    assert "hisparse_kv_blocks_limit" in next(
        r.expr for r in rules.recording_rules() if r.record == rules.FREE_BLOCKS_RATIO)


def test_recalibrations_are_annotations(board):
    notes = {a["name"]: a for a in board["annotations"]["list"]}
    assert "hisparse_recalibrations_total" in notes["Recalibrations"]["expr"]
    assert notes["Recalibrations"]["enable"] is True


@pytest.mark.parametrize("which", ["board", "fleet"])
def test_every_query_is_valid_promql(tmp_path, which, request):
    """promtool parses each query (variables substituted) as a recording rule: no server needed."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: apt-get install -y --no-install-recommends prometheus")
    group = [{"record": f"dashboard:query_{i}:check", "expr": concrete(expr)}
             for i, (_, expr) in enumerate(build.queries(request.getfixturevalue(which)))]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": group}]}))
    proc = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_provisioning_files(board):
    with open(os.path.join(ROOT, "dashboards", "provisioning", "datasources", "prometheus.yml")) as f:
        ds = yaml.safe_load(f)
    assert ds["apiVersion"] == 1 and ds["datasources"][0]["type"] == "prometheus"
    with open(os.path.join(ROOT, "dashboards", "provisioning", "dashboards", "hisparse.yml")) as f:
        prov = yaml.safe_load(f)
    provider = prov["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    assert not re.search(r"\bgraph\b", json.dumps([p["type"] for p in board["panels"]]))


def test_runbook_points_at_panels_that_exist(board):
    """docs/runbook.md says where to confirm each alert: *Row → Panel* must name real ones."""
    with open(os.path.join(ROOT, "docs", "runbook.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    rows = {p["title"] for p in board["panels"] if p["type"] == "row"}
    panels = {p["title"] for p in board["panels"] if p["type"] != "row"}
    refs = [r for r in re.findall(r"(?<!\*)\*([^*]+)\*(?!\*)", text) if r.strip() and r[0] != " "]
    checked = 0
    for ref in refs:
        if ref == "Status → Targets":  # Prometheus' own UI, not the dashboard
            continue
        row, _, panel = ref.rpartition(" → ")
        assert panel in panels, f"runbook names panel {panel!r}, which the dashboard lacks"
        assert not row or row in rows, f"runbook names row {row!r}, which the dashboard lacks"
        checked += 1
    assert checked >= 15


def test_fleet_board_variables_filters_and_worst_first_tables(fleet):
    assert fleet["schemaVersion"] == 41 and fleet["uid"] == build.FLEET_UID
    assert [v["name"] for v in fleet["templating"]["list"]] == ["datasource", "cluster", "namespace",
                                                                 "node", "instance"]
    for where, expr in build.queries(fleet):
        if not where.startswith("variable"):
            assert 'cluster=~"$cluster"' in expr, where
    tables = {p["title"]: p for p in fleet["panels"] if p["type"] == "table"}
    worst = {"Lowest anchor hit rate": ("bottomk(", False), "Highest sampling lag": ("topk(", True),
             "Recently restarted": ("topk(", True), "Targets down": ("bottomk(", False)}
    for title, (fn, desc) in worst.items():
        panel = tables[title]
        assert panel["targets"][0]["expr"].startswith(fn) and panel["targets"][0]["instant"], title
        assert panel["options"]["sortBy"] == [{"desc": desc, "displayName": "Value"}], title


def test_a_node_row_links_to_its_detail_view(fleet, board):
    nodes = next(p for p in fleet["panels"] if p["title"].startswith("Nodes,"))
    links = next(o["properties"][0]["value"] for o in nodes["fieldConfig"]["overrides"]
                 if o["matcher"] == {"id": "byName", "options": "node"})
    url = links[0]["url"]
    assert url.startswith(f"/d/{board['uid']}/") and "var-node=${__data.fields.node}" in url
    # The detail board has the variable the link sets, and every query filters on it.
    assert "node" in [v["name"] for v in board["templating"]["list"]]
    assert {t["refId"] for t in nodes["targets"]} == set("ABCDE")
    assert [t["id"] for t in nodes["transformations"]][0] == "merge"


def test_fleet_board_reads_only_what_the_global_prometheus_has(fleet):
    """A global Prometheus holds the federated series and its own fleet rules, nothing raw."""
    fleet_rules = rules.recording_rule_names(rules.build_fleet_rules())
    federated = [m.split('"')[1] for m in rules.FEDERATE_MATCH if m.startswith("{__name__=~")]
    plain = {m.split("{")[0] for m in rules.FEDERATE_MATCH if not m.startswith("{")}
    for where, expr in build.queries(fleet):
        for name in promql.metric_names(expr):
            assert (name in fleet_rules or name in plain
                    or any(re.fullmatch(f, name) for f in federated)), (where, name)


def test_configmap_carries_both_boards_as_generated(board, fleet):
    with open(build.CONFIGMAP_PATH, encoding="utf-8") as f:
        cm = yaml.safe_load(f)
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["hisparse.json"]) == board
    assert json.loads(cm["data"]["fleet.json"]) == fleet
