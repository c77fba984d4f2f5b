"""Does a probe fit with TF32 dots (the GPU's fit kernel, kernels/probe.py fit_grads) learn what the
fp32 fit learns? On the CPU: the torch ops of the fit's gradients with their dots' inputs rounded
to TF32 (10 mantissa bits, to nearest even) against the same ops in fp32, 100 Adam steps, on
random keys and targets (nothing to learn: the runs drift apart) and on planted anchors (keys of
2 % of the tokens pushed along one direction, their targets 0.5-1): final losses, and the
probabilities the fitted probes give unseen keys of both kinds.

    python benchmarks/fit_tf32.py [--probes 4] [--rows 16384]
"""
from __future__ import annotations

import argparse

import torch

import hi_sparse.probe as probe_module
from hi_sparse.kernels.probe import reference_fit_grads
from hi_sparse.probe import ImportanceProbe, fit_params, write_params


def tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to TF32's 10 mantissa bits, to nearest even (finite inputs)."""
    b = t.contiguous().view(torch.int32)
    return (((b + 0x0FFF + ((b >> 13) & 1)) >> 13) << 13).view(torch.float32)


def tf32_grads(*args, want_z=True):
    """reference_fit_grads with its two dots' inputs in TF32, as the kernel's tensor-core dots."""
    return reference_fit_grads(*args, want_z=want_z, dots_in=tf32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probes", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    P, N, D = args.probes, args.rows, args.dim
    g = torch.Generator().manual_seed(1)
    u = torch.randn(D, generator=g)
    u /= u.norm()
    test = torch.randn(4000, D, generator=torch.Generator().manual_seed(7))
    test[:80] += 6 * u
    for case in ("random", "planted"):
        data = []
        for _ in range(P):
            keys = torch.randn(N, D, generator=g)
            if case == "random":
                data.append((keys.half(), torch.rand(N, generator=g) ** 8))
                continue
            heavy = torch.rand(N, generator=g) < 0.02
            keys[heavy] += 6 * u
            data.append((keys.half(), heavy.float() * torch.rand(N, generator=g).clamp_min(0.5)))
        ends = {}
        for dots, grads in (("fp32", reference_fit_grads), ("tf32", tf32_grads)):
            probe_module.fit_grads = grads
            probes = [ImportanceProbe(D, seed=i) for i in range(P)]
            with torch.no_grad():
                params, losses = fit_params(probes, data)
                write_params(probes, params)
            p = torch.stack([probe.predict(test) for probe in probes])
            ends[dots] = losses, p
            print(f"{case}, {dots} dots: losses {[round(v, 5) for v in losses.tolist()]}, mean probability "
                  f"of planted keys {float(p[:, :80].mean()):.4f}, of the others {float(p[:, 80:].mean()):.5f}")
        (a, pa), (b, pb) = ends["fp32"], ends["tf32"]
        print(f"{case}: losses apart {float(((a - b).abs() / b.abs()).max()):.1e}, "
              f"probabilities apart {float((pa - pb).abs().max()):.3f} at most")


if __name__ == "__main__":
    main()
