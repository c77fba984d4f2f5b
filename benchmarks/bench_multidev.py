"""One HiSparse engine over several GPUs: layers on one device vs split over two (issue 9).

    python benchmarks/bench_multidev.py [--devices cuda:0,cuda:1] [--contexts 4096,32768]
        [--layers 8] [--steps 32] [--model-layers 8] [--prompt 2048] [--new-tokens 32] [--json]

1. **engine**: the planted workload of bench_runtime (every layer gets the same tokens), decoded
   with every layer on the first device and again with the layers split over ``--devices`` in
   contiguous runs (``hi_sparse.multigpu.layer_split``). Reported: p50/p90 step ms, hot-buffer
   hit rate, hot-buffer bytes per device, and the largest difference between the two runs'
   outputs (same kernels on other GPUs: expected 0).
2. **model**: a random-weight Llama (``--model-layers``, hidden 1024, 16 query / 4 KV heads,
   bf16 on CUDA) split with ``hi_sparse.split_layers``; greedy ``generate`` of ``--new-tokens``
   after a ``--prompt``-token prompt, without and with HiSparse at full budget (top_k covers the
   context, so the tokens must match). Reported: tokens/s of each and whether the tokens match.

``--devices cpu,cpu`` runs the same code on the CPU (a smoke test; tiny default sizes there).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hi_sparse as hs
from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.multigpu import layer_split
from hi_sparse.workloads import PlantedWorkload


def _sync(devices) -> None:
    for d in {torch.device(x) for x in devices}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _pct(times: list[float]) -> tuple[float, float]:
    s = sorted(times)
    return s[len(s) // 2] * 1e3, s[min(len(s) - 1, int(0.9 * len(s)))] * 1e3


def bench_engine(args, n: int, layer_devices: list[str]) -> dict:
    wl = PlantedWorkload(args.kv_heads, args.q_heads, args.head_dim, seed=n)
    seg = wl.segment(n, topic="A", anchors=16, margin=min(n // 2, 2048))
    first = torch.device(layer_devices[0])
    k, v = seg.k[None].to(first, args.dtype), seg.v[None].to(first, args.dtype)
    total = args.steps + args.warmup
    tokens = [tuple(t[None].to(first, args.dtype) for t in wl.noise(1)) for _ in range(total)]
    queries = [wl.topic_query("A")[None, :, None].to(first, args.dtype) for _ in range(total)]
    qa = torch.stack([wl.topic_query("A") for _ in range(8)], 1)[None].to(first, args.dtype)
    cfg = HiSparseConfig(max_seq_len=n + total + 8, cache_block_size=args.block_size, top_k=args.top_k,
                         window_size=min(1024, args.top_k // 2), telemetry=False, host_kv_bits=args.host_kv_bits,
                         metadata_device=args.metadata_device)
    eng = HiSparseEngine(cfg, args.layers, args.q_heads, args.kv_heads, args.head_dim, device=first,
                         dtype=args.dtype, layer_devices=layer_devices)
    ids = eng.add_sequences(1)
    for lo in range(0, n, 4096):
        hi = min(n, lo + 4096)
        eng.begin_step()
        for layer in range(args.layers):
            eng.append(layer, ids, k[:, :, lo:hi], v[:, :, lo:hi])
            if hi == n:
                eng.attend(layer, ids, qa)
        eng.end_step()
    times, outs = [], []
    for i, ((kt, vt), q) in enumerate(zip(tokens, queries)):
        if i == args.warmup:
            st = eng.stats
            look0, hit0 = st.hot_buffer_lookups, st.hot_buffer_hits
        _sync(layer_devices)
        t0 = time.perf_counter()
        eng.begin_step()
        for layer in range(args.layers):
            eng.append(layer, ids, kt, vt)
            out = eng.attend(layer, ids, q)
        eng.end_step()
        _sync(layer_devices)
        times.append(time.perf_counter() - t0)
        outs.append(out.float().cpu())
    st = eng.stats
    per_device: dict[str, int] = {}
    for t in eng.k_hot + eng.v_hot:
        per_device[str(t.device)] = per_device.get(str(t.device), 0) + t.numel() * t.element_size()
    eng.close()
    return {"times": times[args.warmup:], "outs": outs,
            "hit_rate": (st.hot_buffer_hits - hit0) / max(1, st.hot_buffer_lookups - look0),
            "hot_bytes": per_device}


def bench_model(args, devices: list[str]) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    cuda = torch.device(devices[0]).type == "cuda"
    kw = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
              head_dim=64) if cuda else dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16)
    cfg = LlamaConfig(num_hidden_layers=args.model_layers, vocab_size=32000 if cuda else 128,
                      max_position_embeddings=args.prompt + args.new_tokens + 8, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    dtype = torch.bfloat16 if cuda else torch.float32
    results = {}
    ids = torch.randint(3, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(devices[0])
    for name in ("dense", "hisparse"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dtype).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        hs.split_layers(model, devices)
        if name == "hisparse":
            ctx = args.prompt + args.new_tokens + 8
            hs.enable_hisparse_kv_cache(model, max_seq_len=ctx, block_size=64, window_size=64, global_tokens=16,
                                        top_k=ctx, name="bench-multidev")
        with torch.no_grad():
            model.generate(input_ids=ids[:, :64], max_new_tokens=2, do_sample=False)  # warm-up (compile)
            _sync(devices)
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, max_new_tokens=args.new_tokens, do_sample=False)
            _sync(devices)
        results[name] = {"seconds": time.perf_counter() - t0, "tokens": out[0, args.prompt:].tolist()}
        if name == "hisparse":
            hs.disable_hisparse_kv_cache(model)
        del model
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    ap.add_argument("--contexts", default=None, help="default 4096,32768 (CUDA) or 512 (CPU)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2048)
    ap.add_argument("--host-kv-bits", default="auto")
    ap.add_argument("--metadata-device", default="device")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--model-layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    devices = args.devices.split(",")
    cuda = torch.device(devices[0]).type == "cuda"
    if cuda and torch.cuda.device_count() < len({d for d in devices}):
        raise SystemExit(f"--devices {args.devices} needs {len(set(devices))} GPUs; this machine has "
                         f"{torch.cuda.device_count()}: run it on a 2-GPU machine or pass fewer devices")
    if not cuda:  # smoke-test sizes
        args.q_heads, args.kv_heads, args.head_dim, args.top_k = 4, 2, 32, 128
        args.layers, args.steps, args.prompt, args.new_tokens = min(args.layers, 4), 6, 96, 6
        args.model_layers = min(args.model_layers, 4)
    args.dtype = torch.bfloat16 if cuda else torch.float32
    contexts = [int(x) for x in (args.contexts or ("4096,32768" if cuda else "512")).split(",")]
    split = [devices[i] for i in layer_split(args.layers, len(devices))]
    rows = []
    for n in contexts:
        one = bench_engine(args, n, [devices[0]] * args.layers)
        two = bench_engine(args, n, split)
        diff = max(float((a - b).abs().max()) for a, b in zip(one["outs"], two["outs"]))
        rows.append({"context": n, "one": _pct(one["times"]), "split": _pct(two["times"]),
                     "hit_one": one["hit_rate"], "hit_split": two["hit_rate"], "max_abs_diff": diff,
                     "hot_bytes_split": two["hot_bytes"]})
    model = bench_model(args, devices)
    d, h = model["dense"], model["hisparse"]
    report = {"devices": devices, "engine": rows,
              "model": {"layers": args.model_layers, "prompt": args.prompt, "new_tokens": args.new_tokens,
                        "dense_tok_s": args.new_tokens / d["seconds"], "hisparse_tok_s": args.new_tokens / h["seconds"],
                        "tokens_match": d["tokens"] == h["tokens"],
                        "agreement": sum(a == b for a, b in zip(d["tokens"], h["tokens"])) / args.new_tokens}}
    if args.json:
        print(json.dumps(report))
        return
    print(f"# engine: L={args.layers} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}, "
          f"top_k {args.top_k}, host_kv_bits {args.host_kv_bits}, metadata {args.metadata_device}; "
          f"split {split}")
    print("| context | one device ms (p50/p90) | split ms (p50/p90) | hit rate one / split | "
          "max |out diff| | hot-buffer MiB per device (split) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        per = ", ".join(f"{k}: {b / 2**20:.0f}" for k, b in r["hot_bytes_split"].items())
        print(f"| {r['context']} | {r['one'][0]:.2f} / {r['one'][1]:.2f} | {r['split'][0]:.2f} / "
              f"{r['split'][1]:.2f} | {r['hit_one']:.3f} / {r['hit_split']:.3f} | {r['max_abs_diff']:.2e} | {per} |")
    m = report["model"]
    print(f"\n# model: random Llama, {m['layers']} layers split over {devices}, prompt {m['prompt']}, "
          f"{m['new_tokens']} new tokens (greedy, full budget)")
    print(f"dense {m['dense_tok_s']:.1f} tok/s, HiSparse {m['hisparse_tok_s']:.1f} tok/s, "
          f"tokens match: {m['tokens_match']} (agreement {m['agreement']:.2f})")


if __name__ == "__main__":
    main()
