"""``model.generate`` refused up front when it cannot fit in ``max_seq_len``.

The prompt and ``max_new_tokens`` (or ``max_length``) are known before generation starts, so a
generation that would outgrow the HiSparse cache is refused with one error naming both and the
fix, instead of failing mid-generate after a long prefill. :func:`guard_generate` puts a check in
front of the model's own ``generate`` (an instance attribute; :func:`unguard_generate` removes it).
The check holds no reference to the model (a weak one), so the model is freed as before.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from .hf_options import HiSparseOptionError

_ATTR = "_hisparse_generate_previous"


def planned_tokens(model: Any, args: tuple, kwargs: dict) -> tuple[int, int, str] | None:
    """(prompt tokens, total tokens the longest row will hold, how the total was given), or None
    when generate's arguments do not say (generate itself then decides)."""
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        return None
    prompt = int(inputs.shape[1])  # left padding included: every row holds a cache slot per column
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    max_new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if max_new is not None:
        return prompt, prompt + int(max_new), f"max_new_tokens={int(max_new)}"
    max_length = kwargs.get("max_length", getattr(config, "max_length", None))
    if max_length is not None:
        return prompt, int(max_length), f"max_length={int(max_length)}"
    return None


def check_generation_length(model: Any, max_seq_len: int, args: tuple, kwargs: dict) -> None:
    planned = planned_tokens(model, args, kwargs)
    if planned is None or planned[1] <= max_seq_len:
        return
    prompt, total, given = planned
    raise HiSparseOptionError(
        f"this generate needs {total} tokens of cache (a prompt of {prompt} tokens and {given}) but the "
        f"HiSparse cache holds max_seq_len={max_seq_len}: lower max_new_tokens (at most "
        f"{max(0, max_seq_len - prompt)} here) or enable HiSparse with a larger max_seq_len")


def guard_generate(model: Any, max_seq_len: int) -> None:
    if not callable(getattr(model, "generate", None)):
        return
    ref = weakref.ref(model)
    previous = vars(model).get("generate")  # someone else's wrapper: kept, and called
    unbound = type(model).generate

    @functools.wraps(unbound)
    def generate(*args: Any, **kwargs: Any) -> Any:
        m = ref()
        check_generation_length(m, max_seq_len, args, kwargs)
        return previous(*args, **kwargs) if previous is not None else unbound(m, *args, **kwargs)

    setattr(model, _ATTR, previous)
    model.generate = generate


def unguard_generate(model: Any) -> None:
    if _ATTR not in vars(model):
        return
    previous = vars(model).pop(_ATTR)
    vars(model).pop("generate", None)
    if previous is not None:
        model.generate = previous
