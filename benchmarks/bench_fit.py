"""A probe fit on a GPU: one iteration's gradients as the torch ops (about twenty passes over the
(P, N, hidden) activations) against the one-launch Triton kernel (kernels/probe.py fit_grads), and
a whole fit (runtime/probe.fit_params, FIT_STEPS Adam iterations) either way.

P probes (one a layer: 32 for the Llama-3-8B shape of stall_profile.py), N training rows each (a
recalibration's FIT_ROWS is 16,384), keys of D = 128, the probe's hidden width. The gradient times
are of CUDA graphs (graph_timing.py); GB/s counts the keys, targets and weights read once. The
whole fit is timed from its first launch to its last kernel's end.

With --shares, a decode step's stand-in (a CUDA graph of 1,200 small kernels, ~4 ms like the
stall profile's step, replayed on a high-priority stream) is timed alone and with fit iterations
running beside it on a low-priority stream, the fit's launch holding all multiprocessors (None)
or at most a share of them (kernels/_probe_triton.py FIT_SM_SHARE): how much a background fit
slows a step, and what the share costs the fit.

    python benchmarks/bench_fit.py [--probes 32] [--rows 16384,4096] [--dim 128] [--tiles ...]
        [--shares 0.25,0.5,0.75]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from graph_timing import graph_us, missing_gpu_or_triton


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _whole_fit_ms(probes, data, grads_fn) -> tuple[float, list[float]]:
    import hi_sparse.probe as probe_module
    kept = probe_module.fit_grads
    probe_module.fit_grads = grads_fn
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, losses = probe_module.fit_params(probes, data)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0), losses.tolist()
    finally:
        probe_module.fit_grads = kept


def _kernel_at(tile: str, call, reps: int, want: list, whole, torch_loss: list[float]) -> None:
    """The kernel's time at another tile of rows, warp count and dot precision (kernels/_probe_triton.py
    FIT_TILE, FIT_WARPS, FIT_DOTS), its error against the torch ops, a whole fit's time and how far
    its losses end from the torch fit's."""
    from hi_sparse.kernels import _probe_triton as module
    kept = module.FIT_TILE, module.FIT_WARPS, module.FIT_DOTS
    rows, warps, *dots = tile.split("x")
    module.FIT_TILE, module.FIT_WARPS, module.FIT_DOTS = int(rows), int(warps), (dots or ["tf32"])[0]
    try:
        with torch.no_grad():
            us = graph_us(call, reps, 5)
            err = max(_rel(a, b) for a, b in zip(call()[0], want))
        whole()
        ms, losses = whole()
        apart = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, torch_loss))
        print(f"  tile {tile}: {us:.0f} us, rel. error {err:.1e}; whole fit {ms:.1f} ms, losses apart {apart:.1e}",
              flush=True)
    finally:
        module.FIT_TILE, module.FIT_WARPS, module.FIT_DOTS = kept


