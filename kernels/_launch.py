"""Launch helpers shared by the Triton kernel modules (imported only with Triton present)."""
from __future__ import annotations

import functools

import torch
import triton


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (4 for CPU tensors under the interpreter)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Index tensors may come from the host: the kernel needs them where it runs."""
    return t if t.device == device else t.to(device, non_blocking=True)
