"""``fused_rotary``: a model's rotary embedding as one Triton launch per layer (runtime/fused_rotary.py,
kernels/rotary.py). On the CPU: the option's validation, that nothing changes without a GPU, the
bit-for-bit check that leaves a function with other math alone, and the wrapper's bookkeeping
(inside a HiSparse forward only; several models; put back by the last one) with the torch
reference standing in for the kernel (the interpreter cases run the kernel itself:
kernels_interpret_cases.py). gpu-marked: the kernel against transformers' function at Llama-8B's
shapes, and greedy generate through the whole-step graph."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hi_sparse as hs
from hi_sparse import fused_rotary
from hi_sparse.integration import binding_of
from hi_sparse.kernels import rotary as rotary_module
from hi_sparse.kernels._dispatch import FORCE_ENV
from hi_sparse.kernels.rotary import reference_rotary, rotary

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(max_seq_len=64, block_size=8, window_size=8, global_tokens=0, top_k=32, telemetry=False)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]
NAME = modeling_llama.__name__
ORIGINAL = modeling_llama.apply_rotary_pos_emb


def tiny_llama(dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


def inputs(dtype: torch.dtype, B: int = 2, Hq: int = 4, Hk: int = 2, T: int = 3, D: int = 16, device: str = "cpu"):
    g = torch.Generator().manual_seed(B * 100 + T)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k = (3 * torch.randn(B, Hk, T, D, generator=g)).to(dtype)
    pos = torch.randint(0, 100000, (B, T), generator=g).double()
    angles = pos[..., None] * 5e5 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.cat((angles, angles), dim=-1)
    return tuple(t.to(device) for t in (q, k, angles.cos().to(dtype), angles.sin().to(dtype)))


@pytest.fixture(autouse=True)
def function_put_back():
    yield
    modeling_llama.apply_rotary_pos_emb = ORIGINAL


@pytest.fixture
def reference_kernel(monkeypatch):
    """"Triton" for the rotary alone on the CPU (the engine's kernels stay the torch references),
    with the torch reference as the kernel: counts its calls."""
    monkeypatch.setattr(fused_rotary, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(rotary_module, "use_triton", lambda *tensors: True)
    calls: list[tuple] = []

    def kernel(q, k, cos, sin):
        calls.append(tuple(q.shape))
        return reference_rotary(q, k, cos, sin)

    monkeypatch.setattr(fused_rotary, "rotary", kernel)
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_is_transformers_function_bit_for_bit(dtype):
    q, k, cos, sin = inputs(dtype)
    for got, want in zip(reference_rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)
    for got, want in zip(rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):   # CPU: the reference
        assert torch.equal(got, want)


def test_rotary_names_the_shapes_it_needs():
    q, k, cos, sin = inputs(torch.float32)
    with pytest.raises(ValueError, match=r"\(batch, heads, tokens, head_dim\)"):
        rotary(q[0], k, cos, sin)
    with pytest.raises(ValueError, match="cos, sin"):
        rotary(q, k, cos, sin[0])


@pytest.mark.parametrize("setting", [None, True])
def test_on_the_cpu_enable_leaves_the_function_alone(monkeypatch, setting):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    model = tiny_llama()
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_rotary=setting)
    try:
        assert binding_of(model).fused_rotary == []
        assert modeling_llama.apply_rotary_pos_emb is ORIGINAL
    finally:
        hs.disable_hisparse_kv_cache(model)


def interleaved(q, k, cos, sin, unsqueeze_dim=1):
    """GPT-J's pairs (x0, x1), (x2, x3) ... instead of the halves."""
    def rot(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def rounded_once(q, k, cos, sin, unsqueeze_dim=1):
    """The same math in fp32, rounded once at the end."""
    out = apply_rotary_pos_emb(q.float(), k.float(), cos.float(), sin.float(), unsqueeze_dim)
    return out[0].to(q.dtype), out[1].to(k.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_accepts_the_function_and_rejects_other_math(dtype):
    args = (4, 2, 16, dtype, torch.device("cpu"))
    assert fused_rotary.matches(ORIGINAL, *args)
    assert not fused_rotary.matches(interleaved, *args)
    assert not fused_rotary.matches(lambda q, k, cos, sin: (q, k), *args)
    assert not fused_rotary.matches(lambda q, k, cos, sin: 1 / 0, *args)
    if dtype != torch.float32:                # in fp32 the two are the same
        assert not fused_rotary.matches(rounded_once, *args)


def test_the_wrapper_fuses_inside_the_models_forward_only(reference_kernel):
    model = tiny_llama()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    hs.enable_hisparse_kv_cache(model, **SMALL)
    try:
        assert binding_of(model).fused_rotary == [NAME]
        wrapper = modeling_llama.apply_rotary_pos_emb
        assert wrapper is not ORIGINAL and wrapper.__wrapped__ is ORIGINAL
        reference_kernel.clear()
        with torch.no_grad():
            got = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        assert reference_kernel == [(1, 4, 4, 16)] * 2 + [(1, 4, 1, 16)] * 4     # 3 forwards x 2 layers
        assert torch.allclose(got.logits[0], want[:, -1], atol=1e-5)     # the prompt as before
        reference_kernel.clear()
        q, k, cos, sin = inputs(torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(wrapper(q, k, cos, sin), ORIGINAL(q, k, cos, sin)))
        assert reference_kernel == []          # outside any HiSparse forward: the original
    finally:
        hs.disable_hisparse_kv_cache(model)
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL


def test_other_arguments_go_to_the_original(reference_kernel):
    """unsqueeze_dim=2 (q, k as (B, T, H, D)) or a positional extra: the function it replaced."""
    model = tiny_llama()
    hs.enable_hisparse_kv_cache(model, **SMALL)
    seen = []
    try:
        wrapper = modeling_llama.apply_rotary_pos_emb
        q, k, cos, sin = inputs(torch.float32)
        layer = model.model.layers[0].self_attn

        def hook(module, args, kwargs):
            seen.append(wrapper(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2))
            seen.append(wrapper(q, k, cos, sin, 1))

        handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
        reference_kernel.clear()
        with torch.no_grad():
            model(torch.tensor([[5, 6]]))
        handle.remove()
        assert len(seen) == 2 and reference_kernel == [(1, 4, 2, 16)] * 2     # only the model's own calls
        want = ORIGINAL(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
        assert all(torch.equal(a, b) for a, b in zip(seen[0], want))
    finally:
        hs.disable_hisparse_kv_cache(model)


def test_two_models_share_the_wrapper_and_the_last_one_puts_the_function_back(reference_kernel):
    first, second, plain = tiny_llama(), tiny_llama(), tiny_llama()
    hs.enable_hisparse_kv_cache(first, **SMALL)
    hs.enable_hisparse_kv_cache(second, **SMALL)
    hs.enable_hisparse_kv_cache(plain, **SMALL, fused_rotary=False)
    wrapper = modeling_llama.apply_rotary_pos_emb
    patch = fused_rotary.patch_of(NAME)
    assert patch is not None and len(patch.bindings) == 2 and binding_of(plain).fused_rotary == []
    reference_kernel.clear()
    with torch.no_grad():
        plain(torch.tensor([[5, 6]]))
    assert reference_kernel == []             # a model with fused_rotary=False: the original
    hs.disable_hisparse_kv_cache(first)
    assert modeling_llama.apply_rotary_pos_emb is wrapper
    with torch.no_grad():
        second(torch.tensor([[5, 6]]))
    assert len(reference_kernel) == 2
    hs.disable_hisparse_kv_cache(second)
    hs.disable_hisparse_kv_cache(plain)
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL


def test_a_function_installed_over_the_wrapper_is_left_in_place(reference_kernel):
    model = tiny_llama()
    hs.enable_hisparse_kv_cache(model, **SMALL)

    def theirs(*args, **kwargs):
        return ORIGINAL(*args, **kwargs)

    modeling_llama.apply_rotary_pos_emb = theirs
    hs.disable_hisparse_kv_cache(model)
    assert modeling_llama.apply_rotary_pos_emb is theirs


def test_a_failing_kernel_warns_and_fuses_nothing(monkeypatch):
    monkeypatch.setattr(fused_rotary, "use_triton", lambda *tensors: True)

    def broken(q, k, cos, sin):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(fused_rotary, "rotary", broken)
    model = tiny_llama()
    with pytest.warns(RuntimeWarning, match="no kernel here"):
        hs.enable_hisparse_kv_cache(model, **SMALL)
    try:
        assert binding_of(model).fused_rotary == [] and modeling_llama.apply_rotary_pos_emb is ORIGINAL
    finally:
        hs.disable_hisparse_kv_cache(model)


def test_a_failed_enable_leaves_the_function_alone(reference_kernel, monkeypatch):
    model = tiny_llama()

    def refuse(*args, **kwargs):
        raise ValueError("no attention switch")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.raises(ValueError, match="no attention switch"):
        hs.enable_hisparse_kv_cache(model, **SMALL)
    assert modeling_llama.apply_rotary_pos_emb is ORIGINAL


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32, 8, 1), (24, 32, 8, 1), (2, 32, 8, 300)], ids=["decode", "batch", "prompt"])
def test_on_a_gpu_the_kernel_is_transformers_function_bit_for_bit(dtype, shape):
    """Llama-3-8B's heads (32 q, 8 kv, 128 wide); the outputs poisoned with NaN first (torch.empty
    reuses it); fp32 too, where a fused multiply-add would round differently."""
    B, Hq, Hk, T = shape
    q, k, cos, sin = inputs(dtype, B, Hq, Hk, T, 128, device="cuda")
    junk = torch.full((4 * q.numel(),), float("nan"), device="cuda")
    del junk
    got = rotary(q, k, cos, sin)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.equal(g, w), int((g != w).sum())


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
def test_on_a_gpu_greedy_generate_with_fused_rotary_equals_unfused(dtype):
    """The fused rotary runs in the whole-step graph (captured and replayed) and the logits are
    those of the original function, bit for bit."""
    from hi_sparse import step_graph

    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(3)).cuda()
    out, models = [], []
    for fused in (True, False):
        model = tiny_llama(dtype).cuda()
        hs.enable_hisparse_kv_cache(model, **SMALL, fused_rotary=fused)
        assert binding_of(model).fused_rotary == ([NAME] if fused else [])
        with torch.no_grad():
            out.append(model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True))
        models.append(model)
    graphs = step_graph.of(models[0])
    assert graphs is not None and graphs.counts["replayed"] > 0, graphs and graphs.counts
    assert fused_rotary.patch_of(NAME).calls > 0
    for model in models:
        hs.disable_hisparse_kv_cache(model)
    assert torch.equal(out[0].sequences, out[1].sequences)
    for a, b in zip(out[0].logits, out[1].logits):
        assert torch.equal(a, b)
