"""With top_k and the hot buffer >= context and no quantization, HiSparse equals dense SDPA."""

import pytest
import torch

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def dense(q, k, v, pads):
    """Reference: torch SDPA, causal, left padding masked. q (B,Hq,Tq,D), k/v (B,Hkv,N,D)."""
    B, Hq, Tq, _ = q.shape
    N = k.shape[2]
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    qpos = torch.arange(N - Tq, N)[:, None]
    kpos = torch.arange(N)[None]
    outs = []
    for b in range(B):
        mask = ((kpos <= qpos) & (kpos >= pads[b])) | (kpos == qpos)
        outs.append(torch.nn.functional.scaled_dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1],
                                                                     attn_mask=mask))
    return torch.cat(outs)


@pytest.mark.parametrize("Hq,Hkv,D,P,bs", [(4, 4, 16, 37, 8), (4, 2, 24, 61, 7), (6, 1, 8, 19, 16),
                                           (8, 2, 60, 63, 5)],
                         ids=["mha-d16-p37", "gqa2-d24-p61-bs7", "mqa-d8-p19", "gqa4-d60-p63-bs5"])
def test_full_budget_equals_dense_sdpa(Hq, Hkv, D, P, bs):
    torch.manual_seed(P)
    L, B, steps = 2, 2, 9
    N = P + steps
    cfg = HiSparseConfig(max_seq_len=256, cache_block_size=bs, window_size=4, global_tokens=2,
                         top_k=128, audit_every=3, telemetry=False, prefetch_blocks=1)
    eng = HiSparseEngine(cfg, L, Hq, Hkv, D)
    pads = [0, 3]
    ids = eng.add_sequences(B, pad_lengths=pads)
    K, V, Q = torch.randn(L, B, Hkv, N, D), torch.randn(L, B, Hkv, N, D), torch.randn(L, B, Hq, N, D)
    split = P // 2  # chunked prefill: the second chunk attends to the first from the host pool
    for lo, hi in ((0, split), (split, P)):
        eng.begin_step()
        for layer in range(L):
            eng.append(layer, ids, K[layer, :, :, lo:hi], V[layer, :, :, lo:hi])
            out = eng.attend(layer, ids, Q[layer, :, :, lo:hi])
            ref = dense(Q[layer, :, :, lo:hi], K[layer, :, :, :hi], V[layer, :, :, :hi], pads)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        eng.end_step()
    for t in range(P, N):
        eng.begin_step()
        for layer in range(L):
            eng.append(layer, ids, K[layer, :, :, t:t + 1], V[layer, :, :, t:t + 1])
            out = eng.attend(layer, ids, Q[layer, :, :, t:t + 1])
            ref = dense(Q[layer, :, :, t:t + 1], K[layer, :, :, :t + 1], V[layer, :, :, :t + 1], pads)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        eng.end_step()
    st = eng.stats
    assert st.tokens_decode == steps * B and st.tokens_prefill == P * B
    assert st.hot_buffer_lookups == st.hot_buffer_hits > 0  # everything fits: all hits
    assert st.anchor_lookups > 0 and st.anchor_hits == pytest.approx(st.anchor_lookups, rel=1e-5)  # all the mass
    eng.close()


def test_sparse_budget_differs_but_stays_close_on_local_attention():
    """Below full budget the output is an approximation, not a copy of dense (the test can fail)."""
    torch.manual_seed(0)
    Hq, Hkv, D, N = 4, 2, 16, 300
    cfg = HiSparseConfig(max_seq_len=512, cache_block_size=8, window_size=16, global_tokens=0,
                         top_k=32, audit_every=0, telemetry=False)
    eng = HiSparseEngine(cfg, 1, Hq, Hkv, D)
    ids = eng.add_sequences(1)
    k, v = torch.randn(1, Hkv, N, D), torch.randn(1, Hkv, N, D)
    eng.append(0, ids, k[:, :, :-1], v[:, :, :-1])
    eng.begin_step()
    eng.append(0, ids, k[:, :, -1:], v[:, :, -1:])
    q = torch.randn(1, Hq, 1, D)
    out = eng.attend(0, ids, q)
    eng.end_step()
    ref = dense(q, k, v, [0])
    assert not torch.allclose(out, ref, atol=1e-4)
    assert (eng.selection(0, ids[0]) >= 0).sum(1).tolist() == [32, 32]  # filled to top_k
