"""The name transformers gives the KV cache, across the supported releases.

transformers 5.24 renamed the models' ``past_key_values`` keyword (and output field) to ``cache``;
the old keyword is still accepted through a deprecation shim that warns (until 5.40). HiSparse
must read whichever name the installed release passes and write only the name it expects, so
that no deprecation warning comes from our side. Detection is by signature, not by version
number: a model's ``forward`` names the keyword it takes.
"""

from __future__ import annotations

import dataclasses
import inspect
from functools import lru_cache
from typing import Any, Callable

NEW_NAME = "cache"             # transformers >= 5.24
OLD_NAME = "past_key_values"   # transformers < 5.24 (deprecated alias until 5.40)


def cache_kwarg(forward: Callable[..., Any]) -> str:
    """The keyword under which ``forward`` (a decoder model's or a causal LM's) takes the cache."""
    return NEW_NAME if NEW_NAME in inspect.signature(forward).parameters else OLD_NAME


@lru_cache(maxsize=None)
def installed_cache_kwarg() -> str:
    """The cache keyword of the installed transformers (read from the Llama model's forward)."""
    from transformers import LlamaModel

    return cache_kwarg(LlamaModel.forward)


def take_cache(kwargs: dict[str, Any], name: str) -> Any:
    """Pop the cache from forward ``kwargs`` under either name and return it (None when absent).

    A cache given under the other name (a caller still using ``past_key_values=`` with a release
    that says ``cache=``) is taken too; the caller writes it back under ``name`` alone.
    """
    other = OLD_NAME if name == NEW_NAME else NEW_NAME
    cache = kwargs.pop(name, None)
    if other in kwargs:
        fallback = kwargs.pop(other)
        if cache is None:
            cache = fallback
    return cache


def output_cache(output: Any) -> Any:
    """The cache a model's output carries: ``output.cache`` (>= 5.24) or ``past_key_values``."""
    names = {f.name for f in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    return getattr(output, NEW_NAME if NEW_NAME in names else OLD_NAME)
