"""HiSparse: a long-context KV cache with a host tier, a device hot buffer and sparse attention."""

__version__ = "0.1.0"

# The transformers integration imports torch and transformers: load it on first use so that
# `import hi_sparse` stays light (the easymats agent must never pull torch in).
_LAZY = {
    "enable_hisparse_kv_cache": "integration",
    "disable_hisparse_kv_cache": "integration",
    "HiSparseCache": "integration",
    "HiSparseEngine": "engine",
    "HiSparseConfig": "config",
    "split_layers": "multigpu",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hi_sparse' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
