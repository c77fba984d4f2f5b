"""Background recalibration (``background_recalibration``): the job computed from the state at the
step that was due, committed at a later step boundary (``recalibration_lag``), or first when
something would free or move what it reads (a fork, a free, a growing host pool); appends go on
(it reads copies of the float tails they reuse). On a CPU the work runs in slices after each step
for about a step's time (or by a worker thread when asked); on a GPU (gpu-marked) a worker queues it
on a side stream while steps go on."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hi_sparse import pinned
from hi_sparse.config import HiSparseConfig
from hi_sparse.engine import SLICE_LAG, HiSparseEngine
from hi_sparse.workloads import run_decode, run_prefill

L, HQ, HKV, D = 2, 4, 2, 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def _engines(device: str = "cpu", **kw):
    base = dict(max_seq_len=1024, cache_block_size=16, window_size=16, global_tokens=4, top_k=48,
                recalibrate_every=10**6, audit_every=0, telemetry=False, host_kv_bits=4) | kw
    return [HiSparseEngine(HiSparseConfig(**base, background_recalibration=bg), L, HQ, HKV, D, device=device)
            for bg in (False, True)]


def _data(T: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(1, HKV, T, D, generator=g).to(device) for _ in range(2))
    return k, v, torch.randn(1, HQ, T, D, generator=g).to(device)


def _state(eng, seq_id):
    s = eng.seqs[seq_id]
    anchors = [(s.anchors[i].clone(), s.anchor_p[i].clone()) for i in range(L)]
    probes = [[p.detach().clone() for p in probe.parameters()] for probe in eng.probes]
    return anchors, probes, [probe.fitted for probe in eng.probes]


def _same(a, b) -> bool:
    (aa, ap, af), (ba, bp, bf) = a, b
    return (af == bf and all(torch.equal(x, y) and torch.equal(u, w) for (x, u), (y, w) in zip(aa, ba))
            and all(torch.equal(x, y) for ps, qs in zip(ap, bp) for x, y in zip(ps, qs)))


def test_a_background_recalibration_commits_at_the_next_boundary_with_the_same_result():
    """recalibration_lag 1: at the end of the first step after its launch, its slices left run there."""
    sync, bg = _engines(recalibration_lag=1)
    k, v, q = _data(203)
    ids = [e.add_sequences(1) for e in (sync, bg)]
    before = _state(bg, ids[1][0])
    for e, i in zip((sync, bg), ids):
        run_prefill(e, i, k, v, q)                     # the first recalibration is due here
    assert sync.stats.recalibrations["schedule"] == 1 and all(sync.probes[j].fitted for j in range(L))
    assert bg.stats.recalibrations["schedule"] == 0 and _same(_state(bg, ids[1][0]), before)
    # due at the prefill's end, launched when the next step begins (not before the first token)
    assert bg._recal_deferred == "schedule" and bg._recal_job is None
    kd, vd, qd = _data(1, seed=1)
    for e, i in zip((sync, bg), ids):
        run_decode(e, i, qd, kd, vd)                   # its start launches the job, its end commits it
    assert bg._recal_job is None and bg.stats.recalibrations["schedule"] == 1
    assert _same(_state(bg, ids[1][0]), _state(sync, ids[0][0]))
    assert not _same(_state(bg, ids[1][0]), before)


def test_the_default_is_background_and_a_bad_value_is_refused():
    """None (the default) recalibrates in the background on a CPU too: the prefill's recalibration
    waits for the next step, and runs in slices (no worker thread); False commits it when the
    prefill's step ends."""
    base = dict(max_seq_len=1024, cache_block_size=16, window_size=16, global_tokens=4, top_k=48,
                recalibrate_every=10**6, audit_every=0, telemetry=False)
    assert HiSparseConfig(**base).background_recalibration is None
    k, v, q = _data(203)
    for bg in (None, False):
        eng = HiSparseEngine(HiSparseConfig(**base, background_recalibration=bg), L, HQ, HKV, D)
        ids = eng.add_sequences(1)
        run_prefill(eng, ids, k, v, q)
        assert eng.stats.recalibrations["schedule"] == (bg is False)
        assert (eng._recal_deferred == "schedule") == (bg is None)
        if bg is None:
            kd, vd, qd = _data(1, seed=1)
            run_decode(eng, ids, qd, kd, vd)
            assert eng._recal_job is not None and not eng._recal_job.threaded and eng._recal_job.due == SLICE_LAG
    with pytest.raises(ValueError, match="background_recalibration must be True, False or None"):
        HiSparseConfig(**base, background_recalibration="yes").validate()


