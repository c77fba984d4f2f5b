"""Which decode steps stall, and what they cost over a long decode (issue 21): a random-weight
32-layer Llama (8 KV heads of 128, the shape of boundary_profile.py) decodes B sequences for
many steps with whole-step graphs; every step is timed until its token is ready. Prints the
median step, each step over --over times the median with its position and what it did (completed
a host block, ran eagerly or captured its whole-step graph: a new key, started or committed a
recalibration), the share of the decode's time those steps added over the median, and the host
time of the engine's parts a stall may come from (the audit, a recalibration's launch in the
step, and its worker thread's launches, which overlap the steps; with --slices, the same work
in slices after each step instead). With --trace, the decode runs under torch.profiler and each
stall and a median step are read from its timeline (step_trace.py): where the step's thread spent
its time, other threads' CUDA calls, the GPU's kernels and busy time.

    python benchmarks/stall_profile.py --batch 1 --prompt 1000 --steps 800 [--slices] [--no-warm-blas]
        [--torch-fit] [--fit-per-step K] [--trace stalls.json.gz]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch
from call_timers import CallTimers
from decode_run import LLAMA_32_LAYERS, decode, host_bits, random_llama
from step_trace import StepTrace

import hi_sparse as hs
from hi_sparse import pinned, probe, recal_job, recalibration, step_graph
from hi_sparse.host_pool import HostPool
from hi_sparse.kernels.probe import reference_fit_grads
from hi_sparse.recal_job import RecalibrationJob


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--bits", type=host_bits, default=4, help="host_kv_bits: none, 4, 5, 6, 8, auto, ...")
    ap.add_argument("--over", type=float, default=1.5, help="a stall: a step over this times the median")
    ap.add_argument("--no-ahead", action="store_true", help="capture no coming key ahead (step_graph.AHEAD_TOKENS)")
    ap.add_argument("--no-warm-blas", action="store_true",
                    help="make no cuBLAS handles for the capture ahead at install (step_graph.WARM_BLAS)")
    ap.add_argument("--slices", action="store_true",
                    help="a background recalibration's work in slices after each step, not on a worker thread")
    ap.add_argument("--torch-fit", action="store_true",
                    help="the probes' fit gradients as torch ops, not the Triton kernel (kernels/probe.py)")
    ap.add_argument("--fit-per-step", type=int, default=None,
                    help="a worker's fit iterations for each step end, at most (recal_job.FIT_PER_STEP; 0: unpaced)")
    ap.add_argument("--lock-duty", type=float, default=None,
                    help="the share of its time the pages' lock ahead registers (pinned.LOCK_DUTY; 1: no pauses)")
    ap.add_argument("--lock-chunk-mb", type=float, default=None,
                    help="MiB a registration locks ahead (pinned.LOCK_CHUNK)")
    ap.add_argument("--fit-share", type=float, default=None,
                    help="the share of the SMs the probes' fit kernel may hold (kernels/_probe_triton.py FIT_SM_SHARE; "
                         "default: all)")
    ap.add_argument("--no-copy-graph", action="store_true",
                    help="make a key change's growth copies one by one, not in the graph captured ahead "
                         "(step_graph._capture_copies)")
    ap.add_argument("--no-lock-ahead", action="store_true",
                    help="lock no pool pages ahead of a growth (HostPool.lock_ahead): the growth locks its own")
    ap.add_argument("--no-priority", action="store_true",
                    help="replay steps on the current stream, not the high-priority one (step_graph.PRIORITY)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="Python's GIL switch interval in seconds (sys.setswitchinterval; default 0.005): how long a "
                         "thread that wants the GIL waits before asking the one holding it to let go")
    ap.add_argument("--trace", metavar="FILE.json.gz",
                    help="profile the decode (torch.profiler) and read each stall and a median step from its timeline; "
                         "their windows' events written to FILE")
    args = ap.parse_args()
    step_graph.WARM_BLAS = not args.no_warm_blas        # read at install
    if args.torch_fit:
        probe.fit_grads = reference_fit_grads
    if args.fit_per_step is not None:
        recal_job.FIT_PER_STEP = args.fit_per_step or None
    if args.fit_share is not None:
        from hi_sparse.kernels import _probe_triton
        _probe_triton.FIT_SM_SHARE = args.fit_share
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.lock_duty is not None:
        pinned.LOCK_DUTY = args.lock_duty
    if args.lock_chunk_mb is not None:
        pinned.LOCK_CHUNK = int(args.lock_chunk_mb * 2**20)
    copies: list = []
    capture_copies = step_graph._capture_copies
    step_graph._capture_copies = (lambda c: None) if args.no_copy_graph else \
        (lambda c: (copies.append(c) if c is not None and c.copies else None, capture_copies(c)))
    if args.no_lock_ahead:
        HostPool.lock_ahead = lambda self, blocks: None
    model, dev = random_llama(**LLAMA_32_LAYERS)
    block = 64
    hs.enable_hisparse_kv_cache(model, name="stalls", max_seq_len=args.max_seq_len, block_size=block, window_size=64,
                                global_tokens=8, top_k=128, host_kv_bits=args.bits, telemetry=False)
    engine, graphs = hs.integration.binding_of(model).engine, step_graph.of(model)
    graphs.ahead = not args.no_ahead
    engine._recalibrator.threaded = False if args.slices else None
    step_graph.PRIORITY = not args.no_priority
    timers = CallTimers()

    def state() -> tuple[int, ...]:
        return (len(timers.calls["a recalibration's launch (in the step)"]), sum(engine.stats.recalibrations.values()),
                graphs.counts["eager"], graphs.counts["captured"], graphs.counts["capture_retried"],
                graphs.counts["ahead"], graphs.counts["ahead_failed"], engine.host.num_blocks,
                engine.host.layers[0][next(iter(engine.host.layers[0]))].data_ptr(), len(timers.calls["the audit"]))

    times: list[tuple[int, float, list[str]]] = []
    trace = StepTrace(cuda=dev == "cuda") if args.trace else None
    with contextlib.ExitStack() as stack:
        for part in timed_parts(engine, timers):
            stack.enter_context(part)
        if trace is not None:
            stack.enter_context(trace)
        before = state()
        for pos, ms in decode(model, dev, args.batch, args.prompt, args.steps,
                              **({"around": trace.step} if trace else {})):
            end = time.perf_counter()
            now = state()
            did = [what for what, a, b in zip(("started a recalibration", "committed one", "ran eagerly (a new key)",
                                               "captured its graph", "(a capture met an unloaded kernel)",
                                               "replayed a graph captured ahead", "(a capture ahead failed)",
                                               "grew the host pool", "(which moved it)", "audited"),
                                              before, now) if a != b]
            if pos % block == block - 1:
                did.insert(0, "completed a block")
            # work of other threads this step overlapped (a recalibration's worker, a capture ahead,
            # the pool's pages locked ahead): where a stall without a cause of its own comes from
            did += [f"[{WHILE[label]}]" for label in timers.overlapping(end - ms / 1e3, end) if label in WHILE]
            times.append((pos, ms, did))
            before = now
    steady = [t for _, t, _ in times[2:]]        # the first two: the eager warm-up and the capture
    med = statistics.median(steady)
    print(f"{dev}, batch {args.batch}, prompt {args.prompt}, {args.steps} steps, host_kv_bits {args.bits}, "
          f"{'no ' if args.no_ahead else ''}capture ahead, {'default' if args.no_priority else 'high'} priority, "
          f"recalibration {'in slices' if args.slices else 'on a worker'}"
          f"{', no cuBLAS warm-up' if args.no_warm_blas else ''}"
          f"{', growth copies one by one' if args.no_copy_graph else ''}"
          f"{', no pages locked ahead' if args.no_lock_ahead else ''}"
          f"{', the fit as torch ops' if args.torch_fit else ''}"
          f", the worker's fit {f'{recal_job.FIT_PER_STEP} iterations a step' if recal_job.FIT_PER_STEP else 'unpaced'}"
          f"{f', the fit on {args.fit_share} of the SMs' if args.fit_share is not None else ''}"
          f"{f', a GIL switch interval of {sys.getswitchinterval() * 1e3:g} ms' if args.switch_interval else ''}"
          + ("" if args.no_lock_ahead else
             f", pages locked ahead in {pinned.LOCK_CHUNK / 2**20:g} MiB chunks at a duty of {pinned.LOCK_DUTY:g}")
          + f": median step {med:.2f} ms", flush=True)
    # left out of the stalls: a new batch's first step runs eagerly and its second captures its graph
    print("the first steps (eager, then the capture, with whatever starts there): "
          + ", ".join(f"{pos} {t:.1f} ms" for pos, t, _ in times[:2]), flush=True)
    picks = {}
    for i, (pos, t, did) in enumerate(times):
        if i >= 2 and t > args.over * med:
            picks[i] = f"  position {pos}: {t:.1f} ms ({t / med:.1f}x) {', '.join(did)}"
            print(picks[i])
    total = sum(steady)
    causes = by_cause([times[i] for i in picks], med)
    extra = sum(ms for _, (_, ms) in causes)
    if causes:
        print("stall time by the first of what the step did: " + ", ".join(
            f"{cause} {n} steps {ms:.1f} ms ({100 * ms / extra:.0f} %)" for cause, (n, ms) in causes))
    print(f"stalls added {extra:.1f} ms over {len(steady)} steps: {100 * extra / total:.1f} % of the decode's "
          f"{total:.0f} ms; {len(steady) / total * 1e3 * args.batch:.0f} tok/s against "
          f"{args.batch / med * 1e3:.0f} at the median")
    if trace is not None:
        report_trace(trace, picks, times, med, args.trace)
    print(f"growths' copies captured ahead in a graph: {sum(c.graph is not None or c.replayed for c in copies)} "
          f"of {len(copies)} staged, {sum(c.replayed for c in copies)} replayed at their growth")
    for why in graphs.capture_errors:
        print(f"a failed capture: {why}")
    for part, spent in timers.calls.items():
        if spent:
            print(f"host time in {part}: {len(spent)} calls, {1e3 * sum(spent):.1f} ms, "
                  f"the longest {1e3 * max(spent):.1f} ms")
    return 0


def report_trace(trace: StepTrace, picks: dict[int, str], times: list, med: float, path: str) -> None:
    """The median step and each stall read from the profiler's timeline; their windows to ``path``."""
    at_median = min(range(2, len(times)), key=lambda i: abs(times[i][1] - med))
    picks = {at_median: f"  a median step, position {times[at_median][0]}: {times[at_median][1]:.1f} ms", **picks}
    print("the timeline (torch.profiler: its overhead is in these times):")
    for line in trace.report(picks):
        print(line)
    kept = sorted(picks, key=lambda i: -times[i][1])[:KEEP_WINDOWS]   # the file small enough to fetch
    trace.write_json(path, {i: picks[i] for i in sorted({at_median, *kept})})
    print(f"the events of the median step's and the {len(kept)} longest stalls' windows: {path}")


