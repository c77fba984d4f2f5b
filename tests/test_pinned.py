"""The locker thread that page-locks a host pool's next growth ahead (pinned.lock_ahead): a chunk
at a time, paced, a newer job stopping the one it covers. cudaHostRegister needs a GPU: here the
registration is recorded (and slowed) in its place; the GPU test in test_host_pool.py locks for
real."""

import platform
import threading
import time

import pytest
import torch

from hi_sparse import pinned

MB = 1 << 20
CPU = torch.device("cpu")


class Registered:
    """Stands in for cudaHostRegister: records (ptr, size, start, end), each taking ``seconds``,
    the first waiting for ``gate`` when set."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float, float]] = []
        self.seconds = 0.0
        self.gate: threading.Event | None = None

    def __call__(self, ptr: int, size: int) -> None:
        began = time.perf_counter()
        if self.gate is not None:
            self.gate.wait(10)
        time.sleep(self.seconds)
        self.calls.append((ptr, size, began, time.perf_counter()))


@pytest.fixture
def registered(monkeypatch):
    fake = Registered()
    monkeypatch.setattr(pinned, "_register", fake)
    return fake


def _space(nbytes: int) -> pinned.Space:
    space = pinned.Space.make(nbytes, pin=True)
    assert space is not None
    return space


def _forget(*spaces: pinned.Space) -> None:
    for s in spaces:
        s.ranges.clear()                          # the finalizer would unregister them with the driver


def test_a_job_locks_its_pages_a_chunk_at_a_time_in_order(registered, monkeypatch):
    monkeypatch.setattr(pinned, "LOCK_CHUNK", MB)
    monkeypatch.setattr(pinned, "LOCK_DUTY", 1.0)
    a, b = _space(8 * MB), _space(8 * MB)
    try:
        job = pinned.lock_ahead([(a, 5 * MB + 100), (b, MB // 2)], CPU)
        job.result(10)
        sizes = [size for _, size, _, _ in registered.calls]
        assert all(s <= MB for s in sizes)
        assert len(sizes) == 6 + 1                       # 5 MB and a page of a; half a MB of b
        page = pinned.mmap.PAGESIZE
        assert a.locked == -(-(5 * MB + 100) // page) * page and b.locked == MB // 2
        ptrs = [ptr for ptr, *_ in registered.calls[:6]]   # a's, back to back from its start
        assert ptrs == [a.base.data_ptr() + sum(sizes[:i]) for i in range(6)]
        assert a.ranges == [(p, s) for (p, s, *_) in registered.calls[:6]]
    finally:
        _forget(a, b)


def test_a_job_makes_the_view_its_growth_will_take_once_its_pages_are_locked(registered, monkeypatch):
    """Space.expect names the view a growth will take; the job that locks its pages makes it then
    (make_ready), and the growth's view() takes that tensor, registering nothing and making no
    view in the step. A space the job was stopped in gets none; a view of another shape is made
    as before."""
    monkeypatch.setattr(pinned, "LOCK_CHUNK", MB)
    monkeypatch.setattr(pinned, "LOCK_DUTY", 1.0)
    a, b, c = _space(8 * MB), _space(8 * MB), _space(8 * MB)
    try:
        old = a.view((MB // 4,), torch.float32)                  # what the pool holds now: 1 MB
        old[:] = 7.0
        pinned.lock_ahead([(a, a.expect((3 * MB // 8, 2), torch.float32)), (b, MB)], CPU).result(10)
        assert b.ready is None                                    # none expected there
        shape, dtype, made = a.ready
        assert (shape, dtype, a.locked) == ((3 * MB // 8, 2), torch.float32, 3 * MB)
        calls = len(registered.calls)
        grown = a.view((3 * MB // 8, 2), torch.float32)
        assert grown is made and a.ready is None and len(registered.calls) == calls
        assert grown.data_ptr() == old.data_ptr() and bool((grown.view(-1)[:MB // 4] == 7.0).all())

        gate = registered.gate = threading.Event()               # a job stopped in its first chunk
        job = pinned.lock_ahead([(c, c.expect((MB,), torch.float32))], CPU)
        time.sleep(0.05)
        job.stop()
        gate.set()
        job.result(10)
        assert c.ready is None and c.locked == MB
        other = c.view((MB // 2,), torch.float32)                 # another view: made (and locked) as before
        assert other.shape == (MB // 2,) and c.locked == 2 * MB
    finally:
        _forget(a, b, c)


def test_the_locker_waits_between_chunks_so_the_steps_get_the_driver(registered, monkeypatch):
    """Each registration is followed by a pause of (1 / LOCK_DUTY - 1) times its length: the
    decode step's CUDA calls, which wait for a registration, wait for one chunk at most."""
    monkeypatch.setattr(pinned, "LOCK_CHUNK", MB)
    monkeypatch.setattr(pinned, "LOCK_DUTY", 0.25)
    registered.seconds = 0.02
    a = _space(8 * MB)
    try:
        pinned.lock_ahead([(a, 4 * MB)], CPU).result(10)
        calls = registered.calls
        assert len(calls) == 4
        for (_, _, _, end), (_, _, start, _) in zip(calls, calls[1:]):
            assert start - end >= 3 * 0.02 * 0.9, (start - end)
    finally:
        _forget(a)


def test_a_newer_job_stops_the_one_it_replaces_and_cancels_a_queued_one(registered, monkeypatch):
    monkeypatch.setattr(pinned, "LOCK_CHUNK", MB)
    monkeypatch.setattr(pinned, "LOCK_DUTY", 1.0)
    gate = registered.gate = threading.Event()      # the first job's first chunk holds
    a, b, c = _space(8 * MB), _space(8 * MB), _space(8 * MB)
    try:
        first = pinned.lock_ahead([(a, 8 * MB)], CPU)
        time.sleep(0.05)                                       # it has begun (waiting in its first chunk)
        queued = pinned.lock_ahead([(b, 8 * MB)], CPU)        # behind it on the one thread
        last = pinned.lock_ahead([(c, 2 * MB)], CPU, replaces=queued)
        first.stop()                                           # as a replacing job stops a running one
        gate.set()
        last.result(10)
        queued.result(10)                                      # cancelled: returns, raises nothing
        first.result(10)
        assert queued.future.cancelled()
        assert b.locked == 0                                   # never ran
        assert a.locked == MB                                  # the chunk it was in, then it stopped
        assert c.locked == 2 * MB
    finally:
        _forget(a, b, c)


def test_populate_faults_pages_in_without_changing_them():
    """Space.populate (MADV_POPULATE_WRITE) makes the next chunk's pages resident before its
    registration; what a view holds stays as written."""
    if pinned._madvise is None or tuple(int(x) for x in platform.release().split(".")[:2]) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14 or later")
    space = pinned.Space.make(64 * MB, pin=False)
    assert space is not None
    t = space.view((MB,), torch.uint8)
    t[:] = 7

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    space.locked = MB                                   # (what lock_to would have locked so far)
    before = rss()
    space.populate(MB + 48 * MB, 48 * MB)
    assert rss() - before >= 40 * MB
    assert torch.all(t == 7)
    assert torch.all(space.base[MB: 49 * MB] == 0)