def _prefilled(bg, T: int = 203):
    """A prefill of T tokens with its recalibration launched (as the next step's start does)."""
    k, v, q = _data(T)
    sid = bg.add_sequences(1)
    run_prefill(bg, sid, k, v, q)
    bg._launch_deferred()
    return sid


@pytest.mark.parametrize("what", ["fork", "free", "append without a step", "settle", "close"])
def test_a_deferred_recalibration_launches_at_whatever_comes_first(what):
    """A recalibration due at a prefill's end waits for the next step's start, unless something
    that would change what it reads comes first: then it is launched (and committed) before it;
    close drops it."""
    sync, bg = _engines()
    k, v, q = _data(203)
    ids = [e.add_sequences(1) for e in (sync, bg)]
    for e, i in zip((sync, bg), ids):
        run_prefill(e, i, k, v, q)
    sid = ids[1]
    assert bg._recal_deferred == "schedule" and bg._recal_job is None
    if what == "close":
        bg.close()
        assert bg._recal_deferred is None and bg.stats.recalibrations["schedule"] == 0
        return
    if what == "fork":
        bg.fork_sequences(sid[0], 1)
    elif what == "free":
        bg.free_sequences(sid)
    elif what == "append without a step":
        kd, vd, _ = _data(1, seed=1)
        bg.append(0, sid, kd, vd)
        bg.settle_recalibration()
    else:
        assert not bg.settle_recalibration(wait=False)  # not launched: nothing to poll yet
        assert bg.settle_recalibration()
    assert bg._recal_deferred is None and bg._recal_job is None
    assert bg.stats.recalibrations["schedule"] == 1
    if what != "free":                                 # the result of the state the prefill left
        assert _same(_state(bg, sid[0]), _state(sync, ids[0][0]))


@pytest.mark.parametrize("what", ["fork", "free", "free on a worker", "host pool growth", "host pool growth in place"])
def test_what_would_free_or_move_its_reads_commits_it_first(what, monkeypatch):
    """Each settle point commits the job before the change: a fork, a free (of a worker's job; one
    in slices runs only its reads, test_freeing_... below), and a host pool that grows out of its
    reserved space (pinned.RESERVE 1: none to spare) and moves; one that grows in place leaves the
    job running (its reads stay where they are)."""
    if what == "host pool growth":
        monkeypatch.setattr(pinned, "RESERVE", 1)
        monkeypatch.setattr(pinned, "RESERVE_LEAST", 0)
    _, bg = _engines()
    bg._recalibrator.threaded = what == "free on a worker" or None
    sid = _prefilled(bg)
    assert bg._recal_job is not None
    if what == "fork":
        forks = bg.fork_sequences(sid[0], 2)
        assert bg._recal_job is None
        src = bg.seqs[sid[0]]
        assert all(torch.equal(bg.seqs[f].anchors[0], src.anchors[0]) for f in forks)
        assert int((src.anchors[0] >= 0).sum()) > 0  # the copies took the new anchors
        return
    if what.startswith("free"):
        job = bg._recal_job
        bg.free_sequences(sid)
        if what == "free":                             # in slices: its reads ran, its fit goes on
            assert bg._recal_job is job and not job.reading and job._slices is not None
        else:
            assert bg._recal_job is None and bg.stats.recalibrations["schedule"] == 1
        return
    where = bg.host.layers[0]["k_packed"].data_ptr()
    bg.host.grow(blocks=bg.host.num_blocks + 8)
    moved = bg.host.layers[0]["k_packed"].data_ptr() != where
    assert moved == (what == "host pool growth") and (bg._recal_job is None) == moved


