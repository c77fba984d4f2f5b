"""Where a HiSparse decode step spends its device time (issue 21, GPU).

One process, the random-weight Llama-3-8B shape of e2e_h200.py (bf16). First the model without
HiSparse at a short context (dense, DynamicCache, eager): the device time of the weights alone.
Then one prompt of --context tokens through HiSparse (--bits, graphs off so that the profiler
names every kernel launch; --graphs: the whole-step graph replayed, as users run it), a few warm
steps, and --steps steps under torch.profiler: device time per step against the wall time and
the forward call's time (host work, and any device work it waits for), and the kernels by device
time (printed; the full tables written to $OUT). Writes $OUT/decode_profile.json.

--batch N profiles N copy-on-write forks of the prompt decoding together (e2e_h200.py's batch
rows), and --planted P plants the model's heavy hitters and P salient tokens in the prompt, as
e2e_h200.py --planted does (its high-hit-rate workload: the 24 x 128K row is --batch 24
--planted 24).

    python benchmarks/decode_profile.py --context 32768
    python benchmarks/decode_profile.py --context 131072 --batch 24 --planted 24
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_h200 import build_model, decode, output_cache, plant_heavy_hitters, prefill, sync  # noqa: E402


def _device_us(e) -> float:
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)


def profiled(model, cache, first, steps: int, label: str, top: int, out_dir: str, device: str) -> dict:
    """``steps`` decode steps under the profiler: wall and device ms per step, the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    decode(model, cache, first, 3, device)                 # warm (graphs, autotune, workspaces)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    calls: list[float] = []
    with profile(activities=activities) as prof:
        times, _ = decode(model, cache, first, steps, device, host_times=calls)
    ka = prof.key_averages()
    kernels = sorted((e for e in ka if _device_us(e) > 0), key=lambda e: -_device_us(e))
    # the total over the device's own events (kernels, copies): an op's self device time counts
    # its kernels again
    on_device = [e for e in kernels if str(getattr(e, "device_type", "")) != "DeviceType.CPU"]
    total = sum(_device_us(e) for e in on_device) / 1e3 / steps
    wall = 1e3 * sum(times) / steps
    call = 1e3 * sum(calls) / steps
    rows = [{"name": e.key[:90], "calls_per_step": e.count / steps, "device_ms_per_step": _device_us(e) / 1e3 / steps}
            for e in kernels[:top]]
    print(f"\n== {label}: wall {wall:.2f} ms/step (the forward's call {call:.2f}), device (sum of kernels) "
          f"{total:.2f} ms/step ==", flush=True)
    for r in rows:
        print(f"{r['device_ms_per_step']:8.3f} ms  x{r['calls_per_step']:6.1f}  {r['name']}", flush=True)
    try:
        table = ka.table(sort_by="self_device_time_total", row_limit=60)
    except (KeyError, AttributeError, RuntimeError):
        table = ka.table(sort_by="self_cuda_time_total", row_limit=60)
    with open(os.path.join(out_dir, f"decode_profile_{label}.txt"), "w") as f:
        f.write(table)
    return {"wall_ms_per_step": wall, "call_ms_per_step": call, "device_ms_per_step": total, "top": rows}


def main() -> int:
    from transformers import DynamicCache

    import hi_sparse as hs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--bits", default="4", help="host_kv_bits: 4, 8, auto or none")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--batch", type=int, default=1, help="forks of the prompt decoding together")
    ap.add_argument("--planted", type=int, default=0,
                    help="plant heavy hitters and this many salient tokens in the prompt (e2e_h200.py --planted)")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: a smoke run of this script")
    ap.add_argument("--graphs", action="store_true",
                    help='decode_graphs="step" (the default of users): the replayed whole-step graph profiled '
                         "(its kernels as the profiler sees a replay) instead of the kernels launched one by one")
    ap.add_argument("--no-decode-kernels", action="store_true",
                    help="decode_kernels=False: the step's small kernels by their torch references")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    bits = None if args.bits == "none" else args.bits if args.bits == "auto" else int(args.bits)
    device = "cpu" if args.tiny else "cuda"
    model = build_model(args.tiny, torch.float32 if args.tiny else torch.bfloat16, device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=g).to(device)
    results: dict = {"argv": sys.argv, "date": time.strftime("%Y-%m-%d"),
                     "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "runs": {}}
    with torch.no_grad():
        out, cache = prefill(model, ids[:, :256], DynamicCache(config=model.config), 256)
        first = out.logits[:, -1:].argmax(-1)
        results["runs"]["dense-256"] = profiled(model, cache, first, args.steps, "dense-256", args.top, out_dir,
                                                 device)
        del out, cache
        window, block = (64, 16) if args.tiny else (1024, 64)
        if args.planted:
            # one salient token in each of `planted` blocks, spread over the prompt before its window
            salient = plant_heavy_hitters(model)
            picked = torch.randperm(max(1, (args.context - window) // block), generator=g)[:args.planted]
            ids[0, picked.to(device) * block + block // 2] = salient
        extra = 64
        # copy-on-write forks: the prompt's blocks once, each fork's own from its last one on
        pool = -(-args.context // block) + args.batch * (-(-extra // block) + 1) if args.batch > 1 else None
        hs.enable_hisparse_kv_cache(model, max_seq_len=args.context + extra, block_size=block, window_size=window,
                                    top_k=2 * window, host_kv_bits=bits, telemetry=False, audit_every=0,
                                    decode_graphs="step" if args.graphs else False,
                                    decode_kernels=not args.no_decode_kernels,
                                    host_pool_blocks=pool)
        out, cache = prefill(model, ids, None, 32768)
        sync(device)
        first = out.logits[:, -1:].argmax(-1)
        cache = output_cache(out)
        del out
        if args.batch > 1:
            cache.batch_repeat_interleave(args.batch)
            first = first.repeat_interleave(args.batch, 0)
        label = (f"hisparse-{args.bits}-{args.context}" + (f"x{args.batch}" if args.batch > 1 else "")
                 + ("-planted" if args.planted else "") + ("-torch" if args.no_decode_kernels else "")
                 + ("-graphs" if args.graphs else ""))
        results["runs"][label] = profiled(model, cache, first, args.steps, label, args.top, out_dir, device)
    with open(os.path.join(out_dir, "decode_profile.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