KEEP_WINDOWS = 12
# what a stall is put down to: the first of these its step did, else another thread's work it
# overlapped, else nothing seen
CAUSES = ("grew the host pool", "started a recalibration", "committed one", "ran eagerly (a new key)",
          "captured its graph", "completed a block", "audited")


def by_cause(stalls: list, med: float) -> list[tuple[str, tuple[int, float]]]:
    """[(cause, (stalled steps, ms over the median))] of the stalled steps (position, ms, what it
    did), the largest first."""
    out: dict[str, tuple[int, float]] = {}
    for _, t, did in stalls:
        cause = next((c for c in CAUSES if c in did), None) or next(
            (d for d in did if d.startswith("[")), "nothing seen")
        n, ms = out.get(cause, (0, 0.0))
        out[cause] = (n + 1, ms + t - med)
    return sorted(out.items(), key=lambda kv: -kv[1][1])

# labels of other threads' work, as a step that overlapped it names it
WHILE = {"  its scoring of one layer (worker or slice)": "its scoring",
         "  an iteration of its probes' fit (worker or slice)": "its fit",
         "a whole-step capture (either thread)": "a capture",
         "  page-locking a tensor's pages (the step, or the thread ahead)": "page-locking",
         "    a registration on the step's thread (cudaHostRegister)": "registering pages itself",
         "    a registration on the lock-ahead thread (cudaHostRegister)": "pages registered ahead"}


