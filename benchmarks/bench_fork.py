"""Forking one long prompt into many sequences: time and host memory (issue 21, copy on write).

    .venv/bin/python benchmarks/bench_fork.py [--context 131072] [--forks 23] [--layers 1] [--json]

Prefills one sequence of --context tokens (random K/V, Llama-3-8B head shape: 8 KV heads of
128, bf16, 64-token blocks, ``host_kv_bits=4``, a host pool with room for every copy) through
the engine's public API, forks it --forks times (``fork_sequences``, what transformers'
``batch_repeat_interleave`` calls), then decodes --steps tokens in every sequence. Prints the fork
time and the host pool's blocks in use (and their bytes) against one sequence's. Runs against
any revision of ``hi_sparse`` put first on ``PYTHONPATH`` (the copying fork before issue 21, for
the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--forks", type=int, default=23)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="decode steps after the fork (slow on a CPU)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    import hi_sparse as hs

    H, Hq, D, L, bs = 8, 32, 128, args.layers, args.block_size
    n = args.forks + 1
    # a pool with room for n copies (what a copying fork needs); blocks in use say what they hold
    blocks = n * (-(-(args.context + args.steps) // bs) + 1)
    cfg = hs.HiSparseConfig(max_seq_len=args.context + args.steps + bs, cache_block_size=bs, host_kv_bits=4,
                            telemetry=False, audit_every=0, host_pool_blocks=blocks)
    eng = hs.HiSparseEngine(cfg, num_layers=L, num_q_heads=Hq, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16)
    sid = eng.add_sequences(1)[0]
    t0 = time.perf_counter()
    eng.begin_step()
    for layer in range(L):
        for lo in range(0, args.context, 16384):
            hi = min(args.context, lo + 16384)
            k = torch.randn(1, H, hi - lo, D, dtype=torch.bfloat16)
            eng.append(layer, [sid], k, torch.randn_like(k))
    eng.end_step()
    prefill_s = time.perf_counter() - t0
    used_one = eng.pool.num_active
    t0 = time.perf_counter()
    ids = [sid] + eng.fork_sequences(sid, args.forks)
    fork_s = time.perf_counter() - t0
    used_after = eng.pool.num_active
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.begin_step()
        for layer in range(L):
            k = torch.randn(n, H, 1, D, dtype=torch.bfloat16)
            eng.append(layer, ids, k, torch.randn_like(k))
            eng.attend(layer, ids, torch.randn(n, Hq, 1, D, dtype=torch.bfloat16))
        eng.end_step()
    decode_s = (time.perf_counter() - t0) / max(1, args.steps)
    data, meta = eng.host.bytes()
    per_block = (data + meta) / eng.pool.num_blocks                 # host bytes of one block, all layers
    res = {"machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv,
           "torch": torch.__version__, "hi_sparse": os.path.dirname(hs.__file__), "sequences": n,
           "prefill_s": prefill_s, "fork_s": fork_s, "decode_step_s": decode_s,
           "blocks_one_sequence": used_one, "blocks_after_forks": used_after,
           "blocks_after_decode": eng.pool.num_active,
           "host_bytes_one_sequence": used_one * per_block, "host_bytes_all": eng.pool.num_active * per_block,
           "host_ratio_to_one": eng.pool.num_active / used_one}
    if args.json:
        print(json.dumps(res))
    print(f"{n} sequences of {args.context} tokens ({L} layer(s), int4 host pool): prefill {prefill_s:.1f} s, "
          f"fork x{args.forks} {1e3 * fork_s:.1f} ms, decode step {1e3 * decode_s:.0f} ms; host blocks in use "
          f"{used_one} for one sequence, {eng.pool.num_active} for all {n} after {args.steps} steps "
          f"({res['host_ratio_to_one']:.3f}x one sequence, {res['host_bytes_all'] / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
