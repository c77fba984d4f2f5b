"""The demo's workloads on the real model: SmolLM2-135M-Instruct reading real text.

- **demo-generate**: chat requests through ``enable_hisparse_kv_cache``: "what does this part of
  a license say?" over excerpts of 3-6 x top_k tokens, some as left-padded batches of two,
  sampled answers; 4/5/6-bit host blocks, each unit's width from its measured error (``host_kv_bits="auto"``).
- **demo-longctx**: a long document read token by token (teacher-forced decode over the text
  itself, so every step's attention is the model's real attention over real prose), on a bounded
  host pool in streaming mode. Timeline per document, as fractions of the cycle (as in
  hi_sparse.demo_longctx): prefill 1,024 tokens of the license texts; at 0.20 the request
  is preempted and resumed (blocks reclaimed); at 0.35 the document switches to Python's language
  reference (384 tokens prefilled, then read on): a real topic shift, after which the audited
  anchor hit rate and the drift check show what real attention does; the context outgrows the
  host pool and streaming evicts blocks. A run longer than a minute starts the next part of the
  texts every minute.

The model is loaded once (hi_sparse.real_model) and copied, one copy per workload: each copy
has its own engine and telemetry segment.
"""

from __future__ import annotations

import copy
import random
import time
from typing import Any

import torch

from .demo_longctx import DocumentTimeline
from .hf_compat import installed_cache_kwarg, output_cache
from .integration import binding_of, disable_hisparse_kv_cache, enable_hisparse_kv_cache
from .real_model import LoadedModel, load_text, token_ids

QUESTION = "In one sentence, what does this part of the text say?"
PROMPT_TOKENS = 1024   # the long-context document's prefill (a few seconds on 2 cores)
SHIFT_TOKENS = 384     # the new document's first chunk at the topic shift
BLOCK = 32
CYCLE_S = 60.0
LONGCTX_OPTIONS = dict(
    max_seq_len=8192, block_size=BLOCK, window_size=64, global_tokens=16, top_k=256,
    device_buffer_tokens=384, host_kv_bits="budget", quant_error_budget=0.02,
    recalibrate_every=1 << 20, recalibrate_topk=16, audit_every=2, audit_top_m=8,
    drift_floor=0.6, drift_window=6, prefetch_blocks=2, streaming=True,
    # room for the prompt and the shift chunk, little more: reading on then evicts
    host_pool_blocks=(PROMPT_TOKENS + SHIFT_TOKENS) // BLOCK + 2)


class RealGeneratePrompts:
    """Chat prompts over excerpts of the license texts, tokenized and left-padded.

    Returns (ids, mask) of shape (batch, tokens) with ``tokens`` about ``length``."""

    def __init__(self, lm: LoadedModel):
        self.tok = lm.tokenizer
        self.tok.padding_side = "left"  # HiSparse takes left padding only
        self.ids = token_ids(self.tok, load_text("licenses"), 12000, "the license texts")

    def __call__(self, rng: random.Random, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        chats = []
        for row in range(batch):
            n = length - 40 if row == 0 else rng.randint(length // 2, length - 40)
            start = rng.randrange(0, len(self.ids) - n)
            excerpt = self.tok.decode(self.ids[start:start + n])
            messages = [{"role": "user", "content": f"{excerpt}\n\n{QUESTION}"}]
            chats.append(self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        enc = self.tok(chats, add_special_tokens=False, padding=True, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]


class RealLongContextWorkload(DocumentTimeline):
    """The real model reads documents on the timeline above; :meth:`run_for` advances it."""

    def __init__(self, lm: LoadedModel, device: torch.device, duration_s: float, name: str):
        # its own copy of the weights: one engine per model (copied before any hooks are on it)
        self.model = enable_hisparse_kv_cache(copy.deepcopy(lm.model).to(device),
                                              **LONGCTX_OPTIONS, name=name)
        self.engine = binding_of(self.model).engine
        self.device = device
        self.cache_kwarg = installed_cache_kwarg()
        tok = lm.tokenizer
        # the first 150,000 characters of the reference are ~30,000 tokens, plenty for a cycle
        self.texts = (token_ids(tok, load_text("licenses"), 16000, "the license texts"),
                      token_ids(tok, load_text("python-reference")[:150000], 24000,
                                "the Python reference"))
        self.cycle_s = min(duration_s, CYCLE_S)
        self.steps = self.documents = 0
        self.cache: Any = None
        self.start = time.monotonic()
        self._new_document()

    @torch.no_grad()
    def _feed(self, ids: list[int]) -> None:
        x = torch.tensor([ids], device=self.device)
        kw = {} if self.cache is None else {self.cache_kwarg: self.cache}
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **kw)
        self.cache = output_cache(out)
        self.context = self.cache.get_seq_length()

    def _new_document(self) -> None:
        """Prefill the next part of the license texts; the previous document's blocks recycle."""
        self.cache = None  # dropped: its sequences are freed when it is collected
        k = self.documents
        self.documents += 1
        self.doc, self.pos = 0, (k * 4 * PROMPT_TOKENS) % (len(self.texts[0]) - 4 * PROMPT_TOKENS)
        self.shift_pos = (k * 8 * PROMPT_TOKENS) % (len(self.texts[1]) - 8 * PROMPT_TOKENS)
        self.preempted = self.shifted = False
        self._feed(self.texts[0][self.pos:self.pos + PROMPT_TOKENS])
        self.pos += PROMPT_TOKENS

    def _seq_ids(self) -> list[int]:
        return list(self.cache.layers[0].sequences.seq_ids)

    def _shift(self) -> None:
        """The next document arrives: Python's language reference instead of the licenses."""
        self.doc, self.pos = 1, self.shift_pos
        self._feed(self.texts[1][self.pos:self.pos + SHIFT_TOKENS])
        self.pos += SHIFT_TOKENS

    def _step(self) -> None:
        self._feed(self.texts[self.doc][self.pos:self.pos + 1])
        self.pos += 1
        self.steps += 1

    def describe(self) -> str:
        st = self.engine.stats
        rate = st.anchor_hits / st.anchor_lookups if st.anchor_lookups else float("nan")
        return (f"long-context reader: {self.documents} document(s), {self.steps} decode steps, "
                f"context {self.context} tokens, anchor hit rate "
                f"{rate:.0%}, recalibrations {dict(st.recalibrations)}, {st.block_evictions} blocks "
                "evicted")

    def close(self) -> None:
        self.cache = None
        disable_hisparse_kv_cache(self.model)
