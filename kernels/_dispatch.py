"""Choosing between the Triton kernel and the PyTorch reference, and importing Triton lazily.

Kernel modules (`_*_triton.py`) are imported only when a Triton launch is about to happen: Triton
reads TRITON_INTERPRET when a function is decorated, so importing them early would freeze that
choice, and importing `hi_sparse.kernels` must work where Triton is not installed at all.
"""
from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch

FORCE_ENV = "HISPARSE_FORCE_TRITON"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when `import triton` works (never raises)."""
    try:
        importlib.import_module("triton")
    except Exception:  # noqa: BLE001 - any import failure means "no Triton", not a crash
        return False
    return True


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton on CUDA tensors (or when HISPARSE_FORCE_TRITON=1, for interpreter tests).

    Falls back to the reference when Triton is missing, so CUDA callers still get a result.
    """
    forced = os.environ.get(FORCE_ENV) == "1"
    if not (forced or any(t.is_cuda for t in tensors)):
        return False
    return triton_available()


def kernel_module(name: str) -> ModuleType:
    """Import `hi_sparse.kernels.<name>` (a Triton kernel module) on first use."""
    return importlib.import_module(f"{__package__}.{name}")


def check(cond: bool, message: str) -> None:
    """Raise ValueError(message) when cond is false (user input, so never `assert`)."""
    if not cond:
        raise ValueError(message)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
