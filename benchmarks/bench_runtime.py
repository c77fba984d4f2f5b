"""HiSparse engine decode step vs dense SDPA, and KV memory per sequence (issue 4's benchmark).

    .venv/bin/python benchmarks/bench_runtime.py [--contexts 4096,16384,65536] [--steps 20]
        [--threads 1] [--device cpu] [--clock wall|cpu] [--json]

For each context length, in one run and on the same data (planted workload: a topic whose anchors
the queries attend to, noise elsewhere; every layer gets the same tokens):

- **dense**: a preallocated full KV cache per layer and torch SDPA over all tokens (GQA), one new
  token appended per step;
- **hisparse**: HiSparseEngine (telemetry off, then on) after the same prompt; one decode step =
  ``begin_step``, per layer ``append`` + ``attend``, ``end_step`` (audits included at their
  configured rate, so their cost is in the median only when a step audits).

Reported: median and p90 step time (ms), hot buffer hit rate and tokens swapped in per step, and
memory per sequence by tier and kind (``eng.memory_bytes()``; dense = its K/V cache).
Model shape: --layers 2, --q-heads 8, --kv-heads 2, --head-dim 64, fp32, batch 1; HiSparse
defaults (top_k 2048, window 1024, 16 anchors, hot buffer 4096) with 64-token blocks.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.workloads import PlantedWorkload


def _prompt(wl: PlantedWorkload, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    seg = wl.segment(n, topic="A", anchors=16, margin=min(n // 2, 2048))
    return seg.k[None], seg.v[None]                                  # (1, Hkv, n, D)


def bench_dense(args, k: torch.Tensor, v: torch.Tensor, tokens, queries) -> dict:
    n = k.shape[2]
    cap = n + len(tokens)
    dev = torch.device(args.device)
    kc = [torch.zeros(1, args.kv_heads, cap, args.head_dim, device=dev) for _ in range(args.layers)]
    vc = [torch.zeros_like(t) for t in kc]
    for layer in range(args.layers):
        kc[layer][:, :, :n] = k.to(dev)
        vc[layer][:, :, :n] = v.to(dev)
    times = []
    for i, ((kt, vt), q) in enumerate(zip(tokens, queries)):
        t0 = args.clock()
        pos = n + i
        for layer in range(args.layers):
            kc[layer][:, :, pos:pos + 1] = kt.to(dev)
            vc[layer][:, :, pos:pos + 1] = vt.to(dev)
            torch.nn.functional.scaled_dot_product_attention(
                q.to(dev), kc[layer][:, :, :pos + 1], vc[layer][:, :, :pos + 1], enable_gqa=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(args.clock() - t0)
    nbytes = sum(t[:, :, :n].numel() * t.element_size() for t in kc + vc)
    return {"times": times[args.warmup:], "memory": {"device/data": nbytes}}


def bench_hisparse(args, k, v, tokens, queries, wl, telemetry: bool) -> dict:
    cfg = HiSparseConfig(max_seq_len=k.shape[2] + len(tokens) + 8, cache_block_size=args.block_size,
                         telemetry=telemetry, name="bench-runtime")
    eng = HiSparseEngine(cfg, args.layers, args.q_heads, args.kv_heads, args.head_dim,
                         device=args.device)
    ids = eng.add_sequences(1)
    n = k.shape[2]
    chunk = 4096
    dev = torch.device(args.device)
    k, v = k.to(dev), v.to(dev)
    tokens = [(kt.to(dev), vt.to(dev)) for kt, vt in tokens]
    queries = [q.to(dev) for q in queries]
    qa = torch.stack([wl.topic_query("A") for _ in range(8)], 1)[None].to(dev)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        eng.begin_step()
        for layer in range(args.layers):
            eng.append(layer, ids, k[:, :, lo:hi], v[:, :, lo:hi])
            if hi == n:  # the last prompt queries (for the first probe fit); prefill cost not timed
                eng.attend(layer, ids, qa)
        eng.end_step()
    before = eng.stats
    look0, hit0, swap0 = before.hot_buffer_lookups, before.hot_buffer_hits, before.swap_in_bytes
    times = []
    for i, ((kt, vt), q) in enumerate(zip(tokens, queries)):
        if i == args.warmup:
            st = eng.stats
            look0, hit0, swap0 = st.hot_buffer_lookups, st.hot_buffer_hits, st.swap_in_bytes
        t0 = args.clock()
        eng.begin_step()
        for layer in range(args.layers):
            eng.append(layer, ids, kt, vt)
            eng.attend(layer, ids, q)
        eng.end_step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(args.clock() - t0)
    st = eng.stats
    steps = len(tokens) - args.warmup
    mem = {f"{tier}/{kind}": b for (tier, kind), b in eng.memory_bytes().items()}
    out = {"times": times[args.warmup:], "memory": mem,
           "hit_rate": (st.hot_buffer_hits - hit0) / max(1, st.hot_buffer_lookups - look0),
           "swap_in_bytes_per_step": (st.swap_in_bytes - swap0) / steps,
           "audited_hit_rate": st.anchor_hits / st.anchor_lookups if st.anchor_lookups else float("nan")}
    eng.close()
    return out


def summary(times: list[float]) -> tuple[float, float]:
    s = sorted(times)
    return statistics.median(s) * 1e3, s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: elapsed time; cpu: this thread's CPU time (with --threads 1 and --device cpu, "
                         "steadier than wall time on a machine other processes load)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.clock == "cpu" and (args.device != "cpu" or args.threads != 1):
        ap.error("--clock cpu measures the main thread only: use it with --device cpu --threads 1")
    args.clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for n in [int(x) for x in args.contexts.split(",")]:
        wl = PlantedWorkload(args.kv_heads, args.q_heads, args.head_dim, seed=n)
        k, v = _prompt(wl, n)
        total = args.steps + args.warmup
        tokens = [tuple(t[None] for t in wl.noise(1)) for _ in range(total)]
        queries = [wl.topic_query("A")[None, :, None] for _ in range(total)]
        res = {"context": n, "dense": bench_dense(args, k, v, tokens, queries)}
        res["hisparse"] = bench_hisparse(args, k, v, tokens, queries, wl, telemetry=False)
        res["hisparse_telemetry"] = bench_hisparse(args, k, v, tokens, queries, wl, telemetry=True)
        rows.append(res)
    clock = "CPU" if args.clock is time.thread_time else "wall"
    meta = {"machine": f"{platform.machine()} {torch.get_num_threads()} torch threads, {args.device}, {clock} time",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, default=float))
        return
    print(f"# {meta['machine']}, torch {meta['torch']}, {meta['date']}; L={args.layers} Hq={args.q_heads} "
          f"Hkv={args.kv_heads} D={args.head_dim} fp32, batch 1, {args.steps} steps")
    print("| context | dense step ms (p50/p90) | HiSparse ms, telemetry off | telemetry on | "
          "hot-buffer hit rate | swap-in KiB/step | audited hit rate |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d, h, t = (summary(r[run]["times"]) for run in ("dense", "hisparse", "hisparse_telemetry"))
        hs = r["hisparse"]
        print(f"| {r['context']} | {d[0]:.2f} / {d[1]:.2f} | {h[0]:.2f} / {h[1]:.2f} | {t[0]:.2f} / {t[1]:.2f} | "
              f"{hs['hit_rate']:.3f} | {hs['swap_in_bytes_per_step'] / 1024:.1f} | {hs['audited_hit_rate']:.2f} |")
    print()
    print("| context | dense KV bytes/seq | HiSparse device data | device metadata | host data | host metadata |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        m = r["hisparse"]["memory"]
        print(f"| {r['context']} | {r['dense']['memory']['device/data'] / 2**20:.1f} MiB | "
              f"{m['device/data'] / 2**20:.1f} MiB | {m['device/metadata'] / 2**20:.2f} MiB | "
              f"{m['host/data'] / 2**20:.1f} MiB | {m['host/metadata'] / 2**10:.1f} KiB |")


if __name__ == "__main__":
    main()
