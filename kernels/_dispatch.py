"""Choosing between the Triton kernel and the PyTorch reference, and importing Triton lazily.

Kernel modules (`_*_triton.py`) are imported only when a Triton launch is about to happen: Triton
reads TRITON_INTERPRET when a function is decorated, so importing them early would freeze that
choice, and importing `hi_sparse.kernels` must work where Triton is not installed at all.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
from collections.abc import Iterator
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


def driver_check(err: int, call: str, doing: str) -> None:
    """A CUDA driver call's error as a RuntimeError that names it and what it was for."""
    if err:
        raise RuntimeError(f"HiSparse: {call} failed (CUDA driver error {err}) {doing}")


@contextlib.contextmanager
def primary_context(index: int, doing: str) -> Iterator[ctypes.CDLL]:
    """The CUDA driver library, with device ``index``'s primary context (torch's) current on this
    thread for the block; errors name ``doing``."""
    cuda, dev, ctx = cuda_driver(), ctypes.c_int(), ctypes.c_void_p()
    driver_check(cuda.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet", doing)
    driver_check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain", doing)
    try:
        driver_check(cuda.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent", doing)
        try:
            yield cuda
        finally:
            cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease(dev)


def device_address(t: torch.Tensor, device: torch.device) -> int:
    """The address a kernel on ``device`` reads t at: its own, or for pinned host memory on a GPU
    the mapping the driver gives it (cuPointerGetAttribute, as Triton resolves a pinned tensor it
    is passed)."""
    if device.type != "cuda" or t.is_cuda:
        return t.data_ptr()
    check(t.is_pinned(), "a GPU reads host memory only where it is pinned: pin the tensor (HostPool(pin=True))")
    out, doing = ctypes.c_uint64(), "mapping a pinned tensor for the GPU"
    with primary_context(device.index if device.index is not None else torch.cuda.current_device(), doing) as cuda:
        driver_check(cuda.cuPointerGetAttribute(ctypes.byref(out), 3, ctypes.c_uint64(t.data_ptr())),  # DEVICE_POINTER
                     "cuPointerGetAttribute", doing)
    return out.value