@pytest.mark.parametrize("T", [203, 208])
def test_a_read_from_copies_made_earlier_reads_what_was_there_then(T):
    """ContextReader.read_batch with the block tables and float tails taken earlier (read_meta,
    read_tails) reads the context as it was then, after appends have filled the block, sealed it
    and reused the tail (203 tokens leave 11 in the tail of a 16-token block; 208 end a block:
    the tail holds none, and the block table no block past it)."""
    sync, _ = _engines()
    sid = sync.add_sequences(1)
    k, v, q = _data(T)
    run_prefill(sync, sid, k, v, q)
    s, rows, reader = sync.seqs[sid[0]], sync.layers[1], sync._recalibrator.reader
    want = reader.read_batch([s], rows, T)
    meta = reader.read_meta([s], rows)
    tails = reader.read_tails(meta, [rows])[0]
    k2, v2, q2 = _data(9, seed=2)                   # 9 more: block 12 sealed and its tail reused (203)
    run_prefill(sync, sid, k2, v2, q2)
    if T == 203:                                    # the tail held 192..202 as floats
        assert not torch.equal(reader.read_batch([s], rows, T), want)
    assert torch.equal(reader.read_batch([s], rows, T, meta=meta, tails=tails), want)
    assert torch.equal(reader.read_batch([s], rows, 100, head=1, meta=meta, tails=tails), want[:, 1:, :100])


def _gated(bg):
    """Hold bg's next worker at its start until the returned event is set."""
    gate, work = threading.Event(), bg._recalibrator._work

    def held(*args):
        assert gate.wait(60), "the test never opened the gate"
        yield from work(*args)

    bg._recalibrator._work = held
    return gate


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_steps_go_on_while_the_worker_runs_and_it_scores_the_step_it_started_at(device):
    """A job on a worker thread (on a GPU every background job; on the CPU when asked) does not
    stop the steps: a prefill chunk and decode steps that seal the block it read from the float
    tail and reuse that tail run while it waits, and what it commits is what a recalibration at
    once computed at the prefill's end."""
    sync, bg = _engines(device)
    bg._recalibrator.threaded = True
    k, v, q = _data(203, device)
    ids = [e.add_sequences(1) for e in (sync, bg)]
    for e, i in zip((sync, bg), ids):
        run_prefill(e, i, k, v, q)
    gate = _gated(bg)
    bg._launch_deferred()
    job = bg._recal_job
    assert job is not None and job._worker.is_alive()
    k2, v2, q2 = _data(5, device, seed=2)
    run_prefill(bg, ids[1], k2, v2, q2)              # 203..207: completes the block
    kd, vd, qd = _data(1, device, seed=1)
    for _ in range(6):                               # 208..213: the tail reused
        run_decode(bg, ids[1], qd, kd, vd)
    assert bg._recal_job is job and job._worker.is_alive() and bg.stats.recalibrations["schedule"] == 0
    gate.set()
    assert bg.settle_recalibration() and bg.stats.recalibrations["schedule"] == 1
    assert _same(_state(bg, ids[1][0]), _state(sync, ids[0][0]))


def test_a_worker_that_fails_raises_at_the_commit_and_writes_nothing():
    _, bg = _engines()
    bg._recalibrator.threaded = True
    sid = _prefilled_after(bg, lambda: setattr(bg._recalibrator, "_work", _fails))
    before = _state(bg, sid[0])
    with pytest.raises(RuntimeError, match="schedule recalibration failed in the background .*broken on purpose"):
        bg.settle_recalibration()
    assert bg._recal_job is None and bg.stats.recalibrations["schedule"] == 0
    assert _same(_state(bg, sid[0]), before)


def _fails(*args):
    raise ValueError("broken on purpose")
    yield  # a generator, as Recalibrator._work is


def _prefilled_after(bg, change):
    k, v, q = _data(203)
    sid = bg.add_sequences(1)
    run_prefill(bg, sid, k, v, q)
    change()
    bg._launch_deferred()
    return sid


def test_no_background_job_while_one_is_pending_and_requests_wait_for_it():
    _, bg = _engines(recalibration_lag=1)
    sid = _prefilled(bg)
    job = bg._recal_job
    bg.request_recalibration("request")
    bg.begin_step()
    bg._prefill.end_step()
    assert bg._recal_job is job or bg._recal_job is None
    kd, vd, qd = _data(1, seed=1)
    run_decode(bg, sid, qd, kd, vd)                    # commits the schedule job, starts the request
    assert bg.stats.recalibrations["schedule"] == 1
    run_decode(bg, sid, qd, kd, vd)
    assert bg.stats.recalibrations["request"] == 1
    assert bg.settle_recalibration() and bg._recal_job is None


