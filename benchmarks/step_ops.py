"""The aten ops of one layer's batched decode step (append + attend), counted on the CPU.

On a GPU each layer's append and attend bodies are replayed CUDA graphs, so what a step costs
there is the kernels inside them. This script counts, on the CPU and through the public engine
API only (so it runs against any revision of ``hi_sparse`` put first on ``PYTHONPATH``), every
aten op of one decode step of a batch, split into what runs inside the bodies (what a graph
holds) and what runs around them on the host, with the elements each op writes. Calls of the
Triton-backed kernels (``hi_sparse.kernels``: swap-in, dequantize, bounds, attention) count as
one op each (their CPU reference's ops are not counted: on a GPU each is one launch).

    python benchmarks/step_ops.py --json ops.json            # this checkout
    PYTHONPATH=/tmp/old python benchmarks/step_ops.py ...    # another revision's hi_sparse

Two runs' JSON compare with ``--diff A.json B.json``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that make a view, read metadata or make a CPU scalar: no kernel on a GPU
VIEWS = {"alias", "slice", "view", "select", "unsqueeze", "squeeze", "expand", "_unsafe_view", "as_strided",
         "transpose", "permute", "t", "detach", "split", "unbind", "is_pinned", "reshape", "_reshape_alias",
         "scalar_tensor", "lift_fresh", "empty"}
KERNELS = ("swap_in", "swap_in_dequant", "sparse_decode_attention", "block_scores", "two_level_candidates",
           "top_blocks", "block_bounds", "superblock_bounds")


class OpLog(TorchDispatchMode):
    """Records (op, elements written) of every aten op while ``on``; kernel calls as one op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, str, int, str]] = []     # (phase, op, elements out, where)
        self.phase = "host"
        self.kernel_depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.kernel_depth == 0:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            n = sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
            self.ops.append((self.phase, str(func.overloadpacket.__name__), n, _where()))
        return out


LOG: OpLog | None = None
SKIP_BODIES = False                  # bodies return their last output without running (host time)


