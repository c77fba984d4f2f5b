"""Host time of a whole-step decode graph's host side (issue 21): ``engine.plan_decode`` (pages,
the batch, every layer's graph key; and room, clocks and positions when they were not prepared
ahead), ``engine.finish_decode`` (lengths, selections, counters) and the next step's preparation
at a step's end (``Decoder.prepare``: room, clocks and positions of every layer, which with
whole-step graphs overlaps the running step), per decode step, for a 32-layer model. The plan
runs before the graph replays, with the device idle: it bounds the step time from below.

    python benchmarks/bench_step_plan.py --batch 1 --batch 24 [--no-plan-ahead]

Runs the planned path eagerly on the CPU (step_graph's ``plan_on_cpu``): the timed host side is
the same code a GPU step runs around its replay; the model is tiny so the forward stays cheap.
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
from hi_sparse import hf_compat, step_graph  # noqa: E402
from hi_sparse.integration import binding_of  # noqa: E402


def measure(batch: int, layers: int, context: int, steps: int, ahead: bool = True) -> dict:
    _, model = make_pair("llama", num_hidden_layers=layers)
    hs.enable_hisparse_kv_cache(model, name=f"bench-plan-{batch}", max_seq_len=context + steps + 64, block_size=64,
                                window_size=64, global_tokens=8, top_k=256, host_kv_bits=4, telemetry=False)
    step_graph.of(model).plan_on_cpu = True
    eng = binding_of(model).engine
    eng.plan_ahead = ahead
    decoder = eng._decoder
    plan_s, finish_s, prepare_s, step_s = [], [], [], []
    real_plan, real_finish, real_prepare = eng.plan_decode, eng.finish_decode, decoder.prepare

    def timed(fn, into):
        def call(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            into.append(time.perf_counter() - t)
            return out
        return call

    ids, mask = prompt(batch, context)
    kw = hf_compat.installed_cache_kwarg()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        cache = hf_compat.output_cache(out)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            model(tok, **{kw: cache}, use_cache=True)
        eng.plan_decode, eng.finish_decode = timed(real_plan, plan_s), timed(real_finish, finish_s)
        used = decoder.ahead_used
        for _ in range(steps):
            t = time.perf_counter()
            decoder.prepare = timed(real_prepare, prepare_s)    # at the step's end, not inside plan
            model(tok, **{kw: cache}, use_cache=True)
            decoder.prepare = real_prepare
            step_s.append(time.perf_counter() - t)
        used = decoder.ahead_used - used
    key_s = []                               # the plan's share spent on the layers' graph keys
    for _ in range(steps):
        t = time.perf_counter()
        for rows in eng.layers:
            decoder.body_key(rows)
        key_s.append(time.perf_counter() - t)
    hs.disable_hisparse_kv_cache(model)
    return {"batch": batch, "layers": layers, "context": context, "steps": steps,
            "plan_ms": 1e3 * statistics.median(plan_s), "finish_ms": 1e3 * statistics.median(finish_s),
            "key_ms": 1e3 * statistics.median(key_s), "eager_step_ms": 1e3 * statistics.median(step_s),
            "prepare_ms": 1e3 * statistics.median(prepare_s) if prepare_s else 0.0, "ahead_used": used}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, action="append", help="sequences per step (repeatable; default 1 and 24)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-plan-ahead", action="store_true", help="prepare each step inside its plan")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for b in args.batch or [1, 24]:
        r = measure(b, args.layers, args.context, args.steps, not args.no_plan_ahead)
        print(f"batch {r['batch']:>3} x {r['layers']} layers: plan {r['plan_ms']:.2f} ms (the graph keys "
              f"{r['key_ms']:.2f} of it), "
              f"finish {r['finish_ms']:.2f} ms per step, the preparation (room, clocks, positions) "
              f"{r['prepare_ms']:.2f} ms, {'ahead' if not args.no_plan_ahead else 'inside the plan'} "
              f"({r['ahead_used']} of {r['steps']} plans took one made ahead) (median of {r['steps']}; "
              f"the eager CPU step around them {r['eager_step_ms']:.1f} ms)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
