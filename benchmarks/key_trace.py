"""What in a whole-step graph's key changes as a sequence decodes (issue 21's stalls): a small
random-weight Llama decodes from a --prompt-token context, and after every step each buffer of
layer 0 that a captured step's key names (its bounds bank, hot rows, hot buffer, host pool) is
compared with the step before; a changed address or shape is printed with the step graphs'
counts (eager, captured, replayed), so the step that re-captures can be matched to what moved.

    python benchmarks/key_trace.py --prompt 1000 --steps 140

On the CPU (no graphs) the buffers grow geometrically: over 300 steps from 1,000 tokens they
moved once, at 1,024 tokens. benchmarks/stall_profile.py on the H200 found an eager step and a
capture after every completed block at this context; this names what moved there.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_integration import make_pair, prompt  # noqa: E402

import hi_sparse as hs  # noqa: E402
from hi_sparse import hf_compat  # noqa: E402


def keyed_buffers(decoder, layer: int = 0) -> dict[str, object]:
    """Name -> (address, shape) of every buffer a step key names at ``layer``, and the probe state."""
    rows = decoder.layers[layer]
    names = [f"bank.{k}" for k in rows.bank.t] + ["k", "v"] + [f"hot{i}" for i in range(len(rows.hot.buffers()))]
    out: dict[str, object] = {n: (t.data_ptr(), tuple(t.shape)) for n, t in zip(names, rows.buffers())}
    out.update({f"host{i}": (t.data_ptr(), tuple(t.shape)) for i, t in enumerate(decoder.host.buffers(layer))})
    out["probe fitted"] = rows.probe.fitted
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=140)
    ap.add_argument("--bits", default="4", help="host_kv_bits: none, 4, 8 or auto")
    args = ap.parse_args()
    bits = None if args.bits == "none" else args.bits if args.bits == "auto" else int(args.bits)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, model = make_pair("llama", dtype=torch.bfloat16 if dev == "cuda" else torch.float32, num_hidden_layers=2,
                         hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=32)
    model = model.to(dev)
    hs.enable_hisparse_kv_cache(model, name="keys", max_seq_len=4096, block_size=64, window_size=64,
                                global_tokens=8, top_k=128, host_kv_bits=bits, telemetry=False)
    decoder = hs.integration.binding_of(model).engine._decoder
    graphs = getattr(model.model.forward, "step_graphs", None)
    ids, mask = prompt(1, args.prompt)
    kw = hf_compat.installed_cache_kwarg()
    with torch.no_grad():
        out = model(ids.to(dev), attention_mask=mask.to(dev), use_cache=True)
        cache, tok = hf_compat.output_cache(out), out.logits[:, -1:].argmax(-1)
        before = keyed_buffers(decoder)
        for step in range(args.steps):
            out = model(tok, **{kw: cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            now = keyed_buffers(decoder)
            moved = [(n, before.get(n), v) for n, v in now.items() if before.get(n) != v]
            counts = dict(graphs.counts) if graphs is not None else "no step graphs"
            if moved or step % 16 == 0:
                print(f"position {args.prompt + step}: {counts} moved: {moved}", flush=True)
            before = now
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
