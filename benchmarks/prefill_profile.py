"""Where a HiSparse prefill spends its time beyond dense attention (issue 21, GPU).

One process, the random-weight Llama-3-8B shape of e2e_h200.py (bf16): a warm-up of every
variant at a short prompt (Triton compiles, cuBLAS picks), then each variant's prefill of one
prompt of --context tokens in chunks of --chunk: once in a fresh engine (its host pool grown and
page-locked on the way), then --repeats times in the same engine (the steady state of a server:
freed blocks recycled); then a warm prefill of each --profile variant under torch.profiler: the
runtime's ``hisparse.*`` ranges (runtime/trace.py: host and device time per phase) and the op
tables (written to $OUT). Writes $OUT/prefill_profile.json. Times are to the first token on the
host. The first recalibration follows the runtime's default (on CUDA in the background, not waited
for); variant hisparse-int4-sync runs it in the step (waited for), hisparse-int4-bg in the
background explicitly.

    python benchmarks/prefill_profile.py --context 32768 --chunk 32768
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_h200 import CACHE, build_model, median, output_cache, sync  # noqa: E402


def run_prefill(model, ids: torch.Tensor, chunk: int, cache) -> float:
    """Seconds until the first token is on the host (the prefill's logits read back: what a
    server waits for; a background recalibration still running on a side stream is not waited
    for, and is finished before the next run)."""
    sync("cuda")
    t0 = time.perf_counter()
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            out = model(input_ids=ids[:, start:start + chunk], **{CACHE: cache}, use_cache=True, logits_to_keep=1)
            cache = output_cache(out)
        out.logits[:, -1].argmax(-1).tolist()
    seconds = time.perf_counter() - t0
    sync("cuda")
    return seconds


def main() -> int:
    from transformers import DynamicCache

    import hi_sparse as hs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="dense,hisparse,hisparse-int4")
    ap.add_argument("--profile", default="hisparse,hisparse-int4",
                    help="comma list of variants profiled after the timings ('' = none)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--print-tables", action="store_true", help="print the op tables (always written to $OUT)")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    model = build_model(False, torch.bfloat16, "cuda")
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.context), generator=g).cuda()
    warm = ids[:, :4096]
    bits = {"dense": None, "hisparse": None, "hisparse-int4": 4, "hisparse-int8": 8, "hisparse-auto": "auto",
            "hisparse-seed": "seed", "hisparse-int4-bg": 4, "hisparse-int4-sync": 4}
    results: dict = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                     "torch": torch.__version__, "runs": {}}

    def enable(variant: str) -> None:
        hs.enable_hisparse_kv_cache(model, max_seq_len=args.context + 64, block_size=64, window_size=1024,
                                    top_k=2048, host_kv_bits=bits[variant], telemetry=False, audit_every=0,
                                    background_recalibration=True if variant.endswith("-bg") else
                                    False if variant.endswith("-sync") else None)

    def settle() -> None:
        gc.collect()
        time.sleep(0.3)                          # past recycle_grace_s: the next prefill reuses the blocks

    def timed(variant: str, x: torch.Tensor, warm_runs: int = 0) -> list[float]:
        """Seconds of one prefill in a fresh engine, then of ``warm_runs`` more in the same engine
        (its host pool grown and pinned by the first: the freed blocks are recycled)."""
        if variant == "dense":
            return [run_prefill(model, x, args.chunk, DynamicCache(config=cfg)) for _ in range(1 + warm_runs)]
        enable(variant)
        try:
            out = []
            for _ in range(1 + warm_runs):
                out.append(run_prefill(model, x, args.chunk, None))
                settle()
            return out
        finally:
            hs.disable_hisparse_kv_cache(model)
            torch.cuda.empty_cache()

    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        timed(v, warm)
    for v in variants:
        times = timed(v, ids, args.repeats)
        results["runs"][v] = {"fresh_s": times[0], "warm_s": times[1:], "warm_median_s": median(times[1:])}
        print(json.dumps({"variant": v, "context": args.context, "chunk": args.chunk, "fresh_s": times[0],
                          "warm_s": times[1:]}), flush=True)
    if "dense" in results["runs"]:
        d = results["runs"]["dense"]["warm_median_s"]
        for v, r in results["runs"].items():
            r["ratio_to_dense"] = r["warm_median_s"] / d
            print(f"{v:>14}: warm {r['warm_median_s']:.3f} s ({r['ratio_to_dense']:.2f}x dense), "
                  f"fresh engine {r['fresh_s']:.3f} s", flush=True)
    from torch.profiler import ProfilerActivity, profile

    results["profiles"] = {}
    for variant in [v for v in args.profile.split(",") if v]:
        if variant != "dense":
            enable(variant)
            run_prefill(model, ids, args.chunk, None)    # grows the pool: the profile is of a warm engine
            settle()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds = run_prefill(model, ids, args.chunk, None if variant != "dense" else DynamicCache(config=cfg))
        if variant != "dense":
            hs.disable_hisparse_kv_cache(model)
            torch.cuda.empty_cache()
        ka = prof.key_averages()
        ranges = {}
        for e in ka:
            if e.key.startswith("hisparse."):
                dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
                ranges[e.key] = {"calls": e.count, "host_ms": e.cpu_time_total / 1e3, "device_ms": dev / 1e3}
        results["profiles"][variant] = {"seconds": seconds, "ranges": ranges}
        print(f"\n== {variant} prefill ({seconds:.3f} s under the profiler): hisparse ranges ==")
        for k, r in sorted(ranges.items(), key=lambda kv: -kv[1]["host_ms"]):
            print(f"{k:<34} calls {r['calls']:>5}  host {r['host_ms']:9.1f} ms  device {r['device_ms']:9.1f} ms")
        for key, name in (("device_time_total", "by device time"), ("cpu_time_total", "by host time")):
            try:
                table = ka.table(sort_by=key, row_limit=args.top)
            except (KeyError, AttributeError, RuntimeError):
                table = ka.table(sort_by="cuda_time_total" if key.startswith("device") else key, row_limit=args.top)
            if args.print_tables:
                print(f"\n== {variant} prefill, {name} ==\n{table}", flush=True)
            with open(os.path.join(out_dir, f"prefill_profile_{variant}_{key}.txt"), "w") as f:
                f.write(table)
    with open(os.path.join(out_dir, "prefill_profile.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
