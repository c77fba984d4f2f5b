"""A real topic shift on the real model, short context: the audited anchor hit rate (the share of
exact attention the selection keeps) drops when the document switches, and a recalibration
restores it, where without one it stays down.

SmolLM2-135M-Instruct reads 1,024 tokens of the license texts and 96 more token by token; then
384 tokens of the Python language reference arrive as one chunk and it reads 96 more; then one
run requests a recalibration and the other does not, and both read the next 96. Every step is
audited (one sampled layer and head; both runs sample the same ones, so the last phase is a
paired comparison). Measured 2026-12-02 (2 cores, torch 2.13 CPU, transformers 5.24): licenses
0.862, after the switch 0.831, then 0.882 recalibrated against 0.829 not (the true top-8 recall
moves the same way: 0.938, 0.901, 0.928 against 0.857).
"""

from __future__ import annotations

import pytest
import torch

from hi_sparse.hf_compat import installed_cache_kwarg, output_cache
from hi_sparse.integration import binding_of, disable_hisparse_kv_cache, enable_hisparse_kv_cache
from hi_sparse.real_model import load_text, token_ids

# the recalibrations in the step: the tests read what one does from the next token on (in the
# background, the default, it lands engine.SLICE_LAG steps later on a CPU)
OPTIONS = dict(max_seq_len=8192, block_size=32, window_size=64, global_tokens=16, top_k=256,
               recalibrate_every=1 << 20, recalibrate_topk=16, audit_every=1, drift_floor=0.0,
               telemetry=False, background_recalibration=False)
PROMPT, READ, SHIFT = 1024, 96, 384


def _read_through_a_shift(lm, recalibrate: bool) -> dict[str, float]:
    """Audited hit rate per phase: 'licenses', 'shifted', 'after' (with or without a recalibration
    requested at its start)."""
    licenses = token_ids(lm.tokenizer, load_text("licenses"), PROMPT + READ)
    python = token_ids(lm.tokenizer, load_text("python-reference"), SHIFT + 2 * READ)
    model = enable_hisparse_kv_cache(lm.model, **OPTIONS)
    engine, name = binding_of(model).engine, installed_cache_kwarg()
    rates: dict[str, float] = {}
    try:
        with torch.no_grad():
            out = model(torch.tensor([licenses[:PROMPT]]), use_cache=True, logits_to_keep=1)

            def read(phase: str, tokens: list[int]) -> None:
                nonlocal out
                st = engine.stats
                before = (st.anchor_lookups, st.anchor_hits)
                for t in tokens:
                    out = model(torch.tensor([[t]]), use_cache=True, **{name: output_cache(out)})
                st = engine.stats
                rates[phase] = (st.anchor_hits - before[1]) / (st.anchor_lookups - before[0])

            read("licenses", licenses[PROMPT:])
            out = model(torch.tensor([python[:SHIFT]]), use_cache=True, logits_to_keep=1,
                        **{name: output_cache(out)})
            read("shifted", python[SHIFT:SHIFT + READ])
            if recalibrate:
                engine.request_recalibration()
            read("after", python[SHIFT + READ:])
        assert engine.stats.recalibrations["request"] == int(recalibrate)
        assert engine.stats.recalibrations["drift"] == 0
    finally:
        disable_hisparse_kv_cache(lm.model)
    return rates


@pytest.fixture(scope="module")
def runs(smollm2):
    return {recal: _read_through_a_shift(smollm2, recal) for recal in (False, True)}


def test_the_switch_drops_the_audited_hit_rate(runs):
    rates = runs[True]
    assert runs[False]["licenses"] == rates["licenses"] and runs[False]["shifted"] == rates["shifted"]
    assert 0.6 < rates["shifted"] < rates["licenses"] - 0.015, rates


def test_recalibration_restores_what_reading_on_does_not(runs):
    kept, recalibrated = runs[False]["after"], runs[True]["after"]
    assert recalibrated > kept + 0.025, (kept, recalibrated)
    assert recalibrated > runs[True]["shifted"], runs[True]
