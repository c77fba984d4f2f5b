"""Real Prometheus and Alertmanager processes for tests: start on free ports, query, stop.

Debian's prometheus and prometheus-alertmanager packages (.ci/run installs them). Prometheus takes a
few seconds before its first scrape: callers poll (:func:`poll`), never sleep a fixed time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Any, Callable

import pytest
from helpers_targets import free_port

__all__ = ["free_port", "binary", "http_json", "poll", "Prom", "start_prometheus", "start_alertmanager",
           "stop", "queries_without_data"]


def binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"{names[0]} is not installed: apt-get install -y --no-install-recommends "
                "prometheus prometheus-alertmanager")


def amtool_route(config: str, *labels: str) -> str:
    """The receiver Alertmanager's routing tree in ``config`` picks for an alert with ``labels``."""
    out = subprocess.run([binary("amtool", "prometheus-alertmanager"), "config", "routes", "test",
                          f"--config.file={config}", *labels], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def http_json(url: str, data: bytes | None = None, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=timeout) as resp:
        return json.loads(resp.read())


def poll(what: str, pred: Callable[[], Any], timeout: float, step: float = 0.25,
         procs: dict[str, subprocess.Popen] | None = None) -> Any:
    """pred() until truthy; on timeout say what did not happen, or which component exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = pred()
        except OSError:
            got = None
        if got:
            return got
        for name, p in (procs or {}).items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited with {p.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(step)


class Prom:
    """The HTTP API of one Prometheus on 127.0.0.1."""

    def __init__(self, port: int):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str) -> list[dict]:
        out = http_json(f"{self.base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        assert out["status"] == "success", out
        return out["data"]["result"]

    def value(self, expr: str) -> float | None:
        """The value of a query that returns one sample, else None."""
        got = self.query(expr)
        return float(got[0]["value"][1]) if len(got) == 1 else None

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
        out = http_json(f"{self.base}/api/v1/query_range?{q}")
        assert out["status"] == "success", out
        return out["data"]["result"]

    def series(self, selector: str, start: float) -> list[dict]:
        q = urllib.parse.urlencode({"match[]": selector, "start": start})
        return http_json(f"{self.base}/api/v1/series?{q}")["data"]


def start_prometheus(config: str, workdir, port: int, name: str = "prometheus") -> subprocess.Popen:
    return subprocess.Popen(
        [binary("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={workdir / (name + '-tsdb')}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(workdir / f"{name}.log", "w"))


def start_alertmanager(config: str, workdir, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [binary("alertmanager", "prometheus-alertmanager"), f"--config.file={config}",
         f"--storage.path={workdir / 'am'}", f"--web.listen-address=127.0.0.1:{port}",
         "--cluster.listen-address=", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(workdir / "alertmanager.log", "w"))


def stop(procs: list[subprocess.Popen], timeout: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def queries_without_data(prom: Prom, board_path: str, start: float, rate_interval: str,
                         gpu_prefixes: tuple[str, ...] = ("easymats_gpu_", "easymats_process_gpu_"),
                         ) -> tuple[list[str], list[str]]:
    """Run every query of a generated dashboard (variables at "All") against ``prom``:
    (queries that returned nothing, those of them that only a GPU can answer)."""
    from dashboards import build as dashboards

    with open(board_path, encoding="utf-8") as f:
        board = json.load(f)
    instant = {(p.get("title"), t.get("refId")) for p in board["panels"]
               for t in p.get("targets", []) or [] if t.get("instant")}
    empty, gpu_only = [], []
    end = time.time()
    for where, expr in dashboards.queries(board):
        concrete = dashboards.with_all_variables(expr, rate_interval)
        if where.startswith("variable"):
            got = prom.series(concrete, start)
        elif any(where == f"panel {t!r} {r}" for t, r in instant):
            got = prom.query(concrete)
        else:
            got = prom.query_range(concrete, start, end)
        if not got:
            empty.append(f"{where}: {concrete}")
            if any(m in expr for m in gpu_prefixes):
                gpu_only.append(f"{where}: {concrete}")
    return empty, gpu_only


def logs(workdir, names: tuple[str, ...]) -> str:
    out = []
    for name in names:
        path = workdir / f"{name}.log"
        if os.path.exists(path):
            out.append(f"--- {name}:\n" + path.read_text()[-2000:])
    return "\n".join(out)
