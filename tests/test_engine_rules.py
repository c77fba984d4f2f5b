"""Engine targets in the generated dashboard, rules and Alertmanager route: panels say "not provided"
for the metrics an engine lacks, and recalibration alerts of engines page instead of calling the
webhook (they have no control channel)."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from helpers_prometheus import amtool_route  # noqa: E402

from alerts import build as rules  # noqa: E402
from dashboards import build as dashboards  # noqa: E402
from easymats.sources import maps  # noqa: E402


def test_every_panel_with_runtime_metrics_has_a_hidden_not_provided_query(board):
    checked = 0
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        drawn = [m for t in panel["targets"] if t["refId"] != dashboards.NOT_PROVIDED_REF
                 for m in dashboards.runtime_metrics_of(t["expr"])]
        marker = [t for t in panel["targets"] if t["refId"] == dashboards.NOT_PROVIDED_REF]
        if not drawn:
            assert not marker, panel["title"]
            continue
        checked += 1
        (np,) = marker
        selected = np["expr"].split('metric=~"')[1].split('"')[0].split("|")
        assert sorted(selected) == sorted(set(drawn)), panel["title"]
        assert 'target=~"$target"' in np["expr"]
        if panel["type"] == "table":
            assert np.get("instant")
            continue
        assert np["legendFormat"] == "{{target}}: {{metric}} not provided by {{engine}}"
        props = next(o["properties"] for o in panel["fieldConfig"]["overrides"]
                     if o["matcher"] == {"id": "byFrameRefID", "options": dashboards.NOT_PROVIDED_REF})
        assert {"id": "custom.hideFrom", "value": {"legend": False, "tooltip": False, "viz": True}} in props
        # The description names the engine revisions that lack what the panel draws.
        lacking = [m.key for m in maps.ENGINE_MAPS if set(drawn) & set(m.not_provided())]
        assert all(k in panel["description"] for k in lacking), panel["title"]
    assert checked >= 15


def test_recording_rules_and_peaks_are_traced_to_their_runtime_metrics():
    assert dashboards.runtime_metrics_of(f"{rules.HOT_BUFFER_RATIO}{{x=\"1\"}}") == [
        "hisparse_hot_buffer_hits_total", "hisparse_hot_buffer_lookups_total"]
    assert dashboards.runtime_metrics_of("max by (target) (easymats_kv_active_blocks_max)") == ["hisparse_kv_blocks"]
    assert dashboards.runtime_metrics_of(rules.STEP_QUANTILE) == ["hisparse_step_duration_seconds"]
    assert dashboards.runtime_metrics_of("easymats_gpu_utilization_ratio") == []


def test_recalibration_alerts_of_engines_page_and_native_ones_call_the_webhook():
    path = os.path.join(ROOT, "alerts", "alertmanager.yml")

    def route(*labels: str) -> str:
        return amtool_route(path, *labels)

    assert route("alertname=HiSparseAnchorHitRateLow", "action=recalibrate", "control=none", "target=vllm-0") == "page"
    assert route("alertname=HiSparseAnchorHitRateLow", "action=recalibrate", "target=decode-0") == \
        "easymats-recalibrate"
    assert route("alertname=HiSparseHotBufferThrashing", "control=none", "target=vllm-0") == "default"



def test_the_check_reads_the_not_provided_queries_too(board):
    bad = json.loads(json.dumps(board))
    panel = next(p for p in bad["panels"] if p.get("title") == "Hot buffer hit rate")
    np = next(t for t in panel["targets"] if t["refId"] == dashboards.NOT_PROVIDED_REF)
    np["expr"] = np["expr"].replace("easymats_target_not_provided_info", "easymats_target_unprovided_info")
    assert any("easymats_target_unprovided_info" in p for p in dashboards.problems(bad))
    assert not any(where.endswith(dashboards.NOT_PROVIDED_REF) for where, _ in dashboards.queries(board))