@pytest.mark.gpu
@needs_cuda
def test_on_a_gpu_the_side_stream_job_equals_the_one_at_once():
    """CUDA: the job queued on a side stream (while decode steps go on) commits the same anchors
    and probes as the recalibration done at once."""
    sync, bg = _engines("cuda", max_seq_len=2048)
    k, v, q = _data(1500, "cuda")
    ids = [e.add_sequences(1) for e in (sync, bg)]
    for e, i in zip((sync, bg), ids):
        run_prefill(e, i, k, v, q)
    assert bg._recal_deferred == "schedule"
    bg._launch_deferred()                    # what the next step's start does
    assert bg._recal_job is not None and bg._recal_job.streams
    kd, vd, qd = _data(1, "cuda", seed=1)
    run_decode(bg, ids[1], qd, kd, vd)       # the job committed at this step's boundary or still pending
    bg.settle_recalibration()
    assert bg._recal_job is None
    assert _same(_state(bg, ids[1][0]), _state(sync, ids[0][0]))


@pytest.mark.parametrize("lag", [None, 3])
def test_a_worker_s_result_lands_on_a_step_fixed_by_the_lag_not_by_the_timing(lag):
    """recalibration_lag None: no sooner than WORKER_LAG steps after the launch, then at the first
    step end after the worker finished (it finished at once here); a number: at the end of that
    step, waiting for the worker (here one that takes 0.3 s). (A pool that grows settles it at
    once: this one has room.)"""
    from hi_sparse.engine import WORKER_LAG
    _, bg = _engines(recalibration_lag=lag, host_pool_blocks=64)
    bg._recalibrator.threaded = True
    if lag is not None:
        work = bg._recalibrator._work

        def slow(*a):
            time.sleep(0.3)
            yield from work(*a)
        bg._recalibrator._work = slow
    sid = _prefilled(bg)
    job = bg._recal_job
    kd, vd, qd = _data(1, seed=1)
    steps = WORKER_LAG if lag is None else lag
    for step in range(steps):
        run_decode(bg, sid, qd, kd, vd)
        if lag is None and bg._recal_job is job:
            job._worker.join()                       # finished: still not committed before its step
        assert (bg._recal_job is None) == (step == steps - 1), step
    assert bg.stats.recalibrations["schedule"] == 1


def _until(cond, seconds: float = 30.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "the worker never got there"
        time.sleep(0.005)


def _on_a_paced_worker(monkeypatch, per_step: int, tick_wait: float):
    """A background job launched on a worker whose fit is paced (recal_job.FIT_PER_STEP), beside
    the same recalibration at once: (sync engine, background engine, their ids, the job)."""
    from hi_sparse import recal_job
    monkeypatch.setattr(recal_job, "FIT_PER_STEP", per_step)
    monkeypatch.setattr(recal_job, "TICK_WAIT", tick_wait)
    sync, bg = _engines()
    k, v, q = _data(203)
    ids = [e.add_sequences(1) for e in (sync, bg)]
    for e, i in zip((sync, bg), ids):
        run_prefill(e, i, k, v, q)
    bg._recalibrator.threaded = True
    bg._launch_deferred()
    job = bg._recal_job
    return sync, bg, ids, job


def test_a_paced_worker_runs_its_fit_a_few_iterations_a_step_and_the_rest_at_the_commit(monkeypatch):
    """recal_job.FIT_PER_STEP: a worker's fit runs at most that many iterations for each step end
    (advance marks one), so the steps it overlaps each carry a few; a commit that cannot wait runs
    the rest at once, and the result is the one at once."""
    sync, bg, ids, job = _on_a_paced_worker(monkeypatch, 2, 60.0)
    _until(lambda: not job.reading and job.left is not None)
    time.sleep(0.2)
    left = job.left
    assert job._worker.is_alive() and left > 10                     # two iterations, then it waits
    for n in (1, 2):
        job.advance(0.0)                                            # a step ended
        _until(lambda: job.left == left - 2 * n)
        time.sleep(0.2)
        assert job.left == left - 2 * n
    assert bg.settle_recalibration() and bg.stats.recalibrations["schedule"] == 1
    assert _same(_state(bg, ids[1][0]), _state(sync, ids[0][0]))


def test_a_paced_worker_goes_on_when_no_step_comes(monkeypatch):
    """A decode that pauses (no step ends) does not hold a paced fit back for ever: after TICK_WAIT
    without one the worker runs another step's worth, so the job finishes and lands unasked."""
    sync, bg, ids, job = _on_a_paced_worker(monkeypatch, 8, 0.01)
    _until(job.ready)
    assert job.ticks == 0 and not job._hurry
    assert bg.settle_recalibration() and bg.stats.recalibrations["schedule"] == 1
    assert _same(_state(bg, ids[1][0]), _state(sync, ids[0][0]))


def test_a_bad_lag_is_refused_with_the_fix():
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="recalibration_lag must be None or a number of decode steps >= 0"):
            _engines(recalibration_lag=bad)


