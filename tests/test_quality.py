"""The quality harness on the real model, short: ~2K tokens of real text, 32 decode steps.

What CI holds the runtime to (docs/BENCHMARKS.md has the long runs at 2K, 6K and 8K):
- the full budget (top_k = max_seq_len, no quantization) equals dense attention: the same
  perplexity to fp32 rounding and the same greedy needle answer;
- the default sparse configuration of the quality table (top_k 512, window 256, 64-token blocks,
  16 anchors, 4 sinks) stays within SPARSE_BOUND of dense perplexity, and 4-bit host blocks
  (keys per channel, values per token) cost at most FOUR_BIT_BOUND over the same selection with
  an unquantized host (issue 23's target; measured 2026-12-01 on this text: see the bounds);
- 8-token selection blocks (`selection_block_size=8`, issue 23's quality setting) stay within
  SELECT8_BOUND of dense and closer to it than 64-token selection, and at top_k 512 with 4-bit
  host blocks retrieve the needle at 50 % depth that 64-token selection loses.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hi_sparse import eval as hs_eval, quality
from hi_sparse.real_model import load_text, token_ids

CONTEXT, CONTINUATION = 2048, 32
# the probe's first fit in the prefill's step (in the background it would land engine.SLICE_LAG
# steps into the text), as when these numbers were measured
SPARSE = dict(max_seq_len=8192, block_size=64, window_size=256, global_tokens=16, top_k=512,
              background_recalibration=False)
FULL = dict(SPARSE, top_k=8192)
# Measured on this text and length (2026-12-01, 2-core AMD EPYC, torch 2.13 CPU, transformers
# 5.24): dense 10.813, top_k 512 11.063 (1.023x), with 4-bit host blocks 11.102 (1.0035x the
# unquantized host). One scale per 64 x 64 block (before issue 23) gave 11.444: 1.035x over the
# unquantized host, which FOUR_BIT_BOUND fails. docs/BENCHMARKS.md "Quality (issue 23)" has the
# 2K / 6K runs with a 512-token continuation.
SPARSE_BOUND = 1.035
FOUR_BIT_BOUND = 1.02
SELECT8 = dict(SPARSE, selection_block_size=8)
# 8-token selection, measured on this text and length (2026-12-03, the same VM, transformers
# 5.25): 10.915 (1.0094x dense) against 11.062 (1.023x) selecting in 64-token blocks.
SELECT8_BOUND = 1.02


@pytest.fixture(scope="module")
def ids(smollm2):
    return torch.tensor([token_ids(smollm2.tokenizer, load_text("licenses"), CONTEXT + CONTINUATION)])


@pytest.fixture(scope="module")
def dense(smollm2, ids):
    return quality.perplexity(smollm2, ids, CONTEXT, None)


def test_full_budget_perplexity_equals_dense(smollm2, ids, dense):
    full = quality.perplexity(smollm2, ids, CONTEXT, FULL)
    assert full.perplexity == pytest.approx(dense.perplexity, rel=1e-4)
    assert full.counters.hot_buffer_hit_rate is not None  # it really decoded through HiSparse


@pytest.fixture(scope="module")
def sparse(smollm2, ids):
    return quality.perplexity(smollm2, ids, CONTEXT, SPARSE)


@pytest.fixture(scope="module")
def dense_needle(smollm2):
    return quality.needle(smollm2, load_text("licenses"), CONTEXT, 0.5, None)


def test_sparse_perplexity_stays_within_its_bound(smollm2, ids, dense, sparse):
    four = quality.perplexity(smollm2, ids, CONTEXT, dict(SPARSE, host_kv_bits=4))
    print(f"dense {dense.perplexity:.3f}, top_k 512 {sparse.perplexity:.3f} "
          f"({sparse.perplexity / dense.perplexity:.3f}x), 4-bit {four.perplexity:.3f} "
          f"({four.perplexity / sparse.perplexity:.4f}x the unquantized host)")
    assert dense.perplexity < sparse.perplexity <= SPARSE_BOUND * dense.perplexity
    assert four.perplexity != sparse.perplexity           # the 4-bit pool really rounded what it read
    assert four.perplexity <= FOUR_BIT_BOUND * sparse.perplexity
    assert four.counters.quant_blocks.get(4, 0) > 0 and not set(four.counters.quant_blocks) - {4}
    assert 0 < four.counters.quant_error_mean < 0.5
    assert sparse.counters.anchor_lookups > 0  # the audit ran: the counters are the runtime's own


def test_eight_token_selection_stays_closer_to_dense(smollm2, ids, dense, sparse):
    fine = quality.perplexity(smollm2, ids, CONTEXT, SELECT8)
    print(f"dense {dense.perplexity:.3f}, top_k 512 selecting in 64 {sparse.perplexity:.3f}, in 8 "
          f"{fine.perplexity:.3f} ({fine.perplexity / dense.perplexity:.4f}x)")
    assert fine.perplexity < sparse.perplexity
    assert fine.perplexity <= SELECT8_BOUND * dense.perplexity


def test_eight_token_selection_retrieves_the_needle_block_selection_loses(smollm2, dense_needle):
    """Issue 23's needle target at CI's scale: 2K tokens, 50 % depth, top_k 512, 4-bit host blocks.
    64-token selection answers 'BLUE-HARVEEN-4921' here (at every host width, docs/BENCHMARKS.md);
    the assertion that it still does keeps this case one that tells the two apart."""
    text = load_text("licenses")
    coarse = quality.needle(smollm2, text, CONTEXT, 0.5, dict(SPARSE, host_kv_bits=4))
    fine = quality.needle(smollm2, text, CONTEXT, 0.5, dict(SELECT8, host_kv_bits=4))
    assert dense_needle.retrieved, dense_needle.answer
    assert fine.retrieved, fine.answer
    assert not coarse.retrieved, f"64-token selection now retrieves it ({coarse.answer!r}): pick a harder case"


def test_full_budget_answers_the_needle_like_dense(smollm2, dense_needle):
    got = quality.needle(smollm2, load_text("licenses"), CONTEXT, 0.5, FULL)
    assert dense_needle.retrieved, dense_needle.answer  # the model itself finds it at 2K
    assert got.answer == dense_needle.answer


def test_needle_prompt_plants_the_sentence_at_its_depth(smollm2):
    text = load_text("licenses")
    for depth in (0.1, 0.9):
        ids = quality.needle_prompt(smollm2, text, 1024, depth)
        assert 1000 <= ids.shape[1] <= 1024
        rendered = smollm2.tokenizer.decode(ids[0])
        at = rendered.index(quality.NEEDLE) / len(rendered)
        assert abs(at - depth) < 0.1
        assert rendered.rstrip().endswith("assistant")  # the answer turn is open
        assert quality.QUESTION in rendered


def test_eval_cli_rejects_bad_options_with_the_fix():
    for argv, fix in ((["--bits", "3"], "none, 4, 5, 6, 8, auto"),
                      (["--context", "8000"], "--max-seq-len"),
                      (["--depths", "1.5"], "between 0 and 1"),
                      (["--passes", "speed"], "perplexity, needle")):
        res = subprocess.run([sys.executable, "-m", "hi_sparse.eval", *argv], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 2 and fix in res.stderr, (argv, res.stderr)
        assert "Traceback" not in res.stderr


def test_eval_tables_from_recorded_results(tmp_path):
    recs = [dict(kind="perplexity", options=None, context=2048, seconds=3.0, perplexity=10.0,
                 continuation=512, depth=None, answer=None, retrieved=None, counters=None),
            dict(kind="perplexity", options=SPARSE | {"host_kv_bits": 4}, context=2048, seconds=9.0,
                 perplexity=11.0, continuation=512, depth=None, answer=None, retrieved=None,
                 counters=dict(anchor_hit_rate=0.9, hot_buffer_hit_rate=0.95, prefetch_efficiency=0.4,
                               quant_blocks={"4": 12}, quant_error_mean=0.18)),
            dict(kind="needle", options=None, context=2048, seconds=5.0, perplexity=None,
                 continuation=0, depth=0.5, answer="BLUE-HARVEST-4921", retrieved=True, counters=None)]
    for r in recs:
        r.update(model="m", text="t", continuation_asked=512)
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    table = hs_eval.tables(hs_eval.read_records(str(path)))
    assert "| 2048 + 512 | dense | 10.000 | – |" in table
    assert "| 11.000 | +10.0 % | 90 % | 95 % | 40 % | 12 x 4-bit (0.180) |" in table
    assert "✓ `BLUE-HARVEST-4921`" in table


def test_eval_records_name_the_source_revision():
    # every recorded number says which code made it (the tests run from a git checkout)
    import re

    rev = hs_eval._revision()
    assert rev is not None and re.fullmatch(r"[0-9a-f]{12}(-dirty)?", rev), rev


def test_eval_tables_keep_a_multiline_answer_in_its_cell(tmp_path):
    # a model's answer may hold line breaks, backticks or pipes: each table row stays one line
    rec = dict(kind="needle", options=None, context=2048, seconds=5.0, perplexity=None, continuation=0,
               depth=0.1, answer='The key is:\n\n`12|34`', retrieved=False, counters=None, model="m", text="t",
               continuation_asked=512)
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(rec) + "\n")
    row = [ln for ln in hs_eval.tables(hs_eval.read_records(str(path))).splitlines() if ln.startswith("| 2048 |")]
    assert row == ["| 2048 | dense | ✗ `` The key is:⏎⏎`12\\|34` `` |"]
