"""Benchmarks of the HiSparse Triton kernels against their baselines, measured in one run.

Run on a CUDA GPU: `python benchmarks/bench_kernels.py [--out results.json] [--quick]`.
Every time is the median of triton.testing.do_bench (L2 flushed between repetitions) unless it
says graph, which is the median replay time of a captured CUDA graph. Ceilings measured here in
the same run: HBM device copy (bytes read + written) and bulk pinned host->device copy.
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager
from itertools import product

import torch
import triton
import triton.testing

import hi_sparse.kernels as K
from hi_sparse.kernels import _quant_triton as QT

SWEEP = False         # --sweep: tile/pipelining variants of the decode kernel
RESULTS: dict[str, list | dict] = {"ceilings": {}, "swap_in": [], "attention": [], "quant": [], "layouts": [],
                                   "hit_detection": []}


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds."""
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn, replays: int = 50) -> float:
    """Median milliseconds of a CUDA-graph replay of fn (launch gaps removed)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay, warmup=10, rep=replays)


def pinned_pool(nbytes: int = 1 << 30) -> torch.Tensor:
    """One pinned host buffer of random bytes (filled by tiling a 64 MiB random chunk: fast)."""
    pool = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    chunk = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    pool.view(-1, chunk.numel()).copy_(chunk.expand(nbytes // chunk.numel(), -1))
    return pool


def hbm_copy_rate(nbytes: int = 1 << 30) -> float:
    """GB/s of a device copy of nbytes of bf16 (bytes read + written)."""
    a = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    return 2 * nbytes / bench(lambda: b.copy_(a)) / 1e6


def ceilings(pool: torch.Tensor) -> dict:
    n = 1 << 30
    hbm = hbm_copy_rate(n)
    dev = torch.empty(pool.shape, device="cuda", dtype=torch.uint8)
    ms_h2d = bench(lambda: dev.copy_(pool, non_blocking=True), warmup=5, rep=50)
    h2d = pool.numel() / ms_h2d / 1e6
    # Rebound, not deleted, to free device memory early: the timed lambdas close over these names.
    dev = None
    c = {"hbm_copy_GBps": hbm, "h2d_bulk_GBps": h2d, "hbm_copy_bytes": 2 * n, "h2d_bytes": pool.numel()}
    RESULTS["ceilings"] = c
    print(f"HBM copy (read+write) {hbm:8.1f} GB/s   bulk pinned H2D {h2d:6.1f} GB/s", flush=True)
    return c


def runs_of(r: int, m: int, run: int) -> torch.Tensor:
    """m distinct source rows in runs of `run` consecutive rows at random run starts (run=1: random rows)."""
    starts = torch.randperm(r // run, device="cuda")[: m // run] * run
    return (starts[:, None] + torch.arange(run, device="cuda")).flatten()


def bench_swap_in(pool: torch.Tensor, h2d: float, quick: bool) -> None:
    print("\nswap-in (scattered rows, pinned host -> device over UVA)", flush=True)
    print(f"{'row B':>6} {'rows':>8} {'ms':>8} {'GB/s':>7} {'% bulk':>7}")
    for row_bytes in ([256, 1152, 4096] if quick else [256, 512, 1024, 1152, 2048, 4096]):
        w = row_bytes // 2
        r = pool.numel() // row_bytes
        src = pool[: r * row_bytes].view(torch.bfloat16).view(r, w)
        assert src.is_pinned(), "the host pool must be pinned for the UVA path"
        m = (256 << 20) // row_bytes // 64 * 64             # ~256 MiB moved per call, whole runs of 64
        dst = torch.empty(m, w, device="cuda", dtype=torch.bfloat16)
        dst_rows = torch.randperm(m, device="cuda")
        for pattern in ("random", "runs64"):
            src_rows = runs_of(r, m, 1 if pattern == "random" else 64)
            ms = bench(lambda: K.swap_in(src, src_rows, dst, dst_rows), warmup=5, rep=40)
            gbps = m * row_bytes / ms / 1e6
            RESULTS["swap_in"].append({"row_bytes": row_bytes, "rows": m, "pattern": pattern, "ms": ms, "GBps": gbps,
                                       "pct_bulk": 100 * gbps / h2d})
            print(f"{row_bytes:6d} {m:8d} {ms:8.3f} {gbps:7.1f} {100 * gbps / h2d:6.1f}%  {pattern}", flush=True)
        src = dst = None
    # fused dequant: D = 128 codes per row at 4 and 8 bits into bf16
    for bits in (4, 8):
        d = 128
        p = K.packed_width(d, bits)
        r = pool.numel() // p
        packed = pool[: r * p].view(r, p)
        rpb = 512
        scale = torch.rand(r // rpb).pin_memory()
        zero = torch.rand(r // rpb).pin_memory()
        m = (64 << 20) // p // 64 * 64
        dst = torch.empty(m, d, device="cuda", dtype=torch.bfloat16)
        dst_rows = torch.arange(m, device="cuda")
        for pattern in ("random", "runs64"):
            src_rows = runs_of(r, m, 1 if pattern == "random" else 64)
            ms = bench(lambda: K.swap_in_dequant(packed, scale, zero, bits, rpb, src_rows, dst, dst_rows),
                       warmup=5, rep=40)
            gbps = m * p / ms / 1e6
            RESULTS["swap_in"].append({"dequant_bits": bits, "row_bytes": p, "rows": m, "pattern": pattern, "ms": ms,
                                       "GBps_packed": gbps, "pct_bulk": 100 * gbps / h2d, "rows_per_s": m / ms * 1e3})
            print(f"dequant {bits}b row {p:3d} B {pattern:>7}: {ms:7.3f} ms {gbps:6.1f} GB/s of packed rows "
                  f"({100 * gbps / h2d:5.1f}% bulk), {m / ms / 1e3:6.1f} M rows/s", flush=True)
        packed = dst = None


GROUP = 16            # blocks per super-block of the two-level bounds (the runtime's default)


def pick_blocks(q, kmin, kmax, sup, n_blocks: int, window_blocks: int, two_stage: bool = True):
    """Top n_blocks block indices (B, Hkv, n_blocks) by Quest bound, the last window_blocks blocks
    excluded; sup = (smin, smax, n_super) scores super-blocks first (two-level), None scores all."""
    B, Hq, D = q.shape
    Hkv, nb = kmin.shape[1], kmin.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, D)
    if sup is None:
        scores = K.block_scores(qg, kmin, kmax)                                  # (B, Hkv, NB)
        scores[..., nb - window_blocks:] = float("-inf")                         # window is always in
        return K.top_blocks(scores, n_blocks) if two_stage else scores.topk(n_blocks, dim=-1).indices
    smin, smax, n_super = sup
    blocks, scores = K.two_level_candidates(qg, kmin, kmax, smin, smax, GROUP, n_super, limit=nb - window_blocks)
    return blocks.gather(-1, K.top_blocks(scores, n_blocks))


def sparse_step(q, kmin, kmax, k_buf, v_buf, top_k: int, bs: int, window: int, two_stage: bool = True, sup=None):
    """One decode step of one layer: Quest scores (one or two levels), top blocks, slots, attention.

    q (B, Hq, D); kmin/kmax (B, Hkv, NB, D); hot buffer (B, Hkv, S, D). Tokens of the recent window
    plus the top (top_k - window) // bs blocks; slot of token t is t % S (a stand-in for the hot
    buffer's token->slot map, which the runtime keeps).
    """
    nb = kmin.shape[2]
    S = k_buf.shape[2]
    top = pick_blocks(q, kmin, kmax, sup, (top_k - window) // bs, window // bs, two_stage)
    tok = (top[..., None] * bs + torch.arange(bs, device=q.device)).flatten(-2)
    win = torch.arange(nb * bs - window, nb * bs, device=q.device).expand(*top.shape[:2], window)
    slots = (torch.cat([tok, win], dim=-1) % S).to(torch.int32)
    return K.sparse_decode_attention(q, k_buf, v_buf, slots)


def sweep_attention(q, k_buf, v_buf, slots, nbytes: int, hbm: float) -> None:
    """Tile and pipelining variants of the decode kernel at batch 64 (the default is the first)."""
    from hi_sparse.kernels import _attention_triton as A
    rows = []
    for block_n, warps, stages in [(64, 4, 2), (32, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2), (32, 2, 3), (64, 4, 4)]:
        ms = bench(lambda: A.launch(q, k_buf, v_buf, slots, None, block_n=block_n, num_warps=warps, num_stages=stages))
        rows.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "ms": ms,
                     "pct_hbm": 100 * nbytes / ms / 1e6 / hbm})
        print(f"    sweep block_n={block_n:3d} warps={warps} stages={stages}: {ms:.4f} ms "
              f"{100 * nbytes / ms / 1e6 / hbm:5.1f}% HBM", flush=True)
    RESULTS["attention_sweep"] = rows


def bench_attention(hbm: float, quick: bool) -> None:
    print("\nsparse decode attention: top_k 2048, 32 q / 8 kv heads, d 128, bf16, block 64, hot buffer 4096",
          flush=True)
    print(f"{'B':>3} {'ctx':>8} {'attn ms':>8} {'attn GB/s':>9} {'%HBM':>5} {'step ms':>8} {'step graph':>10} "
          f"{'dense ms':>9} {'dense/step':>10}")
    Hq, Hkv, D, top_k, S, bs, window = 32, 8, 128, 2048, 4096, 64, 1024
    free_bytes = torch.cuda.mem_get_info()[0]
    for B in (1, 64):
        for ctx in ([32 << 10, 1 << 20] if quick else [32 << 10, 128 << 10, 512 << 10, 1 << 20]):
            torch.manual_seed(0)
            nb = ctx // bs
            q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
            k_buf = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
            v_buf = torch.randn_like(k_buf)
            kmin = torch.randn(B, Hkv, nb, D, device="cuda", dtype=torch.bfloat16)
            kmax = kmin + torch.rand_like(kmin)
            slots = torch.randperm(S, device="cuda")[:top_k].to(torch.int32).repeat(B, Hkv, 1)
            ms_attn = bench(lambda: K.sparse_decode_attention(q, k_buf, v_buf, slots))
            bytes_attn = B * Hkv * top_k * D * 2 * 2 + slots.numel() * 4 + 2 * q.numel() * 2
            gbps = bytes_attn / ms_attn / 1e6
            if B == 64 and ctx == 32 << 10 and SWEEP:
                sweep_attention(q, k_buf, v_buf, slots, bytes_attn, hbm)
            n_blocks = (top_k - window) // bs
            n_super = n_blocks + 2
            sup = None
            if K.two_level_pays(nb, GROUP, n_super):
                smin, smax = K.superblock_bounds(kmin, kmax, GROUP)
                sup = (smin, smax, n_super)
            ms_step = bench(lambda: sparse_step(q, kmin, kmax, k_buf, v_buf, top_k, bs, window, sup=sup))
            ms_graph = bench_graph(lambda: sparse_step(q, kmin, kmax, k_buf, v_buf, top_k, bs, window, sup=sup))
            ms_graph_flat = bench_graph(lambda: sparse_step(q, kmin, kmax, k_buf, v_buf, top_k, bs, window))
            ms_graph_plain = bench_graph(lambda: sparse_step(q, kmin, kmax, k_buf, v_buf, top_k, bs, window, False))
            qg = q.view(B, Hkv, Hq // Hkv, D)
            sc = K.block_scores(qg, kmin, kmax)
            ms_scores = bench(lambda: K.block_scores(qg, kmin, kmax))
            g_scores = bench_graph(lambda: K.block_scores(qg, kmin, kmax))
            g_pick = bench_graph(lambda: pick_blocks(q, kmin, kmax, sup, n_blocks, window // bs))
            g_topk = bench_graph(lambda: sc.topk(n_blocks, dim=-1))
            g_top2 = bench_graph(lambda: K.top_blocks(sc, n_blocks))
            g_attn = bench_graph(lambda: K.sparse_decode_attention(q, k_buf, v_buf, slots))
            if sup is not None:   # how often does two-level pick the same blocks as scoring all of them
                flat = pick_blocks(q, kmin, kmax, None, n_blocks, window // bs).sort(-1).values
                two = pick_blocks(q, kmin, kmax, sup, n_blocks, window // bs).sort(-1).values
                same = float((flat[..., :, None] == two[..., None, :]).any(-1).float().mean())
            bound_bytes = 2 * (kmin.numel() if sup is None else sup[0].numel() + B * Hkv * n_super * GROUP * D) * 2
            bytes_scores = 2 * kmin.numel() * 2
            kv_bytes = 2 * B * Hkv * ctx * D * 2
            ms_dense = None
            if kv_bytes * 1.1 < free_bytes - 8 * (1 << 30):
                kd = torch.randn(B, Hkv, ctx, D, device="cuda", dtype=torch.bfloat16)
                vd = torch.randn_like(kd)
                q4 = q[:, :, None]
                try:
                    ms_dense = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q4, kd, vd, enable_gqa=True), warmup=5, rep=30)
                except torch.OutOfMemoryError:
                    ms_dense = None
                del kd, vd
            row = {"B": B, "context": ctx, "attn_ms": ms_attn, "attn_bytes": bytes_attn, "attn_GBps": gbps,
                   "attn_pct_hbm": 100 * gbps / hbm, "attn_floor_ms": bytes_attn / hbm / 1e6,
                   "scores_ms": ms_scores, "scores_GBps": bytes_scores / ms_scores / 1e6,
                   "step_ms": ms_step, "step_graph_ms": ms_graph, "step_graph_plain_topk_ms": ms_graph_plain,
                   "levels": 1 if sup is None else 2, "step_graph_one_level_ms": ms_graph_flat,
                   "graph_pick_blocks_ms": g_pick, "bound_bytes_read": bound_bytes,
                   "two_level_overlap_with_one_level": same if sup is not None else None,
                   "graph_scores_ms": g_scores, "graph_topk_ms": g_topk, "graph_top_blocks_ms": g_top2,
                   "graph_attn_ms": g_attn, "dense_ms": ms_dense,
                   "dense_kv_GBps": kv_bytes / ms_dense / 1e6 if ms_dense else None,
                   "speedup_vs_dense": ms_dense / ms_graph if ms_dense else None}
            RESULTS["attention"].append(row)
            dense = f"{ms_dense:9.3f} {ms_dense / ms_graph:9.1f}x" if ms_dense else f"{'no fit':>9} {'-':>10}"
            print(f"{B:3d} {ctx:8d} {ms_attn:8.4f} {gbps:9.1f} {100 * gbps / hbm:4.0f}% {ms_step:8.4f} "
                  f"{ms_graph:10.4f} {dense}"
                  f"\n      graph: scores {g_scores:.4f} ms ({bytes_scores / g_scores / 1e6:.0f} GB/s), "
                  f"topk {g_topk:.4f}, top_blocks {g_top2:.4f}, attention {g_attn:.4f}; "
                  f"step with plain topk {ms_graph_plain:.4f}"
                  f"\n      levels {1 if sup is None else 2}: pick_blocks {g_pick:.4f} ms, "
                  f"bounds read {bound_bytes / 1e6:.1f} MB; one-level step {ms_graph_flat:.4f} ms"
                  + (f"; blocks shared with one-level {100 * same:.1f} %" if sup is not None else ""), flush=True)
            q = k_buf = v_buf = kmin = kmax = None
            torch.cuda.empty_cache()


def bench_quant(hbm: float) -> None:
    """The default quantize / dequantize path on two block shapes (the variant sweeps of the
    quantize kernels are benchmarks/diag_quant.py's)."""
    for shape in ((2048, 512, 128), (16384, 64, 128)):
        bench_quant_shape(hbm, shape)


def sweep_scores(hbm: float) -> None:
    """Scores-kernel tile variants at batch 1, 1M context (graph replay: launch gaps removed)."""
    from hi_sparse.kernels import _bounds_triton as Bt
    nb = (1 << 20) // 64
    q = torch.randn(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
    kmin = torch.randn(1, 8, nb, 128, device="cuda", dtype=torch.bfloat16)
    kmax = kmin + 1
    nbytes = 2 * kmin.numel() * 2
    rows = []
    for values, warps in [(4096, 4), (8192, 4), (8192, 8), (16384, 8), (2048, 4)]:
        ms = bench_graph(lambda: Bt.scores(q, kmin, kmax, block_values=values, num_warps=warps))
        rows.append({"block_values": values, "num_warps": warps, "ms": ms, "GBps": nbytes / ms / 1e6})
        print(f"    scores B=1 1M block_values={values} warps={warps}: {ms:.4f} ms {nbytes / ms / 1e6:.0f} GB/s",
              flush=True)
    RESULTS["scores_sweep"] = rows


def bench_quant_shape(hbm: float, shape: tuple[int, int, int]) -> None:
    print(f"\nblock quantize / dequantize: {shape[0]} blocks x {shape[1]} tokens x {shape[2]}, bf16 "
          "(bytes = in + out)", flush=True)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    for bits in (4, 5, 6, 8):
        packed, scale, zero = K.quantize_blocks(x, bits)
        ms_q = bench(lambda: K.quantize_blocks(x, bits))
        ms_d = bench(lambda: K.dequantize_blocks(packed, scale, zero, bits, 128, dtype=torch.bfloat16))
        moved = x.numel() * 2 + packed.numel()
        gq, gd = moved / ms_q / 1e6, moved / ms_d / 1e6
        RESULTS["quant"].append({"shape": list(shape), "bits": bits,
                                 "quant_ms": ms_q, "quant_GBps": gq, "quant_pct_hbm": 100 * gq / hbm,
                                 "dequant_ms": ms_d, "dequant_GBps": gd, "dequant_pct_hbm": 100 * gd / hbm,
                                 "bytes": moved})
        print(f"{bits}b: quantize {ms_q:7.3f} ms {gq:7.1f} GB/s ({100 * gq / hbm:4.1f}% HBM copy)   "
              f"dequantize {ms_d:7.3f} ms {gd:7.1f} GB/s ({100 * gd / hbm:4.1f}%)", flush=True)


# (values per program, warps (0: by tile)) of the swap-in with fused dequant per layout; the default first
ROWS_SWEEP = {"channel": [(8192, 4), (8192, 0), (2048, 0)],
              "token": [(8192, 0), (8192, 16), (4096, 4), (2048, 0)]}
# the channel layout's quantize: ("strip", groups, warps) or ("twopass", tile values, warps); the default first
CHANNEL_QUANT_SWEEP = [("twopass", 1024, 1), ("twopass", 512, 1), ("twopass", 1024, 2), ("strip", 4, 1),
                       ("strip", 4, 2)]


@contextmanager
def _swap_rows_setting(layout: str, tile: int, warps: int):
    """The row dequant kernel's settings for one layout, restored afterwards."""
    saved = QT.ROWS_TILE_VALUES[layout], QT.ROWS_WARPS[layout]
    QT.ROWS_TILE_VALUES[layout], QT.ROWS_WARPS[layout] = tile, warps
    try:
        yield
    finally:
        QT.ROWS_TILE_VALUES[layout], QT.ROWS_WARPS[layout] = saved


def bench_layouts(pool: torch.Tensor, h2d: float, hbm: float) -> None:
    """The host pool's layouts (issue 23): keys one fp16 scale / zero per channel of a 64-token
    unit, values one per token. Swap-in with fused dequant from pinned rows (GB/s of packed rows
    + the pairs they read, against the bulk pinned copy) and quantize (bytes in + out, against the
    HBM copy)."""
    print("\nlayouts: swap-in with fused dequant (64-token units, D = 128) and quantize", flush=True)
    d, rpb = 128, 64
    for bits in (4, 8):
        p = K.packed_width(d, bits)
        r = pool.numel() // p // rpb * rpb
        packed = pool[: r * p].view(r, p)
        m = (64 << 20) // p // 64 * 64
        dst = torch.empty(m, d, device="cuda", dtype=torch.bfloat16)
        dst_rows = torch.arange(m, device="cuda")
        for layout in ("channel", "token"):
            n = r // rpb if layout == "channel" else r
            shape = (n, d) if layout == "channel" else (n,)
            scale = (torch.rand(shape) + 0.1).half().pin_memory()
            zero = torch.rand(shape).half().pin_memory()
            pair = 4 * d / rpb if layout == "channel" else 4
            sweep = ROWS_SWEEP[layout]
            runs = [("random", v) for v in sweep[::len(sweep) - 1]] + [("runs64", v) for v in sweep]
            for pattern, (tile, warps) in runs:
                src_rows = runs_of(r, m, 1 if pattern == "random" else 64)
                with _swap_rows_setting(layout, tile, warps):
                    ms = bench(lambda: K.swap_in_dequant(packed, scale, zero, bits, rpb, src_rows, dst, dst_rows,
                                                         layout), warmup=5, rep=40)
                gbps = m * (p + pair) / ms / 1e6
                default = (tile, warps) == sweep[0]
                RESULTS["layouts"].append({"op": "swap_in_dequant", "layout": layout, "bits": bits, "pattern": pattern,
                                           "tile_values": tile, "warps": warps, "default": default,
                                           "rows": m, "ms": ms, "GBps": gbps, "pct_bulk": 100 * gbps / h2d})
                print(f"dequant {bits}b {layout:>7} {pattern:>7} tile {tile:5d} warps {warps or 'auto':>4}: "
                      f"{ms:7.3f} ms {gbps:6.1f} GB/s of packed rows + pairs "
                      f"({100 * gbps / h2d:5.1f}% bulk)", flush=True)
            scale = zero = None  # free them early (not `del`: the timed lambdas close over them)
        packed = dst = None
    for shape in ((16384, 64, 128), (32768, 64, 64)):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        strip0, quant0 = dict(QT.CHANNEL_STRIP), dict(QT.CHANNEL_QUANT)
        for layout in ("channel", "token"):
            variants = CHANNEL_QUANT_SWEEP if layout == "channel" else CHANNEL_QUANT_SWEEP[:1]
            for bits, (method, size, warps) in product((4, 5, 6, 8), variants):
                QT.CHANNEL_QUANT["method"] = method
                if method == "twopass":
                    QT.CHANNEL_QUANT.update(tile=size, warps=warps)
                else:
                    QT.CHANNEL_STRIP.update(groups=size, warps=warps)
                try:
                    packed, scale, zero = K.quantize_blocks(x, bits, layout)
                    ms = bench(lambda: K.quantize_blocks(x, bits, layout))
                finally:
                    QT.CHANNEL_STRIP.update(strip0)
                    QT.CHANNEL_QUANT.update(quant0)
                moved = x.numel() * 2 + packed.numel() + 2 * scale.numel() * 2
                g = moved / ms / 1e6
                what = f"{method} {min(size, 99999):5d} x {warps} warps" if layout == "channel" else ""
                RESULTS["layouts"].append({"op": "quantize", "layout": layout, "bits": bits, "shape": list(shape),
                                           "method": method, "size": size, "warps": warps, "ms": ms, "GBps": g,
                                           "pct_hbm": 100 * g / hbm})
                print(f"quantize {bits}b {layout:>7} {shape} {what}: {ms:7.3f} ms {g:7.1f} GB/s "
                      f"({100 * g / hbm:4.1f}% HBM copy)", flush=True)
        x = None


def bench_hit_detection() -> None:
    """Host round trip (selection to host, lookup in numpy, slots back) vs the same on the device."""
    print("\nhit detection + slot assignment: host round trip vs device (torch ops), 8 kv heads, 2048 selected, "
          "4096 slots", flush=True)
    Hkv, top_k, S, ctx = 8, 2048, 4096, 128 << 10
    for B in (1, 64):
        g = torch.Generator(device="cuda").manual_seed(0)
        slot_of_token = torch.full((B, Hkv, ctx), -1, device="cuda", dtype=torch.int32)
        resident = torch.randint(0, ctx, (B, Hkv, S), device="cuda", generator=g)
        slots = torch.arange(S, device="cuda", dtype=torch.int32).expand(B, Hkv, S).contiguous()
        slot_of_token.scatter_(2, resident, slots)
        lru = torch.argsort(torch.rand(B, Hkv, S, device="cuda", generator=g), dim=-1).to(torch.int32)
        sel = torch.randint(0, ctx, (B, Hkv, top_k), device="cuda", generator=g)
        host_map = slot_of_token.cpu().numpy()
        host_lru = lru.cpu().numpy()

        def device_path():
            slot = slot_of_token.gather(2, sel)
            miss = slot < 0
            rank = miss.to(torch.int32).cumsum(-1) - 1
            victim = lru.gather(2, rank.clamp(min=0).long())
            return torch.where(miss, victim, slot), miss

        def host_path():
            sel_h = sel.cpu().numpy()                           # device -> host (syncs)
            import numpy as np
            slot = np.take_along_axis(host_map, sel_h, axis=2)
            miss = slot < 0
            rank = np.maximum(np.cumsum(miss, axis=-1) - 1, 0)
            victim = np.take_along_axis(host_lru, rank, axis=2)
            out = np.where(miss, victim, slot)
            return torch.from_numpy(out).to("cuda", non_blocking=False)

        ms_dev = bench(device_path)
        ms_dev_graph = bench_graph(device_path)
        for _ in range(3):
            host_path()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            host_path()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        ms_host = sorted(times)[len(times) // 2]
        a = device_path()[0].cpu()
        b = host_path().cpu()
        same = bool(torch.equal(a, b))
        RESULTS["hit_detection"].append({"B": B, "device_ms": ms_dev, "device_graph_ms": ms_dev_graph,
                                         "host_round_trip_ms": ms_host, "agree": same})
        print(f"B={B:3d}: device {ms_dev:.4f} ms (graph {ms_dev_graph:.4f})  host round trip {ms_host:.4f} ms  "
              f"ratio {ms_host / ms_dev_graph:.1f}x  results agree: {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write all numbers as JSON here")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    ap.add_argument("--sweep", action="store_true", help="also time decode-kernel tile variants at batch 64")
    ap.add_argument("--only", default="swap,attention,quant,layouts,hit", help="comma list of sections")
    args = ap.parse_args()
    global SWEEP
    SWEEP = args.sweep
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels needs a CUDA GPU; run it on the device machine (benchmarks/gpu_kernels.sh)")
    props = torch.cuda.get_device_properties(0)
    RESULTS["device"] = {"name": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                         "triton": triton.__version__}
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    only = set(args.only.split(","))
    if SWEEP:
        only.add("scores_sweep")
    pool = pinned_pool()
    c = ceilings(pool)
    sections = [("scores_sweep", lambda: sweep_scores(c["hbm_copy_GBps"])),
                ("swap", lambda: bench_swap_in(pool, c["h2d_bulk_GBps"], args.quick)),
                ("attention", lambda: bench_attention(c["hbm_copy_GBps"], args.quick)),
                ("quant", lambda: bench_quant(c["hbm_copy_GBps"])),
                ("layouts", lambda: bench_layouts(pool, c["h2d_bulk_GBps"], c["hbm_copy_GBps"])),
                ("hit", bench_hit_detection)]
    for name, fn in sections:
        if name in only:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
                print(f"section {name} failed: {type(e).__name__}: {e}", flush=True)
                RESULTS.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)


if __name__ == "__main__":
    main()
