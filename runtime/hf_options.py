"""``enable_hisparse_kv_cache(model, **options)`` options -> a validated HiSparseConfig.

The option names are the seed's (``block_size`` is kept as an alias of ``cache_block_size``);
any other HiSparseConfig field is accepted under its own name. Every mistake becomes one
:class:`HiSparseOptionError` naming the option and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch

from .config import NAME_BYTES

ALIASES = {"block_size": "cache_block_size"}
_OPTIONAL_INTS = ("device_buffer_tokens", "host_pool_blocks")  # int fields whose default is None
_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


class HiSparseOptionError(ValueError):
    """An option of enable_hisparse_kv_cache is unknown, mistyped or conflicts with another."""


def dtype_name(value: Any) -> str:
    """``torch.float16`` / ``"fp16"`` / ``"float16"`` -> ``"float16"``; raise on anything else."""
    text = str(value).removeprefix("torch.").lower()
    if text not in _DTYPE_NAMES:
        raise HiSparseOptionError(
            f"kv_dtype={value!r} is not supported: use torch.float32, torch.float16 or "
            "torch.bfloat16 (or None for the model's dtype)")
    return _DTYPE_NAMES[text]


def normalise_options(options: dict[str, Any], field_names: set[str]) -> dict[str, Any]:
    """Resolve aliases and reject unknown names; returns HiSparseConfig keyword arguments."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        target = ALIASES.get(name, name)
        if target not in field_names:
            close = difflib.get_close_matches(name, sorted(field_names | set(ALIASES)), n=2)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise HiSparseOptionError(f"unknown HiSparse option {name!r}{hint}")
        if target in out and out[target] != value:
            raise HiSparseOptionError(
                f"block_size={options.get('block_size')!r} and cache_block_size="
                f"{options.get('cache_block_size')!r} disagree: give only one of them")
        out[target] = value
    return out


def fit_name(name: str, limit: int = NAME_BYTES, fallback: str = "hisparse") -> str:
    """A default telemetry name made valid: control characters dropped, cut to ``limit`` bytes of
    UTF-8 at a character boundary. A name the user did not choose must never stop the model from
    loading (the segment's name field holds 64 bytes; a model path's last component may not)."""
    text = "".join(c for c in name if ord(c) >= 32 and ord(c) != 127)
    raw = text.encode("utf-8")[:limit]
    return raw.decode("utf-8", "ignore") or fallback


def build_config(config_cls: type, options: dict[str, Any], *, default_name: str) -> Any:
    """A validated ``config_cls`` (HiSparseConfig) from the user's options.

    ``kv_dtype`` may be a torch dtype or its name ("fp16", "bfloat16"); ``name`` defaults to
    ``default_name`` so the agent shows the model.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    fields = set(defaults)
    kwargs = normalise_options(options, fields)
    for key, value in kwargs.items():
        # 32768.0 from a YAML file or a division is what the user meant by an integer count
        default = defaults[key]
        integral = key in _OPTIONAL_INTS or (isinstance(default, int) and not isinstance(default, bool))
        if (integral
                and isinstance(value, float) and value.is_integer()):
            kwargs[key] = int(value)
    if kwargs.get("kv_dtype") is not None:
        kwargs["kv_dtype"] = getattr(torch, dtype_name(kwargs["kv_dtype"]))
    if "name" in fields and not kwargs.get("name"):
        kwargs["name"] = fit_name(default_name)
    try:
        cfg = config_cls(**kwargs)
        validate = getattr(cfg, "validate", None)
        if validate is not None:
            validate()
    except HiSparseOptionError:
        raise
    except (TypeError, ValueError) as exc:
        raise HiSparseOptionError(f"invalid HiSparse options: {exc}") from None
    return cfg
