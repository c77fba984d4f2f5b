"""The plain-PyTorch references and the dispatchers' input checks (CPU, no Triton needed)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hi_sparse.kernels import (
    block_bounds,
    block_scores,
    dequantize_blocks,
    pack_codes,
    packed_width,
    quantize_blocks,
    reference_sparse_decode_attention,
    sparse_decode_attention,
    superblock_bounds,
    swap_in,
    swap_in_dequant,
    two_level_candidates,
    unpack_codes,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ---------------------------------------------------------------- attention
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (8, 2, 60), (6, 1, 64)], ids=["mha-d16", "gqa4-d60", "mqa-d64"])
def test_attention_with_every_slot_equals_dense_sdpa(hq, hkv, d):
    torch.manual_seed(0)
    B, S = 2, 37
    q = torch.randn(B, hq, d, dtype=torch.float64)
    k = torch.randn(B, hkv, S, d, dtype=torch.float64)
    v = torch.randn(B, hkv, S, d, dtype=torch.float64)
    slots = torch.randperm(S).repeat(B, hkv, 1)           # every slot once, in any order
    out = sparse_decode_attention(q.float(), k.float(), v.float(), slots.to(torch.int32))
    kk = k.repeat_interleave(hq // hkv, dim=1)
    vv = v.repeat_interleave(hq // hkv, dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], kk, vv)[:, :, 0]
    assert out.dtype == torch.float32
    assert _rel(out, dense) < 1e-5


def test_attention_ignores_padding_and_empty_rows_give_zeros():
    torch.manual_seed(1)
    B, Hq, Hkv, S, D = 2, 4, 2, 16, 8
    q, k, v = torch.randn(B, Hq, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    sel = torch.tensor([3, 7, 11])
    slots = torch.full((B, Hkv, 6), -1, dtype=torch.int64)
    slots[:, :, 1:4] = sel
    slots[1, 1] = -1                                       # sequence 1, kv head 1: nothing selected
    out = sparse_decode_attention(q, k, v, slots)
    compact = sparse_decode_attention(q, k, v, sel.repeat(B, Hkv, 1))
    assert torch.allclose(out[0], compact[0], atol=1e-6)
    assert torch.allclose(out[1, :2], compact[1, :2], atol=1e-6)
    assert torch.equal(out[1, 2:], torch.zeros(2, D))


def test_attention_scale_and_low_precision_dtype():
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 2, 32), torch.randn(1, 1, 8, 32), torch.randn(1, 1, 8, 32)
    slots = torch.arange(8).view(1, 1, 8)
    a = sparse_decode_attention(q, k, v, slots, scale=0.5)
    b = sparse_decode_attention(q * 0.5 / 32 ** -0.5, k, v, slots)
    assert torch.allclose(a, b, atol=1e-5)
    half = reference_sparse_decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), slots)
    upcast = sparse_decode_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), slots)
    assert half.dtype == torch.bfloat16 and _rel(half.float(), upcast) < 1e-2


@pytest.mark.parametrize("case,match", [
    (lambda q, k, s: (q[0], k, k, s), "q must be"),
    (lambda q, k, s: (q[:, :3], k, k, s), "multiple of Hkv"),
    (lambda q, k, s: (q, k, k, s.float()), "int32 or int64"),
    (lambda q, k, s: (q, k, k.half(), s), "share a dtype"),
    (lambda q, k, s: (q, k, k, s + 100), r"slots must lie in"),
    (lambda q, k, s: (q.int(), k.int(), k.int(), s), "unsupported"),
], ids=["q-rank", "gqa", "slot-dtype", "mixed-dtype", "slot-range", "int-q"])
def test_attention_rejects_bad_input_with_clear_message(case, match):
    q, k = torch.randn(1, 4, 8), torch.randn(1, 2, 5, 8)
    s = torch.zeros(1, 2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention(*case(q, k, s))


# ---------------------------------------------------------------- quantization
def test_pack_codes_bit_order_is_little_endian():
    assert pack_codes(torch.tensor([1, 2]), 4).tolist() == [0x21]
    # 5-bit codes 0b10101, 0b00011: stream bits 10101 11000 (LSB first) -> byte0 = 0b01110101, byte1 = 0b00
    assert pack_codes(torch.tensor([0b10101, 0b00011]), 5).tolist() == [0b01110101, 0b00]
    assert pack_codes(torch.tensor([0xAB, 0x01]), 8).tolist() == [0xAB, 0x01]


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("d", [60, 64, 7])
def test_pack_unpack_round_trip(bits, d):
    q = torch.randint(0, 1 << bits, (3, 5, d))
    packed = pack_codes(q, bits)
    assert packed.shape == (3, 5, packed_width(d, bits)) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits, d), q)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_quantize_error_is_within_half_a_step(bits):
    torch.manual_seed(bits)
    x = torch.randn(4, 63, 60) * torch.tensor([0.1, 1.0, 10.0, 100.0])[:, None, None]
    packed, scale, zero = quantize_blocks(x, bits)
    assert packed.shape == (4, 63, packed_width(60, bits))
    assert torch.allclose(zero, x.amin(dim=(1, 2)))
    assert torch.allclose(scale, (x.amax(dim=(1, 2)) - zero) / ((1 << bits) - 1))
    x_hat = dequantize_blocks(packed, scale, zero, bits, 60)
    err = (x_hat - x).abs().amax(dim=(1, 2))
    assert bool((err <= scale * 0.5 * (1 + 1e-4) + 1e-6).all()), (err, scale)
    assert dequantize_blocks(packed, scale, zero, bits, 60, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_quantize_constant_block_is_exact():
    x = torch.full((2, 4, 8), 3.25)
    packed, scale, zero = quantize_blocks(x, 4)
    assert torch.equal(scale, torch.zeros(2))
    assert torch.equal(dequantize_blocks(packed, scale, zero, 4, 8), x)


@pytest.mark.parametrize("layout", ["channel", "token"])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_channel_and_token_layouts_quantize_each_group_within_half_its_step(bits, layout):
    """Keys per channel, values per token: each column's (or row's) own fp16 zero and scale, every
    value within half a step of its group (plus the fp16 rounding of the zero point)."""
    torch.manual_seed(bits)
    x = torch.randn(3, 16, 64) * torch.logspace(-1, 2, 64) + 5.0          # channels of very different range
    packed, scale, zero = quantize_blocks(x, bits, layout)
    shape = (3, 64) if layout == "channel" else (3, 16)
    assert scale.shape == zero.shape == shape and scale.dtype == zero.dtype == torch.float16
    dims = 1 if layout == "channel" else 2
    assert torch.equal(zero, x.amin(dims).half())
    x_hat = dequantize_blocks(packed, scale, zero, bits, 64, layout=layout)
    s = scale.float().unsqueeze(dims)
    slack = (zero.float() - x.amin(dims)).abs().unsqueeze(dims) + 1e-3 * s
    assert bool(((x_hat - x).abs() <= 0.5 * s + slack + 1e-6).all())


def test_per_channel_keys_fit_outlier_channels_far_better_than_one_scale_per_block():
    """The reason for the layouts (docs/quality): one outlier channel spends a block-wide scale."""
    torch.manual_seed(0)
    k = torch.randn(8, 64, 64)
    k[..., 3] = k[..., 3] * 0.1 + 20.0                                     # a large, steady channel
    err = {}
    for layout in ("block", "channel", "token"):
        packed, scale, zero = quantize_blocks(k, 4, layout)
        k_hat = dequantize_blocks(packed, scale, zero, 4, 64, layout=layout)
        err[layout] = float((k_hat - k).norm() / k.norm())
    assert err["channel"] < err["token"] < err["block"] and err["channel"] < 0.2 * err["block"], err


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match=r"bits=3 unsupported"):
        quantize_blocks(torch.randn(1, 2, 4), 3)
    with pytest.raises(ValueError, match=r"\(N, T, D\)"):
        quantize_blocks(torch.randn(2, 4), 4)
    packed, scale, zero = quantize_blocks(torch.randn(1, 2, 4), 4)
    with pytest.raises(ValueError, match="needs 3"):
        dequantize_blocks(packed, scale, zero, 6, 4)
    with pytest.raises(ValueError, match="layout='rows' unknown"):
        quantize_blocks(torch.randn(1, 2, 4), 4, "rows")
    with pytest.raises(ValueError, match=r"must be \(1, 4\) for layout 'channel'"):
        dequantize_blocks(packed, scale, zero, 4, 4, layout="channel")
    packed, scale, zero = quantize_blocks(torch.randn(1, 2, 4), 4, "token")
    with pytest.raises(ValueError, match="pass what quantize_blocks returned"):
        dequantize_blocks(packed, scale.float(), zero.float(), 4, 4, layout="token")


# ---------------------------------------------------------------- bounds and scores
def test_block_bounds_cover_each_block_including_partial_last():
    torch.manual_seed(3)
    k = torch.randn(2, 63, 60)
    kmin, kmax = block_bounds(k, 16)
    assert kmin.shape == kmax.shape == (2, 4, 60)
    for b in range(4):
        blk = k[:, b * 16:(b + 1) * 16]
        assert torch.equal(kmin[:, b], blk.amin(1)) and torch.equal(kmax[:, b], blk.amax(1))


def test_block_scores_match_elementwise_definition_and_bound_q_dot_k():
    torch.manual_seed(4)
    hkv, g, length, d, bs = 2, 3, 50, 60, 8
    k, q = torch.randn(hkv, length, d), torch.randn(hkv, g, d)
    kmin, kmax = block_bounds(k, bs)
    s = block_scores(q, kmin, kmax)
    assert s.shape == (hkv, kmin.shape[1]) and s.dtype == torch.float32
    direct = torch.maximum(q[:, :, None] * kmin[:, None], q[:, :, None] * kmax[:, None]).sum(-1).amax(1)
    assert torch.allclose(s, direct, atol=1e-4)
    true = (q @ k.transpose(1, 2))                        # (Hkv, G, L)
    for b in range(kmin.shape[1]):
        assert bool((true[:, :, b * bs:(b + 1) * bs].amax(dim=(1, 2)) <= s[:, b] + 1e-4).all())
    batched = block_scores(q.expand(3, -1, -1, -1), kmin.expand(3, -1, -1, -1), kmax.expand(3, -1, -1, -1))
    assert batched.shape == (3, hkv, kmin.shape[1]) and torch.allclose(batched[2], s)


def test_block_scores_of_listed_blocks_equal_the_full_scores_gathered():
    torch.manual_seed(5)
    q, kmin = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 20, 16)
    kmax = kmin + torch.rand(2, 3, 20, 16)
    full = block_scores(q, kmin, kmax)
    blocks = torch.randint(-1, 20, (2, 3, 7))
    got = block_scores(q, kmin, kmax, blocks)
    assert got.shape == (2, 3, 7)
    want = torch.where(blocks >= 0, full.gather(-1, blocks.clamp(min=0)), float("-inf"))
    assert torch.equal(torch.isinf(got), blocks < 0) and torch.allclose(got, want, atol=1e-5)


def test_superblock_bounds_equal_bounds_of_the_coarser_blocks():
    torch.manual_seed(6)
    k = torch.randn(2, 203, 8)                   # 26 blocks of 8 (last partial), 4 super-blocks of 7
    kmin, kmax = block_bounds(k, 8)
    smin, smax = superblock_bounds(kmin, kmax, 7)
    cmin, cmax = block_bounds(k, 56)
    assert smin.shape == (2, 4, 8) and torch.equal(smin, cmin) and torch.equal(smax, cmax)


def test_two_level_candidates_take_a_limit_per_row():
    """A batch whose rows hold different numbers of blocks (NaN bounds past a row's last block)
    and window limits: each row gets what a call with its own limit gives."""
    g = torch.Generator().manual_seed(8)
    q, kmin = torch.randn(3, 2, 3, 16, generator=g), torch.randn(3, 2, 64, 16, generator=g)
    kmax = kmin + torch.rand(3, 2, 64, 16, generator=g)
    kmin[1, :, 30:], kmax[1, :, 30:] = float("inf"), float("-inf")      # row 1 holds 30 blocks
    smin, smax = superblock_bounds(kmin, kmax, 4)
    limits = torch.tensor([50, 27, 0])
    blocks, sc = two_level_candidates(q, kmin, kmax, smin, smax, 4, n_super=3, limit=limits[:, None])
    assert not torch.isnan(sc).any() and (blocks[2] == -1).all()
    for r, lim in enumerate(limits.tolist()[:2]):
        one_b, one_s = two_level_candidates(q[r:r + 1], kmin[r:r + 1], kmax[r:r + 1], smin[r:r + 1],
                                            smax[r:r + 1], 4, n_super=3, limit=lim)
        for h in range(2):
            assert sorted(blocks[r, h].tolist()) == sorted(one_b[0, h].tolist())
            assert torch.equal(torch.sort(sc[r, h]).values, torch.sort(one_s[0, h]).values)


def test_two_level_candidates_find_planted_blocks_and_cover_everything_when_wide():
    torch.manual_seed(7)
    hkv, g, d, bs, group = 2, 2, 32, 4, 8
    nb = 200
    k = torch.randn(hkv, nb * bs - 3, d) * 0.3
    q = torch.randn(hkv, g, d)
    planted = torch.tensor([[17, 90, 151], [3, 120, 199]])           # per head, one block each
    for h in range(hkv):
        for b in planted[h].tolist():
            k[h, b * bs] = q[h, 0] * 2.0                               # a key aligned with the query
    kmin, kmax = block_bounds(k, bs)
    smin, smax = superblock_bounds(kmin, kmax, group)
    blocks, sc = two_level_candidates(q, kmin, kmax, smin, smax, group, n_super=3)
    assert blocks.shape == sc.shape == (hkv, 3 * group)
    for h in range(hkv):
        best = blocks[h][sc[h].topk(3).indices]
        assert set(best.tolist()) == set(planted[h].tolist())
    full = block_scores(q, kmin, kmax)
    every, every_sc = two_level_candidates(q, kmin, kmax, smin, smax, group, n_super=10 ** 6)
    for h in range(hkv):
        valid = every[h] >= 0
        assert sorted(every[h][valid].tolist()) == list(range(nb))
        assert torch.allclose(every_sc[h][valid], full[h][every[h][valid]], atol=1e-5)
    # a limit keeps the candidates before it (e.g. before the always-selected window)
    lim_blocks, lim_sc = two_level_candidates(q, kmin, kmax, smin, smax, group, n_super=10 ** 6, limit=150)
    assert sorted(lim_blocks[0][lim_blocks[0] >= 0].tolist()) == list(range(150))
    assert bool(torch.isinf(lim_sc[lim_blocks < 0]).all())
    assert bool(torch.isinf(block_scores(q, kmin, kmax, limit=150)[:, 150:]).all())
    with pytest.raises(ValueError, match="rebuild them with superblock_bounds"):
        two_level_candidates(q, kmin, kmax, smin[:, :-1], smax[:, :-1], group, 3)


def test_bounds_reject_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        block_bounds(torch.randn(1, 4, 2), 0)
    with pytest.raises(ValueError, match="must be"):
        block_scores(torch.randn(2, 1, 4), torch.randn(2, 3, 5), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="int64"):
        block_scores(torch.randn(2, 1, 4), torch.randn(2, 3, 4), torch.randn(2, 3, 4),
                     torch.zeros(2, 2, dtype=torch.int32))


# ---------------------------------------------------------------- swap-in
def test_swap_in_copies_rows_in_place():
    src = torch.randn(10, 12)
    dst = torch.full((6, 12), float("nan"))
    swap_in(src, torch.tensor([9, 0, 4]), dst, torch.tensor([5, 1, 2]))
    assert torch.equal(dst[[5, 1, 2]], src[[9, 0, 4]])
    assert bool(dst[[0, 3, 4]].isnan().all())


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_swap_in_dequant_equals_dequantize_blocks(bits):
    torch.manual_seed(5)
    n, t, d = 3, 8, 60
    x = torch.randn(n, t, d)
    packed, scale, zero = quantize_blocks(x, bits)
    ref = dequantize_blocks(packed, scale, zero, bits, d).reshape(n * t, d)
    dst = torch.full((5, d), float("nan"))
    rows = torch.tensor([23, 0, 9, 16])
    swap_in_dequant(packed.reshape(n * t, -1), scale, zero, bits, t, rows, dst, torch.tensor([4, 0, 1, 2]))
    assert torch.equal(dst[[4, 0, 1, 2]], ref[rows])
    assert bool(dst[3].isnan().all())


@pytest.mark.parametrize("layout", ["channel", "token"])
def test_swap_in_dequant_in_a_layout_equals_dequantize_blocks(layout):
    torch.manual_seed(6)
    n, t, d = 3, 8, 64
    packed, scale, zero = quantize_blocks(torch.randn(n, t, d), 4, layout)
    ref = dequantize_blocks(packed, scale, zero, 4, d, layout=layout).reshape(n * t, d)
    if layout == "token":                                                  # one pair per row
        scale, zero = scale.reshape(-1), zero.reshape(-1)
    dst = torch.full((5, d), float("nan"))
    rows = torch.tensor([23, 0, 9, 16])
    swap_in_dequant(packed.reshape(n * t, -1), scale, zero, 4, t, rows, dst, torch.tensor([4, 0, 1, 2]), layout)
    assert torch.equal(dst[[4, 0, 1, 2]], ref[rows])
    assert bool(dst[3].isnan().all())
    with pytest.raises(ValueError, match=f"scale and zero of layout '{layout}' must be"):
        swap_in_dequant(packed.reshape(n * t, -1), scale[:1], zero[:1], 4, t, rows, dst, rows, layout)


def test_swap_in_dequant_pair_equals_two_swap_ins_and_checks_both():
    """Keys (channel pairs) and values (token pairs) at the same rows, -1 included, as two
    swap_in_dequant calls; a bad argument of either set is rejected."""
    from hi_sparse.kernels.swap_in import swap_in_dequant_pair
    torch.manual_seed(7)
    n, t, d = 3, 8, 64
    sets = []
    for layout in ("channel", "token"):
        packed, scale, zero = quantize_blocks(torch.randn(n, t, d), 4, layout)
        if layout == "token":                                              # one pair per row
            scale, zero = scale.reshape(-1), zero.reshape(-1)
        sets.append((packed.reshape(n * t, -1), scale, zero, layout))
    rows, dst_rows = torch.tensor([23, -1, 0, 9, 16]), torch.tensor([4, 3, 0, 1, 2])
    got = [torch.full((6, d), float("nan")) for _ in range(2)]
    want = [x.clone() for x in got]
    swap_in_dequant_pair(*sets[0], *sets[1], 4, t, rows, got[0], got[1], dst_rows)
    for (packed, scale, zero, layout), dst in zip(sets, want):
        swap_in_dequant(packed, scale, zero, 4, t, rows, dst, dst_rows, layout)
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(got, want))
    assert bool(got[1][[3, 5]].isnan().all())
    k, (pv, sv, zv, lv) = sets
    with pytest.raises(ValueError, match="scale and zero of layout 'token' must be"):
        swap_in_dequant_pair(*k, pv, sv[:1], zv[:1], lv, 4, t, rows, got[0], got[1], dst_rows)
    with pytest.raises(ValueError, match="bits=3 unsupported"):
        swap_in_dequant_pair(*k, *sets[1], 3, t, rows, got[0], got[1], dst_rows)


def test_swap_in_rejects_bad_input():
    with pytest.raises(ValueError, match="row widths differ"):
        swap_in(torch.randn(3, 4), torch.tensor([0]), torch.randn(3, 5), torch.tensor([0]))
    with pytest.raises(ValueError, match="one length"):
        swap_in(torch.randn(3, 4), torch.tensor([0, 1]), torch.randn(3, 4), torch.tensor([0]))
    with pytest.raises(ValueError, match="uint8"):
        swap_in_dequant(torch.zeros(4, 2), torch.ones(1), torch.zeros(1), 4, 4, torch.tensor([0]),
                        torch.zeros(2, 4), torch.tensor([0]))


# ---------------------------------------------------------------- dispatch
def test_cpu_tensors_use_the_reference_and_never_load_triton_kernels():
    code = (
        "import sys, torch\n"
        "from hi_sparse.kernels import sparse_decode_attention, quantize_blocks\n"
        "sparse_decode_attention(torch.randn(1,2,8), torch.randn(1,1,4,8), torch.randn(1,1,4,8), "
        "torch.zeros(1,1,2,dtype=torch.long))\n"
        "quantize_blocks(torch.randn(1,2,8), 4)\n"
        "print(sorted(m for m in sys.modules if m.startswith('hi_sparse.kernels._') and m.endswith('_triton')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_package_imports_and_runs_without_triton_installed():
    code = (
        "import sys; sys.modules['triton'] = None\n"   # makes `import triton` raise ImportError
        "import torch, os\n"
        "os.environ['HISPARSE_FORCE_TRITON'] = '1'\n"
        "from hi_sparse.kernels import block_bounds\n"
        "kmin, kmax = block_bounds(torch.randn(1, 5, 4), 2)\n"
        "print(tuple(kmin.shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(1, 3, 4)"


@pytest.mark.parametrize("nb,n", [(100, 7), (20000, 16), (5000, 300)], ids=["short", "two-stage", "large-n"])
def test_top_blocks_selects_the_same_set_as_topk(nb, n):
    from hi_sparse.kernels import top_blocks
    s = torch.randn(3, 2, nb)
    s[..., -5:] = float("-inf")
    got = top_blocks(s, n)
    want = s.topk(n, dim=-1).indices
    assert got.shape == (3, 2, n)
    assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    with pytest.raises(ValueError, match="must be in 1"):
        top_blocks(s, nb + 1)


@pytest.mark.parametrize("nb", [100, 20000], ids=["short", "two-stage"])
def test_top_blocks_rank_nan_lowest(nb):
    """A NaN bound (torch.topk ranks NaN first) never takes the place of a scored block: the same
    as the Triton ranking (kernels_interpret_cases: top_blocks-kernel-*, NaN below -inf there)."""
    from hi_sparse.kernels import top_blocks
    s = torch.randn(2, nb)
    s[:, ::3] = float("nan")
    s[:, 1::3] = float("-inf")
    scored = list(range(2, nb, 3))
    got = top_blocks(s, len(scored))
    assert sorted(got[0].tolist()) == sorted(got[1].tolist()) == scored


def test_the_checkout_kernels_folder_hands_the_top_level_name_to_the_installed_package(tmp_path):
    """From a checkout's root (on sys.path under `python -m` / `-c`) `import kernels` must reach
    the installed package of that name (Hugging Face's, which transformers imports whenever it is
    installed)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import importlib.util, sys\nsys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
            "sys.path.insert(0, %r)\n%s")

    def run(site: Path, body: str) -> list[str]:
        res = subprocess.run([sys.executable, "-c", code % (str(site), body)], cwd=root, capture_output=True,
                             text=True, timeout=60, env=env)
        assert res.returncode == 0, res.stderr
        return res.stdout.split()

    installed = tmp_path / "site" / "kernels"            # a stand-in for the installed package
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("from kernels.part import VALUE\n")
    (installed / "part.py").write_text("VALUE = 'installed'\n")
    assert run(tmp_path / "site", "import kernels; print(kernels.VALUE)") == ["installed"]


def test_with_no_installed_kernels_package_the_checkout_folder_imports_as_itself(monkeypatch):
    """Where no other "kernels" is installed, the folder imports under that name as itself (as
    before the hand-over: transformers then finds no hub kernels in it)."""
    import importlib.machinery
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    find = importlib.machinery.PathFinder.find_spec
    monkeypatch.setattr(importlib.machinery.PathFinder, "find_spec", classmethod(
        lambda cls, name, path=None, target=None: None if name == "kernels" else find(name, path, target)))
    spec = importlib.util.spec_from_file_location("kernels", root / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(root / "kernels")])
    module = importlib.util.module_from_spec(spec)
    saved = {k: v for k, v in sys.modules.items() if k == "kernels" or k.startswith("kernels.")}
    monkeypatch.setitem(sys.modules, "kernels", module)
    try:
        spec.loader.exec_module(module)
        assert sys.modules["kernels"] is module and callable(module.rms_norm)
    finally:
        for k in [k for k in sys.modules if k == "kernels" or k.startswith("kernels.")]:
            del sys.modules[k]
        sys.modules.update(saved)
