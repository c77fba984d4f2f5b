"""The real trained model and real texts: loaded from installed files, run through HiSparse."""

from __future__ import annotations

import warnings

import pytest
import torch

import hi_sparse as hs
from hi_sparse import real_model
from hi_sparse.hf_compat import installed_cache_kwarg, output_cache
from hi_sparse.real_model import RealModelError, load_text, token_ids


def test_smollm2_loads_from_the_installed_gguf_file(smollm2):
    cfg = smollm2.model.config
    assert smollm2.name == "SmolLM2-135M-Instruct"
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.max_position_embeddings) == ("llama", 30, 9, 3, 8192)
    assert real_model.default_model_file().endswith(real_model.MODEL_FILE)
    assert smollm2.tokenizer.chat_template and real_model.real_model_available()
    # trained weights: the license text is far more likely than chance (vocab 49152 -> ~10.8 nats)
    ids = torch.tensor([token_ids(smollm2.tokenizer, load_text("licenses"), 256)])
    with torch.no_grad():
        loss = smollm2.model(ids, labels=ids).loss
    assert float(loss) < 4.0


def test_real_texts_are_long_and_bad_names_get_the_fix(tmp_path):
    assert len(load_text("licenses")) > 80_000 and "GNU GENERAL PUBLIC LICENSE" in load_text("licenses")
    assert len(load_text("python-reference")) > 300_000
    own = tmp_path / "book.txt"
    own.write_text("Call me Ishmael.")
    assert load_text(str(own)) == "Call me Ishmael."
    with pytest.raises(RealModelError, match="licenses, python-reference"):
        load_text(str(tmp_path / "missing.txt"))
    with pytest.raises(RealModelError, match="use --text python-reference"):
        real_model.licenses(str(tmp_path))
    with pytest.raises(RealModelError, match="does not exist"):
        real_model.load_model(str(tmp_path / "x.gguf"))


def test_too_short_a_text_names_the_fix(smollm2):
    with pytest.raises(RealModelError, match="shorter context"):
        token_ids(smollm2.tokenizer, "a few words", 100)


def test_hisparse_on_the_real_model_generates_like_dense_with_full_budget(smollm2):
    """Greedy generation and step logits through the integration on trained weights, with the
    installed release's cache keyword and no deprecation warning from HiSparse."""
    model, tok = smollm2.model, smollm2.tokenizer
    ids = torch.tensor([token_ids(tok, load_text("python-reference"), 300)])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                              do_sample=False, pad_token_id=tok.eos_token_id)
        dense = model(want[:, :-1]).logits[0, -1]
    hs.enable_hisparse_kv_cache(model, max_seq_len=1024, block_size=64, window_size=128,
                                global_tokens=16, top_k=1024, telemetry=False)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
            out = model(want[:, :-2], use_cache=True)
            out = model(want[:, -2:-1], use_cache=True, **{installed_cache_kwarg(): output_cache(out)})
    finally:
        hs.disable_hisparse_kv_cache(model)
    assert torch.equal(got, want)
    torch.testing.assert_close(out.logits[0, -1], dense, rtol=1e-4, atol=1e-4)
