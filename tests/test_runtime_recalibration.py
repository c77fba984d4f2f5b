"""Recalibration decisions (pure logic) and anchor picking from attention mass."""

import torch

from hi_sparse.recalibration import RecalibrationController, distillation_target, pick_anchors


def test_controller_reasons_and_their_order():
    c = RecalibrationController(every_tokens=100, drift_floor=0.6, drift_window=3)
    assert c.due(ready=False) is None                      # nothing to score yet
    assert c.due(ready=True) == "schedule"                 # first fit once sparsity starts
    c.done()
    c.on_tokens(99)
    assert c.due(True) is None
    c.on_tokens(1)
    assert c.due(True) == "schedule"
    c.done()
    for hits in (2, 3):
        c.on_audit(8, hits)
    assert c.due(True) is None                             # window not full: no judgement yet
    c.on_audit(8, 8)
    assert c.audited_rate() == 13 / 24 and c.due(True) == "drift"
    c.request("request")
    assert c.due(True) == "request"                        # an explicit request wins
    c.start("request")
    c.request("request")                                   # made while it runs: it waits for the next
    c.done("request")
    assert c.due(True) == "request" and c.audited_rate() is None  # drift judged on new anchors only
    c.start("request")
    c.done("request")
    assert c.due(True) is None


def test_drift_that_does_not_help_backs_off():
    c = RecalibrationController(every_tokens=10**9, drift_floor=0.6, drift_window=2)
    c.done("schedule")
    fired = []
    for step in range(40):                                 # anchors never help: rate stays 0
        c.on_audit(8, 0)
        if c.due(True) == "drift":
            fired.append(step)
            c.done("drift")
    gaps = [b - a for a, b in zip(fired, fired[1:])]
    assert fired[0] == 1 and gaps == [4, 8, 16]            # 2, then 4, 8, 16 audits apart
    assert len(c.history) == 10                            # failing audits since the last drift
    for _ in range(21):
        c.on_audit(8, 8)
    assert c.backoff == 16                                 # not yet a whole judged window of 32
    c.on_audit(8, 8)
    assert c.backoff == 1                                  # healthy over it: prompt judgement


def test_anchors_ranked_by_mass_even_when_targets_saturate():
    mass = torch.tensor([[0.30, 0.05, 0.40, 0.20, 0.0001, 0.0]])
    outside = torch.tensor([True, True, True, True, True, False])
    target = distillation_target(mass, 1000)              # as if 1000 tokens were visible
    assert target[0, [0, 2, 3]].eq(1.0).all()             # saturated: ties that mass must break
    assert 0 < target[0, 1] < 1 and target[0, 4] == 0
    pos, score = pick_anchors(mass, target, outside, 3)
    assert pos.tolist() == [[2, 0, 3]]
    pos, score = pick_anchors(mass, target, outside, 7)    # more slots than tokens: -1 padded
    assert pos[0, 5:].tolist() == [-1, -1] and score[0, 5:].tolist() == [-1.0, -1.0]


def one_audit(q, keys, visible, selected, top_m, scale, measure):
    """The audit of one query, written out plainly: the reference for the batched one."""
    idx = [i for i in range(len(visible)) if visible[i]]
    if not idx:
        return 0.0, 0.0
    w = torch.softmax(torch.stack([q @ keys[i] for i in idx]) * scale, 0)
    held = {int(p) for p in selected if p >= 0}
    if measure == "mass":
        return 1.0, min(1.0, sum(float(w[j]) for j, i in enumerate(idx) if i in held))
    m = min(top_m, len(idx))
    top = sorted(range(len(idx)), key=lambda j: -float(w[j]))[:m]
    return float(m), float(sum(idx[j] in held for j in top))


def test_the_batched_audit_counts_what_each_query_alone_would():
    torch.manual_seed(0)
    B, L, D = 5, 40, 16
    q, keys = torch.randn(B, D), torch.randn(B, L, D)
    lengths = [40, 31, 7, 0, 22]                          # ragged contexts; one with nothing visible
    visible = torch.arange(L)[None] < torch.tensor(lengths)[:, None]
    visible[1, :4] = False                                # left padding
    visible[3, 10:18] = False                             # a hole
    selected = torch.full((B, 12), -1)
    for b, n in enumerate(lengths):
        pick = torch.randperm(max(n, 1))[:9 - b]          # ragged selections, -1 padded
        selected[b, :len(pick)] = pick
    from hi_sparse.recalibration import audit_hits
    for measure in ("top_m", "mass"):
        got = audit_hits(q, keys, visible, selected, 6, D ** -0.5, measure)
        want = [one_audit(q[b], keys[b], visible[b], selected[b], 6, D ** -0.5, measure) for b in range(B)]
        assert got.shape == (B, 2)
        for (gl, gh), (wl, wh) in zip(got.tolist(), want):
            assert gl == wl and abs(gh - wh) < 1e-5, (measure, got, want)
    assert want[2][0] == 1.0 and got[3].tolist() == [0.0, 0.0]


