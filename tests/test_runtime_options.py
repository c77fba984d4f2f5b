"""Runtime options that are wrong are refused up front, naming the option and the fix (issue 17
item 10); a default telemetry name never breaks its host; a generate that cannot fit in
max_seq_len is refused before it starts. Real (tiny, random-weight) transformers models."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hi_sparse as hs
from easymats import layout as L
from hi_sparse.config import HiSparseConfig
from hi_sparse.hf_options import HiSparseOptionError, build_config
from hi_sparse.integration import binding_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = dict(max_seq_len=256, block_size=8, window_size=8, global_tokens=2, top_k=64)


def tiny_model(name_or_path: str = "") -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=64, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.name_or_path = name_or_path
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("options, names", [
    (dict(global_tokens=2.5), ("global_tokens", "integer")),
    (dict(global_tokens="4"), ("global_tokens", "global_tokens=4")),
    (dict(top_k=True), ("top_k", "integer")),
    (dict(max_seq_len=256, window_size=512, top_k=1024), ("window_size", "max_seq_len")),
    (dict(threshold_base=5), ("threshold_base", "between 0 and 1")),
    (dict(threshold_base="0.5"), ("threshold_base", "number")),
    (dict(drift_floor=float("nan")), ("drift_floor",)),
    (dict(name="decode\x000"), ("name", "NUL")),
    (dict(name="x" * 65), ("name", "64 bytes")),
    (dict(max_seq_len=2**40), ("max_seq_len", "16777216")),
], ids=["float-int", "str-int", "bool-int", "window>max_seq_len", "threshold_base", "str-float", "nan",
        "nul-name", "long-name", "absurd-max_seq_len"])
def test_each_bad_option_is_refused_naming_itself_and_the_fix(options, names):
    with pytest.raises(HiSparseOptionError) as err:
        build_config(HiSparseConfig, options, default_name="llama")
    for word in names:
        assert word in str(err.value), str(err.value)


FUSED = ["fused_norms", "fused_rotary", "fused_projections"]     # fusions of the model's own kernels: True, False, None


@pytest.mark.parametrize("option", FUSED)
@pytest.mark.parametrize("value", ["yes", 1, 0.0, "True"])
def test_a_bad_fused_option_is_refused_naming_the_choices(option, value):
    with pytest.raises(HiSparseOptionError) as err:
        build_config(HiSparseConfig, {option: value}, default_name="llama")
    assert f"{option} must be True, False or None" in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize("option", FUSED)
@pytest.mark.parametrize("value", [None, True, False])
def test_a_fused_option_accepts_true_false_and_none(option, value):
    assert getattr(build_config(HiSparseConfig, {option: value}, default_name="llama"), option) is value


@pytest.mark.parametrize("options", [dict(global_tokens=2.5), dict(max_seq_len=2**40), dict(name="a\x00b")],
                         ids=["float-global_tokens", "absurd-max_seq_len", "nul-name"])
def test_enable_refuses_before_building_anything(options):
    model = tiny_model()
    with pytest.raises(HiSparseOptionError):
        hs.enable_hisparse_kv_cache(model, **{**SMALL, **options})
    assert model.config._attn_implementation != "hisparse"


def test_a_long_model_path_gives_a_shortened_default_name(segment_dir):
    tail = "an-extremely-long-model-directory-name-" + "ü" * 40  # 119 bytes of UTF-8
    model = tiny_model(f"/models/{tail}")
    hs.enable_hisparse_kv_cache(model, **SMALL)  # the segment's 64-byte limit must not break it
    try:
        name = binding_of(model).config.name
        assert 0 < len(name.encode("utf-8")) <= L.NAME_FIELD and tail.startswith(name)
        name.encode("utf-8").decode("utf-8")  # cut at a character boundary
    finally:
        hs.disable_hisparse_kv_cache(model)


def test_generate_longer_than_max_seq_len_is_refused_before_it_starts():
    model = tiny_model()
    hs.enable_hisparse_kv_cache(model, name="gen-check", **SMALL)
    try:
        ids = torch.randint(3, 64, (1, 200))
        engine = binding_of(model).engine
        before = engine.stats.tokens_prefill
        with pytest.raises(HiSparseOptionError) as err:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=100, do_sample=False)
        msg = str(err.value)
        assert "200" in msg and "max_new_tokens=100" in msg and "max_seq_len=256" in msg
        assert engine.stats.tokens_prefill == before, "refused before the prefill ran"
        # Left padding holds cache slots too: 200 columns + 4 new fit in 256, 200 + 60 do not (190
        # real tokens + 60 were let through once, and failed after the prefill).
        mask = torch.ones(2, 200, dtype=torch.long)
        mask[:, :10] = 0
        out = model.generate(input_ids=torch.randint(3, 64, (2, 200)), attention_mask=mask, max_new_tokens=4,
                             do_sample=False)
        assert out.shape == (2, 204)
        with pytest.raises(HiSparseOptionError, match="max_new_tokens=60"):
            model.generate(input_ids=torch.randint(3, 64, (2, 200)), attention_mask=mask, max_new_tokens=60,
                           do_sample=False)
        with pytest.raises(HiSparseOptionError, match="max_length"):
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_length=300, do_sample=False)
    finally:
        hs.disable_hisparse_kv_cache(model)
    # Disabled: the model's own generate again, no HiSparse check.
    assert "generate" not in vars(model)
