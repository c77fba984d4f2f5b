"""The agent as a user runs it: the CLI as a subprocess, /metrics over real HTTP, the log read
back and checked line by line against docs/log-format.md."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from helpers_logformat import validate_line
from prometheus_client.parser import text_string_to_metric_families

AGENT = [sys.executable, "-c", "from easymats.cli import main; main()"]


def start_agent(*args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([*AGENT, *args], stdout=stdout, stderr=subprocess.PIPE, text=True)


def agent_proc(procs: list, *args: str, env: dict | None = None, preexec_fn=None) -> subprocess.Popen:
    """The agent CLI (stdout dropped, stderr kept), added to ``procs`` (the conftest fixture that
    kills whatever a failed test leaves running)."""
    p = subprocess.Popen([*AGENT, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=preexec_fn)
    procs.append(p)
    return p


def target_proc(procs: list, name: str = "decode-0", **kw) -> tuple[subprocess.Popen, str]:
    """A tests/helpers_targets.py process (running until stopped, unless ``duration`` says
    otherwise), added to ``procs``; (process, segment path)."""
    from helpers_targets import start_target

    kw.setdefault("duration", 0)
    p, path = start_target(name, **kw)
    procs.append(p)
    return p, path


def scrape(port: int, timeout: float = 5.0) -> dict[str, list]:
    """name -> samples [(sample name, labels, value)] from a real HTTP scrape."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(metrics: dict, name: str, **labels: str) -> float | None:
    for lab, v in metrics.get(name, []):
        if all(lab.get(k) == x for k, x in labels.items()):
            return v
    return None


def wait_for(pred, timeout: float = 8.0, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(step)
    raise AssertionError("condition not met in time")


def samples_advance(port: int, target: str = "decode-0", timeout: float = 5.0) -> float:
    """The samples counter moves within ``timeout`` (the sampler is alive) and the target is up."""
    before = value(scrape(port), "easymats_samples_total", target=target)
    assert before is not None, "no samples counter"
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(port)
        after = value(m, "easymats_samples_total", target=target)
        if after is not None and after > before:
            break
        assert time.monotonic() < deadline, "sampling stopped"
        time.sleep(0.1)
    assert value(m, "easymats_target_up", target=target) == 1.0
    return after


def read_log(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f]
    for obj in lines:
        assert validate_line(obj) == [], (obj, validate_line(obj))
    assert lines[0]["kind"] == "header"
    return lines


def finish(agent: subprocess.Popen, timeout: float = 15) -> tuple[int, str, str]:
    """Wait for the agent to exit; one that does not within ``timeout`` is killed and fails."""
    try:
        out, err = agent.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        agent.kill()
        out, err = agent.communicate()
        raise AssertionError(f"the agent did not exit within {timeout:g} s; stderr: {err[-2000:]}") from None
    return agent.returncode, out, err
