"""Kernels for HiSparse: per op, a plain-PyTorch reference, a Triton kernel and a launcher.

Each public op runs its Triton kernel on CUDA tensors (or when HISPARSE_FORCE_TRITON=1, which
interpreter tests use with TRITON_INTERPRET=1) and its fp32 reference otherwise. Triton is
imported only on first use, so this package imports without it.
"""
import sys as _sys

_handed_over = False
if __name__ == "kernels":
    # Imported as the top-level "kernels": this folder sits at a checkout's root, which `python -m`
    # or `-c` run from there puts first on sys.path, and transformers imports Hugging Face's
    # package of that name whenever it is installed (its hub kernels; newer transformers declare
    # it). Load that package in this one's place (the import returns what sys.modules holds when
    # this file ends); where there is none, this folder imports as itself, as it always did.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        "kernels", [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
        _handed_over = True
if not _handed_over:
    from .attention import reference_sparse_decode_attention, sparse_decode_attention
    from .bounds import (
        block_bounds,
        block_scores,
        reference_block_bounds,
        reference_block_scores,
        superblock_bounds,
        top_blocks,
        two_level_candidates,
        two_level_least,
        two_level_pays,
        widen_bounds,
    )
    from .lru import install_slots, reference_install_slots
    from .norm import reference_rms_norm, rms_norm
    from .quant import (
        LAYOUTS,
        PARAM_DTYPES,
        SUPPORTED_BITS,
        dequantize_blocks,
        fake_quantize_blocks,
        pack_codes,
        packed_width,
        quantize_blocks,
        reference_dequantize_blocks,
        reference_quantize_blocks,
        unpack_codes,
    )
    from .swap_in import (
        gather_layers,
        reference_swap_in,
        reference_swap_in_dequant,
        scatter_layers,
        swap_in,
        swap_in_dequant,
    )

    __all__ = [
        "sparse_decode_attention", "swap_in", "swap_in_dequant", "gather_layers", "scatter_layers", "quantize_blocks",
        "dequantize_blocks",
        "block_bounds", "block_scores", "top_blocks", "superblock_bounds", "two_level_candidates", "two_level_least",
        "two_level_pays",
        "reference_sparse_decode_attention", "reference_swap_in",
        "reference_swap_in_dequant", "reference_quantize_blocks", "reference_dequantize_blocks",
        "reference_block_bounds", "reference_block_scores", "pack_codes", "unpack_codes", "packed_width",
        "fake_quantize_blocks", "SUPPORTED_BITS", "LAYOUTS", "PARAM_DTYPES", "install_slots",
        "reference_install_slots", "widen_bounds", "rms_norm", "reference_rms_norm",
    ]
