"""Where the fused register-tile quantize loses time at 8 bits (issue 6): variants that differ in one
stage each, timed against the HBM copy rate, for a profiler (ncu) and for differences in time.

    python benchmarks/diag_quant.py --stages           # times every one-stage variant below
    ncu -k regex:diag_ --section SpeedOfLight ... python benchmarks/diag_quant.py --stages --once
    python benchmarks/diag_quant.py --words            # the words path's units and loads, every bit width
    python benchmarks/diag_quant.py --relay            # the relay kernel: tiles, warps, lag
    python benchmarks/diag_quant.py --twopass          # the twopass kernel: tiles, warps, prefetch

Blocks of 64 x 128 bf16 (the runtime's host-pool unit), 16,384 of them (268 MB). Variants:
  fused4 / fused8  the runtime's fused kernel (_quantize_fused_kernel) at 4 / 8 bits
  bytes8           8-bit codes stored as they are (one uint8 per value, 8 contiguous per group)
  word64_8         8 codes summed into one int64 word per group (the 4-bit path's shape at 8 bits)
  join8            two int32 words per group (codes 0-3, 4-7) by masked in-thread sums, joined
  nostore8         8-bit codes computed, one checksum per block stored: load + reduce + codes only
  store4x2         the 4-bit words stored twice (to two buffers): output bytes doubled at 4 bits
Every variant that writes a packed 8-bit layout is checked against fused8's bytes.
"""
from __future__ import annotations

import argparse
import json

import quant_variants as V  # run as `python benchmarks/diag_quant.py`
import torch
import triton
import triton.language as tl
from bench_kernels import bench, hbm_copy_rate

from hi_sparse.kernels import _quant_triton as Q


