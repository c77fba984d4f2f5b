"""Prefill through HiSparse against dense, on a random Llama (issue 21: prefill at dense speed).

    .venv/bin/python benchmarks/bench_prefill.py [--tokens 4096] [--layers 4] [--hidden 256]
        [--repeats 3] [--device cpu] [--json]

One forward of --tokens tokens (then one decode step) through a random-weight Llama (--layers
layers, --hidden wide, heads of 64, KV heads a quarter of them, vocabulary 32,000): dense (SDPA
with a DynamicCache) and HiSparse (``enable_hisparse_kv_cache``: 64-token blocks, top_k 2048,
window 1024, telemetry off; the prompt is longer than top_k, so the first recalibration after it
scores anchors and fits every layer's importance probe). Alternating runs, medians. Prints the
prefill time of each and HiSparse's parts: the engine's appends, its prefill attention, and the
end of the step (recalibration: anchor scoring and the probe's fit).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time

import torch
from call_timers import CallTimers


def build_model(layers: int, hidden: int, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 64)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=64,
                      vocab_size=32000, max_position_embeddings=1 << 20)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    import hi_sparse as hs

    dev = torch.device(args.device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    model = build_model(args.layers, args.hidden, args.device, dtype)
    ids = torch.randint(0, 32000, (1, args.tokens), generator=torch.Generator().manual_seed(1)).to(dev)
    times: dict[str, list[float]] = {"dense": [], "hisparse": []}
    parts: list[dict[str, float]] = []
    for _ in range(args.repeats):
        for label in ("dense", "hisparse"):
            timers = CallTimers()
            with torch.no_grad(), contextlib.ExitStack() as stack:
                cache = DynamicCache(config=model.config) if label == "dense" else None
                if label == "hisparse":
                    hs.enable_hisparse_kv_cache(model, max_seq_len=args.tokens + 64, block_size=64, top_k=2048,
                                                window_size=1024, telemetry=False)
                    eng = hs.integration.binding_of(model).engine
                    stack.callback(hs.disable_hisparse_kv_cache, model)
                    stack.enter_context(timers.wrap(eng, "append", "append", sync))
                    stack.enter_context(timers.wrap(eng._prefill, "attend", "prefill attention", sync))
                    stack.enter_context(timers.wrap(eng, "end_step", "end of step (recalibration)", sync))
                    stack.enter_context(timers.wrap(eng._recalibrator, "start", "recalibration", sync))
                sync()
                t0 = time.perf_counter()
                out = model(input_ids=ids, past_key_values=cache, use_cache=True)
                sync()
                times[label].append(time.perf_counter() - t0)
                if label == "hisparse":
                    parts.append(timers.spent)
                    model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                          use_cache=True)   # the step after the prompt decodes sparsely
                del out
    med = {k: statistics.median(v) for k, v in times.items()}
    part = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in parts[0]}
    res = {"machine": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "prefill_s": times, "median_s": med,
           "ratio": med["hisparse"] / med["dense"], "hisparse_parts_s": part}
    if args.json:
        print(json.dumps(res))
    print(f"prefill of {args.tokens} tokens, {args.layers} layers x {args.hidden} ({dev.type}, "
          f"{torch.get_num_threads()} threads): dense {med['dense']:.2f} s, HiSparse {med['hisparse']:.2f} s "
          f"({res['ratio']:.2f}x); HiSparse parts: " + ", ".join(f"{k} {v:.2f} s" for k, v in part.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
