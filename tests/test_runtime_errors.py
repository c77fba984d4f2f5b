"""User errors get one clear message naming the fix; a bounded pool errors or streams."""

import pytest
import torch

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.page_table import PoolExhausted


@pytest.mark.parametrize("kw,fix", [
    (dict(window_size=4096, top_k=2048), "raise top_k or lower window_size"),
    (dict(device_buffer_tokens=100, top_k=200, window_size=10), "device_buffer_tokens"),
    (dict(host_kv_bits=3), "host_kv_bits must be None, 4, 5, 6, 8"),
    (dict(streaming=True), "set host_pool_blocks"),
    (dict(cache_block_size=0), "cache_block_size must be a positive integer"),
    (dict(window_size=8, global_tokens=20, top_k=16), "lower global_tokens"),
])
def test_config_errors_name_the_fix(kw, fix):
    with pytest.raises(ValueError, match=fix):
        HiSparseConfig(**kw).validate()


def small(**kw):
    base = dict(max_seq_len=64, cache_block_size=4, window_size=4, global_tokens=0, top_k=8,
                audit_every=0, telemetry=False)
    base.update(kw)
    return HiSparseEngine(HiSparseConfig(**base), 1, 4, 2, 8)


def test_shape_and_id_errors():
    eng = small()
    ids = eng.add_sequences(1)
    with pytest.raises(ValueError, match=r"append expects k and v of shape \(B=1, Hkv=2, T, D=8\)"):
        eng.append(0, ids, torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8))
    with pytest.raises(ValueError, match="layer 1 out of range"):
        eng.append(1, ids, torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    with pytest.raises(ValueError, match="unknown sequence id 99"):
        eng.append(0, [99], torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    with pytest.raises(ValueError, match="append k/v for this layer first"):
        eng.attend(0, ids, torch.randn(1, 4, 3, 8))
    with pytest.raises(ValueError, match="raise max_seq_len"):
        eng.append(0, ids, torch.randn(1, 2, 65, 8), torch.randn(1, 2, 65, 8))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        HiSparseEngine(HiSparseConfig(telemetry=False), 1, 6, 4, 8)


def test_bounded_pool_exhaustion_is_a_clear_error():
    eng = small(host_pool_blocks=3)
    ids = eng.add_sequences(1)
    eng.append(0, ids, torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8))
    with pytest.raises(PoolExhausted, match="raise host_pool_blocks, free sequences, or set streaming=True"):
        eng.append(0, ids, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))


def test_streaming_overwrites_least_important_block_and_keeps_working():
    torch.manual_seed(0)
    # no sink tokens: with top_k 8 and window 4 they would take the whole ranked budget, and the
    # block the queries rank is what this test makes important
    eng = small(host_pool_blocks=6, streaming=True, top_k=8, window_size=4, sink_tokens=0)
    ids = eng.add_sequences(1)
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    eng.append(0, ids, k, v)
    # decode a few steps whose queries match block 1 (tokens 4..7): it becomes important
    for t in range(3):
        eng.begin_step()
        eng.append(0, ids, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        q = k[0, :, 5].repeat_interleave(2, 0)[None, :, None] * 4
        eng.attend(0, ids, q)
        eng.end_step()
    assert eng.stats.block_evictions == 0
    eng.begin_step()
    eng.append(0, ids, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))  # needs a 7th block
    eng.end_step()
    st = eng.stats
    assert st.block_evictions == 1
    holes = eng.seqs[ids[0]].holes
    assert not holes[1] and holes[:2].any()  # the important block survived, an idle one went
    eng.begin_step()
    eng.append(0, ids, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    out = eng.attend(0, ids, torch.randn(1, 4, 1, 8))
    eng.end_step()
    assert torch.isfinite(out).all()
    sel = eng.selection(0, ids[0])
    hole_tokens = [t for t in sel.flatten().tolist() if t >= 0 and holes[t // 4]]
    assert hole_tokens == []  # overwritten tokens are never selected again
