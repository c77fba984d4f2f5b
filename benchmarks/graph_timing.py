"""Kernel times from CUDA graphs: the decode step runs in one, so its kernels are timed there
(without their launches' host cost). Shared by the bench_*.py kernel benchmarks."""
from __future__ import annotations

import sys

import torch


def missing_gpu_or_triton(script: str) -> bool:
    """True (after saying why on stderr) when there is no CUDA GPU to time graphs on, or no Triton
    for the kernel a benchmark times against."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (it times CUDA graphs); none is visible here", file=sys.stderr)
        return True
    from hi_sparse.kernels._dispatch import triton_available
    if not triton_available():
        print(f"{script} needs Triton (pip install triton, the gpu extra)", file=sys.stderr)
        return True
    return False


def graph_us(fn, reps: int, replays: int = 1) -> float:
    """Microseconds per call of ``fn``, captured ``reps`` times in one CUDA graph (after a warm-up
    that compiles its kernels) and replayed: the fastest of ``replays`` timed replays."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / reps)
    return best
