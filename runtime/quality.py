"""What HiSparse costs in model quality, measured on a model and a long text.

Two measurements, each run dense (the model as loaded) and through HiSparse with given options:

- **teacher-forced perplexity** of a continuation: the first ``context`` tokens of the text are
  the prompt, the next ``continuation`` tokens are fed one at a time as decode steps (each step
  is where HiSparse selects), and the perplexity is exp of their mean negative log-likelihood.
  Dense runs the whole span in one forward (exact causal attention, the reference);
- **needle retrieval**: a planted sentence (``NEEDLE``) at a depth of the text, the question at
  the end through the tokenizer's chat template, greedy generation; retrieved when the answer
  contains the passphrase.

Each HiSparse run enables the cache on the model, runs, keeps the engine's own counters (the
same ones the telemetry segment carries) and disables it again, so one loaded model serves many
configurations. Model and tokenizer come from :mod:`hi_sparse.real_model` (or a caller's own).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from easymats import catalogue

from .hf_compat import installed_cache_kwarg, output_cache
from .metrics import SCALARS
from .real_model import LoadedModel, token_ids

NEEDLE = "The secret passphrase is BLUE-HARVEST-4921."
NEEDLE_ANSWER = "BLUE-HARVEST-4921"
QUESTION = "What is the secret passphrase? Answer with the passphrase only."
NEEDLE_NEW_TOKENS = 24


@dataclass
class Counters:
    """The runtime's own counters for one run (ratios None when nothing was counted)."""

    anchor_hit_rate: float | None = None
    anchor_lookups: int = 0
    hot_buffer_hit_rate: float | None = None
    prefetch_efficiency: float | None = None
    block_density: float | None = None
    quant_blocks: dict[int, int] = field(default_factory=dict)
    quant_error_mean: float | None = None
    recalibrations: dict[str, int] = field(default_factory=dict)


@dataclass
class Run:
    """One measurement of one configuration (``options`` None: dense)."""

    kind: str                 # "perplexity" or "needle"
    options: dict[str, Any] | None
    context: int              # prompt tokens
    seconds: float
    perplexity: float | None = None
    continuation: int = 0
    depth: float | None = None
    answer: str | None = None
    retrieved: bool | None = None
    counters: Counters | None = None


# unlabelled catalogue counter -> its field in the engine's stats (the ratios' numerators and denominators)
_FIELD = {metric: name for name, (metric, labels) in SCALARS.items() if not labels}


def _ratio(stats: Any, key: str) -> float | None:
    """A catalogue ratio (easymats.catalogue.RATIOS) of the run's counters."""
    r = catalogue.RATIO[key]
    return r.of(getattr(stats, _FIELD[r.numerator]), getattr(stats, _FIELD[r.denominator]))


def counters_of(stats: Any) -> Counters:
    """Counters from an engine's RuntimeStats."""
    err = stats.quant_error
    n_err = sum(err.counts)
    return Counters(
        anchor_hit_rate=_ratio(stats, "anchor_hit_rate"),
        anchor_lookups=stats.anchor_lookups,
        hot_buffer_hit_rate=_ratio(stats, "hot_buffer_hit_rate"),
        prefetch_efficiency=_ratio(stats, "prefetch_efficiency"),
        block_density=_ratio(stats, "block_density"),
        quant_blocks={b: n for b, n in stats.quant_blocks.items() if n},
        quant_error_mean=err.sum / n_err if n_err else None,
        recalibrations={r: n for r, n in stats.recalibrations.items() if n})


class _HiSparse:
    """``with _HiSparse(model, options) as engine``: HiSparse on the model for one run."""

    def __init__(self, model: Any, options: dict[str, Any] | None):
        self.model, self.options, self.engine = model, options, None

    def __enter__(self) -> Any:
        if self.options is not None:
            from .integration import binding_of, enable_hisparse_kv_cache

            enable_hisparse_kv_cache(self.model, **{"telemetry": False, **self.options})
            self.engine = binding_of(self.model).engine
        return self.engine

    def __exit__(self, *exc: Any) -> None:
        if self.options is not None:
            from .integration import disable_hisparse_kv_cache

            disable_hisparse_kv_cache(self.model)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target: logits (T, vocab), targets (T,) -> (T,)."""
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")


@torch.no_grad()
def perplexity(lm: LoadedModel, ids: torch.Tensor, context: int,
               options: dict[str, Any] | None) -> Run:
    """Teacher-forced perplexity of ids[context:] given ids[:context]; ids (1, total) on the
    model's device. Dense (options None): one forward over everything. HiSparse: a prefill of
    the context, then one decode step per continuation token."""
    model, total = lm.model, ids.shape[1]
    if not 0 < context < total:
        raise ValueError(f"context {context} must be between 1 and {total - 1} tokens")
    targets = ids[0, context:]
    t0 = time.perf_counter()
    counters = None
    with _HiSparse(model, options) as engine:
        if engine is None:
            logits = model(ids, use_cache=False, logits_to_keep=total - context + 1).logits[0, :-1]
            nll = _nll(logits, targets)
        else:
            name = installed_cache_kwarg()
            out = model(ids[:, :context], use_cache=True, logits_to_keep=1)
            nlls = [_nll(out.logits[0, -1:], targets[:1])]
            for i in range(context, total - 1):
                out = model(ids[:, i:i + 1], use_cache=True, **{name: output_cache(out)})
                nlls.append(_nll(out.logits[0, -1:], ids[0, i + 1:i + 2]))
            nll = torch.cat(nlls)
            counters = counters_of(engine.stats)
    return Run("perplexity", options, context, time.perf_counter() - t0,
               perplexity=math.exp(float(nll.mean())), continuation=total - context,
               counters=counters)


def needle_prompt(lm: LoadedModel, text: str, tokens: int, depth: float) -> torch.Tensor:
    """(1, ~tokens) chat prompt: ``text`` cut to fit, ``NEEDLE`` planted at a line break near
    ``depth`` (0..1) of it, the question at the end, the assistant turn opened."""
    tok = lm.tokenizer

    def render(haystack: str) -> list[int]:
        messages = [{"role": "user", "content": f"{haystack}\n\n{QUESTION}"}]
        chat = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(chat, add_special_tokens=False)["input_ids"]

    overhead = len(render(NEEDLE))
    haystack = tok.decode(token_ids(tok, text, max(1, tokens - overhead - 2), "the needle text"))
    at = int(depth * len(haystack))
    cut = haystack.rfind("\n", 0, at)
    at = cut + 1 if cut > 0 else at
    planted = f"{haystack[:at]}{NEEDLE}\n{haystack[at:]}"
    return torch.tensor([render(planted)])


@torch.no_grad()
def needle(lm: LoadedModel, text: str, tokens: int, depth: float,
           options: dict[str, Any] | None) -> Run:
    """Greedy answer to the needle question over a ~``tokens``-token prompt (see needle_prompt)."""
    model = lm.model
    ids = needle_prompt(lm, text, tokens, depth).to(next(model.parameters()).device)
    t0 = time.perf_counter()
    counters = None
    with _HiSparse(model, options) as engine:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEEDLE_NEW_TOKENS,
                             pad_token_id=lm.tokenizer.eos_token_id)
        if engine is not None:
            counters = counters_of(engine.stats)
    answer = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    return Run("needle", options, ids.shape[1], time.perf_counter() - t0, depth=depth,
               answer=answer, retrieved=NEEDLE_ANSWER in answer, counters=counters)
