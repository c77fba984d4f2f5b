"""``fused_norms``: a model's RMSNorm modules as one Triton launch each (runtime/fused_norms.py,
kernels/norm.py). On the CPU: the option's validation, that nothing changes without a GPU, the
semantic check that keeps norms with other math unfused, and the install / uninstall bookkeeping
with the torch reference standing in for the kernel (the interpreter cases run the kernel itself:
kernels_interpret_cases.py). gpu-marked: the kernel at Llama-8B's width and a greedy generate."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import hi_sparse as hs
from hi_sparse import fused_norms
from hi_sparse.integration import binding_of
from hi_sparse.kernels import reference_rms_norm, rms_norm
from hi_sparse.kernels._dispatch import FORCE_ENV

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(max_seq_len=64, block_size=8, window_size=8, global_tokens=0, top_k=32, telemetry=False,
             fused_rotary=False)   # forced "Triton" on the CPU: the rotary kernel would need the interpreter
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
DTYPES = [pytest.param(torch.float32, id="fp32"), *HALF]


class OnePlusWeightRMSNorm(LlamaRMSNorm):
    """Gemma's scaling: (1 + weight) instead of weight."""

    def forward(self, hidden_states):
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (1 + self.weight) * h.to(hidden_states.dtype)


class RoundOnceRMSNorm(LlamaRMSNorm):
    """The weight product in fp32, rounded once at the end (Gemma 3's order)."""

    def forward(self, hidden_states):
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * self.weight.float()).to(hidden_states.dtype)


class NoEpsRMSNorm(LlamaRMSNorm):
    def forward(self, hidden_states):
        h = hidden_states.to(torch.float32)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))).to(hidden_states.dtype)


class TwoArgRMSNorm(LlamaRMSNorm):
    def forward(self, hidden_states, residual):
        return super().forward(hidden_states + residual)


def tiny_llama(dtype: torch.dtype = torch.float32, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=96, max_position_embeddings=128,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():                       # norm weights that matter (they start at 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    model.generation_config.eos_token_id = None
    return model


def norms_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


@pytest.fixture
def reference_kernel(monkeypatch):
    """Forced "Triton" on the CPU with the torch reference as the kernel: counts its calls."""
    monkeypatch.setenv(FORCE_ENV, "1")
    calls: list[tuple] = []

    def kernel(x, weight, eps):
        calls.append(tuple(x.shape))
        return reference_rms_norm(x, weight, eps)

    monkeypatch.setattr(fused_norms, "rms_norm", kernel)
    return calls


@pytest.mark.parametrize("setting", [None, True])
def test_on_the_cpu_enable_leaves_the_norms_alone(monkeypatch, setting):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    model = tiny_llama()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_norms=setting)
    try:
        assert binding_of(model).fused_norm_count == 0
        assert not any("forward" in vars(m) for m in norms_of(model))
        with torch.no_grad():
            assert torch.equal(model(ids, use_cache=False).logits, want)
    finally:
        hs.disable_hisparse_kv_cache(model)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_accepts_the_llama_math_and_leaves_the_module_untouched(dtype):
    norm = LlamaRMSNorm(48, eps=1e-6).to(dtype)
    before = norm.weight.detach().clone()
    assert fused_norms.matches(norm, reference_rms_norm)
    assert fused_norms.matches(norm)            # the kernel's dispatch: the reference on the CPU
    assert torch.equal(norm.weight, before) and norm.weight.requires_grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [OnePlusWeightRMSNorm, NoEpsRMSNorm, TwoArgRMSNorm])
def test_the_check_rejects_other_math(cls, dtype):
    assert not fused_norms.matches(cls(48, eps=1e-6).to(dtype), reference_rms_norm)


@pytest.mark.parametrize("dtype", HALF)
def test_the_check_rejects_a_product_rounded_once(dtype):
    """Agrees with the Llama math in fp32 (the same there), not in a half dtype."""
    assert fused_norms.matches(RoundOnceRMSNorm(256).float(), reference_rms_norm)
    assert not fused_norms.matches(RoundOnceRMSNorm(256).to(dtype), reference_rms_norm)


