"""``fused_projections``: each layer's q, k, v projections as one GEMM and its MLP's gate and up as
one, the members' weights views of one tensor (runtime/fused_projections.py). On the CPU (with
fused_projections=True: the default fuses on CUDA only): the fused models generate what the
unfused do, every fused GEMM is counted, the weights keep their values and names and get storage of
their own back on disable, and every call that is not the layer's own pattern (a member alone,
another input, an input written in place, a replaced weight, gradients on) computes its own
projection. gpu-marked: the fused GEMMs inside the whole-step graph against the unfused model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_integration import make_pair, prompt

import hi_sparse as hs
from hi_sparse import fused_projections
from hi_sparse.integration import binding_of

SMALL = dict(max_seq_len=96, block_size=8, window_size=8, global_tokens=0, top_k=32, telemetry=False)
GROUP_NAMES = [("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))]


def members(model, layer: int = 0):
    lay = model.model.layers[layer]
    return [[getattr(getattr(lay, parent), n) for n in names] for parent, names in GROUP_NAMES]


def logits_and_tokens(model, ref, setting, ids: torch.Tensor, new: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """HiSparse enabled on ``model`` with fused_projections=``setting`` and on ``ref`` unfused;
    each one's teacher-forced fp32 logits of ``ids``, then its greedy continuation of ``new`` tokens."""
    out = []
    for m, fused in ((model, setting), (ref, False)):
        hs.enable_hisparse_kv_cache(m, **SMALL, fused_projections=fused)
        with torch.no_grad():
            logits = m(ids).logits.float()
            tokens = m.generate(ids, max_new_tokens=new, do_sample=False)
        out.append((logits, tokens))
    return out


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_on_the_cpu_the_default_fuses_nothing():
    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **SMALL)
    try:
        assert binding_of(model).fused_projections == []
        assert not any("forward" in vars(m) for group in members(model) for m in group)
    finally:
        hs.disable_hisparse_kv_cache(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])   # qwen2: q, k, v with biases
def test_fused_models_generate_what_unfused_ones_do_and_every_gemm_is_fused(family):
    ref, model = make_pair(family)
    out = logits_and_tokens(model, ref, True, prompt(2, 20)[0], 10)
    groups = binding_of(model).fused_projections
    assert len(groups) == 2 * model.config.num_hidden_layers and binding_of(ref).fused_projections == []
    # one fused GEMM per group and forward: the teacher-forced one, the prefill and 9 decode steps
    assert [g.calls for g in groups] == [11] * len(groups)
    assert all(g.y is None and g.x is None for g in groups), "nothing held after the layer's last member"
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0][1], out[1][1])
    for m in (model, ref):
        hs.disable_hisparse_kv_cache(m)


def test_the_weights_keep_names_and_values_as_views_and_get_their_own_storage_back():
    ref, model = make_pair("qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_projections=True)
    for group in members(model):
        assert len({storage(m.weight) for m in group}) == 1
        assert len({storage(m.bias) for m in group if m.bias is not None}) <= 1
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert {n: p for n, p in model.named_parameters()} == params, "the same Parameter objects"
    hs.disable_hisparse_kv_cache(model)
    for group in members(model):
        assert not any("forward" in vars(m) for m in group)
        assert len({storage(m.weight) for m in group}) == len(group)
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_the_prefill_keeps_its_own_copy_of_v_not_the_fused_output():
    """v is a view of the fused q/k/v output; the prefill keeps each layer's new K/V until the
    step's last layer, and a view would keep the whole output alive (6x v in Llama-3-8B)."""
    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_projections=True)
    prefill = binding_of(model).engine._prefill
    original, kept = prefill.keep, []

    def keep(layer, seqs, k, v):
        original(layer, seqs, k, v)
        kept.extend(t for pair in prefill._new[layer].values() for t in pair)
        kept.append(v)

    prefill.keep = keep
    with torch.no_grad():
        model(prompt(1, 24)[0])
    appended = kept[2::3]
    assert appended and all(t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size() for t in appended)
    held = [t for i, t in enumerate(kept) if i % 3 != 2]
    assert all(t.untyped_storage().nbytes() <= t.numel() * t.element_size() for t in held)
    hs.disable_hisparse_kv_cache(model)


def test_save_pretrained_while_fused_writes_the_weights(tmp_path):
    """Members sharing one storage must not stop a save (safetensors refuses shared tensors it
    was not told about) nor change what is saved."""
    from transformers import LlamaForCausalLM

    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_projections=True)
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == model.state_dict().keys()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    hs.disable_hisparse_kv_cache(model)


