"""enable_hisparse_kv_cache on real (small, random-weight) transformers models of each family."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hi_sparse as hs
from easymats.segment import SegmentReader, segments_for_pid
from hi_sparse.hf_compat import installed_cache_kwarg, output_cache
from hi_sparse.hf_support import UnsupportedModelError
from hi_sparse.integration import binding_of

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
VOCAB = 128
CACHE = installed_cache_kwarg()  # "cache" from transformers 5.24 on, "past_key_values" before
# Budget covering the whole context, no quantization: HiSparse must equal dense attention.
FULL_BUDGET = dict(max_seq_len=256, block_size=8, window_size=8, global_tokens=2, top_k=128)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is as fast, and on a busy 2-core CI machine spinning
    OpenMP workers make these tests 5-10x slower. Restored for the modules after this one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_pair(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **config_kw):
    """(reference model, identical copy) of a tiny random-weight model: 2 layers, hidden 64,
    4 query heads sharing 2 KV heads (GQA)."""
    config_cls, model_cls = FAMILIES[family]
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "mistral":
        kw["sliding_window"] = None
    kw.update(config_kw)
    torch.manual_seed(seed)
    ref = model_cls(config_cls(**kw)).to(dtype).eval()
    # A config of its own: enabling HiSparse changes the model's config._attn_implementation.
    model = model_cls(config_cls(**kw)).to(dtype).eval()
    model.load_state_dict(ref.state_dict())
    # No early stop on a random eos: both models generate exactly max_new_tokens.
    for m in (ref, model):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    return ref, model


def prompt(batch: int, length: int, pads: list[int] | None = None, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads or []):
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_equals_unmodified_model_with_full_budget(family):
    ref, model = make_pair(family)
    hs.enable_hisparse_kv_cache(model, name=f"test-{family}", **FULL_BUDGET)
    assert model.config._attn_implementation == "hisparse"
    ids, mask = prompt(2, 21, pads=[0, 5])  # a left-padded batch
    with torch.no_grad():
        want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    # Logits of a prefill and of decode steps: forward with a cache, then token by token.
    with torch.no_grad():
        seq = want[:1]
        r = ref(seq[:, :15], use_cache=True)
        h = model(seq[:, :15], use_cache=True)
        assert type(output_cache(h).layers[0]).__name__ == "HiSparseLayer"
        torch.testing.assert_close(h.logits, r.logits, rtol=1e-4, atol=1e-4)
        for t in range(15, seq.shape[1]):
            r = ref(seq[:, t:t + 1], **{CACHE: output_cache(r)}, use_cache=True)
            h = model(seq[:, t:t + 1], **{CACHE: output_cache(h)}, use_cache=True)
            torch.testing.assert_close(h.logits, r.logits, rtol=1e-4, atol=1e-4)


def test_no_deprecation_warning_from_hisparse_and_the_old_cache_name_still_works():
    """transformers 5.24 renamed past_key_values to cache: the pre-hook reads whichever the
    release passes and writes only that one (before the fix, on 5.24 it wrote past_key_values
    beside generate()'s cache=, transformers warned and dropped ours, and attention failed)."""
    ref, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **FULL_BUDGET)
    ids, mask = prompt(1, 12)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # any FutureWarning/DeprecationWarning fails the test
        want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, want)
        out = model(ids, use_cache=True)
        step = model(want[:, 12:13], **{CACHE: output_cache(out)}, use_cache=True)
    assert type(output_cache(step).layers[0]).__name__ == "HiSparseLayer"
    # A caller of the decoder model itself who still says past_key_values= gets HiSparse too.
    ours = hs.HiSparseCache(model)
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=ours, use_cache=True)
    assert ours.get_seq_length() == 12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_models_run_and_match(dtype):
    ref, model = make_pair("llama", dtype=dtype)
    hs.enable_hisparse_kv_cache(model, **FULL_BUDGET)
    ids, mask = prompt(1, 17)
    with torch.no_grad():
        r = ref(ids, attention_mask=mask).logits.float()
        h = model(ids, attention_mask=mask).logits.float()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 21)
    # Half-precision rounding differs between SDPA and the engine's fp32-accumulated attention.
    assert (h - r).abs().max() <= 0.05 * r.abs().max()


