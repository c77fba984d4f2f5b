"""Where a decode step whose token completes a quantized block spends its time (issue 21): a
random-weight 32-layer Llama (8 KV heads of 128) decodes B sequences across a 64-token block
boundary with whole-step graphs and a 4-bit host; each step timed with a sync, and a cProfile
of the host side of the boundary step (its seal after the forward included).

    python benchmarks/boundary_profile.py --batch 24
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_integration import make_pair, prompt  # noqa: E402

import hi_sparse as hs  # noqa: E402
from hi_sparse import hf_compat  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prompt", type=int, default=40, help="prompt tokens (the boundary step is position 63)")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, model = make_pair("llama", dtype=torch.bfloat16 if dev == "cuda" else torch.float32, num_hidden_layers=32,
                         hidden_size=1024, intermediate_size=2048, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128)
    model = model.to(dev)
    hs.enable_hisparse_kv_cache(model, name="boundary", max_seq_len=512, block_size=64, window_size=64,
                                global_tokens=8, top_k=128, host_kv_bits=4, telemetry=False)
    ids, mask = prompt(args.batch, args.prompt)
    kw = hf_compat.installed_cache_kwarg()
    times, prof = [], cProfile.Profile()
    with torch.no_grad():
        out = model(ids.to(dev), attention_mask=mask.to(dev), use_cache=True)
        cache, tok = hf_compat.output_cache(out), out.logits[:, -1:].argmax(-1)
        for step in range(args.steps):       # blocks complete at position 63
            pos = args.prompt + step
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if pos == 63:
                prof.enable()
            out = model(tok, **{kw: cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            if dev == "cuda":
                torch.cuda.synchronize()
            if pos == 63:
                prof.disable()
            times.append((pos, round(1e3 * (time.perf_counter() - t0), 2)))
    print("step ms by position:", times, flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