def _where() -> str:
    """file:line (function) of the innermost hi_sparse frame outside the kernels package."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if "hi_sparse" in f.f_globals.get("__name__", "") and "kernels" not in f.f_globals["__name__"] \
                and "step_ops" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _as_kernel(name: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if LOG is None or LOG.kernel_depth:
            return fn(*args, **kwargs)
        LOG.ops.append((LOG.phase, f"KERNEL:{name}", 0, _where()))
        LOG.kernel_depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            LOG.kernel_depth -= 1
    return wrapped


def _patch_kernels() -> None:
    """Replace every module-level reference to a kernel entry point in hi_sparse.* by a wrapper."""
    import hi_sparse.kernels as k
    originals = {getattr(k, n): n for n in KERNELS if hasattr(k, n)}
    for mod in [m for name, m in list(sys.modules.items()) if name.startswith("hi_sparse") and m is not None]:
        for attr, val in list(vars(mod).items()):
            if callable(val) and val in originals:
                setattr(mod, attr, _as_kernel(originals[val], val))


def _patch_bodies() -> str:
    """Mark the body calls of either revision (phase "append" / "attend" inside them, "host" outside).
    Returns the revision kind."""
    def phased(fn):
        last: dict = {}

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            if SKIP_BODIES:
                return last.get("out")
            if LOG is None:
                last["out"] = fn(*args, **kwargs)
                return last["out"]
            before, LOG.phase = LOG.phase, fn.__name__.split("_")[0]      # "append" / "attend"
            try:
                return fn(*args, **kwargs)
            finally:
                LOG.phase = before
        return wrapped
    try:
        from hi_sparse import decode                     # one decode path (issue 18)
        decode.append_body = phased(decode.append_body)
        decode.attend_body = phased(decode.attend_body)
        return "one path"
    except ImportError:
        from hi_sparse.batch_step import BatchStep       # before: the static batch step
        BatchStep.append_body = phased(BatchStep.append_body)
        BatchStep.attend_body = phased(BatchStep.attend_body)
        return "static batch step"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=256)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--bound-group", type=int, default=4)
    ap.add_argument("--bits", default="4", help="host_kv_bits (none for an unquantized pool)")
    ap.add_argument("--steps", type=int, default=6, help="decode steps before the counted one")
    ap.add_argument("--time-steps", type=int, default=0,
                    help="then time this many steps (CPU time of the thread), and as many with the bodies "
                         "skipped: the host side of a step, what a GPU pays around the replayed graphs")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare two runs' JSON and exit")
    ap.add_argument("--list", action="store_true", help="with --diff: also list each run's ops in order")
    args = ap.parse_args()
    if args.diff:
        return diff(*args.diff, args.list)

    import hi_sparse as hs
    kind = _patch_bodies()
    _patch_kernels()
    torch.manual_seed(0)
    bits = None if args.bits == "none" else (int(args.bits) if args.bits.isdigit() else args.bits)
    cfg = hs.HiSparseConfig(max_seq_len=args.context + 2 * (args.steps + args.time_steps) + 256,
                            cache_block_size=args.block_size,
                            window_size=args.window, top_k=args.top_k, host_kv_bits=bits,
                            bound_group=args.bound_group, telemetry=False, audit_every=0)
    H, Hq, D, B = args.kv_heads, args.q_heads, args.head_dim, args.batch
    L = args.layers
    eng = hs.HiSparseEngine(cfg, num_layers=L, num_q_heads=Hq, num_kv_heads=H, head_dim=D)
    sid = eng.add_sequences(1)[0]
    eng.begin_step()
    k, v = torch.randn(1, H, args.context, D), torch.randn(1, H, args.context, D)
    for layer in range(L):
        eng.append(layer, [sid], k, v)
    eng.end_step()
    ids = [sid] + eng.fork_sequences(sid, B - 1)

    kn, vn, qn = torch.randn(B, H, 1, D), torch.randn(B, H, 1, D), torch.randn(B, Hq, 1, D)

    def step() -> None:
        eng.begin_step()
        for layer in range(L):
            eng.append(layer, ids, kn, vn)
            eng.attend(layer, ids, qn)
        eng.end_step()

    for _ in range(args.steps):
        step()
    # the counted step must not cross a block boundary (the step that fills a block quantizes)
    while (eng.seq_len(sid) + 1) % args.block_size == 0:
        step()
    global LOG
    LOG = OpLog()
    with LOG:
        step()
    log, LOG = LOG, None
    result = {"revision": kind, "args": vars(args), "ops": log.ops, "fitted": bool(eng.probes[0].fitted)}
    if args.time_steps:
        global SKIP_BODIES
        for key, skip in (("step_cpu_ms", False), ("host_cpu_ms", True)):
            SKIP_BODIES = skip
            times = []
            for _ in range(args.time_steps):
                t0 = time.thread_time()
                step()
                times.append(time.thread_time() - t0)
            result[key] = sorted(times)[len(times) // 2] * 1e3 / args.layers
        SKIP_BODIES = False
    summarize(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0


PHASES = ("append", "attend", "host")


def _table(ops: list) -> dict[str, dict[str, list[int]]]:
    """phase -> op -> [calls, elements written], ops that launch work only (no views)."""
    out: dict[str, dict[str, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
    for phase, op, n, _ in ops:
        if op not in VIEWS:
            out[phase][op][0] += 1
            out[phase][op][1] += n
    return out


def summarize(r: dict) -> None:
    t = _table(r["ops"])
    print(f"{r['revision']}: probe fitted {r['fitted']}" +
          (f", per layer: step {r['step_cpu_ms']:.3f} CPU ms, host side {r['host_cpu_ms']:.3f}"
           if "step_cpu_ms" in r else ""))
    for phase in PHASES:
        calls = sum(c for c, _ in t[phase].values())
        elems = sum(e for _, e in t[phase].values())
        print(f"  {phase}: {calls} ops that launch work, {elems:,} elements written")


def listing(r: dict, phase: str) -> None:
    """The phase's ops that launch work, in order, with where they come from."""
    for i, (ph, op, n, where) in enumerate(x for x in r["ops"] if x[0] == phase and x[1] not in VIEWS):
        print(f"  {i:3d} {op:28s} {n:>10,}  {where}")


def diff(a_path: str, b_path: str, show: bool) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    ta, tb = _table(a["ops"]), _table(b["ops"])
    for r in (a, b):
        summarize(r)
    for phase in PHASES:
        print(f"\n{phase}: op | calls A -> B | elements written A -> B")
        for op in sorted(set(ta[phase]) | set(tb[phase])):
            ca, ea = ta[phase].get(op, [0, 0])
            cb, eb = tb[phase].get(op, [0, 0])
            if (ca, ea) != (cb, eb):
                print(f"  {op:32s} {ca:4d} -> {cb:4d}   {ea:>12,} -> {eb:>12,}")
    if show:
        for name, r in (("A", a), ("B", b)):
            for phase in PHASES:
                print(f"\n{name} {phase}:")
                listing(r, phase)
    return 0


if __name__ == "__main__":
    sys.exit(main())
