"""The agent on engine targets: ``--scrape`` (several, mixed with a native ``--pid``), misbehaving
endpoints that must not delay anyone, SGLang by PID with ``--follow-log``; the CLI as a subprocess,
/metrics over HTTP, the log validated against docs/log-format.md."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from helpers_agent import finish, read_log, scrape, start_agent, value, wait_for  # noqa: E402
from helpers_targets import free_port, start_target  # noqa: E402
from test_engine_sources import start_standin, stop  # noqa: E402


def start_bad(mode: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "helpers_badhttp.py"), mode],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("ready "), line
    return proc, f"http://127.0.0.1:{line.split()[1]}/metrics"


def samples_of(lines: list[dict], target: str) -> list[dict]:
    return [x for x in lines if x["kind"] == "sample" and x["target"] == target]


def test_bad_endpoints_never_delay_a_good_scrape_or_a_pid_target(tmp_path):
    """A hanging, a trickling and a garbage endpoint beside a vLLM endpoint and a native HiSparse
    PID: each bad one is up 0 with its reason at every tick; the good ones are sampled fresh at
    every tick, on time. (Were the reads made in the sampler, each hung read would add its whole
    timeout to every tick's lag and cost the good targets their samples.)"""
    vllm, (port,) = start_standin("vllm", "--revision", "a")
    native, _ = start_target("decode-0", duration=30.0)
    bad = {mode: start_bad(mode) for mode in ("hang", "trickle", "garbage")}
    log = tmp_path / "run.log"
    agent_port = free_port()
    try:
        agent = start_agent("--pid", str(native.pid), "--scrape", f"vllm-0=http://127.0.0.1:{port}/metrics",
                            *[a for mode, (_, url) in bad.items() for a in ("--scrape", f"{mode}={url}")],
                            "--interval", "0.1", "--duration", "4", "--quiet", "--output", str(log),
                            "--listen", f"127.0.0.1:{agent_port}")
        metrics = wait_for(lambda: (m := scrape(agent_port)) and value(m, "easymats_target_up", target="vllm-0")
                           and value(m, "easymats_target_up", target="decode-0") and m)
        for mode in bad:
            assert value(metrics, "easymats_target_up", target=mode) == 0.0
        code, _, err = finish(agent)
        assert code == 0, err
    finally:
        for p in [vllm, native] + [p for p, _ in bad.values()]:
            stop(p)
    lines = read_log(str(log))
    good = samples_of(lines, "vllm-0")
    ticks = len(samples_of(lines, "decode-0"))
    assert ticks >= 30, ticks
    assert all(x["up"] for x in samples_of(lines, "decode-0"))
    up = [x for x in good if x["up"]]
    assert len(up) >= 0.9 * len(good), [x.get("error") for x in good if not x["up"]]
    seqs = [x["seq"] for x in up]
    assert len(set(seqs)) == len(seqs)  # a fresh read at every sample, never one served twice
    lags = [x["lag_s"] for x in good]
    assert statistics.median(lags) < 0.01 and max(lags) < 0.08, sorted(lags)[-5:]
    reasons = {mode: {x.get("error", "").split(": ", 1)[-1] for x in samples_of(lines, mode)} for mode in bad}
    assert all(not x["up"] for mode in bad for x in samples_of(lines, mode))
    assert any("timed out" in r or "still running" in r for r in reasons["hang"]), reasons["hang"]
    assert any("timed out" in r or "still running" in r for r in reasons["trickle"]), reasons["trickle"]
    assert any("not a Prometheus text exposition" in r or "not UTF-8" in r for r in reasons["garbage"])
    # The mapped catalogue series are in the log, with the engine's HiSparse series beside them.
    last = up[-1]["metrics"]
    assert {"hisparse_hot_buffer_hits_total", "hisparse_hot_buffer_lookups_total", 'hisparse_kv_blocks{state="free"}',
            "hisparse_kv_blocks_limit", "hisparse_swap_in_bytes_total"} <= set(last)
    assert any(k.startswith("vllm:hisparse_pending_spills") for k in last)
    assert not any(k.startswith("vllm:num_requests_waiting") for k in last)  # on /metrics only
    assert up[-1]["pid"] == 0 and up[-1]["process"] is None
    attach = [x for x in lines if x["kind"] == "event" and x["event"] == "attach" and x["target"] == "vllm-0"]
    assert attach and attach[0]["detail"] == f"scrape http://127.0.0.1:{port}/metrics"


def test_both_vllm_revisions_on_one_metrics_page(tmp_path):
    a, (pa,) = start_standin("vllm", "--revision", "a", "--engines", "2")
    b, (pb,) = start_standin("vllm", "--revision", "b", "--kv-cache-metrics")
    agent_port = free_port()
    try:
        agent = start_agent("--scrape", f"http://127.0.0.1:{pa}/metrics", "--scrape", f"rev-b=http://127.0.0.1:{pb}/metrics",
                            "--interval", "0.1", "--duration", "3", "--quiet", "--listen", f"127.0.0.1:{agent_port}")
        ta = f"127.0.0.1:{pa}"

        def ready():
            m = scrape(agent_port)
            return m if value(m, "hisparse_hot_buffer_lookups_total", target="rev-b") and \
                value(m, "hisparse_kv_blocks", target=ta, state="free") is not None else None

        m = wait_for(ready)
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{agent_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        finish(agent)
    finally:
        stop(a)
        stop(b)
    # One HELP/TYPE per family even when both targets pass the same family through.
    helps = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(helps) == len(set(helps))
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    running = fams["vllm:num_requests_waiting"]  # not mapped: passed through
    assert {s.labels["target"] for s in running.samples} == {ta, "rev-b"}
    assert {s.labels["engine"] for s in running.samples if s.labels["target"] == ta} == {"0", "1"}
    info = {s.labels["target"]: s.labels["revision"] for s in fams["easymats_target_source_info"].samples}
    assert info == {ta: "hisparse-host-blocks", "rev-b": "hisparse-usage-perc"}
    assert all(s.labels["control"] == "none" for s in fams["easymats_target_source_info"].samples)
    not_provided = {(s.labels["target"], s.labels["metric"]) for s in fams["easymats_target_not_provided_info"].samples}
    assert ("rev-b", "hisparse_kv_blocks") in not_provided and (ta, "hisparse_kv_blocks") not in not_provided
    assert (ta, "hisparse_anchor_hits_total") in not_provided
    assert "vllm:hisparse_host_cache_usage_perc" in fams and "vllm:hisparse_host_block_lifetime_seconds" in fams
    # Ratios from counters: hits / lookups over the stand-in's 0.8 hit rate.
    hits = value(m, "hisparse_hot_buffer_hits_total", target="rev-b")
    looks = value(m, "hisparse_hot_buffer_lookups_total", target="rev-b")
    assert 0.6 < hits / looks < 0.95


def test_the_collector_protocol_gives_what_the_fast_text_path_serves():
    from prometheus_client import generate_latest

    from easymats.exporter import AgentCollector, LagHistogram
    from easymats.sources.attach import EngineAttach

    vllm, (port,) = start_standin("vllm", "--revision", "a")
    try:
        engines = EngineAttach([f"v=http://127.0.0.1:{port}/metrics"], interval=0.1).start()
        tg = engines[0]
        wait_for(lambda: tg.sample(time.time()) == (False, None) and tg.snapshot is not None)
        coll = AgentCollector(lambda: engines, LagHistogram(), lambda: None, 15.0)

        class Reg:
            def collect(self):
                return coll.collect()

        def flat(text: str) -> set:
            return {(s.name, tuple(sorted(s.labels.items())), s.value) for f in text_string_to_metric_families(text)
                    for s in f.samples if not s.name.startswith("easymats_sample_lag")}

        assert flat(coll.render_text()) == flat(generate_latest(Reg()).decode())
        tg.close()
    finally:
        stop(vllm)


def test_sglang_by_pid_with_its_decode_log(tmp_path):
    slog = tmp_path / "sglang.log"
    sglang, (spid, directory) = start_standin("sglang", "--tp", "2", "--log", str(slog))
    log = tmp_path / "run.log"
    agent_port = free_port()
    try:
        agent = start_agent("--pid", spid, "--follow-log", str(slog), "--interval", "0.1", "--quiet",
                            "--output", str(log), "--listen", f"127.0.0.1:{agent_port}")
        target = f"sglang-{spid}"

        def ready():
            m = scrape(agent_port)
            return m if value(m, "hisparse_hot_buffer_resident_tokens", target=target) and \
                value(m, "hisparse_context_tokens", target=target) else None

        m = wait_for(ready, timeout=15)
        assert value(m, "hisparse_kv_blocks_limit", target=target) == 2000000
        assert value(m, "hisparse_tokens_total", target=target, phase="decode") > 0
        assert value(m, "hisparse_backup_bytes_total", target=target) > 0
        assert value(m, "easymats_target_source_info", target=target, engine="sglang", via="pid") == 1
        assert value(m, "easymats_target_not_provided_info", target=target,
                     metric="hisparse_hot_buffer_hits_total") == 1
        assert value(m, "easymats_process_resident_memory_bytes", target=target) > 0  # a local process
        assert m.get("sglang:queue_time_seconds_bucket") and m.get("sglang_log:cpu_token_usage")
        time.sleep(1.0)  # ten more samples
        # The engine exits: the target goes down, as a native one does, and the agent ends.
        stop(sglang)
        code, _, err = finish(agent)
        assert code == 0, err
    finally:
        stop(sglang)
    lines = read_log(str(log))
    ours = samples_of(lines, target)
    up = [x for x in ours if x["up"]]
    assert len(up) >= 10
    keys = set(up[-1]["metrics"])
    assert {"hisparse_hot_buffer_resident_tokens", 'hisparse_kv_blocks{state="active"}', "hisparse_context_tokens",
            "sglang_log:cpu_token_usage", "sglang_log:gpu_token_usage"} <= keys
    assert [x["event"] for x in lines if x["kind"] == "event" and x["target"] == target] == ["attach", "down"]
    assert not ours[-1]["up"] and ours[-1]["error"] == f"process {spid} exited"


def test_a_follow_log_alone_is_its_own_target(tmp_path):
    slog = tmp_path / "decode.log"
    slog.write_text("[2026-04-10 12:00:01 TP0] Decode batch, #running-req: 3, #gpu token: 12288, gpu token "
                    "usage: 0.19, #cpu token: 90000, cpu token usage: 0.05, cuda graph: True, gen throughput "
                    "(token/s): 99.00, #queue-req: 1\n")
    agent_port = free_port()
    agent = start_agent("--follow-log", str(slog), "--interval", "0.1", "--duration", "2", "--quiet",
                        "--listen", f"127.0.0.1:{agent_port}")
    m = wait_for(lambda: (x := scrape(agent_port)) and value(x, "hisparse_hot_buffer_resident_tokens",
                                                             target="log-decode.log") and x)
    assert value(m, "hisparse_kv_blocks", target="log-decode.log", state="active") == 90000
    assert value(m, "hisparse_sequences", target="log-decode.log") == 3
    finish(agent)


@pytest.mark.parametrize("args, expect", [
    (["--scrape", "ftp://127.0.0.1/metrics"], "only http://"),
    (["--scrape", "http://127.0.0.1:1/metrics", "--interval", "0.1", "--scrape-timeout", "0.2"],
     "must be above 0 and below --interval"),
    (["--scrape", "a=http://127.0.0.1:1/metrics", "--scrape", "a=http://127.0.0.1:2/metrics"], "given twice"),
])
def test_cli_usage_errors_name_the_fix(args, expect):
    out = subprocess.run([sys.executable, "-c", "from easymats.cli import main; main()", *args, "--listen", "none"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert expect in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_no_target_at_all_is_still_a_usage_error_that_mentions_scrape():
    out = subprocess.run([sys.executable, "-c", "from easymats.cli import main; main()"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--scrape" in out.stderr


def test_doctor_on_an_endpoint_and_on_an_sglang_pid(tmp_path):
    cli = [sys.executable, "-c", "from easymats.cli import main; main()", "doctor"]
    vllm, (port,) = start_standin("vllm", "--revision", "a", "--hit-rate", "0.3")
    try:
        out = subprocess.run([*cli, "--scrape", f"http://127.0.0.1:{port}/metrics", "--window", "4"],
                             capture_output=True, text=True, timeout=60)
    finally:
        stop(vllm)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Hot buffer thrashes" in out.stdout and "not judged" in out.stdout and "anchor hit rate" in out.stdout
    sglang, (spid, _) = start_standin("sglang", "--tp", "1")
    try:
        time.sleep(0.5)  # its first metric update creates the files
        out = subprocess.run([*cli, "--pid", spid, "--window", "2"], capture_output=True, text=True, timeout=60)
    finally:
        stop(sglang)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"sglang-{spid}" in out.stderr and "samples over" in out.stdout
    out = subprocess.run([*cli, "--window", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "give one of --pid PID and --scrape URL" in out.stderr


def test_an_endpoint_named_like_a_segment_target_is_named_apart():
    from easymats.sources.attach import EngineAttach

    engines = EngineAttach(["decode-0=http://127.0.0.1:9/metrics", "decode-0.2=http://127.0.0.1:9/x"],
                           interval=0.1).start(taken={"decode-0"})
    try:
        assert [tg.name for tg in engines] == ["decode-0.2", "decode-0.2.2"]
    finally:
        for tg in engines:
            tg.close()
