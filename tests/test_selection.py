"""Selection per KV head: window + anchors + top blocks by upper bound, filled to top_k."""

import torch
from hypothesis import given, settings, strategies as st

from hi_sparse.kernels import block_bounds, block_scores
from hi_sparse.selection import candidate_blocks, select


def _select(scores, n, first, window, top_k, bs, anchors, holes, prefetch_blocks=0, sinks=0):
    """select for the H rows of one sequence of n tokens (its count, first position and holes on
    every row; the host bound on candidate blocks from the same numbers)."""
    H, nb = scores.shape
    rows = lambda x: torch.full((H, 1), x)                                  # noqa: E731
    return select(scores, rows(n), rows(first), window, top_k, bs, anchors,
                  None if holes is None else holes[None].expand(H, -1), prefetch_blocks,
                  candidate_blocks(nb, n - window, first, bs), sinks)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), first=st.integers(0, 30), window=st.integers(1, 40), extra=st.integers(0, 80),
       bs=st.integers(1, 17), A=st.integers(0, 6), H=st.integers(1, 3), seed=st.integers(0, 999),
       hole_frac=st.floats(0, 0.3), sinks=st.integers(0, 5))
def test_selection_invariants(n, first, window, extra, bs, A, H, seed, hole_frac, sinks):
    g = torch.Generator().manual_seed(seed)
    first = min(first, n - 1)
    top_k = window + A + sinks + extra
    nb = -(-n // bs)
    scores = torch.randn(H, nb, generator=g)
    holes = torch.rand(nb, generator=g) < hole_frac
    holes[-(-(max(first, n - window - bs)) // bs):] = False  # streaming never punches the window
    # unique per head (as the engine keeps them), some slots empty (-1)
    anchors = torch.stack([torch.randperm(n, generator=g)[:A] for _ in range(H)]) if n >= A \
        else torch.full((H, A), -1)
    anchors[torch.rand(H, A, generator=g) < 0.3] = -1
    sel = _select(scores, n, first, window, top_k, bs, anchors, holes, prefetch_blocks=1, sinks=sinks)
    pos = torch.arange(n)
    visible = (pos >= first) & ~holes[pos // bs]
    n_vis = int(visible.sum())
    for h in range(H):
        toks = sel.tokens[h][sel.tokens[h] >= 0]
        assert toks.unique().numel() == toks.numel()                       # no duplicates
        assert visible[toks].all()                                         # never pads or holes
        assert toks.numel() == min(top_k, n_vis)                           # filled to top_k
        w0 = max(first, n - window)
        assert torch.isin(pos[w0:][visible[w0:]], toks).all()             # window always in
        a = anchors[h][(anchors[h] >= 0)]
        a = a[visible[a]]
        assert torch.isin(a, toks).all()                                   # anchors pinned
        s = pos[first:first + sinks]
        assert torch.isin(s[visible[s]], toks).all()                       # sinks always in
        pf = sel.prefetch[h][sel.prefetch[h] >= 0] if sel.prefetch.numel() else sel.prefetch[h]
        assert not torch.isin(pf, toks).any() and visible[pf].all()        # prefetch is new
    assert int(sel.block_hits.sum()) == int((sel.tokens >= 0).sum())


def test_blocks_ranked_by_quest_upper_bound():
    """The query-aware part takes whole blocks in order of the upper bound of q.k."""
    torch.manual_seed(0)
    H, G, D, bs, n = 1, 2, 8, 4, 64
    k = torch.randn(H, n, D)
    k[0, 13] = 6.0  # block 3 holds a key that matches the query strongly
    k[0, 41] = 5.0  # block 10 a weaker one
    q = torch.ones(H, G, D)
    kmin, kmax = block_bounds(k, bs)
    scores = block_scores(q, kmin, kmax)
    # the bound is an upper bound of every token's q.k in the block
    exact = torch.einsum("hgd,hnd->hgn", q, k).amax(1).view(H, -1, bs).amax(-1)
    assert (scores >= exact - 1e-4).all()
    sel = _select(scores, n, 0, window=4, top_k=4 + 2 * bs, bs=bs, anchors=torch.full((H, 0), -1), holes=None)
    chosen = set(sel.tokens[0].tolist())
    assert set(range(12, 16)) <= chosen and set(range(40, 44)) <= chosen
    assert sel.loaded.item() == 3 * bs  # window block + two chosen blocks


def test_sink_tokens_are_kept_whatever_their_blocks_score():
    """The first visible tokens (attention sinks) are selected even when their block ranks last;
    they come out of the ranked budget, so the selection still holds top_k tokens."""
    H, bs, n = 2, 4, 64
    scores = torch.arange(n // bs, dtype=torch.float32).repeat(H, 1)          # block 0 ranks last
    none = torch.full((H, 0), -1)
    plain = _select(scores, n, 3, window=8, top_k=8 + 2 * bs, bs=bs, anchors=none, holes=None)
    assert not torch.isin(torch.tensor([3, 4]), plain.tokens).any()
    sel = _select(scores, n, 3, window=8, top_k=8 + 2 * bs, bs=bs, anchors=none, holes=None, sinks=2)
    for t in sel.tokens:
        t = t[t >= 0]
        assert {3, 4} <= set(t.tolist()) and t.numel() == 8 + 2 * bs and t.unique().numel() == t.numel()
    assert set(range(52, 56)) <= set(sel.tokens[0].tolist())              # the best block still in


def test_full_budget_selects_everything_visible():
    sel = _select(torch.zeros(2, 3), 10, 2, 3, 100, 4, torch.full((2, 1), -1), None)
    assert [sorted(t[t >= 0].tolist()) for t in sel.tokens] == [list(range(2, 10))] * 2


def test_rows_of_different_lengths_select_as_they_would_alone():
    """One call for rows of sequences of different lengths, paddings and holes (a batch) selects
    for each row what a call for that row alone selects, and blocks past a row's last token may
    score NaN (unfilled bounds) without being taken."""
    g = torch.Generator().manual_seed(4)
    bs, window, top_k, nb = 4, 6, 20, 30
    lengths, firsts = [117, 40, 9], [0, 5, 2]
    scores = torch.randn(3, nb, generator=g)
    holes = torch.zeros(3, nb, dtype=torch.bool)
    holes[0, [3, 7]] = True
    anchors = torch.tensor([[12, 50, -1], [8, -1, 20], [-1, -1, -1]])
    for r, n in enumerate(lengths):
        scores[r, -(-n // bs):] = float("nan")
    batch = select(scores, torch.tensor(lengths)[:, None], torch.tensor(firsts)[:, None], window, top_k, bs,
                   anchors, holes, 1, candidate_blocks(nb, max(lengths) - window, min(firsts), bs))
    for r, (n, first) in enumerate(zip(lengths, firsts)):
        nbr = -(-n // bs)
        alone = _select(scores[r:r + 1, :nbr], n, first, window, top_k, bs, anchors[r:r + 1], holes[r, :nbr], 1)
        assert torch.equal(batch.tokens[r], alone.tokens[0]), r
        assert torch.equal(batch.prefetch[r], alone.prefetch[0]), r
        assert torch.equal(batch.block_hits[r, :nbr], alone.block_hits[0]) and not batch.block_hits[r, nbr:].any()
