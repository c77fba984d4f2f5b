"""Faults at the Alertmanager webhook: a control file that cannot be written, idle and trickling
clients, hostile bodies, tokens, and bursts. Real sockets, a real target process, a real agent.

Alertmanager retries a notification answered 5xx and gives up on 4xx (notify.Retrier), so a
recalibration whose request could not be written must be answered 5xx and must not be remembered
as done: the repeat then gets through.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers_agent import wait_for  # noqa: E402
from helpers_targets import start_target  # noqa: E402
from test_webhook import TOKEN, alert, payload, post, recalibrations, requests_written  # noqa: E402

from easymats import webhook  # noqa: E402
from easymats.agent import Agent  # noqa: E402
from easymats.segment import control_path  # noqa: E402

pytestmark = pytest.mark.fault


@pytest.fixture
def live(tmp_path):
    """A real target, an in-process agent attached to it, and its webhook on a free port."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    proc, seg_path = start_target("decode-0", duration=60)
    agent = Agent([proc.pid], listen=("127.0.0.1", 0), nvml_interval=0, view="none")
    agent.start()
    hook = webhook.start_webhook("127.0.0.1:0", str(token), agent)
    wait_for(lambda: agent.resolve_target("decode-0"))
    yield proc, seg_path, agent, hook
    hook.close()
    agent.close()
    proc.terminate()
    proc.wait(timeout=10)


def metrics_text(agent: Agent) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=5) as resp:
        return resp.read().decode()


@pytest.mark.parametrize("damage", ["wrong-mode", "missing"])
def test_an_unwritable_control_file_gets_a_5xx_and_the_repeat_gets_through(live, damage):
    proc, seg_path, agent, hook = live
    ctl = control_path(seg_path)
    saved = None
    if damage == "wrong-mode":
        os.chmod(ctl, 0o644)  # not a control file the agent may trust: refused
    else:
        saved = ctl + ".away"
        os.rename(ctl, saved)
    code, body = post(hook.port, payload(alert("decode-0")))
    assert code == 503, (code, body)
    assert body["failed"] and "decode-0" in body["error"]
    assert 'easymats_webhook_write_failures_total{target="decode-0"} 1.0' in metrics_text(agent)
    # Repaired; Alertmanager sends the same notification again: it is not a duplicate.
    if saved:
        os.rename(saved, ctl)
    else:
        os.chmod(ctl, 0o600)
    code, body = post(hook.port, payload(alert("decode-0")))
    assert (code, body["requested"], body["duplicates"]) == (200, ["decode-0"], 0)
    assert requests_written(seg_path) == 1
    wait_for(lambda: recalibrations(seg_path) == 1.0)
    # Answered 200 only once written: the next repeat is the duplicate.
    assert post(hook.port, payload(alert("decode-0")))[1]["duplicates"] == 1


def test_one_runtime_named_three_ways_counts_under_its_one_name(live):
    proc, seg_path, agent, hook = live
    for i, name in enumerate(("decode-0", str(proc.pid), f" {proc.pid} ")):
        code, body = post(hook.port, payload(alert(name, starts=f"2026-11-29T22:0{i}:00Z")))
        assert (code, body["requested"]) == (200, ["decode-0"])
    text = metrics_text(agent)
    assert 'easymats_recalibration_requests_total{target="decode-0"} 3.0' in text
    assert f'target="{proc.pid}"' not in text and 'target=" ' not in text


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(live, scheme):
    _, _, _, hook = live
    req = urllib.request.Request(f"http://127.0.0.1:{hook.port}/", data=payload(alert("decode-0")), method="POST",
                                 headers={"Authorization": f"{scheme} {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 3.0) -> bytes:
    """Send ``head`` (and ``body``) on a fresh socket; the response bytes until close or timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        chunks = []
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                if b"\r\n\r\n" in b"".join(chunks) and b"Connection: close" not in b"".join(chunks):
                    break
        except socket.timeout:
            pass
    return b"".join(chunks)


def test_a_wrong_token_is_refused_before_the_body_is_read(live):
    _, _, _, hook = live
    # Headers announce an 8 MiB body that never comes: a 401 must not wait for it.
    head = (b"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nContent-Type: application/json\r\n"
            b"Content-Length: 8388608\r\n\r\n")
    t0 = time.monotonic()
    reply = raw_request(hook.port, head)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert time.monotonic() - t0 < 2.0


def test_deeply_nested_json_is_a_400_not_a_dropped_connection(live):
    _, _, _, hook = live
    code, body = post(hook.port, b"[" * 100_000)
    assert code == 400 and "nested" in body["error"]
    nested = json.dumps({"version": "4", "alerts": []})[:-1] + ', "x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    assert post(hook.port, nested.encode())[0] == 400
    assert post(hook.port, payload(alert("decode-0")))[0] == 200, "the receiver still works"


def test_idle_and_trickling_clients_are_cut_and_threads_stay_bounded(tmp_path):
    """200 clients that connect and send nothing (or one byte at a time) hold neither a thread
    each nor the connection for ever; a real request still gets through."""
    directory = str(tmp_path)
    hook = webhook.Webhook(lambda name: None, TOKEN).serve("127.0.0.1", 0, max_connections=16,
                                                           timeout_s=1.0)
    try:
        base_threads = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", hook.port), timeout=10) for _ in range(200)]
        trickler = socket.create_connection(("127.0.0.1", hook.port), timeout=10)
        stop = threading.Event()

        def trickle() -> None:
            try:
                for byte in b"POST / HTTP/1.1\r\nHost: x\r\n" * 100:
                    if stop.wait(0.2):
                        return
                    trickler.send(bytes([byte]))
            except OSError:  # cut by the server: what we want
                return
        t = threading.Thread(target=trickle, daemon=True)
        t.start()
        time.sleep(0.5)
        assert threading.active_count() <= base_threads + 16 + 2, threading.active_count()
        # Each idle connection is closed by the server within a few timeouts.
        deadline = time.monotonic() + 30
        closed = 0
        for s in idle:
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                closed += s.recv(1) == b""
            except (socket.timeout, ConnectionResetError):
                closed += 0
        assert closed == len(idle)
        t.join(timeout=15)
        assert not t.is_alive(), "a client sending one byte every 0.2 s is cut after the request deadline"
        stop.set()
        assert post(hook.port, payload(alert("decode-0")))[0] == 404  # answered (no such target here)
    finally:
        stop.set()
        for s in idle + [trickler]:
            s.close()
        hook.close()
    assert os.listdir(directory) == []


def test_listen_backlog_is_deep_on_both_servers(live):
    """socketserver's default backlog of 5 overflowed under 50 concurrent scrapers."""
    _, _, agent, hook = live
    for port in (agent.port, hook.port):
        out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True)
        backlog = int(out.stdout.split()[2])  # a listening socket's Send-Q is its backlog
        assert backlog >= 1024, out.stdout


def test_500_concurrent_webhook_requests_are_all_answered(live):
    proc, seg_path, agent, hook = live

    def one(i: int) -> int:
        return post(hook.port, payload(alert("decode-0", fingerprint=f"fp{i}")))[0]
    with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
        codes = list(pool.map(one, range(500)))
    assert codes == [200] * 500
    assert requests_written(seg_path) == 500
