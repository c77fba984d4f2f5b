"""Which decode steps stall, and what they cost over a long decode (issue 21): a random-weight
32-layer Llama (8 KV heads of 128, the shape of boundary_profile.py) decodes B sequences for
many steps with whole-step graphs; every step is timed with a sync. Prints the median step, each
step over --over times the median with its position and what it crossed (a completed host block,
a change of the graph's block-count bucket), and the share of the decode's time those steps
added over the median.

    python benchmarks/stall_profile.py --batch 1 --prompt 1000 --steps 800
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_integration import make_pair, prompt  # noqa: E402

import hi_sparse as hs  # noqa: E402
from hi_sparse import hf_compat  # noqa: E402
from hi_sparse.decode import bucket  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--bits", default="4", help="host_kv_bits: none, 4, 8 or auto")
    ap.add_argument("--over", type=float, default=1.5, help="a stall: a step over this times the median")
    args = ap.parse_args()
    bits = None if args.bits == "none" else args.bits if args.bits == "auto" else int(args.bits)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, model = make_pair("llama", dtype=torch.bfloat16 if dev == "cuda" else torch.float32, num_hidden_layers=32,
                         hidden_size=1024, intermediate_size=2048, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128)
    model = model.to(dev)
    block = 64
    hs.enable_hisparse_kv_cache(model, name="stalls", max_seq_len=args.max_seq_len, block_size=block, window_size=64,
                                global_tokens=8, top_k=128, host_kv_bits=bits, telemetry=False)
    ids, mask = prompt(args.batch, args.prompt)
    kw = hf_compat.installed_cache_kwarg()
    engine = hs.integration.binding_of(model).engine
    times: list[tuple[int, float]] = []
    recal_at: set[int] = set()
    with torch.no_grad():
        out = model(ids.to(dev), attention_mask=mask.to(dev), use_cache=True)
        cache, tok = hf_compat.output_cache(out), out.logits[:, -1:].argmax(-1)
        for step in range(args.steps):
            pos = args.prompt + step
            if dev == "cuda":
                torch.cuda.synchronize()
            recals = sum(engine.stats.recalibrations.values())
            t0 = time.perf_counter()
            out = model(tok, **{kw: cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append((pos, 1e3 * (time.perf_counter() - t0)))
            if sum(engine.stats.recalibrations.values()) != recals:
                recal_at.add(pos)
    steady = [t for _, t in times[2:]]           # the first two: the eager warm-up and the capture
    med = statistics.median(steady)
    print(f"{dev}, batch {args.batch}, prompt {args.prompt}, {args.steps} steps, host_kv_bits {args.bits}: "
          f"median step {med:.2f} ms", flush=True)
    extra = 0.0
    for pos, t in times[2:]:
        if t <= args.over * med:
            continue
        extra += t - med
        what = []
        if pos % block == block - 1:
            what.append("completes a block")
        blocks_before, blocks_now = -(-pos // block), -(-(pos + 1) // block)
        if bucket(max(blocks_now, 1)) != bucket(max(blocks_before, 1)):
            what.append(f"block bucket {bucket(max(blocks_before, 1))} -> {bucket(blocks_now)}")
        if pos in recal_at:
            what.append("a recalibration")
        print(f"  position {pos}: {t:.1f} ms ({t / med:.1f}x) {', '.join(what) or ''}")
    total = sum(steady)
    print(f"stalls added {extra:.1f} ms over {len(steady)} steps: {100 * extra / total:.1f} % of the decode's "
          f"{total:.0f} ms; {len(steady) / total * 1e3 * args.batch:.0f} tok/s against "
          f"{args.batch / med * 1e3:.0f} at the median")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
