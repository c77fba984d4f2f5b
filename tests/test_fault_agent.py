"""What an operator meets around a running agent: the segment directory removed, targets
starting and exiting in crowds, bursts of scrapes. Real processes, real sockets."""

from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers_agent import agent_proc, finish, read_log, samples_advance, scrape, target_proc, value, wait_for  # noqa: E402
from helpers_targets import free_port  # noqa: E402
from test_fault_segment import exposition_problems  # noqa: E402

pytestmark = pytest.mark.fault


def test_segment_directory_removed_under_a_running_agent(procs, segment_dir):
    target, _ = target_proc(procs, "decode-0")
    port = free_port()
    agent = agent_proc(procs, "--keep-serving", "--listen", f"127.0.0.1:{port}", "--quiet")
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="decode-0") == 1.0)
    shutil.rmtree(segment_dir)
    time.sleep(2.5)
    assert value(scrape(port), "easymats_target_up", target="decode-0") == 1.0, "its open segment still reads"
    samples_advance(port)
    later, _ = target_proc(procs, "decode-1")  # its writer creates the directory again
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="decode-1") == 1.0, timeout=10)
    target.send_signal(signal.SIGTERM)
    later.send_signal(signal.SIGTERM)
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    assert code == 0, err
    assert len([line for line in err.splitlines() if "does not exist" in line]) == 1, err


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_many_targets_starting_and_exiting_at_once(tmp_path, procs):
    """40 short-lived targets in overlapping waves under a --keep-serving agent: every one is
    attached and seen down, /metrics stays valid throughout, and nothing leaks."""
    port = free_port()
    log = str(tmp_path / "run.log")
    agent = agent_proc(procs, "--keep-serving", "--interval", "0.05", "--listen", f"127.0.0.1:{port}",
                       "--output", log, "--quiet")
    wait_for(lambda: scrape(port) is not None)
    fds_before = open_fds(agent.pid)
    rng = random.Random(7)
    names = [f"w{i}" for i in range(40)]
    waves = [names[i:i + 10] for i in range(0, 40, 10)]
    problems: list[str] = []
    for wave in waves:
        batch = [subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "helpers_targets.py"),
                                   "--name", n, "--rate", "50", "--duration", f"{rng.uniform(1.0, 2.5):.2f}"],
                                  stdout=subprocess.DEVNULL) for n in wave]
        procs.extend(batch)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                problems += exposition_problems(resp.read().decode())
            time.sleep(0.1)
    for p in procs[1:]:
        p.wait(timeout=30)
    assert problems == []
    # the agent notices the exits on its own schedule: poll until every one is listed down
    m = wait_for(lambda: (lambda m: m if {lab["target"] for lab, v in m.get("easymats_target_up", [])} >= set(names)
                          and all(v == 0.0 for lab, v in m["easymats_target_up"] if lab["target"] in names)
                          else None)(scrape(port)), timeout=10)
    assert {lab["target"] for lab, v in m["easymats_target_up"]} >= set(names)
    assert all(v == 0.0 for lab, v in m["easymats_target_up"] if lab["target"] in names)
    assert open_fds(agent.pid) <= fds_before + 2, "segment descriptors of exited targets are closed"
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    assert code == 0, err
    assert "Traceback" not in err
    lines = read_log(log)
    attached = {x["target"] for x in lines if x["kind"] == "event" and x["event"] == "attach"}
    downs = {x["target"] for x in lines if x["kind"] == "event" and x["event"] == "down"}
    assert attached >= set(names) and downs >= set(names)


def test_scrape_bursts_are_all_answered_and_sampling_goes_on(procs):
    target, _ = target_proc(procs)
    port = free_port()
    agent = agent_proc(procs, "--pid", str(target.pid), "--listen", f"127.0.0.1:{port}", "--quiet")
    wait_for(lambda: value(scrape(port), "easymats_target_up", target="decode-0") == 1.0)
    before = value(scrape(port), "easymats_samples_total", target="decode-0")

    def one(_: int) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
            assert not exposition_problems(body)
            return resp.status
    for _ in range(3):  # three bursts of 200 scrapes opened at once
        with concurrent.futures.ThreadPoolExecutor(max_workers=200) as pool:
            assert list(pool.map(one, range(200))) == [200] * 200
    m = scrape(port)
    assert value(m, "easymats_samples_total", target="decode-0") > before
    assert value(m, "easymats_target_up", target="decode-0") == 1.0
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    assert code == 0, err


