"""``enable_hisparse_kv_cache(model, **options)``: HiSparse in every attention layer of a model.

    import hi_sparse as hs
    model = hs.enable_hisparse_kv_cache(model, max_seq_len=32768, block_size=512,
                                        kv_dtype=torch.float16, window_size=1024, global_tokens=16)
    out = model.generate(**inputs, max_new_tokens=256)

Everything goes through transformers' and torch's own extension points:
- the attention function and mask function are registered as ``"hisparse"`` with
  ``AttentionInterface`` / ``AttentionMaskInterface`` and selected with the model's
  ``set_attn_implementation`` (hf_attention.py);
- the KV cache is a ``Cache`` of ``CacheLayerMixin`` layers backed by the engine (hf_cache.py);
- a forward pre-hook on the decoder model gives every cached forward a HiSparse cache: the
  caller's ``HiSparseCache``, or an empty cache that ``generate()``/``forward`` (or the caller)
  made, switched to HiSparse layers in place, or a new one when ``use_cache`` is on and none was
  passed. It binds engine sequences with each row's left padding and brackets the forward with
  ``engine.begin_step()`` / ``end_step()`` (a forward hook that runs even on exceptions).

One engine (and one telemetry segment, named after the model unless ``name=`` says otherwise)
serves the model for its lifetime; it is closed, and its segment removed, when the model is
garbage-collected, at interpreter exit, or by :func:`disable_hisparse_kv_cache`.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch

from . import (
    fused_norms,
    fused_projections,
    fused_rotary,
    hf_attention,
    hf_cache,
    hf_compat,
    hf_generate,
    hf_options,
    hf_support,
    step_graph,
)
from .bindings import BINDINGS as _BINDINGS, Binding, binding_of
from .hf_options import HiSparseOptionError
from .hf_support import UnsupportedModelError

__all__ = ["enable_hisparse_kv_cache", "disable_hisparse_kv_cache", "HiSparseCache",
           "HiSparseOptionError", "UnsupportedModelError", "binding_of", "left_pad_lengths"]

HiSparseCache = hf_cache.HiSparseCache


def left_pad_lengths(attention_mask: torch.Tensor | None, batch_size: int) -> list[int]:
    """Leading padding of each row of a 2D ``(batch, tokens)`` mask of 1s and 0s.

    HiSparse needs left padding (pads first, then the tokens): a row with a 0 after its first 1
    is rejected with a message naming the tokenizer setting that fixes it.
    """
    if attention_mask is None:
        return [0] * batch_size
    if attention_mask.dim() != 2:
        raise UnsupportedModelError(
            f"attention_mask of shape {tuple(attention_mask.shape)} is not supported with the "
            "HiSparse KV cache: pass the tokenizer's 2D (batch, tokens) mask")
    mask = attention_mask.to("cpu", torch.bool)
    # A row's padding ends at its first 1; left padding means every position after it is a 1.
    firsts = torch.where(mask.any(dim=1), mask.int().argmax(dim=1), mask.shape[1])
    pads = [int(p) for p in firsts]
    for row, pad in enumerate(pads):
        if pad == mask.shape[1]:
            raise UnsupportedModelError(f"attention_mask row {row} is all padding: drop that row")
        if not bool(mask[row, pad:].all()):
            raise UnsupportedModelError(
                f"attention_mask row {row} has padding after its first token: HiSparse supports "
                "left padding only (set tokenizer.padding_side = 'left')")
    return pads


def _check_mask_continues(attention_mask: torch.Tensor | None, past: int, new: int) -> None:
    """After the first forward, a mask may only add 1s for the new tokens."""
    if attention_mask is None or attention_mask.dim() != 2:
        return
    if attention_mask.shape[1] != past + new:
        raise UnsupportedModelError(
            f"attention_mask covers {attention_mask.shape[1]} tokens but the HiSparse cache holds "
            f"{past} and {new} are new: pass the mask for the whole sequence so far")
    if not bool(attention_mask[:, past:].bool().all()):
        raise UnsupportedModelError(
            "attention_mask has padding in the new tokens: HiSparse supports left padding only, "
            "given with the first forward")


class _Hooks:
    """The forward pre-hook and hook on the decoder model (see the module docstring)."""

    def __init__(self, binding: Binding, base_model: torch.nn.Module):
        self.binding = binding
        self.params = [p for p in inspect.signature(base_model.forward).parameters
                       if p not in ("self", "args", "kwargs")]
        # "cache" from transformers 5.24 on, "past_key_values" before (hf_compat.py)
        self.cache_kwarg = hf_compat.cache_kwarg(base_model.forward)

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        binding = self.binding
        if binding.closed:
            raise UnsupportedModelError(
                "the HiSparse KV cache of this model was disabled or closed: enable it again or "
                "use the model without it")
        if args:  # positional calls: name them so the cache can be read and replaced
            kwargs = {**dict(zip(self.params, args)), **kwargs}
        inputs = kwargs.get("input_ids")
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(module.config, "use_cache", True)
        cache = hf_compat.take_cache(kwargs, self.cache_kwarg)
        if cache is not None:
            kwargs[self.cache_kwarg] = cache
        sequences = None
        if inputs is not None and (cache is not None or use_cache):
            batch, new = int(inputs.shape[0]), int(inputs.shape[1])
            if cache is None:
                cache = hf_cache.HiSparseCache.for_binding(binding)
                kwargs[self.cache_kwarg] = cache
            sequences = hf_cache.adopt(cache, binding)
            mask = kwargs.get("attention_mask")
            if not sequences.bound:
                if mask is not None and mask.dim() == 2 and mask.shape[1] != new:
                    raise UnsupportedModelError(
                        f"attention_mask covers {mask.shape[1]} tokens but the first forward has "
                        f"{new}: pass the mask of the prompt")
                sequences.bind(batch, left_pad_lengths(mask, batch))
            else:
                if batch != sequences.batch_size:
                    raise UnsupportedModelError(
                        f"batch size changed from {sequences.batch_size} to {batch} within one "
                        "HiSparse cache: start a new cache for a new batch")
                _check_mask_continues(mask, cache.get_seq_length(), new)
            binding.engine.begin_step()
        hf_attention.push(hf_attention.ForwardContext(binding, sequences))
        return (), kwargs

    def after(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        ctx = hf_attention.current()
        if ctx is None or ctx.binding is not self.binding:
            return None
        hf_attention.pop(ctx)
        if ctx.sequences is not None and not self.binding.closed:
            self.binding.engine.end_step()
        return None


def _model_dtype_device(model: torch.nn.Module) -> tuple[torch.dtype, torch.device]:
    param = next(iter(model.parameters()), None)
    if param is None:
        raise UnsupportedModelError("the model has no parameters")
    return param.dtype, param.device


def _layer_devices(modules: list[torch.nn.Module], default: torch.device) -> list[torch.device]:
    """Each attention layer's device, from its own weights: with a device_map (accelerate's
    dispatch_model, or hi_sparse.split_layers) the layers live on different GPUs and each layer's
    hot buffer belongs next to it. Weights offloaded to the meta device count as ``default``."""
    devices = []
    for module in modules:
        param = next(iter(module.parameters()), None)
        devices.append(default if param is None or param.device.type == "meta" else param.device)
    return devices


def enable_hisparse_kv_cache(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
    """Use HiSparse in every attention layer of ``model``; returns the same model.

    Options (HiSparseConfig fields, docs/runtime.md): max_seq_len, block_size (alias
    cache_block_size), window_size, global_tokens, top_k, device_buffer_tokens, kv_dtype,
    host_kv_bits, metadata_device, recalibrate_every, recalibrate_topk, streaming, telemetry,
    fused_norms, fused_rotary, fused_projections, name. Supported: Llama, Mistral, Qwen2 and Qwen3
    models (GQA included) in float32, float16 or bfloat16, batch size 1 or left-padded batches,
    greedy or sampled generation.
    Raises UnsupportedModelError / HiSparseOptionError (both ValueError) naming the problem.
    """
    from .config import HiSparseConfig  # the runtime's; imported late to keep `import hi_sparse` light
    from .engine import HiSparseEngine

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise UnsupportedModelError(
            f"enable_hisparse_kv_cache needs a transformers model, got {type(model).__name__}")
    if model in _BINDINGS and not _BINDINGS[model].closed:
        raise UnsupportedModelError(
            "the HiSparse KV cache is already enabled on this model: call "
            "hi_sparse.disable_hisparse_kv_cache(model) first to change its options")
    config = model.config
    family = hf_support.check_family(config)
    base_model = getattr(model, "base_model", model)
    modules = hf_support.attention_modules(base_model)
    shape = hf_support.model_shape(config, modules)
    model_dtype, device = _model_dtype_device(model)
    hf_support.check_dtype(str(model_dtype).removeprefix("torch."))
    hf_support.check_generation_config(getattr(model, "generation_config", None))

    default_name = getattr(config, "name_or_path", "") or family
    cfg = hf_options.build_config(HiSparseConfig, options, default_name=_short_name(default_name,
                                                                                    family))
    hf_support.check_sliding_window(config, int(cfg.max_seq_len))
    dtype = model_dtype  # compute dtype; cfg.kv_dtype (None = the same) is the stored one

    hf_attention.register()
    previous_attn = getattr(config, "_attn_implementation", None)
    engine = HiSparseEngine(cfg, num_layers=shape.num_layers, num_q_heads=shape.num_q_heads,
                            num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                            device=device, dtype=dtype, model_name=family,
                            layer_devices=_layer_devices(modules, device))
    _attach(model, base_model, Binding(engine, cfg, shape, modules, previous_attn), modules)
    return model


def _attach(model: torch.nn.Module, base_model: torch.nn.Module, binding: Binding,
            modules: list[torch.nn.Module]) -> None:
    """Switch ``model``'s attention to HiSparse, fuse its RMSNorms and rotary embedding and hook
    its forward; closes ``binding`` (and puts the norms and the rotary function back) if the model
    refuses the switch."""
    try:
        binding.fused_norms = fused_norms.install(model, binding.config.fused_norms)
        binding.fused_rotary = fused_rotary.install(binding, modules, binding.config.fused_rotary)
        binding.fused_projections = fused_projections.install(list(getattr(base_model, "layers", [])),
                                                              binding.config.fused_projections)
        model.set_attn_implementation(hf_attention.ATTN_IMPLEMENTATION)
        if model.config._attn_implementation != hf_attention.ATTN_IMPLEMENTATION:
            raise UnsupportedModelError(
                f"{type(model).__name__} does not let its attention implementation be changed, "
                "so HiSparse cannot attach to it")
    except Exception:
        fused_norms.uninstall(binding.fused_norms)
        binding.fused_norms = []
        fused_rotary.uninstall(binding, binding.fused_rotary)
        binding.fused_rotary = []
        fused_projections.uninstall(binding.fused_projections)
        binding.fused_projections = []
        binding.close()
        raise
    hooks = _Hooks(binding, base_model)
    step_graph.install(binding, base_model)   # one-token steps replayed whole (after _Hooks read the signature)
    binding.hooks = [
        base_model.register_forward_pre_hook(hooks.before, with_kwargs=True),
        base_model.register_forward_hook(hooks.after, with_kwargs=True, always_call=True),
    ]
    _BINDINGS[model] = binding
    if base_model is not model:
        _BINDINGS[base_model] = binding
    hf_generate.guard_generate(model, int(binding.config.max_seq_len))  # prompt + max_new_tokens checked up front
    # The engine (and its telemetry segment) lives as long as the model; finalize also runs at
    # interpreter exit, which is what removes the segment on a clean exit; closing detaches it.
    binding.finalizer = weakref.finalize(model, binding.close)


def disable_hisparse_kv_cache(model: torch.nn.Module) -> torch.nn.Module:
    """Undo :func:`enable_hisparse_kv_cache`: hooks removed, attention restored, engine closed."""
    binding = binding_of(model)
    for handle in binding.hooks:
        handle.remove()
    binding.hooks = []
    hf_generate.unguard_generate(model)
    step_graph.uninstall(getattr(model, "base_model", model))
    fused_norms.uninstall(binding.fused_norms)
    binding.fused_norms = []
    fused_rotary.uninstall(binding, binding.fused_rotary)
    binding.fused_rotary = []
    fused_projections.uninstall(binding.fused_projections)
    binding.fused_projections = []
    if binding.previous_attn and binding.previous_attn != hf_attention.ATTN_IMPLEMENTATION:
        model.set_attn_implementation(binding.previous_attn)
    binding.close()
    for key in [k for k, v in _BINDINGS.items() if v is binding]:
        del _BINDINGS[key]
    return model


def _short_name(name_or_path: str, family: str) -> str:
    """A segment name from the model's name or path: its last component, else the family."""
    tail = name_or_path.rstrip("/").rsplit("/", 1)[-1]
    return tail or family
