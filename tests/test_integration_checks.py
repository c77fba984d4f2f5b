"""What enable_hisparse_kv_cache refuses, and the pure helpers behind it (configs, no engine)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from hi_sparse.config import HiSparseConfig
from hi_sparse.hf_options import HiSparseOptionError, build_config
from hi_sparse.hf_support import (
    UnsupportedModelError,
    check_family,
    check_generation_config,
    check_sliding_window,
    sliding_window_of,
)
from hi_sparse.integration import left_pad_lengths


def test_supported_families_pass_and_others_are_named():
    for cfg in (LlamaConfig(), MistralConfig(), Qwen2Config(), Qwen3Config()):
        assert check_family(cfg) == cfg.model_type
    with pytest.raises(UnsupportedModelError,
                       match="supports Llama, Mistral, Qwen2 and Qwen3 models; got model_type 'gpt2'"):
        check_family(GPT2Config())


def test_sliding_window_rejected_only_when_it_bites():
    mistral = MistralConfig(sliding_window=4096)
    assert sliding_window_of(mistral) == 4096
    with pytest.raises(UnsupportedModelError, match="sliding_window=4096 is shorter than max_seq_len=32768"):
        check_sliding_window(mistral, 32768)
    check_sliding_window(mistral, 4096)  # a window as long as the sequence never masks anything
    check_sliding_window(MistralConfig(sliding_window=None), 1 << 20)
    # Qwen2 keeps sliding_window in its config but only applies it with use_sliding_window.
    assert sliding_window_of(Qwen2Config(sliding_window=512, use_sliding_window=False)) is None
    qwen = Qwen2Config(sliding_window=512, use_sliding_window=True, max_window_layers=0,
                       num_hidden_layers=2)
    with pytest.raises(UnsupportedModelError, match="sliding-window attention is not supported"):
        check_sliding_window(qwen, 4096)


def test_beam_and_contrastive_search_rejected():
    class Gen:
        num_beams = 4
        penalty_alpha = None

    with pytest.raises(UnsupportedModelError, match="beam search.*num_beams=4"):
        check_generation_config(Gen())
    Gen.num_beams, Gen.penalty_alpha = 1, 0.6
    with pytest.raises(UnsupportedModelError, match="contrastive search"):
        check_generation_config(Gen())


def _build(**options):
    return build_config(HiSparseConfig, options, default_name="llama")


def test_options_map_to_config_with_alias_and_dtype_names():
    cfg = _build(max_seq_len=4096, block_size=64, window_size=128, global_tokens=8, top_k=256,
                 kv_dtype="fp16", host_kv_bits="auto", recalibrate_every=1024.0)
    assert cfg.cache_block_size == 64 and cfg.kv_dtype is torch.float16
    assert cfg.recalibrate_every == 1024 and isinstance(cfg.recalibrate_every, int)
    assert cfg.name == "llama"
    assert _build(cache_block_size=32, kv_dtype=torch.bfloat16).kv_dtype is torch.bfloat16


@pytest.mark.parametrize("options, message", [
    (dict(window_size=4096, top_k=2048), "window_size .4096. must be <= top_k .2048."),
    (dict(topk=128), "unknown HiSparse option 'topk' .did you mean top_k"),
    (dict(block_size=64, cache_block_size=128), "give only one of them"),
    (dict(kv_dtype="int8"), "kv_dtype='int8' is not supported"),
    (dict(host_kv_bits=3), "host_kv_bits must be None, 4, 5, 6, 8"),
    (dict(streaming=True), "streaming=True needs a bounded host pool: set host_pool_blocks"),
    (dict(top_k=256, window_size=64, device_buffer_tokens=128), "device_buffer_tokens .128. must be >= top_k"),
], ids=["window>top_k", "unknown", "alias-conflict", "kv_dtype", "bits", "streaming", "buffer<top_k"])
def test_invalid_options_get_one_clear_error(options, message):
    with pytest.raises(HiSparseOptionError, match=message):
        _build(**options)


def test_left_pad_lengths_accepts_left_padding_only():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    assert left_pad_lengths(mask, 3) == [0, 2, 1]
    assert left_pad_lengths(None, 2) == [0, 0]
    with pytest.raises(UnsupportedModelError, match="left padding only .set tokenizer.padding_side = 'left'"):
        left_pad_lengths(torch.tensor([[1, 1, 0, 0]]), 1)
    with pytest.raises(UnsupportedModelError, match="row 1 is all padding"):
        left_pad_lengths(torch.tensor([[1, 1], [0, 0]]), 2)
    with pytest.raises(UnsupportedModelError, match="2D"):
        left_pad_lengths(torch.ones(1, 1, 2, 2), 1)
