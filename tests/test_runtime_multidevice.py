"""One engine over several devices (layer_devices), and models split layer by layer (split_layers).

CPU: per-layer device plumbing with every layer on the CPU changes nothing, bit for bit; bad
layer_devices get one clear error; split_layers on CPU devices generates what the whole model
does. GPU (two GPUs, gpu-marked): layers on cuda:0 and cuda:1 equal dense attention, find planted
needles through the quantized host pool, and a tiny Llama split over both GPUs generates the same
tokens with HiSparse as without.
"""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hi_sparse as hs
from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import HiSparseEngine
from hi_sparse.hf_compat import installed_cache_kwarg, output_cache
from hi_sparse.integration import binding_of
from hi_sparse.multigpu import layer_split
from hi_sparse.workloads import PlantedWorkload, run_decode, run_prefill

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs")
VOCAB = 128
CACHE = installed_cache_kwarg()  # "cache" from transformers 5.24 on, "past_key_values" before


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _drive(eng, L, B, Hq, Hkv, D, P, steps, seed, device="cpu", dtype=torch.float32):
    """Chunked prefill then decode at every layer; returns every attend output and the inputs."""
    g = torch.Generator().manual_seed(seed)
    N = P + steps
    K = torch.randn(L, B, Hkv, N, D, generator=g).to(device, dtype)
    V = torch.randn(L, B, Hkv, N, D, generator=g).to(device, dtype)
    Q = torch.randn(L, B, Hq, N, D, generator=g).to(device, dtype)
    ids = eng.add_sequences(B, pad_lengths=[0, 3][:B])
    outs = []
    spans = [(0, P // 2), (P // 2, P)] + [(t, t + 1) for t in range(P, N)]
    for lo, hi in spans:
        eng.begin_step()
        for layer in range(L):
            eng.append(layer, ids, K[layer, :, :, lo:hi], V[layer, :, :, lo:hi])
            outs.append(eng.attend(layer, ids, Q[layer, :, :, lo:hi]))
        eng.end_step()
    return outs, (K, V, Q), ids


@pytest.mark.parametrize("bits,meta", [(None, "cpu"), ("auto", "device")], ids=["bf-cpu-meta", "auto-dev-meta"])
def test_layer_devices_all_cpu_is_bit_identical_to_default(bits, meta):
    # sparse decode (top_k < context), swap-ins (buffer < context), audits and recalibrations
    cfg = dict(max_seq_len=512, cache_block_size=8, window_size=8, global_tokens=4, top_k=32,
               device_buffer_tokens=48, audit_every=2, recalibrate_every=8, telemetry=False,
               host_kv_bits=bits, metadata_device=meta, prefetch_blocks=1,
               recalibration_lag=2)      # in the background (the default), landing within the 20 steps
    L, B, Hq, Hkv, D = 2, 2, 4, 2, 16
    a = HiSparseEngine(HiSparseConfig(**cfg), L, Hq, Hkv, D)
    b = HiSparseEngine(HiSparseConfig(**cfg), L, Hq, Hkv, D, layer_devices=["cpu", torch.device("cpu")])
    assert b.layer_devices == [torch.device("cpu")] * L
    out_a, _, ids = _drive(a, L, B, Hq, Hkv, D, P=150, steps=20, seed=3)
    out_b, _, _ = _drive(b, L, B, Hq, Hkv, D, P=150, steps=20, seed=3)
    assert len(out_a) == len(out_b)
    for x, y in zip(out_a, out_b):
        assert torch.equal(x, y)
    sa, sb = a.stats, b.stats
    assert sa.swap_in_bytes > 0 and sa.hot_buffer_lookups > sa.hot_buffer_hits > 0  # the paths ran
    assert sum(sa.recalibrations.values()) > 0 and a.recent_audits
    for name in ("hot_buffer_lookups", "hot_buffer_hits", "prefetch_used", "kv_tokens_used",
                 "kv_tokens_loaded", "swap_in_bytes", "anchor_lookups", "anchor_hits", "anchors"):
        assert getattr(sa, name) == getattr(sb, name), name
    assert list(a.recent_audits) == list(b.recent_audits) and a.memory_bytes() == b.memory_bytes()
    for layer in range(L):
        assert torch.equal(a.seqs[ids[0]].anchors[layer], b.seqs[ids[0]].anchors[layer])


@pytest.mark.parametrize("bad,match", [
    (["cpu"], r"layer_devices has 1 entries but the engine has 2 layers: pass one device per layer"),
    (["cpu"] * 3, r"layer_devices has 3 entries but the engine has 2 layers"),
    ("cpu", r"layer_devices must be a list of devices, one per layer"),
    (["cpu", "not-a-device"], r"not a device .*'cuda:1'"),
], ids=["short", "long", "string", "junk"])
def test_bad_layer_devices_name_the_fix(bad, match):
    cfg = HiSparseConfig(max_seq_len=64, cache_block_size=8, window_size=8, global_tokens=2, top_k=16,
                         telemetry=False)
    with pytest.raises(ValueError, match=match):
        HiSparseEngine(cfg, 2, 4, 2, 16, layer_devices=bad)


def test_layer_split_is_contiguous_and_balanced():
    assert layer_split(4, 2) == [0, 0, 1, 1]
    assert layer_split(5, 2) == [0, 0, 0, 1, 1]
    assert layer_split(7, 3) == [0, 0, 0, 1, 1, 2, 2]
    assert layer_split(3, 1) == [0, 0, 0]
    with pytest.raises(ValueError, match="cannot split 2 layers over 3 devices"):
        layer_split(2, 3)


def tiny_llama(layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # no early stop on a random eos
    model.generation_config.pad_token_id = 0
    return model


def _split_pair(devices, layers=4):
    """(split model without HiSparse, split copy with HiSparse at full budget), same weights."""
    ref = tiny_llama(layers)
    model = copy.deepcopy(ref)
    hs.split_layers(ref, devices)
    hs.split_layers(model, devices)
    hs.enable_hisparse_kv_cache(model, max_seq_len=256, block_size=8, window_size=8, global_tokens=2,
                                top_k=128, name="split")
    return ref, model


def _generate(model, ids, mask, n=8):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)


def _prompt(device, batch=2, length=19, pads=(0, 4)):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids.to(device), mask.to(device)


def test_split_layers_on_cpu_generates_like_the_whole_model_and_engine_follows_layers():
    whole = tiny_llama(4)
    ref, model = _split_pair(["cpu", "cpu"])
    assert len(ref.hisparse_split_hooks) == 4 + 2 + 1  # layers, norm, head; the logits hook
    engine = binding_of(model).engine
    assert engine.layer_devices == [torch.device("cpu")] * 4
    ids, mask = _prompt("cpu")
    want = _generate(whole, ids, mask)
    assert torch.equal(_generate(ref, ids, mask), want)
    assert torch.equal(_generate(model, ids, mask), want)
    with pytest.raises(ValueError, match="split already"):
        hs.split_layers(ref, ["cpu", "cpu"])


# -- two GPUs (gpu-marked: deselected in CI, run on a 2-GPU machine) ---------------------------------

@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("dtype,tol,meta", [(torch.float32, 2e-5, "cpu"), (torch.bfloat16, 2e-2, "device")],
                         ids=["fp32-cpu-meta", "bf16-dev-meta"])
def test_two_gpu_layers_full_budget_equal_dense(dtype, tol, meta):
    L, B, Hq, Hkv, D, P, steps = 4, 2, 8, 2, 64, 77, 6
    devs = [torch.device("cuda:0")] * 2 + [torch.device("cuda:1")] * 2
    cfg = HiSparseConfig(max_seq_len=256, cache_block_size=16, window_size=8, global_tokens=4, top_k=128,
                         audit_every=2, telemetry=False, metadata_device=meta)
    eng = HiSparseEngine(cfg, L, Hq, Hkv, D, device="cuda:0", dtype=dtype, layer_devices=devs)
    outs, (K, V, Q), ids = _drive(eng, L, B, Hq, Hkv, D, P, steps, seed=0, device=devs[0], dtype=dtype)
    assert [eng.k_hot[i].device for i in range(L)] == devs
    assert [eng.seqs[ids[0]].hot[i].slot_token.device for i in range(L)] == devs
    spans = [(0, P // 2), (P // 2, P)] + [(t, t + 1) for t in range(P, P + steps)]
    pads = [0, 3]
    i = 0
    for lo, hi in spans:
        for layer in range(L):
            out = outs[i]
            i += 1
            assert out.device == devs[0]  # attend answers on the device q came from
            q, k, v = (x[layer, :, :, a:b].float() for x, a, b in ((Q, lo, hi), (K, 0, hi), (V, 0, hi)))
            kpos, qpos = torch.arange(hi, device=q.device), torch.arange(lo, hi, device=q.device)
            for b in range(B):
                mask = ((kpos[None] <= qpos[:, None]) & (kpos[None] >= pads[b])) | (kpos[None] == qpos[:, None])
                ref = torch.nn.functional.scaled_dot_product_attention(
                    q[b:b + 1], k[b:b + 1], v[b:b + 1], attn_mask=mask, enable_gqa=True)
                torch.testing.assert_close(out[b:b + 1].float(), ref, atol=tol, rtol=tol)
    st = eng.stats  # counters of both GPUs summed
    assert st.hot_buffer_hits == st.hot_buffer_lookups > 0
    # full budget: every decode step looks up each visible token of each KV head at every layer
    assert st.hot_buffer_lookups == L * Hkv * sum(t + 1 - pad for t in range(P, P + steps) for pad in pads)
    mem = eng.memory_bytes()
    assert mem[("device", "data")] == sum(t.numel() * t.element_size() for t in eng.k_hot + eng.v_hot)


@pytest.mark.gpu
@two_gpus
def test_two_gpu_planted_needles_quantized_device_metadata():
    Hq, Hkv, D, L = 4, 2, 32, 2
    wl = PlantedWorkload(Hkv, Hq, D, seed=1)
    cfg = HiSparseConfig(max_seq_len=8192, cache_block_size=32, window_size=32, global_tokens=0, top_k=128,
                         audit_every=1, audit_top_m=1, drift_floor=0.0, telemetry=False, host_kv_bits="auto",
                         metadata_device="device", prefetch_blocks=1)
    eng = HiSparseEngine(cfg, L, Hq, Hkv, D, device="cuda:0", layer_devices=["cuda:0", "cuda:1"])
    (sid,) = eng.add_sequences(1)
    needles = tuple(range(16))
    seg = wl.segment(4096, needles=needles, margin=64)
    run_prefill(eng, [sid], seg.k[None].cuda(0), seg.v[None].cuda(0))
    for nid in needles:
        k, v = wl.noise(1)
        run_decode(eng, [sid], wl.needle_query(nid)[None, :, None].cuda(0), k[None].cuda(0), v[None].cuda(0))
        assert eng.recent_audits[-1].lookups == 1
    audits = list(eng.recent_audits)[-len(needles):]
    recall = sum(a.hits for a in audits) / len(audits)
    assert recall >= 0.95, recall
    assert {a.layer for a in audits} == {0, 1}  # audited on both GPUs' layers
    for layer in range(L):  # the last needle itself was selected at each layer
        assert seg.needles[needles[-1]] in eng.selection(layer, sid).flatten().tolist()
    st = eng.stats  # quantized host blocks were swapped into both hot buffers
    assert st.swap_in_bytes > 0 and st.hot_buffer_lookups > st.hot_buffer_hits
    assert sum(st.quant_blocks.values()) > 0


@pytest.mark.gpu
@two_gpus
def test_two_gpu_topic_shift_recalibrates_each_layer_on_its_gpu():
    Hq, Hkv, D, L = 4, 2, 32, 2
    wl = PlantedWorkload(Hkv, Hq, D, seed=1)
    cfg = HiSparseConfig(max_seq_len=8192, cache_block_size=32, window_size=32, global_tokens=12, top_k=128,
                         audit_every=1, audit_top_m=8, drift_floor=0.0, telemetry=False, host_kv_bits="auto",
                         metadata_device="device")
    eng = HiSparseEngine(cfg, L, Hq, Hkv, D, device="cuda:0", layer_devices=["cuda:0", "cuda:1"])
    (sid,) = eng.add_sequences(1)
    seg = wl.segment(2048, topic="A", anchors=8, needles=(0, 1, 2, 3), margin=64)
    qa = torch.stack([wl.topic_query("A") for _ in range(8)], 1)[None]
    run_prefill(eng, [sid], seg.k[None].cuda(0), seg.v[None].cuda(0), qa.cuda(0))

    def rate(query, steps):
        before = eng.stats
        lookups0, hits0 = before.anchor_lookups, before.anchor_hits
        for _ in range(steps):
            k, v = wl.noise(1)
            run_decode(eng, [sid], query()[None, :, None].cuda(0), k[None].cuda(0), v[None].cuda(0))
        after = eng.stats
        return (after.anchor_hits - hits0) / (after.anchor_lookups - lookups0)

    assert rate(lambda: wl.topic_query("A"), 6) >= 0.95
    segb = wl.segment(512, topic="B", anchors=8, margin=64)
    run_prefill(eng, [sid], segb.k[None].cuda(0), segb.v[None].cuda(0))
    shifted = rate(lambda: wl.topic_query("B"), 6)
    eng.request_recalibration()
    rate(lambda: wl.topic_query("B"), 1)
    assert shifted <= 0.7 and rate(lambda: wl.topic_query("B"), 6) >= 0.95
    for layer, dev in enumerate(["cuda:0", "cuda:1"]):
        anchors = eng.seqs[sid].anchors[layer]
        assert anchors.device == torch.device(dev) and int((anchors >= 0).sum()) > 0
    assert eng.stats.recalibrations["request"] == 1


@pytest.mark.gpu
@two_gpus
def test_two_gpu_split_llama_generates_like_without_hisparse():
    ref, model = _split_pair(["cuda:0", "cuda:1"])
    engine = binding_of(model).engine
    devs = [torch.device("cuda:0")] * 2 + [torch.device("cuda:1")] * 2
    assert engine.layer_devices == devs
    assert model.model.layers[3].self_attn.q_proj.weight.device == devs[3]
    ids, mask = _prompt("cuda:0")
    want = _generate(ref, ids, mask)
    got = _generate(model, ids, mask)
    assert got.device == devs[0]
    assert torch.equal(got, want)
    assert [engine.k_hot[i].device for i in range(4)] == devs
    with torch.no_grad():  # logits of a prefill and of decode steps, through the engine's layers
        r = ref(want[:1, :15], use_cache=True)
        h = model(want[:1, :15], use_cache=True)
        torch.testing.assert_close(h.logits, r.logits, rtol=1e-4, atol=1e-4)
        for t in range(15, want.shape[1]):
            r = ref(want[:1, t:t + 1], **{CACHE: output_cache(r)}, use_cache=True)
            h = model(want[:1, t:t + 1], **{CACHE: output_cache(h)}, use_cache=True)
            torch.testing.assert_close(h.logits, r.logits, rtol=1e-4, atol=1e-4)
