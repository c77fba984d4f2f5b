"""What in a whole-step graph's key changes as a sequence decodes (issue 21's stalls): a small
random-weight Llama decodes from a --prompt-token context, and after every step each buffer of
layer 0 that a captured step's key names (its bounds bank, hot rows, hot buffer, host pool) is
compared with the step before; a changed address or shape is printed with the step graphs'
counts (eager, captured, replayed), so the step that re-captures can be matched to what moved
(the first step's line holds what the prefill allocated too).

    python benchmarks/key_trace.py --prompt 1000 --steps 140

On the CPU (no graphs) the buffers grow geometrically: over 300 steps from 1,000 tokens they
moved once, at 1,024 tokens. benchmarks/stall_profile.py on the H200 found an eager step and a
capture after every completed block at this context; this names what moved there.
"""

from __future__ import annotations

import argparse

from decode_run import decode, host_bits, random_llama

import hi_sparse as hs
from hi_sparse import step_graph


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
    ap.add_argument("--bits", type=host_bits, default=4, help="host_kv_bits: none, 4, 5, 6, 8, auto, ...")
    args = ap.parse_args()
    model, dev = random_llama(hidden_size=256, intermediate_size=512, num_attention_heads=8, head_dim=32)
    hs.enable_hisparse_kv_cache(model, name="keys", max_seq_len=4096, block_size=64, window_size=64,
                                global_tokens=8, top_k=128, host_kv_bits=args.bits, telemetry=False)
    decoder, graphs = hs.integration.binding_of(model).engine._decoder, step_graph.of(model)
    before = keyed_buffers(decoder)
    for pos, _ in decode(model, dev, 1, args.prompt, args.steps):
        now = keyed_buffers(decoder)
        moved = [(n, before.get(n), v) for n, v in now.items() if before.get(n) != v]
        if moved or (pos - args.prompt) % 16 == 0:
            print(f"position {pos}: {graphs.counts} moved: {moved}", flush=True)
        before = now
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