def test_load_state_dict_writes_through_the_views():
    ref, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_projections=True)
    torch.manual_seed(7)
    new = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    ref.load_state_dict(new)
    model.load_state_dict(new)
    ids, _ = prompt(1, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    assert all(g.calls == 1 for g in binding_of(model).fused_projections)
    hs.disable_hisparse_kv_cache(model)


def test_calls_outside_the_layers_pattern_compute_their_own_projection():
    _, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_projections=True)
    q, k, v = members(model)[0]
    group = binding_of(model).fused_projections[0]
    x, other = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    with torch.no_grad():
        own = {m: F.linear(x, m.weight.clone()) for m in (q, k, v)}
        outs = [m(x) for m in (q, k, v)]                                  # the layer's pattern: one GEMM
        assert len({storage(o) for o in outs}) == 1 and group.calls == 1 and group.y is None
        for o, m in zip(outs, (q, k, v)):
            torch.testing.assert_close(o, own[m], rtol=1e-5, atol=1e-6)
        group.calls = 0
        assert torch.equal(v(x), own[v]) and group.calls == 0            # a member alone
        assert torch.equal(q(x), own[q]) and group.calls == 1
        assert torch.equal(k(other), F.linear(other, k.weight))           # another input
        x.mul_(2)                                                          # written in place since
        assert torch.equal(v(x), F.linear(x, v.weight))
        q(x)
        assert torch.equal(k(x), F.linear(x, k.weight)) and torch.equal(v(x), F.linear(x, v.weight))
        k.weight = torch.nn.Parameter(torch.randn_like(k.weight))          # replaced: used unfused
        assert torch.equal(q(x), F.linear(x, q.weight)) and group.calls == 2
        assert torch.equal(k(x), F.linear(x, k.weight))
    replaced = k.weight
    hs.disable_hisparse_kv_cache(model)
    assert k.weight is replaced


def test_gradients_reach_the_members_weights():
    ref, model = make_pair("llama")
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_projections=True)
    ids, _ = prompt(1, 8)
    for m in (model, ref):
        m(ids).logits.float().pow(2).mean().backward()
    for a, b in zip(members(model), members(ref)):
        for ma, mb in zip(a, b):
            assert ma.weight.grad is not None
            torch.testing.assert_close(ma.weight.grad, mb.weight.grad, rtol=1e-4, atol=1e-6)
    assert all(g.calls == 0 for g in binding_of(model).fused_projections), "unfused with gradients on"
    hs.disable_hisparse_kv_cache(model)


def test_members_that_are_not_plain_linears_are_left_alone():
    class MyLinear(torch.nn.Linear):
        pass

    _, model = make_pair("llama")
    attn = model.model.layers[1].self_attn
    old = attn.k_proj
    attn.k_proj = MyLinear(old.in_features, old.out_features, bias=False)
    hs.enable_hisparse_kv_cache(model, **SMALL, fused_projections=True)
    fused = {id(g.members[0]()) for g in binding_of(model).fused_projections}
    assert id(attn.q_proj) not in fused and id(model.model.layers[1].mlp.gate_proj) in fused
    assert len(binding_of(model).fused_projections) == 3
    hs.disable_hisparse_kv_cache(model)


def test_a_failed_enable_leaves_the_projections_unfused(monkeypatch):
    _, model = make_pair("llama")

    def refuse(*args, **kwargs):
        raise ValueError("no attention switch")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.raises(ValueError, match="no attention switch"):
        hs.enable_hisparse_kv_cache(model, **SMALL, fused_projections=True)
    for group in members(model):
        assert not any("forward" in vars(m) for m in group)
        assert len({storage(m.weight) for m in group}) == len(group)


def test_install_skips_the_meta_device_and_setting_false():
    with torch.device("meta"):
        _, model = make_pair("llama")
    assert fused_projections.install(list(model.model.layers), True) == []
    _, model = make_pair("llama")
    assert fused_projections.install(list(model.model.layers), False) == []


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")])
def test_on_a_gpu_the_fused_gemms_run_in_the_step_graph_and_match_unfused(dtype):
    """Default options on CUDA fuse; the whole-step graph captures the fused GEMMs and replays
    them; the logits match the unfused model's to the GEMMs' rounding and fp32 generates the same
    tokens."""
    from hi_sparse import step_graph

    ref, model = make_pair("llama", dtype=dtype)
    ref, model = ref.cuda(), model.cuda()
    out = logits_and_tokens(model, ref, None, prompt(1, 20)[0].cuda(), 12)
    assert len(binding_of(model).fused_projections) == 4 and binding_of(ref).fused_projections == []
    graphs = step_graph.of(model)
    assert graphs is not None and graphs.counts["replayed"] > 0, graphs and graphs.counts
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out[0][0], out[1][0], rtol=tol, atol=tol * float(out[1][0].abs().max()))
    if dtype == torch.float32:
        assert torch.equal(out[0][1], out[1][1])
    for m in (model, ref):
        hs.disable_hisparse_kv_cache(m)
