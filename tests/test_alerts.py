"""Alert and recording rules: generated from easymats/thresholds.py, checked by promtool.

promtool and amtool come from Debian's prometheus / prometheus-alertmanager packages (.ci/run
installs them); without them these tests fail with the command that installs them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from helpers_prometheus import amtool_route  # noqa: E402

from alerts import build, promql  # noqa: E402
from easymats import catalogue, thresholds  # noqa: E402

ALERTS_DIR = os.path.join(ROOT, "alerts")
ISSUE_ALERTS = {"HiSparseAnchorHitRateLow", "HiSparsePrefetchEfficiencyLow", "HiSparseBlockRecycleSlow",
                "HiSparseKVBlocksExhausted", "HiSparseQuantErrorHigh", "HiSparseHotBufferThrashing",
                "EasymatsTargetDown", "EasymatsSamplingLagHigh"}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: apt-get install -y --no-install-recommends "
                    "prometheus prometheus-alertmanager")
    return path


def _rules() -> dict:
    with open(build.RULES_PATH, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _alerts(rules: dict) -> list[dict]:
    return [r for g in rules["groups"] for r in g["rules"] if "alert" in r]


def test_rules_file_is_generated_and_current():
    proc = subprocess.run([sys.executable, os.path.join(ALERTS_DIR, "build.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_check_fails_on_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "rules.yml"
    stale.write_text(build.render(build.build_rules()).replace("< 0.65", "< 0.6"))
    assert build.main(["--check", "--output", str(stale)]) == 1
    assert "stale" in capsys.readouterr().err
    fresh = tmp_path / "fresh.yml"
    assert build.main(["--output", str(fresh)]) == 0
    assert build.main(["--check", "--output", str(fresh)]) == 0


def test_check_names_a_metric_the_catalogue_lacks():
    rules = build.build_rules()
    rules["groups"][0]["rules"].append({"alert": "EasymatsTargetDown",
                                        "expr": "rate(hisparse_anchor_hit_total[5m]) < 1"})
    found = build.problems(rules)
    assert any("'hisparse_anchor_hit_total'" in p for p in found), found


@pytest.mark.parametrize("expr, names", [
    ('sum by (job, le) (rate(x_bucket{a="b"}[5m]))', ["x_bucket"]),
    ("a / on (job) group_left (foo) b offset 5m > 0 and c unless vector(1)", ["a", "b", "c"]),
    ('histogram_quantile(0.99, sum without (instance) (rate(h_bucket{job=~"$job"}[$__rate_interval])))',
     ["h_bucket"]),
    ("level:metric:ratio_rate5m < 0.65", ["level:metric:ratio_rate5m"]),
    ('label_replace(up, "dst", "$1 by (x)", "src", "(.*)")', ["up"]),
    ("sum(rate(x_total[1m])) by (target) * 1e-3", ["x_total"]),
])
def test_metric_names_are_found_in_promql(expr, names):
    assert promql.metric_names(expr) == names


def test_undefined_names_accepts_catalogue_histogram_parts_rules_and_builtins():
    expr = ("hisparse_step_duration_seconds_bucket + hisparse_step_duration_seconds_count + up"
            " + my:rule:x + hisparse_tokens_total + hisparse_tokens_bucket + nope_total")
    assert promql.undefined_names(expr, catalogue.CATALOGUE, {"my:rule:x"}) == [
        "hisparse_tokens_bucket", "nope_total"]


def test_thresholds_come_from_the_one_config():
    alerts = {a["alert"]: a for a in _alerts(build.build_rules())}
    for t in thresholds.THRESHOLDS:
        rule = alerts[t.alert]
        assert f"{t.limit:g}" in rule["expr"], (t.alert, rule["expr"])
        assert rule["for"] == build.duration(t.for_s)
        op = "<" if t.direction == "min" else ">"
        assert f" {op} {t.limit:g}" in rule["expr"]
    assert alerts["EasymatsTargetDown"]["for"] == build.duration(thresholds.TARGET_DOWN_FOR_S)


def test_every_alert_is_complete():
    alerts = _alerts(_rules())
    assert ISSUE_ALERTS <= {a["alert"] for a in alerts}
    with open(build.RUNBOOK_PATH, encoding="utf-8") as f:
        runbook = f.read()
    for a in alerts:
        assert a["labels"]["severity"] in ("warning", "critical"), a["alert"]
        assert a["for"], a["alert"]
        for key in ("summary", "description", "runbook_url"):
            assert a["annotations"][key], (a["alert"], key)
        assert a["annotations"]["runbook_url"].endswith("#" + a["alert"].lower())
        assert f"\n## {a['alert']}\n" in runbook, f"docs/runbook.md lacks a section for {a['alert']}"
    anchor = next(a for a in alerts if a["alert"] == "HiSparseAnchorHitRateLow")
    assert anchor["labels"]["action"] == "recalibrate"
    assert all("action" not in a["labels"] for a in alerts if a is not anchor)


def test_recording_rules_are_named_and_aggregated_before_dividing():
    records = [r for g in _rules()["groups"] for r in g["rules"] if "record" in r]
    assert len({r["record"] for r in records}) >= 9
    for r in records:
        level, metric, operation = r["record"].split(":")
        assert level and metric and operation, r["record"]
        if "ratio" in operation:
            num, _, den = r["expr"].partition("\n/\n")
            # a numerator may be a difference of sums (headroom = limit - used), aggregated too
            assert num.lstrip("(").startswith("sum by (") and den.startswith("(sum by ("), r["record"]
            assert "\n/\n" not in den and all(line.lstrip(" (-").startswith("sum by (")
                                                for line in num.splitlines()), r["record"]


def test_promtool_check_rules():
    proc = subprocess.run([_tool("promtool"), "check", "rules", build.RULES_PATH],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@pytest.mark.parametrize("tests_file", ["tests.yml", "fleet_tests.yml"])
def test_promtool_unit_tests_pass(tests_file):
    proc = subprocess.run([_tool("promtool"), "test", "rules", tests_file], cwd=ALERTS_DIR,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _value_tested_exprs(tests_file: str) -> list[str]:
    with open(os.path.join(ALERTS_DIR, tests_file), encoding="utf-8") as f:
        tests = yaml.safe_load(f)
    return [p["expr"] for t in tests["tests"] for p in t.get("promql_expr_test", [])]


def test_every_fleet_rule_has_a_value_test():
    with open(build.FLEET_RULES_PATH, encoding="utf-8") as f:
        fleet = yaml.safe_load(f)
    exprs = _value_tested_exprs("fleet_tests.yml")
    names = build.recording_rule_names(fleet)
    assert len(names) >= 8
    for record in names:
        assert any(record in e for e in exprs), f"fleet recording rule {record} has no value test"


def test_fleet_rules_use_only_what_the_global_prometheus_federates():
    """Every series a fleet rule reads is a node-level rule that FEDERATE_MATCH selects."""
    fleet = build.build_fleet_rules()
    edge_records = build.recording_rule_names(build.build_rules())
    federated = [m.split('"')[1] for m in build.FEDERATE_MATCH if m.startswith('{__name__=~')]
    for rule in fleet["groups"][0]["rules"]:
        for name in promql.metric_names(rule["expr"]):
            assert name in edge_records and name.startswith("node:"), (rule["record"], name)
            assert any(re.fullmatch(f, name) for f in federated), (rule["record"], name)


def test_prometheus_rule_carries_the_same_groups_as_rules_yml():
    with open(build.PROMETHEUS_RULE_PATH, encoding="utf-8") as f:
        obj = yaml.safe_load(f)
    assert (obj["apiVersion"], obj["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert obj["spec"]["groups"] == _rules()["groups"]


def test_unit_tests_cover_both_sides_of_every_for_and_every_recording_rule():
    with open(os.path.join(ALERTS_DIR, "tests.yml"), encoding="utf-8") as f:
        tests = yaml.safe_load(f)
    step = 60  # tests.yml evaluates once a minute
    assert tests["evaluation_interval"] == "1m"
    silent: dict[str, list[int]] = {}
    firing: dict[str, list[int]] = {}
    for t in tests["tests"]:
        for a in t.get("alert_rule_test", []):
            minutes = int(a["eval_time"].rstrip("m")) * 60
            (firing if a.get("exp_alerts") else silent).setdefault(a["alertname"], []).append(minutes)
    exprs = _value_tested_exprs("tests.yml")
    for a in _alerts(_rules()):
        name = a["alert"]
        assert name in firing and name in silent, f"{name} needs a firing and a silent test"
        # The silent check sits one evaluation before a firing one: the `for` boundary.
        assert any(f - step in silent[name] for f in firing[name]), name
    for record in build.recording_rule_names(_rules()):
        assert any(record in e for e in exprs), f"recording rule {record} has no value test"


def test_promtool_tests_fail_when_a_for_changes(tmp_path):
    """The unit tests can fail: the same tests against rules with a shorter `for` do."""
    (tmp_path / "rules.yml").write_text(build.render(build.build_rules(for_override_s=60)))
    shutil.copy(os.path.join(ALERTS_DIR, "tests.yml"), tmp_path / "tests.yml")
    proc = subprocess.run([_tool("promtool"), "test", "rules", "tests.yml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode != 0
    assert "HiSparseAnchorHitRateLow" in proc.stdout + proc.stderr


def test_alertmanager_config_is_valid_and_routes_recalibration_to_easymats():
    amtool = _tool("amtool")
    path = os.path.join(ALERTS_DIR, "alertmanager.yml")
    proc = subprocess.run([amtool, "check-config", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def route(*labels: str) -> str:
        return amtool_route(path, *labels)

    assert route("alertname=HiSparseAnchorHitRateLow", "action=recalibrate", "target=decode-0") == \
        "easymats-recalibrate"
    assert route("alertname=HiSparseQuantErrorHigh", "target=decode-0") == "default"
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    hook = next(r for r in cfg["receivers"] if r["name"] == "easymats-recalibrate")["webhook_configs"][0]
    assert hook["http_config"]["authorization"]["credentials_file"]