def test_install_fuses_what_agrees_and_uninstall_restores_it(reference_kernel):
    model = tiny_llama()
    model.model.layers[0].input_layernorm = OnePlusWeightRMSNorm(64)   # other math: kept
    wrapped = model.model.layers[1].input_layernorm
    wrapped.forward = lambda hidden_states: LlamaRMSNorm.forward(wrapped, hidden_states)  # someone's wrapper
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    assert fused_norms.install(model, False) == []
    fused = fused_norms.install(model, None)
    modules = [ref() for ref in fused]
    assert len(modules) == 3 and {id(m) for m in modules} == {
        id(model.model.layers[0].post_attention_layernorm), id(model.model.layers[1].post_attention_layernorm),
        id(model.model.norm)}
    reference_kernel.clear()
    with torch.no_grad():
        assert torch.equal(model(ids, use_cache=False).logits, want)
    assert reference_kernel == [(1, 4, 64)] * 3
    norm = model.model.norm
    assert list(inspect.signature(norm.forward).parameters) == ["hidden_states"]
    x = torch.randn(2, 64)
    reference_kernel.clear()
    with torch.no_grad():
        assert torch.equal(norm(hidden_states=x), LlamaRMSNorm.forward(norm, x))
    assert reference_kernel == [(2, 64)]
    y = norm(x.requires_grad_())                # gradients on: the module's own forward, differentiable
    assert y.grad_fn is not None and reference_kernel == [(2, 64)]
    fused_norms.uninstall(fused)
    assert not any("forward" in vars(m) for m in modules)
    assert "forward" in vars(wrapped)


def test_a_failing_kernel_warns_and_fuses_nothing(monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "1")

    def broken(x, weight, eps):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(fused_norms, "rms_norm", broken)
    model = tiny_llama()
    with pytest.warns(RuntimeWarning, match="no kernel here"):
        assert fused_norms.install(model, True) == []
    assert not any("forward" in vars(m) for m in norms_of(model))


def test_enable_and_disable_install_and_remove_the_fused_forwards(reference_kernel):
    model = tiny_llama()
    hs.enable_hisparse_kv_cache(model, **SMALL, decode_kernels=False)
    assert binding_of(model).fused_norm_count == 5
    assert all("forward" in vars(m) for m in norms_of(model))
    hs.disable_hisparse_kv_cache(model)
    assert not any("forward" in vars(m) for m in norms_of(model))


def test_a_failed_enable_leaves_the_norms_unfused(reference_kernel, monkeypatch):
    model = tiny_llama()

    def refuse(*args, **kwargs):
        raise ValueError("no attention switch")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.raises(ValueError, match="no attention switch"):
        hs.enable_hisparse_kv_cache(model, **SMALL)
    assert not any("forward" in vars(m) for m in norms_of(model))


def test_rms_norm_names_the_fix_for_bad_inputs():
    with pytest.raises(ValueError, match="one entry per element"):
        rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        rms_norm(torch.randn(2, 8).double(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="eps must be a number"):
        rms_norm(torch.randn(2, 8), torch.ones(8), None)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("rows", [1, 24])
@pytest.mark.parametrize("n", [4096, 576, 128])
def test_on_a_gpu_the_kernel_matches_the_module(rows, n):
    """bf16 rows of Llama-3-8B's width (and SmolLM2's, and Qwen3's heads): at most 1 % of the
    elements an ulp apart, none more; the output poisoned with NaN first (torch.empty reuses it)."""
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, n, generator=g) * 10.0 ** -(torch.arange(rows)[:, None] % 3)).to("cuda", torch.bfloat16)
    norm = LlamaRMSNorm(n, eps=1e-5).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(n, generator=g))
        junk = torch.full((rows * n * 4,), float("nan"), device="cuda")
        del junk
        got, want = rms_norm(x, norm.weight, 1e-5), norm(x)
        want_ref = reference_rms_norm(x, norm.weight, 1e-5)
    torch.cuda.synchronize()
    assert torch.equal(want, want_ref)
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.double() - want.double()).abs()
    assert float((diff > 0).double().mean()) <= 0.01
    assert bool((diff <= want.double().abs() * 2 ** -7).all())


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
def test_on_a_gpu_greedy_generate_with_fused_norms_equals_unfused(dtype):
    """The fused norms run in the whole-step graph (captured and replayed) and generate the same
    tokens as the modules' own forwards."""
    from hi_sparse import step_graph

    ids = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(3)).cuda()
    out, models = [], []
    for fused in (True, False):
        model = tiny_llama(dtype).cuda()
        hs.enable_hisparse_kv_cache(model, **SMALL, fused_norms=fused)
        assert binding_of(model).fused_norm_count == (5 if fused else 0)
        with torch.no_grad():
            out.append(model.generate(input_ids=ids, max_new_tokens=12, do_sample=False))
        models.append(model)
    graphs = step_graph.of(models[0])
    assert graphs is not None and graphs.counts["replayed"] > 0, graphs and graphs.counts
    for model in models:
        hs.disable_hisparse_kv_cache(model)
    assert torch.equal(out[0], out[1])
