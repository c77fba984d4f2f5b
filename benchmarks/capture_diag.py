"""Pytest plugin for GPU runs: makes CUDA graph captures explain themselves.

    PYTHONPATH=benchmarks python -m pytest -p capture_diag -m gpu -s tests/test_runtime_batched.py

Prints, with a ``[capdiag]`` prefix: every capture's begin (stream, Python threads alive) and end;
the error of the op that broke a capture, with its full traceback; every Triton compile and
module load that happens while a stream is capturing; and, at each test's start and end, whether
the current stream is still the default one (a failed capture can leave its side stream current).
Set ``CUDA_LOG_FILE`` too (CUDA 12.9+) for the driver's own account of the first failing call.
"""
from __future__ import annotations

import threading
import traceback

import torch
from torch.cuda import graphs


def _say(*parts) -> None:
    print("[capdiag]", *parts, flush=True)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_enter, _exit = graphs.graph.__enter__, graphs.graph.__exit__


def _diag_enter(self):
    _say("capture begin: current", torch.cuda.current_stream(), "threads",
         [t.name for t in threading.enumerate()])
    return _enter(self)


def _diag_exit(self, exc_type, exc, tb):
    if exc is not None:
        _say("the body raised while capturing:")
        traceback.print_exception(exc_type, exc, tb)
    try:
        out = _exit(self, exc_type, exc, tb)
    except BaseException as end:
        _say("ending the capture raised:", repr(end), "; current stream now", torch.cuda.current_stream())
        raise
    _say("capture end: ok")
    return out


graphs.graph.__enter__, graphs.graph.__exit__ = _diag_enter, _diag_exit


def _hook_triton() -> None:
    try:
        import triton
        from triton.compiler import compiler
    except ImportError:
        return

    def cache_hook(*args, **kw):      # called on a JIT cache miss, before compiling
        if _capturing():
            fn = kw.get("fn")
            _say("Triton compile while capturing:", getattr(fn, "name", fn), kw.get("key"))
            traceback.print_stack(limit=12)
        return False                  # a true value would skip the compile

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        knobs.runtime.jit_cache_hook = cache_hook
    init = getattr(compiler.CompiledKernel, "_init_handles", None)
    if init is not None:
        def init_handles(self, *a, **kw):
            if getattr(self, "module", None) is None and _capturing():
                _say("Triton module load while capturing:", getattr(self, "name", "?"))
            return init(self, *a, **kw)
        compiler.CompiledKernel._init_handles = init_handles


_hook_triton()


def _stream_note(item, when: str) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cur, default = torch.cuda.current_stream(), torch.cuda.default_stream()
        if cur != default:
            _say(f"{when} {item.nodeid}: current stream {cur} is not the default {default}")


def pytest_runtest_setup(item):
    _stream_note(item, "start of")


def pytest_runtest_teardown(item):
    _stream_note(item, "end of")
