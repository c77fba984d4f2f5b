"""The command line: option parsing, lazy subcommands, and one-line errors with exit status 2."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))
from helpers_targets import start_target  # noqa: E402

from easymats import cli  # noqa: E402

AGENT = [sys.executable, "-c", "from easymats.cli import main; main()"]


def run_cli(*args: str, timeout: float = 20, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*AGENT, *args], capture_output=True, text=True, timeout=timeout, **kw)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("values,expected", [
    (("123",), [123]),
    (("1 2\n3",), [1, 2, 3]),
    (("4,5", "6"), [4, 5, 6]),
    (("7\n7",), [7]),
    (("",), []),
])
def test_parse_pids_accepts_what_pgrep_prints(values, expected):
    assert cli.parse_pids(values) == expected


@pytest.mark.parametrize("bad", ["abc", "-3", "0", "12x"])
def test_parse_pids_rejects_non_pids(bad):
    with pytest.raises(cli.UsageFailure, match="not a process id"):
        cli.parse_pids((bad,))


def test_unquoted_pgrep_words_fold_into_pid():
    assert cli._join_pid_words(["--pid", "1", "2", "3", "--quiet"]) == ["--pid", "1,2,3", "--quiet"]
    assert cli._join_pid_words(["--pid", "1", "ls"]) == ["--pid", "1", "ls"]


@pytest.mark.parametrize("value,expected", [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)), (":80", ("0.0.0.0", 80)), ("[::1]:9", ("::1", 9)),
    ("", None), ("none", None), (None, None),
])
def test_parse_listen(value, expected):
    assert cli.parse_listen(value) == expected


@pytest.mark.parametrize("bad", ["9464", "host:port", "h:70000"])
def test_parse_listen_rejects(bad):
    with pytest.raises(cli.UsageFailure, match="HOST:PORT"):
        cli.parse_listen(bad)


def test_no_such_pid_names_it():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that surely existed and is now gone
    res = run_cli("--pid", str(p.pid), "--listen", "none")
    assert_one_line_error(res, f"no process with PID {p.pid}")


@pytest.mark.parametrize("interval", ["0.001", "61", "0"])
def test_interval_out_of_range(interval):
    res = run_cli("--pid", str(os.getpid()), "--interval", interval)
    assert_one_line_error(res, "--interval", "0.01..60")


def test_no_pid_given():
    assert_one_line_error(run_cli("--listen", "none"), "no PID given", "pgrep")


def test_port_in_use_names_the_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        target, _ = start_target("decode-0", duration=0)
        try:
            res = run_cli("--pid", str(target.pid), "--listen", f"127.0.0.1:{port}")
        finally:
            target.send_signal(signal.SIGTERM)
            target.wait()
    assert_one_line_error(res, f"port {port}", "in use", "--listen")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root to run the agent as another user (setpriv)")
def test_permission_denied_says_whose_process():
    # The agent runs as nobody and is pointed at a root process (pid 1).
    res = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *AGENT,
                          "--pid", "1", "--listen", "none"], capture_output=True, text=True, timeout=20)
    assert_one_line_error(res, "permission denied for PID 1", "root")


def test_unwritable_output_is_one_line(tmp_path):
    target, _ = start_target("decode-0", duration=0)
    try:
        res = run_cli("--pid", str(target.pid), "--output", str(tmp_path / "no" / "such" / "dir.log"),
                      "--listen", "none")
    finally:
        target.send_signal(signal.SIGTERM)
        target.wait()
    assert_one_line_error(res, "cannot write the log", "--output")


def test_missing_subcommand_module_is_a_clear_error(monkeypatch):
    group = cli.main
    monkeypatch.setitem(group.lazy, "nosuch", "easymats.no_such_module:cmd")
    res = CliRunner().invoke(group, ["nosuch", "--x"])
    assert res.exit_code == 2
    assert "command 'nosuch' is not available in this install" in res.output


def test_lazy_subcommand_is_loaded_on_use(monkeypatch):
    group = cli.main
    monkeypatch.setitem(group.lazy, "lsalias", "easymats.ls:ls")
    res = CliRunner().invoke(group, ["lsalias", "--dir", "/nonexistent-dir"])
    assert res.exit_code == 0, res.output
    assert "no segment directory" in res.output
    assert isinstance(group.get_command(click.Context(group), "lsalias"), click.Command)


def test_help_lists_subcommands_without_importing_them():
    code = ("import sys; from easymats.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'triton', 'easymats.agent', 'easymats.report',"
            " 'prometheus_client', 'psutil') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert "HEAVY []" in res.stdout, res.stdout + res.stderr
    for name in cli.LAZY_SUBCOMMANDS:
        assert name in res.stdout


def test_agent_never_imports_torch():
    code = ("import sys, easymats.cli, easymats.agent, easymats.ls, easymats.exporter, easymats.nvml\n"
            "easymats.nvml.Nvml().available()\n"
            "print('HEAVY', [m for m in ('torch', 'transformers', 'triton', 'numpy') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    assert "HEAVY []" in res.stdout, res.stdout + res.stderr
