"""The engine on CUDA (Triton kernels for attention, swap-in, bounds): same behaviour as on CPU."""

import pytest
import torch

from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.workloads import PlantedWorkload, run_decode, run_prefill

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_full_budget_equals_dense_on_cuda(dtype, tol):
    torch.manual_seed(0)
    L, B, Hq, Hkv, D, P, steps = 2, 2, 8, 2, 64, 77, 6
    dev = torch.device("cuda")
    cfg = HiSparseConfig(max_seq_len=256, cache_block_size=16, window_size=8, global_tokens=4, top_k=128,
                         audit_every=2, telemetry=False)
    eng = HiSparseEngine(cfg, L, Hq, Hkv, D, device=dev, dtype=dtype)
    ids = eng.add_sequences(B)
    N = P + steps
    K = torch.randn(L, B, Hkv, N, D, device=dev, dtype=dtype)
    V = torch.randn_like(K)
    Q = torch.randn(L, B, Hq, N, D, device=dev, dtype=dtype)
    eng.begin_step()
    for layer in range(L):
        eng.append(layer, ids, K[layer, :, :, :P], V[layer, :, :, :P])
        eng.attend(layer, ids, Q[layer, :, :, :P])
    eng.end_step()
    for t in range(P, N):
        eng.begin_step()
        for layer in range(L):
            eng.append(layer, ids, K[layer, :, :, t:t + 1], V[layer, :, :, t:t + 1])
            out = eng.attend(layer, ids, Q[layer, :, :, t:t + 1])
            ref = torch.nn.functional.scaled_dot_product_attention(
                Q[layer, :, :, t:t + 1].float(), K[layer, :, :, :t + 1].float(), V[layer, :, :, :t + 1].float(),
                enable_gqa=True)
            assert out.device.type == "cuda"
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        eng.end_step()
    assert eng.stats.hot_buffer_hits == eng.stats.hot_buffer_lookups > 0


@needs_cuda
@pytest.mark.parametrize("bits,meta", [(None, "cpu"), ("auto", "cpu"), (None, "device"), ("auto", "device")])
def test_planted_needles_and_topic_shift_on_cuda(bits, meta):
    Hq, Hkv, D = 4, 2, 32
    wl = PlantedWorkload(Hkv, Hq, D, seed=1)
    cfg = HiSparseConfig(max_seq_len=8192, cache_block_size=32, window_size=32, global_tokens=12, top_k=128,
                         audit_every=1, audit_top_m=8, drift_floor=0.0, telemetry=False, host_kv_bits=bits,
                         metadata_device=meta, recalibration_lag=1)
    eng = HiSparseEngine(cfg, 1, Hq, Hkv, D, device="cuda")
    (sid,) = eng.add_sequences(1)
    seg = wl.segment(2048, topic="A", anchors=8, needles=(0, 1, 2, 3), margin=64)
    qa = torch.stack([wl.topic_query("A") for _ in range(8)], 1)[None]
    run_prefill(eng, [sid], seg.k[None].cuda(), seg.v[None].cuda(), qa.cuda())

    def rate(query, steps):
        before = eng.stats
        lookups0, hits0 = before.anchor_lookups, before.anchor_hits
        for _ in range(steps):
            k, v = wl.noise(1)
            run_decode(eng, [sid], query()[None, :, None].cuda(), k[None].cuda(), v[None].cuda())
        after = eng.stats
        return (after.anchor_hits - hits0) / (after.anchor_lookups - lookups0)

    assert rate(lambda: wl.topic_query("A"), 6) >= 0.95
    segb = wl.segment(512, topic="B", anchors=8, margin=64)
    run_prefill(eng, [sid], segb.k[None].cuda(), segb.v[None].cuda())
    shifted = rate(lambda: wl.topic_query("B"), 6)
    eng.request_recalibration()
    # the step that reads the request launches it; on CUDA in the background (the default), and
    # with recalibration_lag 1 the step after commits it for the steps that follow
    rate(lambda: wl.topic_query("B"), 2)
    assert shifted <= 0.7 and rate(lambda: wl.topic_query("B"), 6) >= 0.95
    st = eng.stats
    assert st.swap_in_bytes > 0 and st.hot_buffer_lookups > st.hot_buffer_hits


@needs_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_chunked_prefill_equals_dense_causal_attention_on_cuda(dtype, tol):
    """A prompt prefilled in chunks (the later ones attend over the earlier, read back from the
    host pool, through SDPA's bottom-right causal mask) equals dense causal attention; with left
    padding too (the masked path)."""
    torch.manual_seed(1)
    L, Hq, Hkv, D, chunks = 2, 8, 2, 64, (96, 64, 40)
    N = sum(chunks)
    dev = torch.device("cuda")
    cfg = HiSparseConfig(max_seq_len=512, cache_block_size=16, window_size=8, global_tokens=4, top_k=512,
                         audit_every=0, telemetry=False)
    for pad in (0, 5):
        eng = HiSparseEngine(cfg, L, Hq, Hkv, D, device=dev, dtype=dtype)
        (sid,) = eng.add_sequences(1, pad_lengths=[pad])
        K = torch.randn(L, 1, Hkv, N, D, device=dev, dtype=dtype)
        V, Q = torch.randn_like(K), torch.randn(L, 1, Hq, N, D, device=dev, dtype=dtype)
        lo = 0
        for size in chunks:
            eng.begin_step()
            for layer in range(L):
                eng.append(layer, [sid], K[layer, :, :, lo:lo + size], V[layer, :, :, lo:lo + size])
                out = eng.attend(layer, [sid], Q[layer, :, :, lo:lo + size])
                seen = torch.arange(lo + size, device=dev) >= pad
                mask = (torch.arange(lo + size, device=dev)[None] <= torch.arange(lo, lo + size, device=dev)[:, None])
                mask = (mask & seen[None]) | (torch.arange(lo + size, device=dev)[None]
                                              == torch.arange(lo, lo + size, device=dev)[:, None])
                ref = torch.nn.functional.scaled_dot_product_attention(
                    Q[layer, :, :, lo:lo + size].float(), K[layer, :, :, :lo + size].float(),
                    V[layer, :, :, :lo + size].float(), attn_mask=mask[None, None], enable_gqa=True)
                rows = torch.arange(lo, lo + size, device=dev) >= pad
                torch.testing.assert_close(out.float()[:, :, rows], ref[:, :, rows], atol=tol, rtol=tol)
            eng.end_step()
            lo += size
        eng.close()