def _sleeps(seconds: list[float], ran: list[float]):
    """Slices of work that sleep the given seconds each, noting when each ended."""
    for s in seconds:
        time.sleep(s)
        ran.append(time.perf_counter())
        yield


def test_a_job_in_slices_runs_about_the_time_it_is_given_and_the_rest_at_its_commit():
    """advance(seconds): at least one slice, then no more once the slowest so far would not fit
    in what is left; commit runs whatever is left; an error is raised at the commit, with nothing
    written."""
    from hi_sparse.recal_job import RecalibrationJob
    job, ran = RecalibrationJob("request", background=True), []
    job.run(_sleeps([0.01] * 20, ran), "slices")
    assert not job.ready() and ran == []
    job.advance(0.0)
    assert len(ran) == 1                             # one at least, whatever the time given
    job.advance(0.035)                               # slices of 10 ms or more: a fourth would not fit
    assert 1 <= len(ran) - 1 <= 3, len(ran)
    assert not job.ready()
    job.commit()
    assert len(ran) == 20 and job.ready()

    failing = RecalibrationJob("drift", background=True)
    failing.run(_fails(), "slices")
    failing.advance(1.0)
    assert failing.ready()                           # ended: by its error
    failing.anchors.append(("a result of a slice before the error",))
    with pytest.raises(RuntimeError, match="drift recalibration failed in the background .*broken on purpose"):
        failing.commit()
    assert failing.anchors == []


