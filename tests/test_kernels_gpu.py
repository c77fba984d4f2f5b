"""Triton kernels on a CUDA GPU against their fp32 references (run on the H200: pytest -m gpu).

Odd shapes (T=63, D=60), both half dtypes, outputs poisoned with NaN before each call: in-place
destinations are filled with NaN, and for ops that allocate their result the caching allocator is
first handed a NaN-filled block, which torch.empty then reuses, so an unwritten element fails.
"""
import pytest
import torch

import hi_sparse.kernels as K

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def _poison_allocator(nbytes: int = 256 << 20) -> None:
    """Leave a NaN-filled block in torch's caching allocator for the next torch.empty to reuse."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Hq,Hkv,S,D,Kn", [
    (3, 32, 8, 300, 128, 63),       # few tokens, no split
    (1, 32, 8, 4096, 128, 2048),    # the benchmark shape at batch 1: split-K + merge
    (2, 8, 2, 257, 60, 200),        # non-power-of-2 head_dim
    (4, 12, 4, 500, 64, 1000),      # G = 3 (not a power of 2)
], ids=["k63", "k2048-split", "d60", "g3"])
def test_sparse_decode_attention(dtype, B, Hq, Hkv, S, D, Kn):
    torch.manual_seed(Kn + D)
    q = torch.randn(B, Hq, D, device="cuda").to(dtype)
    k = torch.randn(B, Hkv, S, D, device="cuda").to(dtype)
    v = torch.randn(B, Hkv, S, D, device="cuda").to(dtype)
    slots = torch.randint(0, S, (B, Hkv, Kn), device="cuda", dtype=torch.int32)
    slots[..., 5::11] = -1
    slots[-1, -1] = -1
    _poison_allocator()
    out = K.sparse_decode_attention(q, k, v, slots)
    torch.cuda.synchronize()
    ref = K.reference_sparse_decode_attention(q.float(), k.float(), v.float(), slots)
    assert out.dtype == dtype and out.shape == (B, Hq, D)
    assert _rel(out, ref) < TOL[dtype]
    assert bool((out[-1, -(Hq // Hkv):] == 0).all())


def test_sparse_decode_attention_64bit_offsets():
    """A hot buffer of more than 2^31 elements: slots near its end must be addressed correctly."""
    B, Hq, Hkv, D, S = 1, 4, 2, 128, (1 << 23) + 64          # 2.15e9 elements per buffer
    k = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, S, D, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(S - 100, S, device="cuda").repeat(B, Hkv, 1)
    out = K.sparse_decode_attention(q, k, v, slots)
    ref = K.reference_sparse_decode_attention(q.float(), k[:, :, -100:].float(), v[:, :, -100:].float(),
                                              torch.arange(100, device="cuda").repeat(B, Hkv, 1))
    assert _rel(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype,W", [(torch.bfloat16, 576), (torch.bfloat16, 128), (torch.float32, 60),
                                     (torch.uint8, 7), (torch.float16, 1000)],
                         ids=["bf16-1152B", "bf16-256B", "fp32-d60", "u8-7B", "fp16-2000B"])
def test_swap_in_from_pinned_host(dtype, W):
    src = (torch.randn(1000, W) * 50).to(dtype).pin_memory()
    dst = torch.zeros(300, W, device="cuda", dtype=dtype)
    if dtype.is_floating_point:
        dst.fill_(float("nan"))
    src_rows = torch.randperm(1000)[:200]
    dst_rows = torch.randperm(300)[:200].cuda()
    K.swap_in(src, src_rows, dst, dst_rows)
    torch.cuda.synchronize()
    assert torch.equal(dst[dst_rows].cpu(), src[src_rows])
    rest = torch.ones(300, dtype=torch.bool)
    rest[dst_rows.cpu()] = False
    if dtype.is_floating_point:
        assert bool(dst[rest.cuda()].isnan().all())


@pytest.mark.parametrize("where", ["registered", "pin_memory", "device"])
def test_gather_layers_reads_every_layer_at_its_address(where):
    """gather_layers on the GPU from a table of the sources' device addresses: host memory the pool
    page-locks in place (cudaHostRegister, pinned.pin), torch's pinned allocations, and device
    tensors (a bank's recent queries); -1 rows are zeros, every other row its layer's own."""
    from hi_sparse.pinned import pin
    g = torch.Generator().manual_seed(5)
    srcs = [(torch.randn(n, 8, 128, generator=g) * 20).to(torch.bfloat16) for n in (300, 257, 512)]
    if where == "registered":
        for t in srcs:
            pin(t)
    srcs = [t.pin_memory() if where == "pin_memory" else t.cuda() if where == "device" else t for t in srcs]
    # a column of a (M, 4) table, as a recalibration's bank rows are: every 4th element
    rows = torch.tensor([[r, 9999, -7, 1] for r in [256, -1, 0, 17, 255, -1, 3] * 40], device="cuda")[:, 0]
    _poison_allocator()
    out = K.gather_layers(srcs, rows)
    torch.cuda.synchronize()
    assert out.shape == (3, rows.numel(), 8, 128) and out.is_cuda
    for layer, t in enumerate(srcs):
        want = t.cuda()[rows.clamp_min(0)]
        want[rows < 0] = 0
        assert torch.equal(out[layer], want), layer


@pytest.mark.parametrize("where", ["registered", "pin_memory", "device"])
def test_scatter_layers_writes_every_layer_at_its_address(where):
    """scatter_layers on the GPU into a table of the destinations' device addresses (a seal's
    writes of its layers' units into the pool: host memory page-locked in place, torch's pinned
    allocations, or the bits' device mirrors): packed rows as a column slice of wider rows, 2-byte
    and 1-byte rows, each layer's own rows or shared ones; a row of -1 writes nothing."""
    from hi_sparse.pinned import pin
    g = torch.Generator().manual_seed(6)
    for row, dtype, own in (((64,), torch.uint8, False), ((), torch.float16, True), ((), torch.uint8, True)):
        wide = (row[0] + 32,) if row else ()
        dsts = [(torch.randn(n, *wide, generator=g) * 50).to(dtype) for n in (300, 257, 512)]
        if where == "registered":
            for t in dsts:
                pin(t)
        dsts = [t.pin_memory() if where == "pin_memory" else t.cuda() if where == "device" else t for t in dsts]
        before = [t.cpu() for t in dsts]
        views = [t[:, :row[0]] if row else t for t in dsts]
        shared = torch.tensor([256, -1, 0, 17, 255, -1, 3, 100, 42, 7, 200])      # each row once
        rows = torch.stack([shared, shared.roll(1), shared.roll(2)]) if own else shared
        src = (torch.randn(3, shared.numel(), *row, generator=g) * 50).to(dtype)
        _poison_allocator()
        K.scatter_layers(src.cuda(), views, rows.cuda())
        torch.cuda.synchronize()
        for layer, t in enumerate(dsts):
            r = rows[layer] if own else rows
            want = before[layer].clone()
            if row:
                want[r[r >= 0], :row[0]] = src[layer][r >= 0]
            else:
                want[r[r >= 0]] = src[layer][r >= 0]
            assert torch.equal(t.cpu(), want), (row, dtype, layer)


def test_swap_in_device_to_device():
    src = torch.randn(500, 128, device="cuda", dtype=torch.bfloat16)
    dst = torch.full((64, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    rows = torch.randperm(500, device="cuda")[:64]
    K.swap_in(src, rows, dst, torch.arange(64, device="cuda"))
    assert torch.equal(dst, src[rows])


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [60, 128])
def test_swap_in_dequant_from_pinned_host(bits, dtype, D):
    t = 63
    x = torch.randn(6, t, D)
    packed, scale, zero = K.reference_quantize_blocks(x, bits)
    flat = packed.reshape(6 * t, -1).pin_memory()
    src_rows = torch.randperm(6 * t)[:100]
    dst_rows = torch.randperm(150)[:100]
    dst = torch.full((150, D), float("nan"), device="cuda", dtype=dtype)
    K.swap_in_dequant(flat, scale.pin_memory(), zero.pin_memory(), bits, t, src_rows, dst, dst_rows.cuda())
    ref = torch.full((150, D), float("nan"), dtype=dtype)
    K.reference_swap_in_dequant(flat, scale, zero, bits, t, src_rows, ref, dst_rows)
    assert torch.equal(dst.cpu().isnan(), ref.isnan())
    assert _rel(dst.cpu()[dst_rows].float(), ref[dst_rows].float()) < 1e-3


LAYOUT_SHAPES = [(63, 60), (64, 64), (64, 128), (512, 128), (2100, 16)]


@pytest.mark.parametrize("layout", ["channel", "token"])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("T,D", LAYOUT_SHAPES, ids=[f"t{t}-d{d}" for t, d in LAYOUT_SHAPES])
def test_quantize_channel_and_token_layouts(layout, bits, T, D):
    """The host pool's layouts (keys per channel, values per token), bf16: every kernel path (the
    axis kernel's whole block, channel strips at 512 tokens, the general kernel at D=60 and for a
    2100-token channel strip), outputs poisoned; pairs as the reference's, codes a correct rounding
    against the kernel's own pair, the round trip through swap-in from pinned host memory."""
    n = 9
    x = (torch.randn(n, T, D, device="cuda") * torch.linspace(0.5, 20.0, D, device="cuda") + 3.0).to(torch.bfloat16)
    x[-1, :, 1] = 1.25                                 # a constant column
    x[-1, 2] = -0.5                                    # a constant row
    _poison_bytes(n * T * K.packed_width(D, bits))
    packed, scale, zero = K.quantize_blocks(x, bits, layout)
    rp, rs, rz = K.reference_quantize_blocks(x, bits, layout)
    assert packed.shape == rp.shape and scale.dtype == torch.float16 and scale.shape == rs.shape
    assert torch.equal(zero, rz) and torch.allclose(scale.float(), rs.float(), rtol=1e-3, atol=0)
    dims = 1 if layout == "channel" else 2
    s, z = scale.double().unsqueeze(dims), zero.double().unsqueeze(dims)
    exact = torch.where(s > 0, ((x.double() - z) / s.clamp_min(1e-30)).clamp(0, (1 << bits) - 1), 0.0)
    codes = K.unpack_codes(packed, bits, D).double()
    assert float((codes - exact).abs().max()) <= 0.5 + 1e-3
    flat = packed.reshape(n * T, -1).cpu().pin_memory()
    sc, zc = (scale.reshape(-1), zero.reshape(-1)) if layout == "token" else (scale, zero)
    sc, zc = sc.cpu().pin_memory(), zc.cpu().pin_memory()
    src_rows = torch.randperm(n * T)[:200]
    src_rows[:64] = torch.arange(64) + T                   # a run of one block
    dst_rows = torch.randperm(300)[:200]
    dst = torch.full((300, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    K.swap_in_dequant(flat, sc, zc, bits, T, src_rows, dst, dst_rows.cuda(), layout)
    ref = torch.full((300, D), float("nan"), dtype=torch.bfloat16)
    K.reference_swap_in_dequant(flat, sc, zc, bits, T, src_rows, ref, dst_rows, layout)
    assert torch.equal(dst.cpu().isnan(), ref.isnan())
    assert _rel(dst.cpu()[dst_rows].float(), ref[dst_rows].float()) < 1e-3


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,D", [(63, 60), (63, 128), (512, 128)], ids=["t63-d60", "t63-d128", "t512-d128"])
def test_quantize_dequantize(bits, dtype, T, D):
    x = (torch.randn(5, T, D, device="cuda") * torch.arange(1, 6, device="cuda")[:, None, None]).to(dtype)
    _poison_allocator()
    packed, scale, zero = K.quantize_blocks(x, bits)
    rp, rs, rz = K.reference_quantize_blocks(x, bits)
    assert torch.allclose(scale, rs, rtol=1e-6) and torch.equal(zero, rz)
    # a tie may round either way (the kernel multiplies by an exact reciprocal): require a correct
    # rounding of the exact value, and codes at most one step from the reference's
    codes = K.unpack_codes(packed, bits, D)
    exact = (x.double() - zero.double()[:, None, None]) / scale.double()[:, None, None]
    assert float((codes.double() - exact).abs().max()) <= 0.5 + 1e-3
    assert int((codes - K.unpack_codes(rp, bits, D)).abs().max()) <= 1
    _poison_allocator()
    out = K.dequantize_blocks(rp, rs, rz, bits, D, dtype=dtype)
    ref = K.reference_dequantize_blocks(rp, rs, rz, bits, D, dtype=torch.float32)
    assert out.dtype == dtype and _rel(out, ref) < TOL[dtype] / 4


@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(torch.float32, id="fp32")])
@pytest.mark.parametrize("D,L,bs", [(60, 63, 16), (128, 1000, 64), (128, 4096, 512)], ids=["d60-t63", "d128", "bs512"])
def test_block_bounds_and_scores(dtype, D, L, bs):
    k = torch.randn(8, L, D, device="cuda").to(dtype)
    _poison_allocator()
    kmin, kmax = K.block_bounds(k, bs)
    rmin, rmax = K.reference_block_bounds(k, bs)
    assert torch.equal(kmin, rmin) and torch.equal(kmax, rmax)
    q = torch.randn(3, 8, 4, D, device="cuda").to(dtype)
    lo, hi = kmin.expand(3, -1, -1, -1), kmax.expand(3, -1, -1, -1)
    _poison_allocator()
    s = K.block_scores(q, lo, hi)
    assert s.dtype == torch.float32 and _rel(s, K.reference_block_scores(q, lo, hi)) < 1e-5
    blocks = torch.randint(-1, kmin.shape[1], (3, 8, 37), device="cuda")
    _poison_allocator()
    sl = K.block_scores(q, lo, hi, blocks)
    ref = K.reference_block_scores(q, lo, hi, blocks)
    assert torch.equal(torch.isinf(sl), blocks < 0)
    assert _rel(torch.where(blocks >= 0, sl, 0.0), torch.where(blocks >= 0, ref, 0.0)) < 1e-5


def _poison_bytes(nbytes: int) -> None:
    """Drop torch's free cached blocks, then leave one 0xFF block of nbytes for the next allocation."""
    torch.cuda.empty_cache()
    junk = torch.full((nbytes,), 0xFF, device="cuda", dtype=torch.uint8)
    del junk


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("T,tuning", [
    (64, {}),                                        # default: words at 4/8 bits, twopass at 5/6
    (512, {}),                                       # default: relay
    (64, {"method": "fused"}),                       # fused, 8192 values: the whole block one register tile
    (512, {"method": "fused", "reg_cap": 65536, "fused_warps": 16}),   # a 512-row block as one register tile
    (64, {"method": "split"}),                       # partial min/max kernel, then the pack kernel
    (512, {"method": "split"}),
    (64, {"method": "words"}),                       # whole words per thread, 2D load
    (50, {"method": "words"}),                       # ragged block
    (64, {"method": "words", "load2d": False}),
    (64, {"method": "relay"}),                       # one kernel, input read once, min/max relayed
    (50, {"method": "relay", "pack_values": 1024}),  # ragged last row tile
    (512, {"method": "relay", "lag": 1, "pack_values": 8192, "pack_warps": 8}),   # waits on the block before
    (50, {"method": "twopass"}),                     # one program per block, second read from L2
    (512, {"method": "twopass", "prefetch": False, "pack_values": 8192, "fused_warps": 8}),
], ids=["default-t64", "default-t512", "fused-register-t64", "fused-register-t512",
        "split-t64", "split-t512", "words-t64", "words-t50", "words-3d-t64",
        "relay-t64", "relay-t50", "relay-lag1-t512", "twopass-t50", "twopass-no-prefetch-t512"])
def test_quantize_paths(bits, T, tuning):
    """Every D % 8 == 0 kernel of the Triton quantize (bf16, D=128) against the reference: the
    default (quantize_blocks' auto_method), and with benchmarks/quant_variants.py's methods and
    launch geometry (fused and split: the benchmarks' baselines)."""
    _check_quantize(bits, T, 128, tuning)


@pytest.mark.parametrize("bits", [5, 6, 8])
@pytest.mark.parametrize("D", [40, 48, 96])
@pytest.mark.parametrize("T,tuning", [(64, {"method": "fused"}), (50, {"method": "fused"}), (64, {"method": "split"})],
                         ids=["fused-register", "fused-register-ragged", "split"])
def test_quantize_word_and_byte_stores(bits, D, T, tuning):
    """Whole-word stores where rows hold whole word groups (6 bits: D=48, 96; 5 bits: D=96, the last of
    4 padded quads masked off; 8 bits: every D) and the byte stores otherwise (D=40; 5 bits D=48)."""
    _check_quantize(bits, T, D, tuning)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tuning", [
    {"method": "relay"}, {"method": "relay", "lag": 1}, {"method": "relay", "pack_values": 8192, "pack_warps": 8},
    {"method": "twopass"}, {"method": "auto"},
], ids=["relay", "relay-lag1", "relay-8192", "twopass", "auto"])
def test_quantize_matches_split_on_a_large_input(bits, tuning):
    """4096 blocks of 512 rows (the relay kernel: over a hundred thousand programs, many waves, each
    waiting on min / max others published; lag 1 waits on the programs just before): every byte,
    scale and zero point equals the split path's (same min / max, same reciprocal, same codes), so
    a partial read before it was published shows."""
    from benchmarks import quant_variants as Q
    torch.manual_seed(bits)
    x = (torch.randn(4096, 512, 128, device="cuda") * torch.rand(4096, 1, 1, device="cuda") * 10).to(torch.bfloat16)
    want = Q.quantize(x, bits, method="split")
    for _ in range(3):
        _poison_bytes(x.shape[0] * x.shape[1] * K.packed_width(128, bits))
        got = Q.quantize(x, bits, **tuning)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def _check_quantize(bits: int, T: int, D: int, tuning: dict) -> None:
    from benchmarks import quant_variants as Q
    n = 37
    x = (torch.randn(n, T, D, device="cuda") * torch.linspace(0.5, 20.0, n, device="cuda")[:, None, None])
    x = x.to(torch.bfloat16)
    x[-1] = 1.25                                     # a constant block: scale 0, every code 0
    _poison_bytes(n * T * K.packed_width(D, bits))
    packed, scale, zero = Q.quantize(x, bits, **tuning) if tuning else K.quantize_blocks(x, bits)
    rp, rs, rz = K.reference_quantize_blocks(x, bits)
    assert packed.shape == rp.shape
    assert torch.allclose(scale, rs, rtol=1e-6) and torch.equal(zero, rz) and float(scale[-1]) == 0.0
    # a tie may round either way (exact reciprocal times the offset): a correct rounding of the exact
    # value, at most one step from the reference's code
    codes = K.unpack_codes(packed, bits, D)
    safe = torch.where(scale > 0, scale, 1.0).double()[:, None, None]
    exact = torch.where(scale[:, None, None] > 0, (x.double() - zero.double()[:, None, None]) / safe, 0.0)
    assert float((codes.double() - exact).abs().max()) <= 0.5 + 1e-3
    assert int((codes - K.unpack_codes(rp, bits, D)).abs().max()) <= 1
    assert bool((codes[-1] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_level_candidates_match_the_reference(dtype):
    """The one-launch candidate kernel (super-blocks expanded in the kernel, limit masked)."""
    torch.manual_seed(3)
    B, H, G, D, nb, group = 3, 8, 4, 128, 1000, 16
    kmin = torch.randn(B, H, nb, D, device="cuda").to(dtype)
    kmax = (kmin.float() + torch.rand(B, H, nb, D, device="cuda")).to(dtype)
    q = torch.randn(B, H, G, D, device="cuda").to(dtype)
    smin, smax = K.superblock_bounds(kmin, kmax, group)
    limit = nb - 16
    _poison_allocator()
    blocks, sc = K.two_level_candidates(q, kmin, kmax, smin, smax, group, n_super=18, limit=limit)
    sup = K.top_blocks(K.reference_block_scores(q, smin, smax, limit=-(-limit // group)), 18)
    want = (sup[..., None] * group + torch.arange(group, device="cuda")).flatten(-2)
    want = torch.where(want < limit, want, -1)
    assert torch.equal(blocks.sort(-1).values, want.sort(-1).values)
    ref = K.reference_block_scores(q, kmin, kmax, blocks)
    ok = blocks >= 0
    assert torch.equal(torch.isinf(sc), ~ok)
    assert _rel(torch.where(ok, sc, 0.0), torch.where(ok, ref, 0.0)) < 1e-5


@pytest.mark.parametrize("tile,warps", [(2048, 0), (4096, 0), (8192, 0), (8192, 4), (16384, 16), (16384, 8)])
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("D", [64, 128, 60])
@pytest.mark.parametrize("layout", ["channel", "token"])
def test_layout_swap_in_at_every_row_tile(tile, warps, bits, D, layout, monkeypatch):
    """Each values-per-program and warps setting the layout benchmark sweeps (words,
    grouped and general kernels) dequantizes as the reference: runs of one block and rows of
    mixed blocks."""
    from hi_sparse.kernels import _quant_triton

    monkeypatch.setitem(_quant_triton.ROWS_TILE_VALUES, layout, tile)
    monkeypatch.setitem(_quant_triton.ROWS_WARPS, layout, warps)
    T, n = 64, 12
    x = (torch.randn(n, T, D, device="cuda") * torch.linspace(0.5, 20.0, D, device="cuda")).to(torch.bfloat16)
    packed, scale, zero = K.quantize_blocks(x, bits, layout)
    flat = packed.reshape(n * T, -1).cpu().pin_memory()
    sc, zc = scale.cpu().pin_memory(), zero.cpu().pin_memory()
    src_rows = torch.cat([torch.arange(128) + 3 * T, torch.randperm(n * T)[:77]])
    dst_rows = torch.randperm(256)[:src_rows.numel()]
    dst = torch.full((256, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    if layout == "token":
        sc, zc = sc.reshape(-1), zc.reshape(-1)
    K.swap_in_dequant(flat, sc, zc, bits, T, src_rows, dst, dst_rows.cuda(), layout)
    ref = torch.full((256, D), float("nan"), dtype=torch.bfloat16)
    K.reference_swap_in_dequant(flat, sc, zc, bits, T, src_rows, ref, dst_rows, layout)
    assert torch.equal(dst.cpu().isnan(), ref.isnan())
    assert _rel(dst.cpu()[dst_rows].float(), ref[dst_rows].float()) < 1e-3


@pytest.mark.parametrize("method,groups,warps", [
    ("strip", 1 << 30, 8), ("strip", 8, 4), ("strip", 4, 4), ("strip", 4, 2), ("strip", 2, 2), ("strip", 4, 1),
    ("twopass", 1024, 1), ("twopass", 2048, 2), ("twopass", 4096, 4), ("twopass", 8192, 4)])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("D", [64, 128])
def test_channel_quantize_at_every_strip(method, groups, warps, bits, D, monkeypatch):
    """Each strip width (or two-pass tile) and warp count the layout benchmark sweeps quantizes
    as the reference."""
    from hi_sparse.kernels import _quant_triton

    monkeypatch.setitem(_quant_triton.CHANNEL_QUANT, "method", method)
    if method == "twopass":
        monkeypatch.setitem(_quant_triton.CHANNEL_QUANT, "tile", groups)
        monkeypatch.setitem(_quant_triton.CHANNEL_QUANT, "warps", warps)
    monkeypatch.setitem(_quant_triton.CHANNEL_STRIP, "groups", groups)
    monkeypatch.setitem(_quant_triton.CHANNEL_STRIP, "warps", warps)
    x = (torch.randn(7, 64, D, device="cuda") * torch.linspace(0.5, 20.0, D, device="cuda")).to(torch.bfloat16)
    packed, scale, zero = K.quantize_blocks(x, bits, "channel")
    rp, rs, rz = K.reference_quantize_blocks(x, bits, "channel")
    assert torch.equal(zero, rz) and torch.allclose(scale.float(), rs.float(), rtol=1e-3, atol=0)
    codes, ref = K.unpack_codes(packed, bits, D).int(), K.unpack_codes(rp, bits, D).int()
    assert int((codes - ref).abs().max()) <= 1 and float((codes != ref).float().mean()) < 1e-3


@pytest.mark.parametrize("nb,take", [(512, 48), (2048, 48), (4096, 50), (300, 36)],
                         ids=["nb512", "nb2048", "nb4096", "nb300"])
def test_ranked_candidates_and_top_blocks_rank_like_a_stable_sort(nb, take):
    """The one-launch mask + ranking (kernels/select.py ranked_candidates) and top_blocks through
    it, compiled for the GPU: s as candidate_scores, top exactly a stable descending sort's first
    take columns (topk's scores, ties to the lower column, -inf ones in column order); rows with
    ties, negative scores, fewer candidates than take, none; NaN past a row's tokens."""
    from hi_sparse.kernels import _select_triton
    from hi_sparse.kernels.select import candidate_scores, ranked_candidates
    g = torch.Generator().manual_seed(nb)
    R, bs, window = 24, 64, 64
    n = torch.randint(window, nb * bs + 1, (R, 1), generator=g)
    n[0], n[1] = 10, window + (take // 2) * bs + 5
    first = torch.randint(0, 4 * bs, (R, 1), generator=g)
    scores = torch.randn(R, nb, generator=g)
    scores[2:6] = torch.randint(-3, 3, (4, nb), generator=g).float()          # ties
    scores[6] = -scores[6].abs()
    scores[torch.arange(nb)[None] * bs >= n] = float("nan")
    scores, n, first = scores.cuda(), n.cuda(), first.cuda()
    _poison_allocator()
    s, top = ranked_candidates(scores, n, first, window, bs, take)
    want_s = candidate_scores(scores, n, first, window, bs)
    assert torch.equal(s, want_s)
    assert torch.equal(top, torch.sort(want_s, dim=1, descending=True, stable=True).indices[:, :take])
    assert torch.equal(s.gather(1, top), want_s.topk(take, dim=1).values)
    x = torch.randn(3, 8, nb, device="cuda").to(torch.bfloat16)
    x[0] = x[0].round()                                                       # ties
    got = K.top_blocks(x, take)
    assert torch.equal(x.gather(-1, got).float().sort(-1).values, x.float().topk(take, dim=-1).values.sort(-1).values)
    flat = x.float().reshape(-1, nb)
    assert torch.equal(_select_triton.row_topk(x.reshape(-1, nb), take),
                       torch.sort(flat, dim=1, descending=True, stable=True).indices[:, :take])


@pytest.mark.parametrize("P,N,D,HID", [(32, 16384, 128, 64), (5, 1000, 60, 12)], ids=["llama-8b-fit", "odd"])
def test_fit_grads_match_the_torch_ops(P, N, D, HID):
    """A probe fit's gradients in one launch (TF32 dots on the keys' fp16 values) against the torch
    ops, the allocator poisoned first, padding rows included; and a whole fit ends near the torch
    fit (the same losses to 1 %)."""
    from hi_sparse.kernels.probe import fit_grads, reference_fit_grads
    from hi_sparse.probe import ImportanceProbe, fit_params

    g = torch.Generator().manual_seed(N)
    x = torch.randn(P, N, D, generator=g).half().float()
    y = torch.rand(P, N, generator=g) ** 8
    wn = torch.rand(P, N, generator=g) / N
    x[:, -N // 7:], y[:, -N // 7:], wn[:, -N // 7:] = 0, 0, 0
    params = [torch.randn(P, D, HID, generator=g) * D ** -0.5, torch.randn(P, HID, generator=g) * 0.1,
              torch.randn(P, HID, generator=g) * HID ** -0.5, torch.randn(P, generator=g) * 0.1]
    cuda = [t.cuda() for t in (x, y, wn, *params)]
    _poison_allocator()
    got, z = fit_grads(*cuda, want_z=True)
    want, want_z = reference_fit_grads(x, y, wn, *params)
    for a, b in zip(got, want):
        assert _rel(a.cpu(), b) < 1e-2
    assert _rel(z.cpu(), want_z) < 1e-3
    data = [(x[i, :N - N // 7].half(), y[i, :N - N // 7]) for i in range(P)]
    probes = [ImportanceProbe(D, seed=i) for i in range(P)]
    with torch.no_grad():
        _, cpu_loss = fit_params(probes, data, steps=30)
        _, gpu_loss = fit_params([p.cuda() for p in probes], [(k.cuda(), t.cuda()) for k, t in data], steps=30)
    assert gpu_loss.cpu() == pytest.approx(cpu_loss, rel=1e-2)


def test_the_fit_kernel_is_one_compile_for_every_row_count():
    """The fit kernel does not specialize on its row counts, which vary by recalibration (1, a
    multiple of 16 or not): the one kernel the engine loads at install (step_graph.warm_first_launches)
    serves every fit, and none is loaded beside a step. Each count's gradients still match."""
    from hi_sparse.kernels import _probe_triton
    from hi_sparse.kernels.probe import fit_grads, reference_fit_grads

    def kernels() -> int:
        return len(_probe_triton._fit_grads_kernel.device_caches[torch.cuda.current_device()][0])

    P, D, HID = 3, 128, 64
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(P, D, HID, generator=g) * D ** -0.5, torch.randn(P, HID, generator=g) * 0.1,
              torch.randn(P, HID, generator=g) * HID ** -0.5, torch.randn(P, generator=g) * 0.1]
    loaded = None
    for N in (16, 1, 37, 1000, 4096, 20000):
        x = torch.randn(P, N, D, generator=g).half().float()
        y, wn = torch.rand(P, N, generator=g), torch.rand(P, N, generator=g) / N
        for want_z in (False, True):
            got, _ = fit_grads(*(t.cuda() for t in (x, y, wn, *params)), want_z=want_z)
        loaded = kernels() if loaded is None else loaded
        assert kernels() == loaded, f"{N} rows compiled a kernel of their own"
        for a, b in zip(got, reference_fit_grads(x, y, wn, *params)[0]):
            assert _rel(a.cpu(), b) < 1e-2
