import os
import tempfile

import pytest


@pytest.fixture(autouse=True)
def segment_dir(monkeypatch):
    """Every test publishes into its own private segment directory (0700), never the user's."""
    d = tempfile.mkdtemp(prefix="easymats-test-")
    os.chmod(d, 0o700)
    monkeypatch.setenv("EASYMATS_SEGMENT_DIR", d)
    yield d
