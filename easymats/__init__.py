"""easymats: attach to a HiSparse process and sample its telemetry, GPU and process metrics."""

__version__ = "0.1.0"