def test_generate_with_a_cache_passed_by_the_caller():
    ref, model = make_pair("qwen3")
    hs.enable_hisparse_kv_cache(model, **FULL_BUDGET)
    ids, mask = prompt(1, 12)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        want = ref.generate(**kw)
        ours = hs.HiSparseCache(model)
        assert torch.equal(model.generate(**kw, **{CACHE: ours}), want)
        assert ours.get_seq_length() == want.shape[1] - 1
        dynamic = DynamicCache()  # the caller's own empty cache is switched to HiSparse layers
        assert torch.equal(model.generate(**kw, **{CACHE: dynamic}), want)
        assert type(dynamic.layers[0]).__name__ == "HiSparseLayer"
        filled = DynamicCache()
        ref(ids, **{CACHE: filled}, use_cache=True)
        with pytest.raises(UnsupportedModelError, match="already holds 12 tokens"):
            model(ids, **{CACHE: filled}, use_cache=True)
        # Without a cache there is nothing to hold; the forward still matches.
        torch.testing.assert_close(model(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)


def test_small_budget_long_prompt_bounds_device_memory_and_moves_counters():
    _, model = make_pair("llama")
    top_k, buffer = 24, 32
    hs.enable_hisparse_kv_cache(model, max_seq_len=1024, block_size=8, window_size=8,
                                global_tokens=4, top_k=top_k, device_buffer_tokens=buffer,
                                name="small-budget")
    engine = binding_of(model).engine
    (path,) = segments_for_pid(os.getpid())
    before = _counters(path)
    ids, mask = prompt(2, 6 * top_k, pads=[0, 7])  # a prompt six times top_k
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
        assert out.shape == (2, 6 * top_k + 12)
        mem = engine.memory_bytes()
    cfg = model.config
    # Device data: per sequence, layer and KV head, at most `buffer` slots of K and V.
    bound = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * buffer * 16 * 2 * 4
    assert 0 < mem[("device", "data")] <= bound
    assert mem[("host", "data")] > mem[("device", "data")]  # the full context lives on the host
    # publish the latest counters (an end_step publishes at most every publish_interval_s: the
    # last decode steps may have ended within it)
    engine.publisher.maybe_publish(force=True)
    after = _counters(path)
    for name in ("hisparse_tokens_total{phase=\"decode\"}", "hisparse_tokens_total{phase=\"prefill\"}",
                 "hisparse_hot_buffer_lookups_total", "hisparse_kv_tokens_loaded_total",
                 "hisparse_kv_tokens_used_total", "hisparse_swap_in_bytes_total",
                 "hisparse_kv_block_allocations_total"):
        assert after[name] > before.get(name, 0.0), name
    assert after["hisparse_tokens_total{phase=\"decode\"}"] - before.get(
        "hisparse_tokens_total{phase=\"decode\"}", 0.0) == 2 * 11  # 11 decode forwards of 2 rows
    # Selection touched fewer tokens than the context holds: the budget is really small.
    assert after["hisparse_kv_tokens_used_total"] <= 2 * 11 * top_k * 2 * cfg.num_key_value_heads


def _counters(path: str) -> dict[str, float]:
    snap = SegmentReader(path).read()
    out = {}
    for s in snap.series:
        if isinstance(s.value, float | int):
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def test_unsupported_models_and_modes_get_clear_errors():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB))
    with pytest.raises(UnsupportedModelError, match="got model_type 'gpt2'"):
        hs.enable_hisparse_kv_cache(gpt2)
    _, sliding = make_pair("mistral", sliding_window=32)
    with pytest.raises(UnsupportedModelError, match="sliding_window=32 is shorter than max_seq_len=256"):
        hs.enable_hisparse_kv_cache(sliding, **FULL_BUDGET)
    _, fp64 = make_pair("llama", dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match="dtype float64 is not supported"):
        hs.enable_hisparse_kv_cache(fp64, **FULL_BUDGET)

    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **FULL_BUDGET)
    with pytest.raises(UnsupportedModelError, match="already enabled"):
        hs.enable_hisparse_kv_cache(model, **FULL_BUDGET)
    ids, mask = prompt(1, 10)
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="beam search"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2)
    right = torch.tensor([[1] * 8 + [0] * 2])
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="left padding only"):
        model(ids, attention_mask=right)
    hs.disable_hisparse_kv_cache(model)
    assert model.config._attn_implementation != "hisparse"
    with torch.no_grad():
        model(ids)  # a plain model again


def test_segment_lives_with_the_model_in_process():
    _, model = make_pair("qwen2")
    hs.enable_hisparse_kv_cache(model, name="lifetime", **FULL_BUDGET)
    (path,) = segments_for_pid(os.getpid())
    assert SegmentReader(path).read().name == "lifetime"
    del model
    gc.collect()
    assert not os.path.exists(path)


def test_disable_frees_the_engine_and_its_host_pool():
    """A disabled model keeps nothing of the engine alive (enable, disable, enable again must not
    hold two host pools: at 24 x 128K one is 96 GiB of page-locked memory)."""
    import weakref

    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, name="freed", host_kv_bits=4, **FULL_BUDGET)
    ids, mask = prompt(2, 20)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    engine = weakref.ref(binding_of(model).engine)
    (path,) = segments_for_pid(os.getpid())
    hs.disable_hisparse_kv_cache(model)
    gc.collect()
    assert engine() is None, [type(r).__name__ for r in gc.get_referrers(engine())]
    assert not os.path.exists(path)
    hs.enable_hisparse_kv_cache(model, name="again", **FULL_BUDGET)      # and the model works on
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)


