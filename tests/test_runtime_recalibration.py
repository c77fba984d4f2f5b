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
