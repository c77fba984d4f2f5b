"""Where a decode step whose token completes a quantized block spends its time (issue 21): a
random-weight 32-layer Llama (8 KV heads of 128) decodes B sequences across a 64-token block
boundary with whole-step graphs and a 4-bit host; each step timed with a sync, and a cProfile
of the host side of the boundary step (its seal after the forward included).

    python benchmarks/boundary_profile.py --batch 24
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats

from decode_run import LLAMA_32_LAYERS, decode, random_llama

import hi_sparse as hs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prompt", type=int, default=40, help="prompt tokens (the boundary step is position 63)")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    model, dev = random_llama(**LLAMA_32_LAYERS)
    hs.enable_hisparse_kv_cache(model, name="boundary", max_seq_len=512, block_size=64, window_size=64,
                                global_tokens=8, top_k=128, host_kv_bits=4, telemetry=False)
    prof = cProfile.Profile()
    # blocks complete at position 63: the host side of that step profiled
    steps = decode(model, dev, args.batch, args.prompt, args.steps,
                   around=lambda pos: prof if pos == 63 else contextlib.nullcontext())
    times = [(pos, round(ms, 2)) for pos, ms in steps]
    print("step ms by position:", times, flush=True)
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    pstats.Stats(prof).sort_stats("cumtime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
