"""A transformers ``Cache`` whose layers keep their keys and values in a HiSparse engine.

transformers builds a ``Cache`` as a list of ``CacheLayerMixin`` layers and calls
``cache.update(k, v, layer_idx)`` in every attention layer just before the attention function.
Here each layer hands the new tokens to the engine (host pool + device hot buffer) instead of
concatenating dense tensors, so device memory stays bounded by the hot buffer. The attention
function (hf_attention.py) then asks the engine to attend for the same layer.

One :class:`SequenceSet` is shared by the layers of one cache: the engine sequences of its batch
rows, created on the first forward (when the padding is known) and freed when the cache is reset
or garbage-collected.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .bindings import binding_of
from .hf_support import UnsupportedModelError


class SequenceSet:
    """The engine sequences behind one cache: one per batch row, left padding recorded.

    ``bind`` happens on the first forward; ``free`` (reset, or the cache going away) returns the
    sequences' blocks to the engine, which is what makes blocks recycle between requests.
    """

    def __init__(self, binding: Any):
        self.binding = binding  # the integration's per-model binding (engine, shape, config)
        self.seq_ids: list[int] | None = None
        self.pad_lengths: list[int] = []
        self._finalizer: weakref.finalize | None = None

    @property
    def bound(self) -> bool:
        return self.seq_ids is not None

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids) if self.seq_ids is not None else -1

    def bind(self, batch_size: int, pad_lengths: list[int]) -> None:
        engine = self.binding.engine
        self.seq_ids = list(engine.add_sequences(batch_size, pad_lengths=pad_lengths))
        self.pad_lengths = list(pad_lengths)
        # Free through a finalizer that holds only the engine and ids, so a cache dropped by
        # generate() (the usual case) gives its blocks back as soon as it is collected.
        self._finalizer = weakref.finalize(self, _free, self.binding, list(self.seq_ids))

    def repeat_interleave(self, repeats: int) -> None:
        """Each row followed by ``repeats - 1`` forks of it (transformers' batch_repeat_interleave)."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        engine = self.binding.engine
        ids, pads = [], []
        for sid, pad in zip(self.seq_ids, self.pad_lengths):
            ids += [sid] + (engine.fork_sequences(sid, repeats - 1) if repeats > 1 else [])
            pads += [pad] * repeats
        if self._finalizer is not None:
            self._finalizer.detach()
        self.seq_ids, self.pad_lengths = ids, pads
        self._finalizer = weakref.finalize(self, _free, self.binding, list(ids))

    def free(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.seq_ids = None
        self.pad_lengths = []


def _free(binding: Any, seq_ids: list[int]) -> None:
    if not binding.closed:
        binding.engine.free_sequences(seq_ids)


class HiSparseLayer(CacheLayerMixin):
    """One decoder layer's KV cache, stored in the HiSparse engine.

    ``update`` appends the new tokens ``(batch, kv_heads, new_tokens, head_dim)`` to the engine and
    returns them unchanged: the HiSparse attention function never reads dense history, it asks
    the engine, which attends over its own selection.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, layer_idx: int, sequences: SequenceSet):
        super().__init__()
        self.layer_idx = layer_idx
        self.sequences = sequences
        self.length = 0  # tokens held per row, padding included (what transformers counts)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        seqs = self.sequences
        if not seqs.bound:
            raise RuntimeError(
                "bug: HiSparse cache layer updated before its sequences were bound (the forward "
                "pre-hook binds them); was the model called through a path that skips hooks?")
        seqs.binding.engine.append(self.layer_idx, seqs.seq_ids, key_states, value_states)
        self.length += key_states.shape[-2]
        return key_states, value_states

    @property
    def batch_size(self) -> int:
        return self.sequences.batch_size

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return int(self.sequences.binding.config.max_seq_len)

    def get_max_cache_shape(self) -> int:  # the same, under its name before transformers 5.x renamed it
        return self.get_max_length()

    def reset(self) -> None:
        self.sequences.free()
        self.length = 0
        self.is_initialized = False

    # The engine keeps no dense copy it could reorder or crop: say so instead of silently
    # attending over the wrong tokens. Repeating rows forks the engine's sequences.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedModelError(
            "beam search is not supported with the HiSparse KV cache: use greedy or sampling "
            "(num_beams=1)")

    def crop(self, tokens_to_remove: int) -> None:
        raise UnsupportedModelError(
            "cropping the HiSparse KV cache (assisted or speculative decoding) is not supported: "
            "generate without an assistant model")

    def batch_repeat_interleave(self, repeats: int) -> None:
        # the layers share one SequenceSet: the engine forks whole sequences (every layer) once
        if self.sequences.bound and self.layer_idx == 0:
            self.sequences.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise UnsupportedModelError(
            "selecting batch rows of a filled HiSparse KV cache is not supported (contrastive "
            "search): use greedy or sampling")

    def offload(self) -> None:  # the host tier is HiSparse's own; nothing dense to move
        return None

    def prefetch(self) -> None:
        return None


def hisparse_layers(binding: Any) -> list[HiSparseLayer]:
    """A fresh set of layers for ``binding``'s model, sharing one SequenceSet."""
    sequences = SequenceSet(binding)
    return [HiSparseLayer(i, sequences) for i in range(binding.shape.num_layers)]


class HiSparseCache(Cache):
    """A ``Cache`` for a model on which ``enable_hisparse_kv_cache`` was called.

    Pass it as ``cache=`` (``past_key_values=`` before transformers 5.24), or let ``generate()``
    and ``forward`` create one: any fresh cache they make is switched to HiSparse layers on the
    first forward.
    """

    def __init__(self, model: Any):
        super().__init__(layers=hisparse_layers(binding_of(model)))

    @classmethod
    def for_binding(cls, binding: Any) -> "HiSparseCache":
        """The cache the pre-hook creates when a cached forward got none."""
        cache = cls.__new__(cls)
        Cache.__init__(cache, layers=hisparse_layers(binding))
        return cache


def sequences_of(cache: Any) -> SequenceSet | None:
    """The SequenceSet of a cache whose layers are HiSparse layers, else None."""
    layers = getattr(cache, "layers", None)
    if layers and isinstance(layers[0], HiSparseLayer):
        return layers[0].sequences
    return None


def adopt(cache: Any, binding: Any) -> SequenceSet:
    """Switch an empty transformers cache (e.g. the DynamicCache generate() made) to HiSparse.

    The cache object stays the same (generate and the caller keep their reference); only its
    list of layers changes, which is the extension point transformers' Cache is built around.
    """
    seqs = sequences_of(cache)
    if seqs is not None:
        if seqs.binding is not binding:
            raise UnsupportedModelError(
                "this HiSparse cache belongs to another model: create one per model with "
                "hi_sparse.HiSparseCache(model)")
        return seqs
    if not isinstance(cache, Cache):
        raise UnsupportedModelError(
            f"a cache of type {type(cache).__name__} is not supported: pass a "
            "transformers Cache (or none) to a model using the HiSparse KV cache")
    if cache.get_seq_length() > 0:
        raise UnsupportedModelError(
            f"the cache already holds {cache.get_seq_length()} tokens in a "
            f"{type(cache).__name__}: HiSparse cannot take over a filled dense cache; pass a fresh "
            "cache (or none) for a new sequence")
    if getattr(cache, "offloading", False):
        raise UnsupportedModelError(
            "cache offloading is not supported with HiSparse (it has its own host tier): drop "
            "cache_implementation='offloaded'")
    if any(getattr(layer, "is_compileable", False) for layer in cache.layers):
        raise UnsupportedModelError(
            "static caches are not supported with HiSparse: drop cache_implementation='static'")
    cache.layers = hisparse_layers(binding)
    cache.layer_class_to_replicate = None
    return cache.layers[0].sequences
