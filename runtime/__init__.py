"""HiSparse: a long-context KV cache with a host tier, a device hot buffer and sparse attention."""

__version__ = "0.1.0"
