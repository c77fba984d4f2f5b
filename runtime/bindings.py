"""Which model is bound to which engine: the registry that the integration fills and the cache reads.

``enable_hisparse_kv_cache`` (integration.py) creates a :class:`Binding` per model and records it
here; ``HiSparseCache(model)`` (hf_cache.py) looks it up. Both import this module, neither imports
the other.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .hf_support import ModelShape, UnsupportedModelError

BINDINGS: "weakref.WeakKeyDictionary[torch.nn.Module, Binding]" = weakref.WeakKeyDictionary()


class Binding:
    """What ties one model to its engine: shape, config, owned attention modules, hooks."""

    def __init__(self, engine: Any, config: Any, shape: ModelShape,
                 modules: list[torch.nn.Module], previous_attn: str | None):
        self.engine = engine
        self.config = config
        self.shape = shape
        self.previous_attn = previous_attn
        self.closed = False
        self.hooks: list[Any] = []
        self.finalizer: weakref.finalize | None = None
        # the RMSNorm modules whose forward fused_norms.install replaced (weakly: the model owns them)
        self.fused_norms: list[weakref.ref] = []
        # the modeling modules whose apply_rotary_pos_emb runs fused for this model (fused_rotary)
        self.fused_rotary: list[str] = []
        # the projection groups whose GEMMs fused_projections.install fused (fused_projections)
        self.fused_projections: list = []
        self._module_ids = frozenset(id(m) for m in modules)

    @property
    def fused_norm_count(self) -> int:
        """How many RMSNorm modules run as one Triton launch (``fused_norms``)."""
        return sum(1 for ref in self.fused_norms if ref() is not None)

    def owns(self, module: torch.nn.Module) -> bool:
        return id(module) in self._module_ids

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.engine.close()
        if self.finalizer is not None:      # it holds the binding: the engine would outlive close
            self.finalizer.detach()
            self.finalizer = None


def binding_of(model: torch.nn.Module) -> Binding:
    """The binding of a model that ``enable_hisparse_kv_cache`` was called on."""
    binding = BINDINGS.get(model)
    if binding is None or binding.closed:
        raise UnsupportedModelError(
            "this model does not use the HiSparse KV cache: call "
            "hi_sparse.enable_hisparse_kv_cache(model, ...) first")
    return binding
