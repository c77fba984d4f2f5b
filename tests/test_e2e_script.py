"""benchmarks/e2e_h200.py in its --tiny CPU mode: the same code paths as the H200 run (full-budget
check first, dense and HiSparse rows, the easymats-attached telemetry row, a batch row), and a
non-zero exit when the full-budget check fails."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "e2e_h200.py")

pytestmark = pytest.mark.slow     # each test runs a benchmark script end to end (tens of seconds)


def _run(tmp_path, *args):
    out = tmp_path / "e2e.json"
    p = subprocess.run([sys.executable, SCRIPT, "--tiny", "--json", str(out), *args],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    return p, (json.loads(out.read_text()) if out.exists() else None)


def test_tiny_run_measures_every_row_after_passing_the_check(tmp_path):
    p, res = _run(tmp_path, "--contexts", "256", "--decode-steps", "3",
                  "--variants", "dense,dense-static,hisparse-int4,hisparse-int4-step", "--telemetry-check",
                  "--batch", "2",
                  "--batch-context", "128", "--hisparse-batch", "3",
                  "--dense-batch", "3", "--batch-telemetry")
    assert p.returncode == 0, p.stderr[-2000:]
    assert res["check"]["rel_max_err"] <= res["check"]["tolerance"]
    rows = {(r["variant"], r["batch"], r["decode_input"]): r for r in res["runs"]}
    forked = [rows.pop(("hisparse-int4", 3, i)) for i in ("greedy", "repeated token")]
    on = rows.pop(("hisparse-int4+easymats", 3, "greedy A/B"))   # the same batch, telemetry off / on phases
    assert "error" not in on and on["agent"]["alive_at_end"] and on["agent"]["log_lines"] >= 3, on.get("agent")
    assert len(on["decode_step_ms_on"]) == len(on["decode_step_ms_off"]) == 3 * 11
    assert on["decode_step_ms_median"] > 0 and on["decode_step_ms_off_median"] > 0
    assert res["batch_telemetry_overhead_pct"]["3"] == on["telemetry_overhead_pct"]
    dense = [rows.pop(("dense", 3, i)) for i in ("greedy", "repeated token")]
    rows = {(v, b): r for (v, b, _), r in rows.items()}
    assert set(rows) == {("dense", 1), ("dense-static", 1), ("hisparse-int4", 1), ("hisparse-int4-step", 1),
                         ("hisparse+easymats", 1), ("dense", 2), ("hisparse", 2)}
    # whole-step graphs are a GPU's: on the CPU every step took the layer-by-layer path, unplanned
    assert rows[("hisparse-int4-step", 1)]["decode_steps_by_path"] == {"eager": 0, "captured": 0, "replayed": 0,
                                                                       "layer_by_layer": 0, "capture_retried": 0,
                                                                       "ahead": 0, "ahead_failed": 0}
    assert rows[("dense-static", 1)]["decode_mode"] == "eager"           # a CUDA graph on a GPU
    for r in forked:       # one prefill forked into 3 sequences sharing the prompt's host blocks
        assert "error" not in r and r["hot_buffer_hit_rate"] is not None and r["decode_tokens_per_s"] > 0
        assert r["host_kv_bytes"] > 0 and r["repeat_s"] > 0
        assert r["host_blocks_one_sequence"] <= r["host_blocks_in_use"] <= r["host_pool_blocks"]
    assert all("error" not in r and r["decode_tokens_per_s"] > 0 for r in dense)
    for r in rows.values():
        assert "error" not in r and r["decode_tokens_per_s"] > 0
    hs = rows[("hisparse-int4", 1)]
    assert 0 < hs["host_kv_bytes"] < rows[("hisparse+easymats", 1)]["host_kv_bytes"]   # 4-bit host < bf16
    agent = rows[("hisparse+easymats", 1)]["agent"]
    assert agent["alive_at_start"] and agent["alive_at_end"] and agent["log_lines"] >= 3, agent


def test_a_failed_full_budget_check_exits_non_zero(tmp_path):
    p, res = _run(tmp_path, "--contexts", "128", "--decode-steps", "2", "--variants", "hisparse",
                  "--check-tol", "1e-12")
    assert p.returncode == 1
    assert "diverges from dense" in p.stderr
    assert res["check"]["rel_max_err"] > 1e-12 and res["runs"] == []


def test_two_device_benchmark_runs_on_two_cpu_devices_and_agrees():
    """benchmarks/bench_multidev.py with 'cpu,cpu' (the plumbing of the two-GPU run): identical
    engine outputs split or not, and the split model generates the same tokens with HiSparse."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_multidev.py"), "--devices", "cpu,cpu",
                        "--contexts", "512", "--steps", "4", "--warmup", "1", "--layers", "2", "--q-heads", "4",
                        "--kv-heads", "2", "--head-dim", "32", "--model-layers", "2", "--prompt", "64",
                        "--new-tokens", "4"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    row = [ln for ln in p.stdout.splitlines() if ln.startswith("| 512 |")]
    assert row and row[0].split("|")[5].strip() == "0.00e+00", p.stdout
    assert "tokens match: True" in p.stdout, p.stdout


def test_planted_heavy_hitters_make_the_high_hit_rate_workload(tmp_path):
    """--planted: the same forked batch with heavy-hitter tokens planted in the random model keeps
    the query-aware top-k on the same blocks from step to step: the greedy hit rate rises from the
    random model's ~0.7 (tiny config) to >= 0.9."""
    rates = {}
    for planted in ("0", "3"):
        p, res = _run(tmp_path, "--contexts", "", "--batch-context", "512", "--hisparse-batch", "2",
                      "--decode-steps", "16", "--planted", planted)
        assert p.returncode == 0, p.stderr[-2000:]
        greedy = [r for r in res["runs"] if r.get("decode_input") == "greedy"]
        assert len(greedy) == 1 and "error" not in greedy[0]
        rates[planted] = greedy[0]["hot_buffer_hit_rate"]
        assert ("planted" in res) == (planted != "0")
    assert rates["3"] >= 0.9 and rates["3"] > rates["0"] + 0.1, rates
