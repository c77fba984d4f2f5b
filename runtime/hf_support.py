"""Which transformers models HiSparse can drive, and the shapes it needs from them.

Pure inspection of a model's config and modules: no tensors are touched, so the checks can be
tested on configs alone. Everything a user can get wrong raises :class:`UnsupportedModelError`
with one sentence naming what is unsupported and what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> family name shown in messages. These four share one attention layout: q/k/v/o
# projections, RoPE applied before the cache update, the attention function picked through
# config._attn_implementation, and a head_dim ** -0.5 (or configured) scaling.
SUPPORTED_FAMILIES: dict[str, str] = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
}
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


class UnsupportedModelError(ValueError):
    """The model (architecture, attention layout, dtype or generation mode) is not supported."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the engine needs to know about a model's attention."""

    family: str  # config.model_type, e.g. "llama"
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float  # the softmax scale the model's attention uses


def _families() -> str:
    names = list(SUPPORTED_FAMILIES.values())
    return ", ".join(names[:-1]) + " and " + names[-1]


def check_family(config: Any) -> str:
    """The model_type of ``config`` if HiSparse supports it; raise otherwise."""
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"HiSparse supports decoder-only {_families()} models; {model_type or 'this model'} is "
            "an encoder-decoder model")
    if model_type not in SUPPORTED_FAMILIES:
        arch = ", ".join(getattr(config, "architectures", None) or []) or model_type
        raise UnsupportedModelError(
            f"HiSparse supports {_families()} models; got model_type {model_type!r}"
            f"{f' ({arch})' if arch and arch != model_type else ''}: use one of the supported "
            "families or run this model without enable_hisparse_kv_cache")
    return model_type


def sliding_window_of(config: Any) -> int | None:
    """The sliding window the model's attention applies, or None when every layer is full."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def check_sliding_window(config: Any, max_seq_len: int) -> None:
    """Reject a sliding window that would bite within ``max_seq_len`` tokens.

    HiSparse replaces the whole attention with its own selection; a model trained to see only
    its last W tokens would then see tokens it never saw in training. A window at least as long
    as the longest sequence never masks anything, so it is accepted.
    """
    window = sliding_window_of(config)
    if window is not None and window < max_seq_len:
        raise UnsupportedModelError(
            f"sliding-window attention is not supported (config.sliding_window={window} is "
            f"shorter than max_seq_len={max_seq_len}): use a full-attention config "
            "(sliding_window=None) or set max_seq_len <= the window")


def check_dtype(dtype_name: str) -> None:
    if dtype_name not in SUPPORTED_DTYPES:
        raise UnsupportedModelError(
            f"model dtype {dtype_name} is not supported: HiSparse runs float32, float16 and "
            "bfloat16 models (convert with model.to(torch.bfloat16))")


def check_generation_config(generation_config: Any) -> None:
    """Reject generation modes that reorder, crop or fork the cache (HiSparse cannot undo them)."""
    if generation_config is None:
        return
    beams = getattr(generation_config, "num_beams", 1) or 1
    if beams > 1:
        raise UnsupportedModelError(
            f"beam search is not supported with the HiSparse KV cache (generation_config.num_beams="
            f"{beams}): use greedy or sampling (num_beams=1)")
    if getattr(generation_config, "penalty_alpha", None):
        raise UnsupportedModelError(
            "contrastive search is not supported with the HiSparse KV cache: unset penalty_alpha")


def model_shape(config: Any, attention_modules: list[Any]) -> ModelShape:
    """Shapes of the model's attention, read from its config and checked against its modules."""
    family = check_family(config)
    num_layers = int(config.num_hidden_layers)
    hq = int(config.num_attention_heads)
    hkv = int(getattr(config, "num_key_value_heads", None) or hq)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    if hq % hkv:
        raise UnsupportedModelError(
            f"num_attention_heads={hq} is not a multiple of num_key_value_heads={hkv}")
    if len(attention_modules) != num_layers:
        raise UnsupportedModelError(
            f"found {len(attention_modules)} attention layers but config.num_hidden_layers="
            f"{num_layers}: this {SUPPORTED_FAMILIES[family]} model has a modified layout that "
            "HiSparse does not support")
    scalings = {float(getattr(m, "scaling", head_dim ** -0.5)) for m in attention_modules}
    if len(scalings) != 1:
        raise UnsupportedModelError("attention layers use different softmax scales; not supported")
    for i, module in enumerate(attention_modules):
        if getattr(module, "layer_idx", i) != i:
            raise UnsupportedModelError(
                f"attention layer {i} reports layer_idx={module.layer_idx}: layers must be in order")
    return ModelShape(family=family, num_layers=num_layers, num_q_heads=hq, num_kv_heads=hkv,
                      head_dim=int(head_dim), scaling=scalings.pop())


def attention_modules(base_model: Any) -> list[Any]:
    """The self-attention module of every decoder layer, in layer order."""
    layers = getattr(base_model, "layers", None)
    if layers is None:
        raise UnsupportedModelError(
            f"{type(base_model).__name__} has no decoder layers (.layers): pass the model itself "
            "(e.g. LlamaForCausalLM or LlamaModel)")
    modules = [getattr(layer, "self_attn", None) for layer in layers]
    if any(m is None or not hasattr(m, "layer_idx") for m in modules):
        raise UnsupportedModelError(
            f"{type(base_model).__name__}'s layers have no self_attn with a layer_idx: not a "
            "supported attention layout")
    return modules
