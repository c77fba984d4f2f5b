"""What the agent loads, and its small /metrics HTTP server, exercised over real sockets.

The agent serves /metrics from its own text path on a ``socketserver`` handler: neither
prometheus_client (with the http.server, http.client, email and ssl modules it imports) nor,
on a machine without an NVIDIA driver, pynvml is loaded into the agent process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from easymats.exporter import AgentCollector, LagHistogram, make_registry, serve
from easymats.nvml import DRIVER_PATHS


def test_agent_process_loads_no_prometheus_client_http_server_or_pynvml():
    code = ("import sys, easymats.cli, easymats.agent, easymats.nvml\n"
            "from easymats.exporter import AgentCollector, LagHistogram, make_registry, serve\n"
            "easymats.nvml.Nvml().available()\n"
            "reg = make_registry(AgentCollector(lambda: [], LagHistogram(), lambda: None, 15))\n"
            "srv, _ = serve(reg, '127.0.0.1', 0); reg.render(); srv.shutdown()\n"
            "print('LOADED', sorted(m for m in ('prometheus_client', 'http.server', 'http.client', 'email', "
            "'ssl', 'pynvml') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    loaded = res.stdout.strip().rpartition("LOADED ")[2]
    assert res.returncode == 0, res.stderr
    if any(os.path.exists(p) for p in DRIVER_PATHS):
        loaded = loaded.replace(", 'pynvml'", "").replace("'pynvml'", "")  # a GPU machine needs it
    assert loaded == "[]", res.stdout + res.stderr


@pytest.fixture
def server():
    reg = make_registry(AgentCollector(lambda: [], LagHistogram(), lambda: None, 15.0))
    srv, thread = serve(reg, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{srv.server_port}", srv.server_port
    srv.shutdown()
    srv.server_close()


def test_metrics_root_and_errors_over_http(server):
    url, port = server
    with urllib.request.urlopen(url + "/metrics?x=1", timeout=5) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        names = {f.name for f in text_string_to_metric_families(r.read().decode())}
    assert "easymats_build_info" in names and "easymats_sample_lag_seconds" in names
    with urllib.request.urlopen(url + "/", timeout=5) as r:
        assert b"/metrics" in r.read()
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/nothing", timeout=5)
    assert e.value.code == 404
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url + "/metrics", method="DELETE"), timeout=5)
    assert e.value.code == 501
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"nonsense\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 400 ")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # one header per line, many
        s.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n")
        assert s.recv(100).startswith(b"HTTP/1.0 431 ")