@triton.jit
def diag_kernel(p_x, p_out, p_out2, p_scale, p_zero, T, D, P,
                BITS: tl.constexpr, MODE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr):
    i_n = tl.program_id(0).to(tl.int64)
    o_t, o_g, o_i = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_G), tl.arange(0, 8)
    b_x, m = Q._load_units(p_x + i_n * T * D, o_t, T, D, 8, BLOCK_T, BLOCK_G, False)   # as the fused kernel
    lo, hi = Q._tile_min_max(b_x, m)
    inv = Q._block_params(p_scale, p_zero, i_n, lo, hi, BITS, True)
    b_c = Q._codes(b_x, lo, inv, BITS)
    p_on = p_out + i_n * T * P
    if MODE == 0:      # bytes8
        p_o = p_on + o_t[:, None, None] * P + o_g[None, :, None] * 8 + o_i[None, None, :]
        tl.store(p_o, b_c.to(tl.uint8), mask=m[:, :, None])
    elif MODE == 1:    # word64_8
        b_w = tl.sum(b_c.to(tl.int64) << (o_i * 8).to(tl.int64)[None, None, :], 2)
        p_w = p_on.to(tl.pointer_type(tl.int64)) + o_t[:, None] * (P // 8) + o_g[None, :]
        tl.store(p_w, b_w, mask=m)
    elif MODE == 2:    # join8
        sh = ((o_i % 4) * 8)[None, None, :]
        w_lo = tl.sum(tl.where((o_i < 4)[None, None, :], b_c << sh, 0), 2)
        w_hi = tl.sum(tl.where((o_i >= 4)[None, None, :], b_c << sh, 0), 2)
        b_w = tl.join(w_lo, w_hi)                                               # (T, G, 2)
        p_w = p_on.to(tl.pointer_type(tl.int32)) + o_t[:, None, None] * (P // 4) + \
            o_g[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
        tl.store(p_w, b_w, mask=m[:, :, None])
    elif MODE == 3:    # nostore8
        tl.store(p_on.to(tl.pointer_type(tl.int32)), tl.sum(tl.sum(tl.sum(b_c, 2), 1), 0))
    else:              # store4x2
        b_w = tl.sum(b_c << (o_i * 4)[None, None, :], 2)
        p_w = p_on.to(tl.pointer_type(tl.int32)) + o_t[:, None] * (P // 4) + o_g[None, :]
        tl.store(p_w, b_w, mask=m)
        p_w2 = (p_out2 + i_n * T * P).to(tl.pointer_type(tl.int32)) + o_t[:, None] * (P // 4) + o_g[None, :]
        tl.store(p_w2, b_w, mask=m)


MODES = {"bytes8": (0, 8), "word64_8": (1, 8), "join8": (2, 8), "nostore8": (3, 8), "store4x2": (4, 4)}


def run(name: str, x: torch.Tensor, warps: int = 4):
    n, t, d = x.shape
    if name in ("fused4", "fused8"):
        bits = int(name[-1])
        return (lambda: V.quantize(x, bits, method="fused", fused_warps=warps)), bits, 1
    mode, bits = MODES[name]
    p = d * bits // 8
    out = torch.zeros(n, t, p, device=x.device, dtype=torch.uint8)
    out2 = torch.zeros_like(out)
    scale = torch.empty(n, device=x.device)
    zero = torch.empty_like(scale)

    def fn():
        diag_kernel[(n,)](x, out, out2, scale, zero, t, d, p, BITS=bits, MODE=mode, BLOCK_T=t,
                          BLOCK_G=d // 8, num_warps=warps)
        return out, scale, zero
    return fn, bits, 2 if name == "store4x2" else 1


WORDS_SWEEP = {   # bits: (unit codes, word bits) options of method="words"
    4: [(8, 32), (16, 64)], 5: [(32, 32), (64, 64)], 6: [(16, 32), (32, 64)], 8: [(8, 64), (16, 64)],
}


RELAY_SWEEP = [   # values per program, warps, lag in programs (rounded up to whole blocks; 0: the default)
    (2048, 2, 0), (2048, 2, 64), (2048, 2, 4096), (2048, 1, 0), (4096, 4, 0), (4096, 4, 2048), (8192, 8, 2048),
    (1024, 2, 0),
]
TWOPASS_SWEEP = [   # values per tile, warps, prefetch
    (2048, 2, True), (2048, 2, False), (4096, 4, True), (4096, 4, False), (1024, 1, True), (1024, 2, False),
    (2048, 4, False), (8192, 8, True),
]


def _variants(mode: str, shape: tuple[int, int, int], bits: int, words: bool) -> list[tuple[str, dict]]:
    """The variants of one sweep mode: "words" (split's pack settings, and at 64 tokens fused and
    every words unit / load / warps), "relay" (RELAY_SWEEP) or "twopass" (TWOPASS_SWEEP), each
    after the default path and split."""
    out = [("default (auto)", {}), ("split", {"method": "split"})]
    if mode == "relay":
        out.append(("twopass 2048 w2", {"method": "twopass", "pack_values": 2048, "fused_warps": 2}))
        for v, w, lag_programs in RELAY_SWEEP:
            lag = -(-lag_programs // (shape[1] * shape[2] // v))
            out.append((f"relay {v} w{w} lag {f'{lag} blocks' if lag else 'default'}",
                        {"method": "relay", "pack_values": v, "pack_warps": w, "lag": lag}))
        return out
    if mode == "twopass":
        out += [(f"twopass {v} w{w}{'' if pf else ' no prefetch'}",
                 {"method": "twopass", "pack_values": v, "fused_warps": w, "prefetch": pf})
                for v, w, pf in TWOPASS_SWEEP]
        return out
    out.append(("split pack 3d", {"method": "split", "pack_load2d": False}))
    out += [(f"split pack {v} w{w}", {"method": "split", "pack_values": v, "pack_warps": w})
            for v, w in ((1024, 2), (1024, 4), (2048, 2), (4096, 4), (4096, 8), (8192, 8))]
    if shape[1] == 64 and words:
        out.append(("fused", {"method": "fused"}))
        out += [(f"words u{unit[0]}/{unit[1]} {'2d' if load2d else '3d'} w{warps}",
                 {"method": "words", "unit": unit, "load2d": load2d, "fused_warps": warps})
                for unit in WORDS_SWEEP[bits] for load2d in (True, False) for warps in (4, 8)]
    elif words:
        out += [(f"words u{WORDS_SWEEP[bits][0]} 2d w{warps} cap64K",
                 {"method": "words", "unit": WORDS_SWEEP[bits][0], "reg_cap": 65536, "fused_warps": warps})
                for warps in (8, 16)]
    return out


def words_sweep(json_path: str | None, bits_list=(4, 5, 6, 8), words: bool = True, mode: str = "words") -> None:
    """Quantize variants (_variants(mode)) on 64 x 128 blocks and the 512-token blocks; bytes =
    bf16 input + packed output; every variant's bytes checked against split's."""
    hbm = hbm_copy_rate()
    print(f"HBM copy {hbm:.0f} GB/s", flush=True)
    rows = []
    for shape in ((16384, 64, 128), (2048, 512, 128)):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        for bits in bits_list:
            ref = V.quantize(x, bits, method="split")[0]
            moved = x.numel() * 2 + ref.numel()
            variants = _variants(mode, shape, bits, words)
            for name, kw in variants:
                try:
                    same = bool(torch.equal(V.quantize(x, bits, **kw)[0], ref))
                    ms = bench(lambda x=x, kw=kw: V.quantize(x, bits, **kw), warmup=10, rep=40)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported
                    print(f"  {shape[1]}t {bits}b {name:28s} failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                pct = 100 * moved / ms / 1e6 / hbm
                rows.append({"shape": list(shape), "bits": bits, "variant": name, "ms": ms, "pct_hbm": pct,
                             "bytes": moved, "matches_split": same})
                print(f"  {shape[1]}t {bits}b {name:28s} {ms:.4f} ms {moved / ms / 1e6:7.1f} GB/s {pct:5.1f} %"
                      f"{'' if same else '  BYTES DIFFER FROM SPLIT'}", flush=True)
        del x
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"hbm_GBps": hbm, "rows": rows}, f, indent=1)


NCU_VARIANTS = [   # (tokens per block, bits, quantize keywords): one launch each for `--ncu`
    (64, 4, {"method": "twopass", "pack_values": 2048, "fused_warps": 2}),
    (512, 4, {"method": "twopass", "pack_values": 2048, "fused_warps": 2}),
    (512, 4, {"method": "twopass", "pack_values": 8192, "fused_warps": 8}),
    (512, 4, {"method": "relay", "pack_values": 2048, "pack_warps": 2, "lag": 32}),
    (512, 4, {"method": "split"}),
]


def ncu_launches() -> None:
    """Each NCU_VARIANTS entry launched once on its 268 MB input, for a profiler:

    ncu --clock-control none -k 'regex:quantize|pack|minmax' --metrics dram__bytes_read.sum,
    dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum,
    sm__warps_active.avg.pct_of_peak_sustained_active python benchmarks/diag_quant.py --ncu
    """
    for t, bits, kw in NCU_VARIANTS:
        x = torch.randn(268435456 // 2 // (t * 128), t, 128, device="cuda", dtype=torch.bfloat16)
        V.quantize(x, bits, **kw)
        torch.cuda.synchronize()
        print(f"launched {t}t {bits}b {kw}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", action="store_true", help="the one-stage variants (diag_kernel)")
    ap.add_argument("--words", action="store_true", help="the words path sweep")
    ap.add_argument("--once", action="store_true", help="with --stages: launch each variant twice, no timing (ncu)")
    ap.add_argument("--bits", default="4,5,6,8", help="with --words: bit widths")
    ap.add_argument("--split-only", action="store_true", help="with --words: only the split path's variants")
    ap.add_argument("--relay", action="store_true", help="the relay kernel's sweep")
    ap.add_argument("--twopass", action="store_true", help="the twopass kernel's sweep")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ncu", action="store_true", help="launch NCU_VARIANTS once each (for ncu)")
    args = ap.parse_args()
    if args.ncu:
        ncu_launches()
    if args.words or args.relay or args.twopass:
        mode = "relay" if args.relay else "twopass" if args.twopass else "words"
        words_sweep(args.json, [int(b) for b in args.bits.split(",")], not args.split_only, mode)
    if not args.stages:
        return
    x = torch.randn(16384, 64, 128, device="cuda", dtype=torch.bfloat16)
    names = ["fused4", "fused8", "bytes8", "word64_8", "join8", "nostore8", "store4x2"]
    if args.once:
        for name in names:
            fn = run(name, x)[0]
            fn()
            fn()
        torch.cuda.synchronize()
        return
    hbm = hbm_copy_rate()
    ref = V.quantize(x, 8, method="fused")[0]
    rows = []
    print(f"HBM copy {hbm:.0f} GB/s; 16384 x 64 x 128 bf16", flush=True)
    for name in names:
        for warps in (4, 8):
            fn, bits, outs = run(name, x, warps)
            res = fn()
            same = None
            if bits == 8 and name != "nostore8":
                same = bool(torch.equal(res[0], ref))
            ms = bench(fn, warmup=10, rep=50)
            written = 0 if name == "nostore8" else outs * x.numel() * bits // 8
            moved = x.numel() * 2 + written
            pct = 100 * moved / ms / 1e6 / hbm
            rows.append({"variant": name, "warps": warps, "ms": ms, "bytes": moved, "pct_hbm": pct,
                         "matches_fused8": same})
            print(f"  {name:10s} warps {warps}: {ms:.4f} ms, {moved / ms / 1e6:7.1f} GB/s, {pct:5.1f} % "
                  f"(bytes {moved / 1e6:.0f} MB){'' if same is None else f', bytes match fused8: {same}'}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hbm_GBps": hbm, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
