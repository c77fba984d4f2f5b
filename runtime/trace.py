"""Named ranges for torch.profiler around the runtime's prefill-time phases.

A profile of a prefill (benchmarks/prefill_profile.py) lists ``hisparse.*`` ranges beside the
ops: where the time beyond dense attention goes (quantization, bounds, the first recalibration).
Only phases that run once per prefill chunk or recalibration are marked: a range costs a few
microseconds, nothing next to them, but too much for every decode step's layer.
"""

from __future__ import annotations

import contextlib

from torch.profiler import record_function


def phase(name: str, on: bool = True) -> contextlib.AbstractContextManager:
    """``with phase("prefill.seal", T > 1):`` a profiler range named ``hisparse.<name>`` (none when off)."""
    return record_function(f"hisparse.{name}") if on else contextlib.nullcontext()
