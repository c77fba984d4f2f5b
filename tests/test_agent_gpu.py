"""NVML on a real GPU: per-process GPU memory of a real CUDA process (run on the device machine:
``pytest -m gpu tests/test_agent_gpu.py``). Deselected by default (marker ``gpu``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(__file__))
from helpers_targets import free_port  # noqa: E402

from easymats.nvml import Nvml  # noqa: E402

pytestmark = pytest.mark.gpu

ALLOC_BYTES = 512 << 20
CUDA_CHILD = f"""
import time, torch
x = torch.ones({ALLOC_BYTES}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < 60:
    x.add_(1)  # keep the SMs a little busy so per-process utilization has samples
    torch.cuda.synchronize()
    time.sleep(0.01)
"""


@pytest.fixture
def cuda_process():
    p = subprocess.Popen([sys.executable, "-c", CUDA_CHILD], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    assert line.strip() == "ready", f"the CUDA child did not start (exit {p.poll()})"
    yield p
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_nvml_finds_the_process_gpu_memory(cuda_process):
    n = Nvml()
    assert n.available(), f"NVML is not available on this GPU machine: {n.why_unavailable}"
    deadline = time.monotonic() + 15
    mine = []
    while time.monotonic() < deadline:
        snap = n.read()
        assert snap is not None and snap.gpus
        mine = [r for r in snap.for_pid(cuda_process.pid) if r.memory_bytes]
        if mine:
            break
        time.sleep(0.2)
    assert mine, (f"NVML lists no compute process with pid {cuda_process.pid} "
                  f"(it lists {sorted({p.pid for p in snap.processes})}; a PID namespace?)")
    assert sum(r.memory_bytes for r in mine) >= ALLOC_BYTES
    gpu = snap.gpus[int(mine[0].gpu)]
    assert gpu.memory_total_bytes > gpu.memory_used_bytes >= ALLOC_BYTES
    assert 0.0 <= gpu.utilization_ratio <= 1.0
    n.close()


def test_agent_exports_and_logs_per_process_gpu_memory(cuda_process, tmp_path):
    port = free_port()
    log = tmp_path / "run.log"
    agent = subprocess.Popen([sys.executable, "-c", "from easymats.cli import main; main()", "--pid",
                              str(cuda_process.pid), "--nvml-interval", "0.2", "--output", str(log),
                              "--listen", f"127.0.0.1:{port}", "--quiet"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        found = None
        while time.monotonic() < deadline and found is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                time.sleep(0.1)
                continue
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
            per_proc = [s for s in samples if s.name == "easymats_process_gpu_memory_bytes"]
            if per_proc:
                found = (per_proc, samples)
            else:
                time.sleep(0.2)
        assert found, "easymats_process_gpu_memory_bytes never appeared on /metrics"
        per_proc, samples = found
        assert per_proc[0].labels["target"] == f"pid-{cuda_process.pid}"
        assert per_proc[0].value >= ALLOC_BYTES
        assert any(s.name == "easymats_gpu_memory_total_bytes" and s.value > 0 for s in samples)
        time.sleep(0.5)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=10)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    gpu_lines = [x for x in lines if x["kind"] == "sample" and x.get("gpu")]
    assert gpu_lines and gpu_lines[-1]["gpu"][0]["memory_bytes"] >= ALLOC_BYTES