@pytest.mark.parametrize("lag", [None, 7])
def test_a_cpu_background_recalibration_runs_in_slices_between_steps_with_the_same_result(lag):
    """On a CPU (no worker asked for) each step's end runs the job's slices for that step's own
    time (RecalibrationJob.advance: how much that is, the test above) and at least its share of
    those left until the job is due (engine.SLICE_LAG steps, or recalibration_lag); here each
    gets no time, so its share alone: the slices spread over the steps, the last due step runs
    what is left, and the job lands at its end whatever the timing, with what the recalibration
    at once computed at the prefill's end."""
    sync, bg = _engines(recalibration_lag=lag)
    k, v, q = _data(203)
    ids = [e.add_sequences(1) for e in (sync, bg)]
    for e, i in zip((sync, bg), ids):
        run_prefill(e, i, k, v, q)
    bg._launch_deferred()
    job = bg._recal_job
    assert job is not None and not job.threaded and job._slices is not None
    due = SLICE_LAG if lag is None else lag
    assert job.due == due
    ran: list[int] = []
    said: list[int] = []

    def counted(slices):
        for left in slices:
            ran.append(bg.decode_steps)
            said.append(left)
            yield left
    job._slices = counted(job._slices)
    advance = job.advance

    def none_given(seconds, steps_left):
        assert seconds > 0 and steps_left == due - bg.decode_steps + 1
        advance(0.0, steps_left)
    job.advance = none_given
    kd, vd, qd = _data(1, seed=1)
    steps = 0
    while bg._recal_job is not None and steps < 400:
        run_decode(bg, ids[1], qd, kd, vd)
        steps += 1
    assert bg._recal_job is None and bg.stats.recalibrations["schedule"] == 1 and steps == due
    # a yield after each layer's scoring and each fit iteration but the last, which ends the
    # work; what the work said was left each time, exactly once the layers were scored
    total = L + 99
    assert len(ran) == total and said[L - 1:] == list(range(100, 0, -1)), said
    per = [ran.count(step) for step in range(1, due + 1)]
    share = -(-(total + 1) // due)   # (the first step's is counted once the work said how many are left)
    last = max(step for step, n in enumerate(per) if n)
    assert sum(per) == total and all(1 <= n <= share + 2 for n in per[:last + 1]), per
    assert _same(_state(bg, ids[1][0]), _state(sync, ids[0][0]))


def test_freeing_a_sequence_runs_only_the_reads_of_a_job_in_slices_and_drops_its_anchors():
    """Freeing sequences while a CPU's job runs in slices runs only its slices that read the pool
    (each layer's scoring), not its fit (seconds with a real model, in the step of a request that
    ends soon after its prefill); the job lands at its step with what the recalibration at once
    computed for the sequences left, and writes nothing to the freed one's row, which a new
    sequence took meanwhile."""
    sync, bg = _engines()
    k, v, q = (t.expand(2, -1, -1, -1).clone() for t in _data(203))
    ids = [e.add_sequences(2) for e in (sync, bg)]
    for e, i in zip((sync, bg), ids):
        run_prefill(e, i, k, v, q)
    bg._launch_deferred()
    job, (a, b) = bg._recal_job, ids[1]
    row = bg.seqs[a].row
    bg.free_sequences([a])
    assert bg._recal_job is job and not job.reading and job._slices is not None
    assert bg.stats.recalibrations["schedule"] == 0
    assert all(a not in {s.seq_id for s in seqs} for seqs, *_ in job.anchors)
    c = bg.add_sequences(1)
    assert bg.seqs[c[0]].row == row                      # the freed row, taken again
    kc, vc, qc = _data(20, seed=4)
    run_prefill(bg, c, kc, vc, qc)
    before = _state(bg, c[0])
    kd, vd, qd = _data(1, seed=1)
    steps = 0
    while bg._recal_job is not None and steps < 400:
        run_decode(bg, [b], qd, kd, vd)
        steps += 1
    assert bg.stats.recalibrations["schedule"] == 1 and steps == SLICE_LAG
    assert _same(_state(bg, b), _state(sync, ids[0][1]))
    anchors_c, _, _ = _state(bg, c[0])
    assert all(torch.equal(x, y) and torch.equal(u, w) for (x, u), (y, w) in zip(anchors_c, before[0]))


def test_an_interrupt_in_a_slice_reaches_the_caller_and_drops_the_job():
    """Ctrl-C while a CPU's slices run (after a step, in the caller's thread) is raised there, as
    it happens; the job is dropped: nothing written or counted, and settling or closing after it
    raises nothing (a demo stopped with SIGINT exits cleanly)."""
    _, bg = _engines()

    def interrupted(*args):
        yield
        raise KeyboardInterrupt
    sid = _prefilled_after(bg, lambda: setattr(bg._recalibrator, "_work", interrupted))
    before = _state(bg, sid[0])
    kd, vd, qd = _data(1, seed=1)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            run_decode(bg, sid, qd, kd, vd)
    assert bg.settle_recalibration() and bg._recal_job is None
    assert bg.stats.recalibrations["schedule"] == 0 and _same(_state(bg, sid[0]), before)
    bg.close()


def test_a_commit_writes_each_layers_anchors_into_its_sequences_rows():
    """recal_job._write_anchors: sequences in consecutive bank rows are written as slices (all
    layers' in one foreach copy), others by index: either way each sequence's anchors and scores
    land in its own row and no other row changes."""
    from types import SimpleNamespace

    from hi_sparse.recal_job import _write_anchors

    g = torch.Generator().manual_seed(3)
    L, rows, G = 3, 8, 4
    banks = [SimpleNamespace(t={"anchors": torch.full((rows, G), -1, dtype=torch.int32),
                                "anchor_p": torch.zeros(rows, G, dtype=torch.float16)}) for _ in range(L)]
    seqs = [SimpleNamespace(row=r, banks=banks) for r in range(rows)]
    want = [{k: t.clone() for k, t in b.t.items()} for b in banks]
    anchors = []
    for i, picked in enumerate([[2, 3, 4], [1, 5, 6], [7]]):       # consecutive, not, one
        pos = torch.randint(0, 100, (len(picked), G), generator=g, dtype=torch.int32)
        p = torch.rand(len(picked), G, generator=g).half()
        anchors.append(([seqs[r] for r in picked], i, pos, p))
        want[i]["anchors"][picked], want[i]["anchor_p"][picked] = pos, p
    anchors.append(([], 0, torch.zeros(0, G, dtype=torch.int32), torch.zeros(0, G).half()))   # nothing kept
    _write_anchors(anchors)
    for b, w in zip(banks, want):
        assert torch.equal(b.t["anchors"], w["anchors"]) and torch.equal(b.t["anchor_p"], w["anchor_p"])
