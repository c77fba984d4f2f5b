"""A model's rotary position embedding as one Triton launch per layer (``fused_rotary``,
kernels/rotary.py).

In transformers the rotary embedding is not a module: each attention layer's forward calls the
function ``apply_rotary_pos_emb`` of its modeling module (modeling_llama, modeling_mistral, ...),
which on CUDA launches about ten small kernels a layer (multiply by cos, negate and concatenate
the rotated half, multiply by sin, add; for q and for k): 15.9 us a layer of a Llama-3-8B-shape
model's decode step on the H200 against 1.7 us for the one launch (bench_rotary.py), ~0.45 ms of
device time and ~290 kernels a step (docs/BENCHMARKS.md).

:func:`install` replaces that module attribute with a wrapper, once per modeling module and for
as long as a model with the HiSparse cache uses it. The wrapper runs ``kernels.rotary`` only
inside a forward of such a model (``hf_attention.current()`` names its binding: the forward
pushes it on this thread) and only for arguments the kernel takes (4-D q and k, 3-D cos and sin
of one dtype checked at install, the default ``unsqueeze_dim``, no gradients); every other call,
on any thread, goes to the function it replaced. The kernel rounds like torch, so its result is
bit for bit the function's; :func:`matches` checks exactly that on random inputs of the model's
shape, dtype and device before anything is replaced, and a function with other math keeps
running. :func:`uninstall` (``disable_hisparse_kv_cache``) puts the function back when the last
model using the wrapper lets go of it (a function someone installed over the wrapper since is
left in place). A model dropped without that call leaves the wrapper installed, but it then
fuses for no one: every call goes to the original.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
import weakref
from types import ModuleType
from typing import Any, Callable

import torch

from hi_sparse.kernels._dispatch import FLOAT_DTYPES, use_triton
from hi_sparse.kernels.rotary import rotary, supported

from . import hf_attention

log = logging.getLogger(__name__)
NAME = "apply_rotary_pos_emb"
MARK = "hisparse_fused_rotary"       # attribute of an installed wrapper: its _Patch
_lock = threading.Lock()


class _Patch:
    """One modeling module's function, replaced by the wrapper while bindings use it."""

    def __init__(self, module: ModuleType, original: Callable[..., Any]) -> None:
        self.module = module
        self.original = original
        self.bindings: weakref.WeakSet = weakref.WeakSet()
        self.dtypes: set[torch.dtype] = set()      # dtypes the kernel was checked in (matches)
        self.calls = 0                             # fused calls (tests count them)

    def wrapper(self) -> Callable[..., Any]:
        original = self.original

        def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
            ctx = hf_attention.current()
            if (ctx is not None and not args and ctx.binding in self.bindings and _default_kwargs(kwargs)
                    and getattr(q, "dtype", None) in self.dtypes and supported(q, k, cos, sin)):
                self.calls += 1
                return rotary(q, k, cos, sin)
            return original(q, k, cos, sin, *args, **kwargs)

        setattr(apply_rotary_pos_emb, MARK, self)
        apply_rotary_pos_emb.__doc__ = (f"{self.module.__name__}.{NAME} as one Triton launch inside a HiSparse "
                                        "model's forward (hi_sparse fused_rotary); the original otherwise")
        apply_rotary_pos_emb.__wrapped__ = original       # type: ignore[attr-defined]
        return apply_rotary_pos_emb


def _default_kwargs(kwargs: dict) -> bool:
    """Only the keywords whose values the kernel assumes (cos and sin unsqueezed at dim 1)."""
    return all((k == "unsqueeze_dim" and v == 1) or (k == "position_ids" and v is None) for k, v in kwargs.items())


