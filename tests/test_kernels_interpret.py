"""Every Triton kernel against its reference under TRITON_INTERPRET=1 (CPU, no GPU needed).

Triton reads TRITON_INTERPRET when a kernel is decorated, so the cases run in one fresh process
with the variables set from the start (kernels_interpret_cases.py); each case is reported here
as its own test.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from kernels_interpret_cases import CASES

HERE = pathlib.Path(__file__).parent


@pytest.fixture(scope="module")
def interpreter_run() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", HISPARSE_FORCE_TRITON="1")
    proc = subprocess.run([sys.executable, str(HERE / "kernels_interpret_cases.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_interpreter_really_ran_the_triton_kernels(interpreter_run):
    assert interpreter_run["triton_modules"] == [
        "hi_sparse.kernels._attention_triton", "hi_sparse.kernels._bounds_triton",
        "hi_sparse.kernels._counts_triton", "hi_sparse.kernels._lru_triton", "hi_sparse.kernels._norm_triton",
        "hi_sparse.kernels._probe_triton", "hi_sparse.kernels._quant_triton", "hi_sparse.kernels._recent_triton",
        "hi_sparse.kernels._rotary_triton", "hi_sparse.kernels._select_triton",
        "hi_sparse.kernels._swap_in_triton"]


@pytest.mark.parametrize("case", list(CASES))
def test_triton_kernel_matches_reference(interpreter_run, case):
    error = interpreter_run["results"][case]
    assert error == "", error
