"""``easymats ls``: live and stale segments, and --clean."""

from __future__ import annotations

import os
import signal
import sys

from click.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))
from helpers_targets import start_target  # noqa: E402

from easymats.cli import main  # noqa: E402


def test_ls_shows_live_and_stale_and_cleans(segment_dir):
    live, live_path = start_target("decode-live", duration=0)
    dead, dead_path = start_target("decode-dead", duration=0)
    try:
        dead.send_signal(signal.SIGKILL)  # a crash leaves its segment behind
        dead.wait()
        res = CliRunner().invoke(main, ["ls"])
        assert res.exit_code == 0, res.output
        rows = {line.split()[0]: line for line in res.output.splitlines()[1:] if line.strip()[:1].isdigit()}
        assert "decode-live" in rows[str(live.pid)] and "live" in rows[str(live.pid)]
        assert "stale" in rows[str(dead.pid)] and "not running" in rows[str(dead.pid)]
        assert "easymats ls --clean" in res.output
        res = CliRunner().invoke(main, ["ls", "--clean"])
        assert "removed 1 stale segment(s)" in res.output
        assert os.path.exists(live_path) and not os.path.exists(dead_path)
        assert not os.path.exists(dead_path[:-4] + ".ctl")
    finally:
        live.send_signal(signal.SIGTERM)
        live.wait()
    assert "no segments" in CliRunner().invoke(main, ["ls"]).output