def test_a_target_not_sampled_recently_is_reported_down(segment_dir):
    """/metrics never serves a target's last values as up once the sampler stopped reaching it."""
    from easymats import telemetry
    from easymats.exporter import AgentCollector, LagHistogram
    from easymats.targets import Target

    seg = telemetry.open_segment(name="w")
    seg.publish()
    try:
        tg = Target(os.getpid(), seg.path, peak_window_s=15)
        tg.sample(time.time())
        col = AgentCollector(lambda: [tg], LagHistogram(), lambda: None, 15.0, sample_max_age_s=0.3)
        assert 'easymats_target_up{target="w"} 1.0' in col.render_text()
        time.sleep(0.4)
        assert 'easymats_target_up{target="w"} 0.0' in col.render_text()
    finally:
        seg.close()


def test_a_sampler_that_fails_takes_every_target_down_and_fails_the_run(procs):
    """A bug in the sampler (injected here into discovery) must not leave a silent agent serving
    its last values: every target goes down, /metrics says so, the run's status is 1."""
    import io

    from easymats.agent import Agent

    target, _ = target_proc(procs)
    err = io.StringIO()
    agent = Agent([target.pid], interval=0.05, listen=("127.0.0.1", 0), view="none", nvml_interval=0, err=err)
    agent.start()
    try:
        wait_for(lambda: value(scrape(agent.port), "easymats_target_up", target="decode-0") == 1.0)

        def broken(current):
            raise RuntimeError("injected bug")
        agent.discovery.scan = broken
        agent._next_discovery = 0.0
        assert agent.wait(timeout=5), "the sampler stopped"
        assert agent.failure and "injected bug" in agent.failure
        assert all(not tg.up for tg in agent.targets)
        assert agent.exit_status() == 1
        assert "internal error in the sampler" in err.getvalue()
    finally:
        agent.close()


class CountingSource:
    """Another kind of source, in a few lines: what a vLLM endpoint or SGLang file reader would
    implement (easymats.source.Source). It fails on demand and can 'exit'."""

    def __init__(self, name: str):
        self.name, self.labels, self.pid, self.path = name, {"kind": "test"}, os.getpid(), None
        self.n, self.fail, self.exited, self.last = 0, False, False, None

    def read(self):
        from easymats.source import Series, Snapshot, SourceError

        if self.exited:  # what is left of an exited producer: its last snapshot, heartbeat still
            return self.last
        if self.fail:
            err = SourceError(f"{self.name}: endpoint answered 500; check the server")
            err.kind = "io"
            raise err
        self.n += 1
        now = time.monotonic_ns()
        self.last = Snapshot(None, self.pid, self.name, dict(self.labels), 0, 0, time.time_ns(), now, self.n, 1,
                             [Series("hisparse_sequences", "gauge", "", {}, float(self.n))])
        return self.last

    def alive(self) -> bool:
        return not self.exited

    def close(self) -> None:
        pass


def test_another_kind_of_source_is_sampled_and_judged_like_a_segment():
    from easymats.agent import Agent

    src = CountingSource("other-0")
    agent = Agent([], keep_serving=True, interval=0.05, listen=("127.0.0.1", 0), view="none", nvml_interval=0)
    agent.start()
    try:
        agent.add_source(src)
        m = wait_for(lambda: (lambda s: s if value(s, "easymats_target_up", target="other-0") == 1.0 else None)(
            scrape(agent.port)))
        assert value(m, "hisparse_sequences", target="other-0") >= 1.0
        assert value(m, "easymats_target_info", target="other-0", labels="kind=test") == 1.0
        src.fail = True
        wait_for(lambda: value(scrape(agent.port), "easymats_target_up", target="other-0") == 0.0)
        assert next(tg for tg in agent.targets if tg.name == "other-0").error.endswith("check the server")
        src.fail = False
        wait_for(lambda: value(scrape(agent.port), "easymats_target_up", target="other-0") == 1.0)
        src.exited = True
        wait_for(lambda: next(tg for tg in agent.targets if tg.name == "other-0").gone)
    finally:
        agent.stop()
        agent.wait(timeout=5)