def _beside(call, shares: list[float | None], replays: int = 20) -> None:
    """A step's stand-in replayed alone and beside the fit's iterations, per share of the SMs."""
    from hi_sparse.kernels import _probe_triton as module
    high, low = torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=0)
    buf = torch.zeros(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(high):
        for _ in range(3):
            buf.mul_(0.5).add_(1.0)
        with torch.cuda.graph(graph, stream=high):
            for _ in range(600):
                buf.mul_(0.5).add_(1.0)
    torch.cuda.synchronize()

    def steps() -> list[float]:
        out = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(high):
                a.record()
                graph.replay()
                b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        return sorted(out)

    alone = steps()[replays // 2]
    print(f"  a step's stand-in (1,200 kernels) alone: median {alone:.2f} ms")
    kept = module.FIT_SM_SHARE
    try:
        for share in shares:
            module.FIT_SM_SHARE = share
            with torch.no_grad(), torch.cuda.stream(low):
                call()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    call()
                torch.cuda.synchronize()
                it_us = (time.perf_counter() - t0) / 10 * 1e6
                for _ in range(int(replays * alone * 1e3 / it_us) * 2 + 10):   # outlasting the replays
                    call()
            beside = steps()
            torch.cuda.synchronize()
            med = beside[replays // 2]
            print(f"  beside the fit at share {share}: step median {med:.2f} ms ({med / alone:.2f}x), slowest "
                  f"{beside[-1]:.2f} ms; a fit iteration {it_us:.0f} us alone", flush=True)
    finally:
        module.FIT_SM_SHARE = kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=32)
    ap.add_argument("--rows", default="16384,4096")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiles", default="",
                    help="also time the kernel at these TILExWARPS[xDOTS], e.g. 32x4,64x8,32x8xieee")
    ap.add_argument("--shares", default="",
                    help="time a step's stand-in beside the fit holding these shares of the SMs, e.g. 0.25,0.5,1.0")
    args = ap.parse_args()
    if missing_gpu_or_triton("bench_fit.py"):
        return 2
    from hi_sparse.kernels.probe import fit_grads, reference_fit_grads
    from hi_sparse.probe import ImportanceProbe

    P, D = args.probes, args.dim
    probes = [ImportanceProbe(D, seed=i).cuda() for i in range(P)]
    HID = probes[0].fc1.out_features
    print(f"{torch.cuda.get_device_name()}, {P} probes, keys of {D}, hidden {HID}")
    print("| rows | torch grads us | kernel grads us | speed-up | kernel GB/s | rel. error | "
          "whole fit torch ms | whole fit kernel ms | losses apart |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for N in [int(v) for v in args.rows.split(",")]:
        keys = [torch.randn(N, D, generator=g).half() for _ in range(P)]
        targets = [torch.rand(N, generator=g) ** 8 for _ in range(P)]
        x = torch.stack(keys).float().cuda()
        y = torch.stack(targets).cuda()
        wn = torch.full((P, N), 1.0 / N, device="cuda")
        params = [torch.stack([f(p) for p in probes]).detach() for f in (
            lambda p: p.fc1.weight.T, lambda p: p.fc1.bias, lambda p: p.fc2.weight[0], lambda p: p.fc2.bias[0])]
        with torch.no_grad():
            ref_us = graph_us(lambda: reference_fit_grads(x, y, wn, *params), args.reps, 5)
            ker_us = graph_us(lambda: fit_grads(x, y, wn, *params, want_z=False), args.reps, 5)
            got, _ = fit_grads(x, y, wn, *params, want_z=False)
            want, _ = reference_fit_grads(x, y, wn, *params)
        err = max(_rel(a, b) for a, b in zip(got, want))
        gbs = (x.numel() + 2 * y.numel()) * 4 / (ker_us * 1e-6) / 1e9
        data = [(k.cuda(), t.cuda()) for k, t in zip(keys, targets)]
        _whole_fit_ms(probes, data, fit_grads)                             # warm-up (compiles)
        torch_ms, torch_loss = _whole_fit_ms(probes, data, reference_fit_grads)
        kernel_ms, kernel_loss = _whole_fit_ms(probes, data, fit_grads)
        apart = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(kernel_loss, torch_loss))
        print(f"| {N} | {ref_us:.0f} | {ker_us:.0f} | {ref_us / ker_us:.1f}x | {gbs:.0f} | {err:.1e} | "
              f"{torch_ms:.1f} | {kernel_ms:.1f} | {apart:.1e} |", flush=True)
        for tile in filter(None, args.tiles.split(",")):
            _kernel_at(tile, lambda: fit_grads(x, y, wn, *params, want_z=False), args.reps, want,
                       lambda: _whole_fit_ms(probes, data, fit_grads), torch_loss)
        if args.shares:
            _beside(lambda: fit_grads(x, y, wn, *params, want_z=False),
                    [None] + [float(v) for v in args.shares.split(",")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
