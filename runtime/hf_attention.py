"""The "hisparse" attention function and mask function, registered with transformers.

A model selects them through ``config._attn_implementation = "hisparse"`` (set with the model's
own ``set_attn_implementation``). During a forward that has a HiSparse cache, the integration's
pre-hook pushes a :class:`ForwardContext`; the attention function then asks the engine to attend
for ``module.layer_idx`` over the tokens the cache layer just appended, and the mask function
returns no mask at all (the engine knows causality and each row's left padding, and a dense
``(batch, 1, q_len, kv_len)`` mask over a long context would cost more than the attention).
Without a cache (``use_cache=False``) there is nothing for HiSparse to hold, and the call falls
back to transformers' own SDPA attention with its usual mask.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "hisparse"


@dataclass(slots=True)
class ForwardContext:
    """One forward of one model through HiSparse (pushed by the pre-hook, popped after)."""

    binding: Any  # the integration's per-model binding
    sequences: Any  # hf_cache.SequenceSet, or None when the forward has no cache


_local = threading.local()


def push(ctx: ForwardContext) -> None:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)


def pop(ctx: ForwardContext) -> None:
    stack = getattr(_local, "stack", [])
    if stack and stack[-1] is ctx:
        stack.pop()
    elif ctx in stack:  # an exception skipped an inner pop; drop everything above ours too
        del stack[stack.index(ctx):]


def current() -> ForwardContext | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def hisparse_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               dropout: float = 0.0, scaling: float | None = None,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention through the HiSparse engine.

    query: (batch, q_heads, q_len, head_dim); key, value: (batch, kv_heads, new_tokens, head_dim),
    the tokens the cache layer just appended (unused on the HiSparse path: the engine holds them).
    Returns ((batch, q_len, q_heads, head_dim), None), the layout transformers' attention
    functions return.
    """
    ctx = current()
    if ctx is None or ctx.sequences is None or not ctx.binding.owns(module):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        raise ValueError("HiSparse attention is for inference: call model.eval() (attention "
                         "dropout is active in training mode)")
    binding = ctx.binding
    head_dim = query.shape[-1]
    if scaling is not None and abs(scaling - head_dim ** -0.5) > 1e-12 * scaling:
        # The engine scales by head_dim ** -0.5; fold a different model scale into q (exact).
        query = query * (scaling / head_dim ** -0.5)
    out = binding.engine.attend(module.layer_idx, ctx.sequences.seq_ids, query)
    return out.transpose(1, 2).contiguous(), None


def hisparse_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for a HiSparse forward; transformers' SDPA mask otherwise (the fallback path)."""
    ctx = current()
    if ctx is not None and ctx.sequences is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make ``attn_implementation="hisparse"`` known to transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, hisparse_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, hisparse_mask)
