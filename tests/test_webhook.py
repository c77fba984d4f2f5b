"""The Alertmanager webhook and ``easymats recalibrate``, against real target processes.

Targets are tests/helpers_targets.py processes: they publish through easymats.telemetry and
acknowledge and count recalibration requests on their control file, as the runtime does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers_agent import wait_for  # noqa: E402
from helpers_targets import free_port, start_target  # noqa: E402

from easymats import webhook  # noqa: E402
from easymats.agent import Agent  # noqa: E402
from easymats.control import ControlFile  # noqa: E402
from easymats.segment import control_path, read_segment  # noqa: E402

TOKEN = "s3cret-token"
CLI = [sys.executable, "-c", "from easymats.cli import main; main()"]


def payload(*alerts: dict, version: str = "4") -> bytes:
    return json.dumps({"version": version, "groupKey": "{}:{alertname=\"x\"}", "truncatedAlerts": 0,
                       "status": "firing", "receiver": "easymats-recalibrate", "groupLabels": {},
                       "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am",
                       "alerts": list(alerts)}).encode()


def alert(target: str, *, status: str = "firing", fingerprint: str = "f00d", starts: str = "2026-11-29T22:00:00Z",
          action: str | None = "recalibrate") -> dict:
    labels = {"alertname": "HiSparseAnchorHitRateLow", "target": target, "severity": "warning"}
    if action:
        labels["action"] = action
    return {"status": status, "labels": labels, "annotations": {}, "startsAt": starts,
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prom", "fingerprint": fingerprint}


def post(port: int, body: bytes, token: str | None = TOKEN) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/alertmanager", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def requests_written(seg_path: str) -> int:
    ctl = ControlFile.open_existing(control_path(seg_path))
    try:
        return ctl._read()[4]  # the request sequence number: how many requests were ever written
    finally:
        ctl.close()


def recalibrations(seg_path: str) -> float:
    return read_segment(seg_path).get("hisparse_recalibrations_total", reason="request") or 0.0


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def live(token_file):
    """A real target, a real in-process agent attached to it, and the webhook on a free port."""
    proc, seg_path = start_target("decode-0", duration=60)
    agent = Agent([proc.pid], listen=("127.0.0.1", 0), nvml_interval=0, view="none")
    agent.start()
    hook = webhook.start_webhook("127.0.0.1:0", token_file, agent)
    yield proc, seg_path, agent, hook
    hook.close()
    agent.close()
    proc.terminate()
    proc.wait(timeout=10)


def test_firing_alert_recalibrates_the_target_once(live):
    proc, seg_path, agent, hook = live
    wait_for(lambda: agent.resolve_target("decode-0"))
    code, body = post(hook.port, payload(alert("decode-0")))
    assert (code, body["requested"]) == (200, ["decode-0"])
    assert requests_written(seg_path) == 1  # written before the answer
    wait_for(lambda: recalibrations(seg_path) == 1.0)  # the target acknowledged and counted it

    # Alertmanager repeats a still-firing alert: acknowledged, not acted on again.
    code, body = post(hook.port, payload(alert("decode-0")))
    assert (code, body["requested"], body["duplicates"]) == (200, [], 1)
    # Resolved notifications and alerts without action="recalibrate" are ignored.
    code, body = post(hook.port, payload(alert("decode-0", status="resolved", starts="2026-11-29T23:00:00Z"),
                                         alert("decode-0", action=None, fingerprint="beef")))
    assert (code, body["requested"], body["ignored"]) == (200, [], 2)
    # The same alert firing again later (new startsAt) is a new request; the target may be named by pid.
    code, body = post(hook.port, payload(alert(str(proc.pid), starts="2026-11-30T00:00:00Z")))
    assert (code, body["requested"]) == (200, ["decode-0"])
    assert requests_written(seg_path) == 2
    wait_for(lambda: recalibrations(seg_path) == 2.0)

    # Counters reach Prometheus through the agent's /metrics.
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'easymats_webhook_requests_total{code="200"} 4.0' in text
    # Counted under the target's declared name, however the alert named it.
    assert 'easymats_recalibration_requests_total{target="decode-0"} 2.0' in text


def test_rejections_write_nothing(live):
    proc, seg_path, agent, hook = live
    wait_for(lambda: agent.resolve_target("decode-0"))
    good = payload(alert("decode-0"))
    assert post(hook.port, good, token=None)[0] == 401
    assert post(hook.port, good, token="wrong")[0] == 401
    assert post(hook.port, b"{not json")[0] == 400
    assert post(hook.port, payload(alert("decode-0"), version="3"))[0] == 400
    assert post(hook.port, json.dumps({"version": "4", "alerts": "x"}).encode())[0] == 400
    assert post(hook.port, json.dumps({"version": "4", "alerts": [{"status": "firing"}]}).encode())[0] == 400
    no_target = alert("decode-0")
    del no_target["labels"]["target"]
    code, body = post(hook.port, payload(no_target))
    assert code == 400 and "target" in body["error"]
    code, body = post(hook.port, payload(alert("decode-9")))
    assert code == 404 and "decode-9" in body["error"]
    assert post(hook.port, b"x" * (webhook.MAX_BODY_BYTES + 1))[0] == 413
    assert requests_written(seg_path) == 0
    counts = hook.counts()["requests_by_code"]
    assert counts == {"401": 2, "400": 5, "404": 1, "413": 1}
    # A 401 reply must not depend on the body: an unauthenticated caller learns nothing.
    assert post(hook.port, b"{not json", token=None)[0] == 401


def test_agent_cli_serves_the_webhook(tmp_path, token_file):
    proc, seg_path = start_target("decode-0", duration=60)
    port, metrics_port = free_port(), free_port()
    agent = subprocess.Popen([*CLI, "--pid", str(proc.pid), "--quiet", "--listen", f"127.0.0.1:{metrics_port}",
                              "--webhook-listen", f"127.0.0.1:{port}", "--webhook-token-file", token_file],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def accepted():
            try:
                return post(port, payload(alert("decode-0")))[0] == 200
            except OSError:
                return False
        wait_for(accepted, timeout=15)
        wait_for(lambda: recalibrations(seg_path) == 1.0)
    finally:
        agent.terminate()
        agent.communicate(timeout=15)
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("token_args, message", [
    ([], "--webhook-token-file"),
    (["--webhook-token-file", "/nonexistent/token"], "cannot read"),
])
def test_agent_cli_rejects_a_missing_token_in_one_line(token_args, message):
    proc, _ = start_target("decode-0", duration=30)
    try:
        out = subprocess.run([*CLI, "--pid", str(proc.pid), "--quiet", "--listen", "none",
                              "--webhook-listen", f"127.0.0.1:{free_port()}", *token_args],
                             capture_output=True, text=True, timeout=20)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr


def test_recalibrate_command_waits_for_the_acknowledgement():
    proc, seg_path = start_target("decode-0", duration=60)
    try:
        out = subprocess.run([*CLI, "recalibrate", "--pid", str(proc.pid), "--reason", "test"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "acknowledged" in out.stdout and "decode-0" in out.stdout
        assert recalibrations(seg_path) >= 1.0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_recalibrate_times_out_naming_what_to_check(tmp_path):
    # A process with a segment that never polls its control file.
    script = textwrap.dedent("""
        import sys, time
        from easymats import telemetry
        seg = telemetry.open_segment(name="idle-0")
        seg.publish()
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        out = subprocess.run([*CLI, "recalibrate", "--pid", str(proc.pid), "--timeout", "0.3"],
                             capture_output=True, text=True, timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert out.returncode == 1
    assert "did not acknowledge" in out.stderr and "--timeout" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_recalibrate_without_a_segment_is_one_clear_line():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        out = subprocess.run([*CLI, "recalibrate", "--pid", str(sleeper.pid)], capture_output=True,
                             text=True, timeout=30)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert out.returncode == 2
    assert "no telemetry segment" in out.stderr and "EASYMATS_SEGMENT_DIR" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    gone = subprocess.run([*CLI, "recalibrate", "--pid", str(sleeper.pid)], capture_output=True,
                          text=True, timeout=30)
    assert gone.returncode == 2 and "no process" in gone.stderr


def test_parse_alerts_reads_a_real_alertmanager_shape():
    alerts = webhook.parse_alerts(payload(alert("decode-0"), alert("decode-1", status="resolved")))
    assert [a["labels"]["target"] for a in alerts] == ["decode-0", "decode-1"]
    with pytest.raises(webhook.PayloadError, match="version"):
        webhook.parse_alerts(payload(alert("decode-0"), version="2"))
    with pytest.raises(webhook.PayloadError, match="labels"):
        webhook.parse_alerts(json.dumps({"version": "4", "alerts": [
            {"status": "firing", "labels": {"target": 3}}]}).encode())
