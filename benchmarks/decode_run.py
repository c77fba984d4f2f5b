"""A random-weight Llama decoding through HiSparse one token per step, each step timed: what the
decode profiles share (boundary_profile.py, stall_profile.py, key_trace.py)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_integration import make_pair, prompt  # noqa: E402

from hi_sparse import hf_compat  # noqa: E402
from hi_sparse.eval import _bits  # noqa: E402

# 32 layers of Llama-3-8B's attention shape (8 KV heads of 128) around a narrow model
LLAMA_32_LAYERS = dict(num_hidden_layers=32, hidden_size=1024, intermediate_size=2048, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128)


def host_bits(text: str) -> Any:
    """One ``host_kv_bits`` value from the command line (none, 4, 5, 6, 8, auto, budget, seed)."""
    return _bits(text)[0]


def random_llama(**shape: Any) -> tuple[torch.nn.Module, str]:
    """(model, device): a random-weight Llama of ``shape`` (make_pair's tiny one by default), bf16 on
    a GPU where there is one, else fp32 on the CPU."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    _, model = make_pair("llama", dtype=torch.bfloat16 if dev == "cuda" else torch.float32, **shape)
    return model.to(dev), dev


def decode(model: torch.nn.Module, dev: str, batch: int, prompt_len: int, steps: int,
           around: Callable[[int], Any] = lambda pos: contextlib.nullcontext()) -> Iterator[tuple[int, float]]:
    """Prefill a ``prompt_len``-token prompt of ``batch`` sequences, then decode greedily, yielding
    (position, milliseconds) after each step, timed until its token is ready: the current stream
    synchronized, as a caller reading the token waits (work a step queued on side streams, a
    background recalibration, runs on); ``around(position)``: a context each step runs in (a
    profiler, say)."""
    ids, mask = prompt(batch, prompt_len)
    kw = hf_compat.installed_cache_kwarg()
    with torch.no_grad():
        out = model(ids.to(dev), attention_mask=mask.to(dev), use_cache=True)
        cache, tok = hf_compat.output_cache(out), out.logits[:, -1:].argmax(-1)
        for step in range(steps):
            pos = prompt_len + step
            if dev == "cuda":
                torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter()
            with around(pos):
                out = model(tok, **{kw: cache}, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                if dev == "cuda":
                    torch.cuda.current_stream().synchronize()
            yield pos, 1e3 * (time.perf_counter() - t0)
