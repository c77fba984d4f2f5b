"""What test_hot_buffer's gpu comparison met (twenty-third session): two engines, decode kernels on
and off, decode graphs on, the same 2,000-token prefill of two sequences and 40 steps, the prefill's
background recalibration landing at step ``--lag``. Prints, per step, whether the last layer's
outputs agree when each step's is copied at once (what run_decode returns now) and when the
buffer HiSparseEngine.attend returned is kept as it is (a decode graph's output buffer: later
steps overwrite it, and a landing that re-captures the graphs leaves each engine's last buffer
holding a different step's output); and whether the anchors agree at the end. Needs a GPU.

    python benchmarks/graph_outputs.py [--lag 8]
"""
from __future__ import annotations

import argparse
import sys

import torch

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.workloads import run_prefill


def _decode(eng, sid, q, k, v):
    """One step, as run_decode, returning attend's own output of the last layer and a copy of it."""
    eng.begin_step()
    for layer in range(eng.num_layers):
        eng.append(layer, sid, k, v)
        out = eng.attend(layer, sid, q)
    eng.end_step()
    return out, out.clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lag", type=int, default=8, help="recalibration_lag: the landing's step (past 40: none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("graph_outputs.py needs a CUDA GPU (decode graphs)", file=sys.stderr)
        return 2
    base = dict(max_seq_len=4096, cache_block_size=32, window_size=64, global_tokens=8, top_k=256, audit_every=0,
                telemetry=False, recalibrate_every=1 << 20, decode_graphs=True, recalibration_lag=args.lag)
    g = torch.Generator().manual_seed(5)
    L, HQ, HKV, D, T = 2, 8, 2, 64, 2000
    k, v, q = (torch.randn(2, h, T, D, generator=g).cuda() for h in (HKV, HKV, HQ))
    steps = [tuple(torch.randn(2, h, 1, D, generator=g).cuda() for h in (HQ, HKV, HKV)) for _ in range(40)]
    runs = []
    for kernels in (True, False):
        eng = HiSparseEngine(HiSparseConfig(**base, decode_kernels=kernels), L, HQ, HKV, D, device="cuda")
        sid = eng.add_sequences(2)
        run_prefill(eng, sid, k, v, q)
        outs = [_decode(eng, sid, *s) for s in steps]
        anchors = [eng.seqs[s].anchors[i].clone() for s in sid for i in range(L)]
        runs.append((outs, anchors, dict(eng.stats.recalibrations)))
    (a, a_anchors, a_recal), (b, b_anchors, b_recal) = runs
    print(f"lag {args.lag}: recalibrations {a_recal} / {b_recal}; anchors agree: "
          f"{all(torch.equal(x, y) for x, y in zip(a_anchors, b_anchors))}")
    for n, ((a_kept, a_copy), (b_kept, b_copy)) in enumerate(zip(a, b)):
        kept = float((a_kept - b_kept).abs().max())
        copied = float((a_copy - b_copy).abs().max())
        if kept or copied:
            print(f"  step {n}: kept buffers apart by {kept:.3f}, copies apart by {copied:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