def matches(fn: Callable[..., Any], num_q_heads: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, device: torch.device) -> bool:
    """True when ``fn(q, k, cos, sin)`` and the kernel agree bit for bit on random q (2, Hq, 3, D)
    and k (2, Hk, 3, D), a transposed view as the attention forward passes it, with cos and sin
    of random positions in the rotary embedding's form (the angles repeated over both halves),
    in ``dtype`` on ``device``. A function that raises counts as a disagreement."""
    g = torch.Generator().manual_seed(head_dim)
    B, T, D = 2, 3, head_dim
    q = torch.randn(B, T, num_q_heads, D, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
    k = (4 * torch.randn(B, T, num_kv_heads, D, generator=g)).to(device=device, dtype=dtype).transpose(1, 2)
    pos = torch.randint(0, 1 << 16, (B, T), generator=g).double()
    angles = pos[..., None] * 5e5 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = (a.to(device=device, dtype=dtype) for a in (angles.cos(), angles.sin()))
    with torch.no_grad():
        try:
            want = fn(q, k, cos, sin)
        except Exception:  # noqa: BLE001 - a function that cannot run on plain inputs is not replaced
            return False
        got = rotary(q, k, cos, sin)
    return (isinstance(want, tuple) and len(want) == 2 and all(isinstance(w, torch.Tensor) for w in want)
            and all(w.shape == g_.shape and w.dtype == g_.dtype and torch.equal(w, g_) for w, g_ in zip(want, got)))


def install(binding: Any, modules: list[torch.nn.Module], setting: bool | None) -> list[str]:
    """Fuse the rotary embedding of the attention ``modules`` of ``binding``'s model (module
    docstring); returns the names of the modeling modules whose function the binding now uses
    fused. ``setting`` is the config's ``fused_rotary``: False fuses nothing; None and True fuse
    where kernels run Triton (on the CPU nothing: the function's torch code runs either way)."""
    if setting is False or not modules:
        return []
    weight = next((p for m in modules for p in m.parameters(recurse=True)), None)
    if weight is None or weight.device.type == "meta" or weight.dtype not in FLOAT_DTYPES or not use_triton(weight):
        return []
    shape = binding.shape
    names = []
    with _lock:
        for name in dict.fromkeys(type(m).__module__ for m in modules):
            module = sys.modules.get(name)
            fn = getattr(module, NAME, None)
            if module is None or not callable(fn):
                continue
            patch = getattr(fn, MARK, None)
            original = patch.original if isinstance(patch, _Patch) else fn
            try:
                agree = (isinstance(patch, _Patch) and weight.dtype in patch.dtypes) or matches(
                    original, shape.num_q_heads, shape.num_kv_heads, shape.head_dim, weight.dtype, weight.device)
            except Exception as exc:  # noqa: BLE001 - the kernel failed (a Triton or driver problem)
                warnings.warn(f"HiSparse: the fused rotary embedding kernel failed ({type(exc).__name__}: {exc}); "
                              f"{name}.{NAME} runs unfused (fused_rotary=False silences this)", RuntimeWarning,
                              stacklevel=3)
                continue
            if not agree:
                log.debug("fused_rotary: %s.%s left alone (other math)", name, NAME)
                continue
            if not isinstance(patch, _Patch):
                patch = _Patch(module, fn)
                setattr(module, NAME, patch.wrapper())
            patch.dtypes.add(weight.dtype)
            patch.bindings.add(binding)
            names.append(name)
    log.debug("fused_rotary: %s", names)
    return names


def patch_of(name: str) -> _Patch | None:
    """The wrapper's state for a modeling module (None when its function is not the wrapper)."""
    fn = getattr(sys.modules.get(name), NAME, None)
    patch = getattr(fn, MARK, None)
    return patch if isinstance(patch, _Patch) else None


def uninstall(binding: Any, names: list[str]) -> None:
    """Let go of the wrapper of each modeling module in ``names``; the last binding to let go of
    one puts its original function back."""
    with _lock:
        for name in names:
            patch = patch_of(name)
            if patch is None:
                continue
            patch.bindings.discard(binding)
            if not len(patch.bindings):
                setattr(patch.module, NAME, patch.original)
