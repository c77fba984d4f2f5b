"""Quantization error bounds per bit width, and the bit-width policies on constructed blocks.

Bounds (asymmetric uniform, step Delta = range / (2^b - 1)):
- hard: every element is within Delta / 2, so ||x - x_hat|| <= Delta / 2 * sqrt(n);
- typical on Gaussian units: rounding error ~ uniform, RMS Delta / sqrt(12), so the relative error
  is within 15 % of range / ((2^b - 1) * sqrt(12) * rms(x)): ~0.13, 0.062, 0.030, 0.0075 for
  4, 5, 6, 8 bits on N(0, 1) units of 16 x 64 values.
"""

import math

import pytest
import torch

from hi_sparse.kernels import dequantize_blocks, quantize_blocks
from hi_sparse.quant_policy import (
    LAYOUT,
    ErrorBudgetPolicy,
    FixedBits,
    SeedBimodalPolicy,
    peak_separation,
    quantize_roundtrip,
    relative_error,
)

EXPECTED = {4: 0.13, 5: 0.062, 6: 0.030, 8: 0.0075}  # documented in hi_sparse.quant_policy


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_error_bounds_on_gaussian_blocks(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(32, 16, 64, generator=g)
    packed, scale, zero = quantize_blocks(x, bits)
    x_hat = dequantize_blocks(packed, scale, zero, bits, 64)
    err = relative_error(x, x_hat)
    n = 16 * 64
    rng = (x.amax((1, 2)) - x.amin((1, 2)))
    step = rng / (2 ** bits - 1)
    # hard bound, element-wise and in norm
    assert ((x - x_hat).abs() <= step[:, None, None] / 2 + 1e-5).all()
    assert (err <= (step / 2 * math.sqrt(n)) / x.flatten(1).norm(dim=1) + 1e-6).all()
    # typical bound from the uniform rounding model
    rms = x.flatten(1).pow(2).mean(1).sqrt()
    model = step / math.sqrt(12) / rms
    assert ((err - model).abs() <= 0.15 * model).all()
    assert abs(err.mean().item() - EXPECTED[bits]) <= 0.15 * EXPECTED[bits]


def _bimodal(n, sep, g):
    sign = torch.where(torch.rand(n, 16, 64, generator=g) < 0.5, -1.0, 1.0)
    return sign * sep / 2 + 0.3 * torch.randn(n, 16, 64, generator=g)


def test_seed_rule_splits_bimodal_blocks_and_keeps_unimodal_at_int5():
    g = torch.Generator().manual_seed(0)
    uni = torch.randn(6, 16, 64, generator=g)
    bi = _bimodal(6, 4.0, g)
    near = _bimodal(6, 0.2, g)  # two modes closer than their spread: one peak
    assert (peak_separation(uni) == 0).all()
    assert (peak_separation(bi) > 0.5).all()
    assert (peak_separation(near) <= 0.15).all()
    pol = SeedBimodalPolicy()
    kb, vb = pol.choose(torch.cat([uni, bi, near]), torch.cat([uni, uni, uni]))
    assert kb.tolist() == [5] * 6 + [6] * 6 + [5] * 6
    assert vb.tolist() == [5] * 6 + [4] * 6 + [5] * 6
    assert (kb + vb == 10).all()  # 5 bits per value on average either way


def test_error_budget_policy_picks_fewest_bits_within_budget():
    g = torch.Generator().manual_seed(1)
    base = torch.randn(4, 16, 32, generator=g)
    blocks = torch.cat([base, base + 1.5, base + 3.5, base + 8.0])   # larger offset -> smaller error
    kb, vb = ErrorBudgetPolicy(0.02).choose(blocks, blocks)
    # keys per channel, values per token (the host pool's layouts): errors under one scale per
    # block would need 8 bits for the first four
    assert kb.tolist() == [6] * 4 + [5] * 4 + [4] * 8
    for chosen, layout in ((kb, LAYOUT["k"]), (vb, LAYOUT["v"])):
        assert len(set(chosen.tolist())) >= 3
        for b, x in zip(chosen.tolist(), blocks):
            assert quantize_roundtrip(x[None], b, layout)[3].item() <= 0.02
            if b > 4:
                fewer = {8: 6, 6: 5, 5: 4}[b]
                assert quantize_roundtrip(x[None], fewer, layout)[3].item() > 0.02
    assert quantize_roundtrip(blocks[:4], 6, "block")[3].max().item() > 0.02
    assert FixedBits(6).choose(blocks, blocks)[0].eq(6).all()


def test_auto_picks_by_measured_error_within_four_to_six_bits():
    """host_kv_bits="auto": per unit the fewest of 4/5/6 bits within the budget (0.03 unless
    quant_error_budget says otherwise), the widest (6) where none is; "seed" is the bimodal rule."""
    from hi_sparse.quant_policy import AUTO_ERROR_BUDGET, make_policy, max_bits

    g = torch.Generator().manual_seed(2)
    base = torch.randn(4, 16, 32, generator=g)
    blocks = torch.cat([base, base + 1.5, base + 8.0, base * 0 + torch.linspace(-1, 1, 32)])
    pol = make_policy("auto")
    assert pol == ErrorBudgetPolicy(AUTO_ERROR_BUDGET, (4, 5, 6)) and max_bits("auto") == 6
    assert AUTO_ERROR_BUDGET == 0.03        # the default docs/runtime.md states
    kb, vb = pol.choose(blocks, blocks)
    for chosen, layout in ((kb, LAYOUT["k"]), (vb, LAYOUT["v"])):
        assert set(chosen.tolist()) <= {4, 5, 6} and len(set(chosen.tolist())) >= 2
        for b, x in zip(chosen.tolist(), blocks):
            err = quantize_roundtrip(x[None], b, layout)[3].item()
            assert err <= AUTO_ERROR_BUDGET or b == 6
            if b > 4:
                assert quantize_roundtrip(x[None], b - 1, layout)[3].item() > AUTO_ERROR_BUDGET
    # a tighter budget than 6 bits can meet stops at 6 (rows are sized for 6), where "budget" goes to 8
    # (the last four blocks are constant per channel: exact at any width, so 4 bits either way)
    tight_auto = make_policy("auto", 0.001).choose(blocks, blocks)[0]
    tight_budget = make_policy("budget", 0.001).choose(blocks, blocks)[0]
    assert tight_auto[:12].eq(6).all() and tight_budget[:12].eq(8).all()
    assert tight_auto[12:].eq(4).all() and tight_budget[12:].eq(4).all()
    assert make_policy("budget") == ErrorBudgetPolicy(0.02)
    assert isinstance(make_policy("seed"), SeedBimodalPolicy) and max_bits("seed") == 6


@pytest.mark.parametrize("value,fix", [(0.0, "in (0, 1)"), (1.5, "in (0, 1)"), ("0.05", "number")])
def test_a_bad_error_budget_is_refused_naming_the_fix(value, fix):
    from hi_sparse.config import HiSparseConfig

    with pytest.raises(ValueError, match="quant_error_budget") as err:
        HiSparseConfig(max_seq_len=256, top_k=64, window_size=32, host_kv_bits="auto",
                       quant_error_budget=value).validate()
    assert fix in str(err.value)
    HiSparseConfig(max_seq_len=256, top_k=64, window_size=32, host_kv_bits="auto").validate()


@pytest.mark.parametrize("layout", ["block", "channel", "token"])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_the_policy_measures_the_error_the_pool_stores(bits, layout):
    """The budget policies measure with fake_quantize_blocks (no packing, on the units' device):
    the same relative error as a quantize / dequantize round trip through the packed rows."""
    from hi_sparse.kernels import fake_quantize_blocks

    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 16, 32, generator=g) * torch.linspace(0.2, 9.0, 32) + 0.5
    x[2] = 1.25                                       # a constant unit (scale 0)
    stored = quantize_roundtrip(x, bits, layout)[3]
    assert torch.equal(relative_error(x, fake_quantize_blocks(x, bits, layout)), stored)


def test_the_widths_the_catalogue_counts_are_the_ones_the_kernels_pack():
    from easymats import catalogue
    from hi_sparse.config import QUANT_BITS
    from hi_sparse.kernels import SUPPORTED_BITS
    from hi_sparse.quant_policy import BITS

    assert BITS == QUANT_BITS == tuple(int(b) for b in catalogue.QUANT_BITS)
    assert set(BITS) <= set(SUPPORTED_BITS)
