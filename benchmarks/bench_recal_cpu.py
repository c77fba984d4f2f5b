"""What a recalibration costs a decode step on the CPU, with the real model (SmolLM2-135M).

    .venv/bin/python benchmarks/bench_recal_cpu.py [--prompt 1024] [--steps 6] [--recals 2]
        [--threads 2] [--modes step,step-keep,slices] [--prefill] [--request N]

SmolLM2-135M-Instruct (30 layers, 3 KV heads of 64) reads --prompt tokens of the license texts
through HiSparse (64-token blocks, window 64, top_k 256, 16 anchors), then decodes token by token:
--steps plain steps, then a requested recalibration (every layer's anchors re-scored, every
probe refitted) and --steps more, --recals times. Modes, one after another in one process:
"step", the recalibration in the step (``background_recalibration`` False), denormal floats
flushed while it runs (the runtime's way); "step-keep", the same with them kept
(``probe.FLUSH_DENORMALS`` off); "slices", in the background (True, the default): its work in
slices after each step for about a step's time and at least its share by engine.SLICE_LAG steps,
decoding on until it is committed. Prints the median plain step, each recalibration's step (the slowest step while
it ran, in slices, and how many steps it ran over) and the scoring of all its layers (the rest
is the probes' fit).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from call_timers import CallTimers

MAX_STEPS = 400       # steps a recalibration in slices may run over, at most
OPTIONS = dict(max_seq_len=8192, block_size=64, window_size=64, global_tokens=16, top_k=256,
               recalibrate_every=1 << 20, recalibrate_topk=16, audit_every=0, telemetry=False)


def run(lm, ids: list[int], prompt: int, steps: int, recals: int, mode: str) -> dict:
    import hi_sparse.probe as probe
    import hi_sparse.recalibration as rc
    from hi_sparse.hf_compat import installed_cache_kwarg, output_cache
    from hi_sparse.integration import binding_of, disable_hisparse_kv_cache, enable_hisparse_kv_cache

    probe.FLUSH_DENORMALS = mode != "step-keep"
    model = enable_hisparse_kv_cache(lm.model, **OPTIONS, background_recalibration=mode == "slices")
    engine, name = binding_of(model).engine, installed_cache_kwarg()
    timers = CallTimers()
    plain: list[float] = []
    recal: list[float] = []
    over: list[int] = []
    at = prompt
    try:
        with torch.no_grad(), timers.wrap(rc.Recalibrator, "_layer", "score"):
            out = model(torch.tensor([ids[:prompt]]), use_cache=True, logits_to_keep=1)

            def step() -> float:
                nonlocal out, at
                t0 = time.perf_counter()
                out = model(torch.tensor([[ids[at]]]), use_cache=True, **{name: output_cache(out)})
                at += 1
                return time.perf_counter() - t0

            def done() -> int:
                return engine.stats.recalibrations["request"]

            plain += [step() for _ in range(steps)]
            engine.settle_recalibration()     # the prefill's own first recalibration is not counted
            timers.calls.clear()
            for j in range(recals):
                engine.request_recalibration()
                during = [step()]
                while done() < j + 1 and len(during) < MAX_STEPS:
                    during.append(step())
                recal.append(max(during))
                over.append(len(during))
                plain += [step() for _ in range(steps)]
        assert done() == recals, engine.stats.recalibrations
    finally:
        disable_hisparse_kv_cache(lm.model)
        probe.FLUSH_DENORMALS = True
    layers = len(timers.calls["score"]) // recals      # one scoring call per layer and recalibration
    score = [sum(timers.calls["score"][j * layers:(j + 1) * layers]) for j in range(recals)]
    return {"plain": statistics.median(plain), "recal": recal, "over": over, "score": score}


def request(lm, ids: list[int], prompt: int, tokens: int, mode: str) -> tuple[float, float, float]:
    """A short request on a fresh engine: seconds of its prefill (the prompt's forward), of its
    ``tokens`` decode steps and of its end (the cache released: the engine frees the sequence),
    with the first recalibration in the step ("step") or in the background ("slices"); dense: a
    DynamicCache."""
    from transformers import DynamicCache

    from hi_sparse.hf_compat import installed_cache_kwarg, output_cache
    from hi_sparse.integration import disable_hisparse_kv_cache, enable_hisparse_kv_cache

    model = lm.model if mode == "dense" else enable_hisparse_kv_cache(
        lm.model, **OPTIONS, background_recalibration=mode == "slices")
    name = installed_cache_kwarg()
    cache = {name: DynamicCache()} if mode == "dense" else {}
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model(torch.tensor([ids[:prompt]]), use_cache=True, logits_to_keep=1, **cache)
            t1 = time.perf_counter()
            for at in range(prompt, prompt + tokens):
                out = model(torch.tensor([[ids[at]]]), use_cache=True, **{name: output_cache(out)})
            t2 = time.perf_counter()
            del out               # the engine frees the sequence (and settles what that needs)
            return t1 - t0, t2 - t1, time.perf_counter() - t2
    finally:
        if mode != "dense":
            disable_hisparse_kv_cache(lm.model)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--recals", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="step,step-keep,slices")
    ap.add_argument("--prefill", action="store_true",
                    help="time the prompt's forward instead: dense, HiSparse with the first recalibration "
                         "in the step and in the background, twice each, alternating")
    ap.add_argument("--request", type=int, default=0, metavar="N",
                    help="time short requests instead: the prompt, N decode steps and the request's end, "
                         "dense, the recalibration in the step and in the background, twice each")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from hi_sparse.real_model import load_model, load_text, token_ids

    lm = load_model()
    ids = token_ids(lm.tokenizer, load_text("licenses"), args.prompt + args.recals * (args.steps + MAX_STEPS) + 8)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads, "
          f"prompt {args.prompt}, {args.steps} steps before each of {args.recals} recalibrations")
    if args.request:
        for mode in ["dense", "step", "slices"] * 2:
            took = request(lm, ids, args.prompt, args.request, mode)
            print(f"a request of {args.prompt} + {args.request} tokens, {mode:6s}: prefill {took[0]:.2f} s, "
                  f"decode {took[1]:.2f} s, end {took[2]:.2f} s, in all {sum(took):.2f} s", flush=True)
        return 0
    if args.prefill:
        for mode in ["dense", "step", "slices"] * 2:
            took = request(lm, ids, args.prompt, 0, mode)[0]     # the prompt's forward alone
            print(f"prefill of {args.prompt} tokens, {mode:6s}: {took:.2f} s", flush=True)
        return 0
    for mode in args.modes.split(","):
        r = run(lm, ids, args.prompt, args.steps, args.recals, mode)
        recal = ", ".join(f"{t:.2f}" for t in r["recal"])
        over = ", ".join(str(n) for n in r["over"])
        score = ", ".join(f"{t:.2f}" for t in r["score"])
        print(f"{mode:9s}: median step {r['plain']:.3f} s; slowest step of each recalibration {recal} s "
              f"({max(r['recal']) / r['plain']:.1f}x the median), over {over} steps; its scoring {score} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
