"""Selection blocks finer than storage blocks (``selection_block_size``).

Key bounds are kept and ranked per selection block, a run of rows of one storage block; the
host pool, quantization, page tables and streaming eviction keep their storage blocks. So an
engine with 32-token storage blocks selecting in 8-token blocks must select exactly what an
engine with 8-token storage blocks selects (same bounds, same ranking, same prefetch width), and
attend to the same tokens. A 4-bit host pool of the same storage blocks decodes beside them (its
quantization units stay 32 tokens). Streaming holes (per storage block) are never selected.
"""

import pytest
import torch

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

L, HQ, HKV, D = 2, 4, 2, 16


def _engine(device="cpu", dtype=torch.float32, **kw):
    cfg = dict(max_seq_len=1024, window_size=8, global_tokens=4, top_k=40, device_buffer_tokens=80,
               audit_every=5, telemetry=False, recalibrate_every=150, recalibrate_topk=8,
               recalibration_lag=1)        # the engines compared land a recalibration on the same step
    cfg.update(kw)
    return HiSparseEngine(HiSparseConfig(**cfg), L, HQ, HKV, D, device=device, dtype=dtype)


def _step(eng, ids, K, V, Q, lo, hi):
    outs = []
    eng.begin_step()
    for layer in range(L):
        eng.append(layer, ids, K[layer, :, :, lo:hi], V[layer, :, :, lo:hi])
        outs.append(eng.attend(layer, ids, Q[layer, :, :, lo:hi]))
    eng.end_step()
    return outs


def _selections(eng, ids):
    return [[eng.selection(layer, i).sort(dim=1).values for i in ids] for layer in range(L)]


@pytest.mark.parametrize("group", [1, 2], ids=["one-level", "two-level"])
def test_selection_blocks_inside_storage_blocks_select_as_storage_blocks_of_their_size(group):
    _compare(group, "cpu", torch.float32, 1e-6, 0.2)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graphs"])
def test_selection_blocks_on_cuda(graphs):
    """The Triton bounds scoring and swap-in at selection-block granularity, through the batched
    step's CUDA graphs too (bf16: 4-bit error a little above fp32's)."""
    _compare(2, "cuda", torch.bfloat16, 1e-2, 0.25, decode_graphs=graphs, metadata_device="device")


def _compare(group, device, dtype, tol, quant_tol, **kw):
    torch.manual_seed(3)
    prompts, steps = (130, 97), 40                           # two lengths: partial blocks, a batch
    N = max(prompts) + steps
    K, V, Q = (torch.randn(L, 2, h, N, D).to(device, dtype) for h in (HKV, HKV, HQ))
    # the same prefetch in tokens: 8 blocks of 8 = 2 storage blocks of 32 = 8 selection blocks
    common = dict(device=device, dtype=dtype, bound_group=group, **kw)
    fine = _engine(cache_block_size=8, prefetch_blocks=8, **common)
    inside = _engine(cache_block_size=32, selection_block_size=8, prefetch_blocks=2, **common)
    inside4 = _engine(cache_block_size=32, selection_block_size=8, prefetch_blocks=2, host_kv_bits=4, **common)
    engines = (fine, inside, inside4)
    ids = []
    for eng in engines:
        a, b = eng.add_sequences(1), eng.add_sequences(1)
        for sid, (row, p) in zip((a, b), enumerate(prompts)):
            eng.begin_step()
            for layer in range(L):
                eng.append(layer, sid, K[layer, row:row + 1, :, :p], V[layer, row:row + 1, :, :p])
            eng.end_step()
        ids.append(a + b)
    # decode: both sequences per step, each at its own position (the shorter one catches up
    # nothing: its columns start where its prompt ended)
    Kd, Vd, Qd = (torch.cat([X[:, 0:1, :, prompts[0]:prompts[0] + steps],
                             X[:, 1:2, :, prompts[1]:prompts[1] + steps]], 1) for X in (K, V, Q))
    rels = []
    for t in range(steps):
        outs = [_step(eng, i, Kd, Vd, Qd, t, t + 1) for eng, i in zip(engines, ids)]
        sels = [_selections(eng, i) for eng, i in zip(engines, ids)]
        for layer in range(L):
            assert torch.allclose(outs[0][layer], outs[1][layer], atol=tol), (t, layer)
            for r in range(2):
                assert torch.equal(sels[0][layer][r], sels[1][layer][r]), (t, layer, r)
            rel = (outs[2][layer] - outs[1][layer]).float().norm() / outs[1][layer].float().norm()
            rels.append(float(rel))
    for eng in engines:
        st = eng.stats
        assert st.recalibrations["schedule"] >= 1 and st.anchor_lookups > 0
    assert sum(inside4.stats.quant_blocks.values()) > 0
    # 4-bit values of Gaussian K/V: ~0.14 mean relative error of the outputs with 32-token
    # selection blocks as with 8 (the selection granularity does not touch the quantization)
    assert sum(rels) / len(rels) < quant_tol, sum(rels) / len(rels)
    # selected tokens are counted once; the loaded (touched storage blocks) count is the engine's own
    assert fine.stats.kv_tokens_used == inside.stats.kv_tokens_used
    assert inside.stats.kv_tokens_loaded > fine.stats.kv_tokens_loaded


def test_streaming_never_selects_a_hole_of_a_storage_block():
    torch.manual_seed(5)
    P, steps = 200, 60
    eng = _engine(cache_block_size=16, selection_block_size=4, streaming=True, host_pool_blocks=14,
                  global_tokens=0, prefetch_blocks=1)
    sid = eng.add_sequences(1)
    K, V, Q = (torch.randn(L, 1, h, P + steps, D) for h in (HKV, HKV, HQ))
    eng.begin_step()
    for layer in range(L):
        eng.append(layer, sid, K[layer, :, :, :P], V[layer, :, :, :P])
    eng.end_step()
    for t in range(P, P + steps):
        _step(eng, sid, K, V, Q, t, t + 1)
        holes = eng.seqs[sid[0]].holes.nonzero().flatten().tolist()
        for layer in range(L):
            sel = eng.selection(layer, sid[0])
            blocks = set((sel[sel >= 0] // 16).tolist())
            assert not blocks & set(holes), (t, layer)
    assert eng.stats.block_evictions > 0


def test_a_selection_block_that_does_not_divide_the_storage_block_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"selection_block_size \(24\) must divide cache_block_size \(64\).*8, 16"):
        HiSparseConfig(cache_block_size=64, selection_block_size=24).validate()
    with pytest.raises(ValueError, match="selection_block_size"):
        HiSparseConfig(cache_block_size=64, selection_block_size=0).validate()
    assert HiSparseConfig(cache_block_size=64).validate().select_block == 64
