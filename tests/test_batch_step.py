"""The graph runner: a body runs eagerly, or is captured once per key in a CUDA graph and replayed;
a capture that fails falls back to eager steps and leaves nothing behind in capture mode."""

import warnings

import pytest
import torch

from hi_sparse.batch_step import GraphRunner

D = 16


def test_without_graphs_every_run_is_the_body_itself():
    runner = GraphRunner(graphs=False)
    calls = []

    def body(x, n):
        calls.append(n)
        return (x * n,)

    x = torch.arange(4.0)
    for n in (1, 2, 3):
        assert torch.equal(runner.run((0, "attend"), ("k",), body, x, n)[0], x * n)
    assert calls == [1, 2, 3] and not runner.graphs and runner.no_graphs


@pytest.mark.gpu
def test_a_body_is_replayed_until_its_key_changes():
    """First sight eager, second captured (and run), later replayed with new input values; a new
    key starts over."""
    runner = GraphRunner(graphs=True)
    seen = []

    def body(x):
        seen.append(torch.cuda.is_current_stream_capturing())
        return (x * 2,)

    x = torch.arange(6.0, device="cuda")
    for step in range(4):
        assert torch.equal(runner.run((0, "attend"), ("a",), body, x + step)[0], (x + step) * 2)
    assert seen == [False, True]                       # eager, captured; then replays run no Python
    runner.run((0, "attend"), ("b",), body, x)
    assert seen == [False, True, False]


@pytest.mark.gpu
def test_a_failed_capture_warns_with_its_cause_and_restores_the_stream():
    """A body that cannot be captured (a host read): the warning names the op's own error, the
    batch decodes on eagerly, and later work runs on the caller's stream again, not on the capture
    stream torch.cuda.graph leaves current when ending the capture raises."""
    runner = GraphRunner(graphs=True)
    x = torch.arange(6.0, device="cuda")

    def body(x):
        return (x * 2 + (x.sum().item() > 0),)       # .item() reads back: not capturable

    before = torch.cuda.current_stream()
    first = runner.run((0, "attend"), ("k",), body, x)                 # first sight: eager
    with pytest.warns(RuntimeWarning, match=r"capture .* failed \(\w*Error: [^\n]*capturing at batch_step\.py:"
                                            r"\d+ \(\w+\); then ending the capture: [^\n]*\); this batch"):
        second = runner.run((0, "attend"), ("k",), body, x)            # capture fails, eager again
    assert torch.cuda.current_stream() == before
    assert runner.no_graphs and not runner.graphs
    assert torch.equal(first[0], second[0]) and torch.equal(second[0], x * 2 + 1)
    third = runner.run((0, "attend"), ("k",), body, x)                 # eager from now on
    assert torch.equal(third[0], x * 2 + 1) and torch.cuda.current_stream() == before
    # nothing else in the process is left in capture mode: the GPU's random generator works (it
    # raises "Offset increment outside graph capture" otherwise) and a new capture replays
    assert torch.randn(4, device="cuda").isfinite().all()
    again = GraphRunner(graphs=True)
    for step in range(3):
        y = again.run((0, "attend"), ("k",), lambda x: (x * 3,), x + step)
        assert torch.equal(y[0], (x + step) * 3)
    assert again.graphs and not again.no_graphs


@pytest.mark.gpu
def test_garbage_collected_during_a_capture_cannot_break_it():
    """What broke captures on freshly started machines: the cyclic collector ran inside a capture
    and freed an earlier engine's pinned pool (cudaHostUnregister) and graphs (cuGraphExecDestroy),
    calls a capture forbids. Here a pinned pool in a reference cycle becomes garbage inside the
    captured body, which then allocates enough objects for a collection to be due."""
    import gc
    import weakref

    from hi_sparse.host_pool import HostPool

    runner = GraphRunner(graphs=True)
    x = torch.arange(6.0, device="cuda")
    gc.collect()
    pool = HostPool(1, 1, D, 8, torch.float32, pin=True)
    pool.grow(blocks=4)                                   # pinned: freeing it unregisters its pages
    pool.cycle = pool
    holder, gone = [pool], weakref.ref(pool)
    del pool
    seen = []

    def body(x):
        if torch.cuda.is_current_stream_capturing():
            holder.clear()                                # garbage now, collectable only by the GC
            seen.append(len([[] for _ in range(5 * gc.get_threshold()[0])]))   # a collection is due
        return (x * 3,)

    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # a failed capture warns: fail on it
        for step in range(3):
            y = runner.run((0, "attend"), ("k",), body, x + step)
            assert torch.equal(y[0], (x + step) * 3)
    assert seen and runner.graphs and not runner.no_graphs and gc.isenabled()
    gc.collect()
    assert gone() is None                                 # collected after the capture, unregistered
