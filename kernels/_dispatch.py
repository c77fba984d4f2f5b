"""Choosing between the Triton kernel and the PyTorch reference, and importing Triton lazily.

Kernel modules (`_*_triton.py`) are imported only when a Triton launch is about to happen: Triton
reads TRITON_INTERPRET when a function is decorated, so importing them early would freeze that
choice, and importing `hi_sparse.kernels` must work where Triton is not installed at all.
"""
from __future__ import annotations

import ctypes
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


@functools.lru_cache(maxsize=1)
def cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library (OSError where it cannot be loaded: not Linux, no driver)."""
    return ctypes.CDLL("libcuda.so.1")


def device_address(t: torch.Tensor, device: torch.device) -> int:
    """The address a kernel on ``device`` reads t at: its own, or for pinned host memory on a GPU
    the mapping the driver gives it (cuPointerGetAttribute, as Triton resolves a pinned tensor it
    is passed), in the device's primary context, torch's."""
    if device.type != "cuda" or t.is_cuda:
        return t.data_ptr()
    check(t.is_pinned(), "a GPU reads host memory only where it is pinned: pin the tensor (HostPool(pin=True))")
    cuda, ctx, index = cuda_driver(), ctypes.c_void_p(), ctypes.c_int()
    out = ctypes.c_uint64()
    errs = [cuda.cuDeviceGet(ctypes.byref(index), device.index if device.index is not None else
                             torch.cuda.current_device())]
    errs.append(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), index))
    errs.append(cuda.cuCtxPushCurrent_v2(ctx))
    try:
        errs.append(cuda.cuPointerGetAttribute(ctypes.byref(out), 3, ctypes.c_uint64(t.data_ptr())))  # DEVICE_POINTER
    finally:
        cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        cuda.cuDevicePrimaryCtxRelease(index)
    if any(errs):
        raise RuntimeError(f"HiSparse: the CUDA driver gave no device address for a pinned tensor (errors {errs})")
    return out.value