def test_a_batch_of_ragged_contexts_scores_each_context_as_alone():
    """score_tokens and pick_anchors over sequences of different lengths, queries kept, left
    padding and a hole at once: each sequence's mass, targets and anchors as scoring it alone."""
    from hi_sparse.recalibration import score_tokens
    torch.manual_seed(1)
    B, R, H, G, D, n, window = 3, 6, 2, 2, 8, 50, 8
    queries, keys = torch.randn(B, R, H, G, D), torch.randn(B, H, n, D) * 2
    lengths, kept = torch.tensor([50, 33, 20]), torch.tensor([6, 2, 4])
    visible = torch.arange(n)[None] < lengths[:, None]
    visible[1, :5] = False
    visible[2, 8:12] = False
    mass, target, outside = score_tokens(queries, kept, keys, visible, lengths, window, D ** -0.5)
    pos, score = pick_anchors(mass, target, outside, 16)
    for b in range(B):
        m = int(lengths[b])
        one = score_tokens(queries[b:b + 1], kept[b:b + 1], keys[b:b + 1, :, :m], visible[b:b + 1, :m],
                           lengths[b:b + 1], window, D ** -0.5)
        for got, want in zip((mass[b, :, :m], target[b, :, :m], outside[b, :m]), one):
            torch.testing.assert_close(got, want[0])
        assert not mass[b, :, m:].any() and not outside[b, m:].any()
        p1, s1 = pick_anchors(*one, 16)
        assert torch.equal(pos[b], p1[0])
        torch.testing.assert_close(score[b], s1[0])
        # only kept queries weigh: a stale one changed changes nothing
        stale = queries[b:b + 1].clone()
        stale[:, :R - int(kept[b])] = 1e3
        again = score_tokens(stale, kept[b:b + 1], keys[b:b + 1, :, :m], visible[b:b + 1, :m], lengths[b:b + 1],
                             window, D ** -0.5)
        torch.testing.assert_close(again[0], one[0])
    assert (pos[2] == -1).any() and not (pos[0] == -1).any()    # 8 tokens outside the window of the third


def test_a_large_batch_trains_the_probes_on_a_spread_of_its_sequences():
    """Up to FIT_ROWS rows a layer: all sequences of a small batch, a spread of a large one's
    (24 sequences of 8 KV heads: 3, one in each third, shifting between recalibrations)."""
    from types import SimpleNamespace

    from hi_sparse.recalibration import FIT_ROWS, NEGATIVES, Recalibrator
    cfg, shape = SimpleNamespace(recalibrate_topk=32), SimpleNamespace(num_kv_heads=8)
    r = Recalibrator(cfg, shape, [], None)
    seqs = [SimpleNamespace(seq_id=100 + i) for i in range(24)]
    assert r._fit_sequences(seqs[:3]) == {100, 101, 102}
    picks = [sorted(r._fit_sequences(seqs)) for _ in range(3)]
    k = FIT_ROWS // (8 * (32 + NEGATIVES))
    assert k == 3 and all(len(p) == k for p in picks)
    for p in picks:
        assert [(i - 100) // 8 for i in p] == [0, 1, 2]
    assert len({tuple(p) for p in picks}) == 3


def test_the_audit_reads_a_steps_selections_as_one_view_or_row_by_row_alike():
    """Recalibrator._selected: sequences that were the step's batch in order read its (B * Hkv, K)
    selection as one view; in another order (or a batch of other steps), row by row: the same
    rows either way."""
    from types import SimpleNamespace

    from hi_sparse.recalibration import Recalibrator
    from hi_sparse.sequences import Sequence
    H, K, B = 3, 5, 4
    step = torch.arange(B * H * K).view(B * H, K)
    seqs = [Sequence(b, b, 0, -1, [9], [1], [], []) for b in range(B)]
    for b, s in enumerate(seqs):
        s.last_selection[0] = (step, b * H, (b + 1) * H)
    rc = Recalibrator.__new__(Recalibrator)
    rc.shape = SimpleNamespace(num_kv_heads=H)
    layer = SimpleNamespace(index=0)
    one = rc._selected(layer, seqs, 2)
    assert one.data_ptr() == step.data_ptr() + 2 * K * step.element_size()      # a view, no copy
    assert torch.equal(one, torch.stack([step[b * H + 2] for b in range(B)]))
    turned = rc._selected(layer, seqs[::-1], 1)
    assert turned.data_ptr() != step.data_ptr() + K * step.element_size()
    assert torch.equal(turned, torch.stack([step[b * H + 1] for b in reversed(range(B))]))
