"""The host ops of a capture ahead's staging (Decoder.later: every layer's banks and token map made
for the coming key's growth), counted with torch.profiler on the CPU: one torch.full a tensor, or
with row_bank.fills_together the fills grouped by dtype and value. On a GPU each fill is a launch.

    python benchmarks/count_staging_ops.py [--layers 32]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.row_bank import fills_together
from hi_sparse.workloads import run_prefill

OPS = ("aten::full", "aten::fill_", "aten::empty", "aten::_foreach_zero_", "aten::_foreach_add_")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1000, help="tokens prefilled; the growth staged is to 1,025")
    args = ap.parse_args()
    for together in (False, True):
        cfg = HiSparseConfig(max_seq_len=4096, cache_block_size=64, window_size=64, global_tokens=8, top_k=128,
                             telemetry=False, host_kv_bits=4, background_recalibration=False,
                             recalibrate_every=10**6)
        engine = HiSparseEngine(cfg, args.layers, 4, 2, 16, device="cpu")
        ids = engine.add_sequences(1)
        g = torch.Generator().manual_seed(0)
        k, v, q = (torch.randn(1, h, args.prompt, 16, generator=g) for h in (2, 2, 4))
        run_prefill(engine, ids, k, v, q)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with fills_together() if together else contextlib.nullcontext():
                for rows in engine._decoder.layers:
                    rows.make_room(1025, cfg, staged=True)
        counts = {e.key: e.count for e in prof.key_averages() if e.key in OPS}
        print(f"{args.layers} layers, {'fills together' if together else 'one torch.full a tensor'}: "
              + ", ".join(f"{n} {op}" for op, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
