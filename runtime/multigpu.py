"""``split_layers(model, devices)``: a transformers decoder model's layers split over several GPUs.

A small stand-in for accelerate's ``device_map`` dispatch (which may not be installed): the
decoder layers are cut into contiguous, nearly equal runs, one per device in order; the input
embedding and rotary embedding go with the first run, the final norm and the LM head with the
last. Forward pre-hooks move every tensor a moved module receives (recursively through tuples,
lists and dicts, e.g. ``position_embeddings = (cos, sin)``) to that module's device, and the
logits come back to the first device, where ``generate()`` keeps its token ids.

HiSparse then keeps each layer's hot buffer on that layer's GPU
(``enable_hisparse_kv_cache`` reads each attention layer's device from its weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .hf_support import UnsupportedModelError

__all__ = ["split_layers", "layer_split"]


def layer_split(num_layers: int, num_devices: int) -> list[int]:
    """Device index (into the device list) of each of ``num_layers`` layers: contiguous runs whose
    sizes differ by at most one, earlier devices taking the extra layers."""
    if num_devices < 1 or num_layers < num_devices:
        raise ValueError(f"cannot split {num_layers} layers over {num_devices} devices: give between 1 "
                         f"and {num_layers} devices")
    per, extra = divmod(num_layers, num_devices)
    out: list[int] = []
    for d in range(num_devices):
        out += [d] * (per + (d < extra))
    return out


def _move(x: Any, device: torch.device) -> Any:
    """x with every tensor inside (tuples, lists, dicts, recursively) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple):
        items = [_move(i, device) for i in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)  # namedtuples keep their type
    if isinstance(x, list):
        return [_move(i, device) for i in x]
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x


def _inputs_to(device: torch.device):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return _move(args, device), _move(kwargs, device)
    return hook


def _outputs_to(device: torch.device):
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        return _move(output, device)
    return hook


def split_layers(model: torch.nn.Module, devices: Sequence[torch.device | str]) -> torch.nn.Module:
    """Place ``model``'s decoder layers over ``devices`` (in order) and return the same model.

    Works for the decoder families HiSparse supports (Llama, Mistral, Qwen2, Qwen3): a base model
    with ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``, and an optional ``lm_head``.
    Call it before ``enable_hisparse_kv_cache``. The hook handles are kept in
    ``model.hisparse_split_hooks`` (``handle.remove()`` undoes the input moves, not the placement).
    """
    devs = [torch.device(d) for d in devices]
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    missing = [name for name in ("embed_tokens", "layers", "norm") if getattr(base, name, None) is None]
    if missing:
        raise UnsupportedModelError(
            f"{type(base).__name__} has no {', '.join(missing)}: split_layers supports decoder models "
            "laid out like Llama (embed_tokens, layers, norm); use accelerate's device_map otherwise")
    if getattr(model, "hisparse_split_hooks", None):
        raise UnsupportedModelError("this model is split already: split a fresh model")
    where = layer_split(len(layers), len(devs))
    first, last = devs[0], devs[-1]
    head = getattr(model, "lm_head", None)
    if head is not None and head.weight is base.embed_tokens.weight:
        last = first  # tied input/output embeddings: one weight, so norm and head stay with it
    base.embed_tokens.to(first)
    if getattr(base, "rotary_emb", None) is not None:
        base.rotary_emb.to(first)
    handles = []
    placed = [(layer, devs[d]) for layer, d in zip(layers, where)] + [(base.norm, last)]
    if head is not None:
        placed.append((head, last))
    for module, device in placed:
        module.to(device)
        handles.append(module.register_forward_pre_hook(_inputs_to(device), with_kwargs=True))
    # logits (or the base model's last hidden state) back where the caller's ids live
    out = head if head is not None else base.norm
    handles.append(out.register_forward_hook(_outputs_to(first)))
    model.hisparse_split_hooks = handles
    return model