def timed_parts(engine, timers: CallTimers) -> list:
    """The engine's parts a stall may come from (the audit, a recalibration's launch, committing one
    and waiting for it), each timed by ``timers`` while the contexts returned are entered."""
    return [timers.wrap(engine, "_audit", "the audit"),
            timers.wrap(engine._recalibrator, "start", "a recalibration's launch (in the step)"),
            timers.wrap(engine._recalibrator, "_inputs", "  its inputs, all layers (in the step)"),
            timers.wrap(engine._recalibrator, "_alike", "    those of the layers alike (one gather each)"),
            timers.wrap(RecalibrationJob, "_to_the_end", "its work's launches (a worker, or slices after a step)"),
            timers.wrap(engine._recalibrator, "_layer", "  its scoring of one layer (worker or slice)"),
            timers.wrap_slices(recalibration, "fit_iterations", "  an iteration of its probes' fit (worker or slice)"),
            timers.wrap(engine.host, "grow", "the host pool's growth (in the step)"),
            timers.wrap(pinned.Space, "lock_to", "  page-locking a tensor's pages (the step, or the thread ahead)"),
            timers.wrap(pinned, "_register", "    a registration on the step's thread (cudaHostRegister)",
                        elsewhere="    a registration on the lock-ahead thread (cudaHostRegister)"),
            timers.wrap(engine, "settle_recalibration", "settling a recalibration (commit, waits)"),
            timers.wrap(step_graph, "capture", "a whole-step capture (either thread)"),
            timers.wrap(torch.cuda.CUDAGraph, "capture_end", "  ending a capture (the graph instantiated)")]


if __name__ == "__main__":
    raise SystemExit(main())