def test_telemetry_off_publishes_nothing_and_default_name_is_the_family():
    _, quiet = make_pair("mistral")
    hs.enable_hisparse_kv_cache(quiet, telemetry=False, **FULL_BUDGET)
    ids, mask = prompt(1, 9)
    with torch.no_grad():
        quiet.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert segments_for_pid(os.getpid()) == []
    assert binding_of(quiet).engine.stats.tokens_decode == 2
    _, named = make_pair("qwen2")
    hs.enable_hisparse_kv_cache(named, **FULL_BUDGET)
    (path,) = segments_for_pid(os.getpid())
    assert SegmentReader(path).read().name == "qwen2"


def test_segment_gone_after_clean_exit_of_a_process():
    script = textwrap.dedent("""
        import sys, torch
        from transformers import LlamaConfig, LlamaForCausalLM
        import hi_sparse as hs
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
        model = hs.enable_hisparse_kv_cache(LlamaForCausalLM(cfg).eval(), max_seq_len=64,
                                            block_size=8, window_size=8, global_tokens=0, top_k=16,
                                            name="exit-test")
        with torch.no_grad():
            model.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3)
        print("ready", flush=True)
        sys.stdin.readline()  # the model stays alive until the test says go
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        (path,) = segments_for_pid(proc.pid)
        assert SegmentReader(path).read().name == "exit-test"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
        assert not os.path.exists(path)
        assert segments_for_pid(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_generate_matches_and_small_budget_runs(dtype):
    """On the GPU path (Triton kernels): full budget equals the unmodified model; a small budget
    on a long prompt runs with device KV bounded by the hot buffer."""
    ref, model = make_pair("qwen3", dtype=dtype)
    ref, model = ref.cuda(), model.cuda()
    hs.enable_hisparse_kv_cache(model, **FULL_BUDGET)
    ids, mask = prompt(2, 21, pads=[0, 5])
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        r = ref(ids, attention_mask=mask).logits.float()
        h = model(ids, attention_mask=mask).logits.float()
        assert (h - r)[mask.bool()].abs().max() <= (1e-4 if dtype == torch.float32 else 0.05) * r.abs().max()
        if dtype == torch.float32:
            want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
            got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
            assert torch.equal(got, want)
    hs.disable_hisparse_kv_cache(model)
    hs.enable_hisparse_kv_cache(model, max_seq_len=2048, block_size=16, window_size=16,
                                global_tokens=4, top_k=64, device_buffer_tokens=96,
                                host_kv_bits="auto")
    engine = binding_of(model).engine
    ids, mask = prompt(2, 640, pads=[0, 33])
    with torch.no_grad():
        out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16,
                             do_sample=False)
        mem = engine.memory_bytes()
    assert out.shape == (2, 656)
    elem = torch.finfo(dtype).bits // 8
    assert 0 < mem[("device", "data")] <= 2 * 2 * 2 * 96 * 16 * 2 * elem
    st = engine.stats
    assert st.hot_buffer_lookups > 0 and st.swap_in_bytes > 0 and sum(st.quant_blocks.values()) > 0


def test_batch_repeat_interleave_forks_the_engine_sequences():
    """cache.batch_repeat_interleave (n samples of one prompt after prefill) forks the engine's
    sequences: every repeated row decodes like the same prompt in a model of its own."""
    ref, model = make_pair("llama")
    for m in (ref, model):
        # the prefill's recalibration in its step: a fork lands a pending one first, which a model
        # of its own would land later (engine.SLICE_LAG)
        hs.enable_hisparse_kv_cache(m, max_seq_len=256, block_size=8, window_size=8, global_tokens=2,
                                    top_k=24, telemetry=False, background_recalibration=False)
    ids, mask = prompt(1, 60)
    with torch.no_grad():
        one = ref(input_ids=ids, attention_mask=mask, use_cache=True)
        many = model(input_ids=ids, attention_mask=mask, use_cache=True)
        output_cache(many).batch_repeat_interleave(3)
        tok = one.logits[:, -1:].argmax(-1)
        c1, c3 = output_cache(one), output_cache(many)
        m1, m3 = mask, mask.repeat(3, 1)
        for _ in range(6):
            m1 = torch.cat([m1, torch.ones_like(m1[:, :1])], 1)
            m3 = torch.cat([m3, torch.ones_like(m3[:, :1])], 1)
            o1 = ref(input_ids=tok, attention_mask=m1, **{CACHE: c1}, use_cache=True)
            o3 = model(input_ids=tok.repeat(3, 1), attention_mask=m3, **{CACHE: c3}, use_cache=True)
            for r in range(3):
                torch.testing.assert_close(o3.logits[r], o1.logits[0], atol=1e-4, rtol=1e-4)
            tok = o1.logits[:, -1:].argmax(-1)
    engine = binding_of(model).engine
    assert len(engine.seqs) == 3 and engine.stats.tokens_decode == 3 * 6   # the forks decoded together
    # the forks share the 7 blocks that were full at the fork (60 tokens in blocks of 8) and own
    # the rest: the 8th, filled by decoding, and a 9th
    assert binding_of(ref).engine.pool.num_active == 9
    assert engine.pool.num_active == 9 + 2 * 2
