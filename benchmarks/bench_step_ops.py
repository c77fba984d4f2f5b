"""Kernels a HiSparse decode step launches per layer: the count the whole-step graph replays.

On the H200 (docs/BENCHMARKS.md, issue 21) a replayed 32K decode step is device-bound by the
HiSparse step's own small kernels (~0.72 ms per layer: a few hundred launches of 1-3 us each), so
their number is what a faster step removes. This counts the aten operations that run a kernel
(views, empty allocations and metadata ops excluded) inside the decode step's two bodies,
``decode.append_body`` and ``decode.attend_body``, per layer and step, on the CPU reference path
(a few parts that run one Triton kernel on a GPU, such as the attention and the swap-in, count
as their reference ops here), with the configuration of e2e_h200.py: top_k 2048, window 1024,
64-token blocks, 4-bit host blocks.

    python benchmarks/bench_step_ops.py [--context 32768] [--steps 4] [--top 25] [--triton [--no-decode-kernels]]

--triton counts the GPU path instead: the Triton kernels run in the interpreter (set before
anything imports Triton), each launch one kernel, the aten operations inside it not counted.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

if "--triton" in sys.argv:                     # before any Triton import: the GPU path on a CPU
    os.environ.update(TRITON_INTERPRET="1", HISPARSE_FORCE_TRITON="1")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hi_sparse import decode  # noqa: E402
from hi_sparse.config import HiSparseConfig  # noqa: E402
from hi_sparse.engine import HiSparseEngine  # noqa: E402
from hi_sparse.workloads import run_decode, run_prefill  # noqa: E402

# operations that launch no kernel: views, allocation without a fill, metadata
_FREE = {"view", "_unsafe_view", "slice", "select", "expand", "t", "transpose", "permute", "unsqueeze",
         "squeeze", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "narrow",
         "diagonal", "unfold", "lift_fresh", "_reshape_alias", "empty", "empty_like", "empty_strided",
         "new_empty", "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "is_nonzero",
         "_local_scalar_dense", "resize_", "set_", "view_as_real", "view_as_complex", "is_pinned",
         "scalar_tensor"}   # a Python number wrapped for an op: a host value, no kernel
_OWN = (os.path.dirname(decode.__file__), os.path.dirname(os.path.dirname(decode.__file__)) + os.sep + "kernels")


class Count(TorchDispatchMode):
    launching = False                          # inside an interpreted Triton launch: one kernel

    def __init__(self) -> None:
        super().__init__()
        self.by_op: collections.Counter = collections.Counter()
        self.by_function: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in _FREE and not Count.launching:
            self.by_op[name] += 1
            self.by_function[_caller()] += 1
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """The innermost runtime or kernels function on the stack (module.function)."""
    f = sys._getframe(2)
    while f is not None:
        path = os.path.realpath(f.f_code.co_filename)
        if path.startswith(_OWN):
            return f"{os.path.basename(path)[:-3]}.{f.f_code.co_name}"
        f = f.f_back
    return "?"


def count_triton_launches(counts: dict) -> None:
    """Count each interpreted Triton launch as one kernel (named after the kernel)."""
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        if warmup or Count.launching:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        for c in counts.values():
            if c.active:
                c.by_op[f"triton:{self.fn.__name__}"] += 1
                c.by_function[_caller()] += 1
        Count.launching = True
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            Count.launching = False

    interpreter.InterpretedFunction.run = counted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--bits", default="4", help="host_kv_bits: 4, 8 or none")
    ap.add_argument("--triton", action="store_true", help="count the GPU path (Triton interpreter)")
    ap.add_argument("--no-decode-kernels", action="store_true",
                    help="with --triton: decode_kernels=False, the torch references of the step's small kernels")
    args = ap.parse_args()
    torch.manual_seed(0)
    L, HQ, HKV, D = 1, 8, 2, 32
    bits = None if args.bits == "none" else int(args.bits)
    cfg = HiSparseConfig(max_seq_len=args.context + args.steps + 64, cache_block_size=64, window_size=1024,
                         top_k=2048, global_tokens=16, host_kv_bits=bits, telemetry=False, audit_every=0,
                         recalibrate_every=1 << 30, decode_kernels=not args.no_decode_kernels)
    eng = HiSparseEngine(cfg, L, HQ, HKV, D)
    sid = eng.add_sequences(1)
    T = args.context
    run_prefill(eng, sid, torch.randn(1, HKV, T, D), torch.randn(1, HKV, T, D), torch.randn(1, HQ, T, D))
    counts = {"append": Count(), "attend": Count()}
    bodies = {"append": decode.append_body, "attend": decode.attend_body}

    for c in counts.values():
        c.active = False
    if args.triton:
        count_triton_launches(counts)

    def counted(name):
        def body(*a, **kw):
            counts[name].active = True
            try:
                with counts[name]:
                    return bodies[name](*a, **kw)
            finally:
                counts[name].active = False
        return body

    q, k, v = torch.randn(1, HQ, 1, D), torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D)
    run_decode(eng, sid, q, k, v)                               # warm
    decode.append_body, decode.attend_body = counted("append"), counted("attend")
    try:
        for _ in range(args.steps):
            run_decode(eng, sid, q, k, v)
    finally:
        decode.append_body, decode.attend_body = bodies["append"], bodies["attend"]
    per = args.steps * L
    total = 0.0
    for name, c in counts.items():
        n = sum(c.by_op.values()) / per
        total += n
        print(f"{name}: {n:.1f} kernel ops per layer and step")
    print(f"both: {total:.1f}\n\n| op | per layer and step |\n|---|---:|")
    both = counts["append"].by_op + counts["attend"].by_op
    for op, n in both.most_common(args.top):
        print(f"| {op} | {n / per:.1f} |")
    print("\n| function | per layer and step |\n|---|---:|")
    funcs = counts["append"].by_function + counts["attend"].by_function
    for fn, n in funcs.most_common(args.top):
        print(f"| {fn} | {n / per:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
