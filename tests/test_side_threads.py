"""The GIL's switch interval while the runtime's own threads run beside the decode steps
(side_threads.py): shortened while any runs, the program's own put back after the last, a
program's lower or changed setting left alone; and the recalibration worker runs under it."""

from __future__ import annotations

import sys
import threading

import pytest

from hi_sparse import side_threads
from hi_sparse.recal_job import RecalibrationJob
from hi_sparse.side_threads import beside_the_steps


@pytest.fixture(autouse=True)
def _interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_the_interval_is_short_while_any_side_thread_runs_and_put_back_after_the_last():
    with beside_the_steps():
        assert sys.getswitchinterval() == pytest.approx(side_threads.SWITCH_INTERVAL)
        inner_done, outer_may_end = threading.Event(), threading.Event()
        seen = []

        def other():
            with beside_the_steps():
                seen.append(sys.getswitchinterval())
                inner_done.set()
                assert outer_may_end.wait(10)
            seen.append(sys.getswitchinterval())

        t = threading.Thread(target=other)
        t.start()
        assert inner_done.wait(10)
    # the first to enter ended; the other still runs: still short
    assert sys.getswitchinterval() == pytest.approx(side_threads.SWITCH_INTERVAL)
    outer_may_end.set()
    t.join()
    assert seen[0] == pytest.approx(side_threads.SWITCH_INTERVAL)
    assert seen[1] == pytest.approx(0.005) and sys.getswitchinterval() == pytest.approx(0.005)


def test_a_program_s_own_lower_interval_or_its_change_meanwhile_is_left_alone(monkeypatch):
    sys.setswitchinterval(1e-4)
    with beside_the_steps():
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    assert sys.getswitchinterval() == pytest.approx(1e-4)

    sys.setswitchinterval(0.005)
    with beside_the_steps():
        sys.setswitchinterval(0.002)           # the program's, while a side thread ran
    assert sys.getswitchinterval() == pytest.approx(0.002)

    monkeypatch.setattr(side_threads, "SWITCH_INTERVAL", None)
    sys.setswitchinterval(0.005)
    with beside_the_steps():
        assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_error_in_the_thread_still_puts_the_interval_back():
    with pytest.raises(ValueError), beside_the_steps():
        raise ValueError("broken on purpose")
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_recalibration_worker_runs_under_the_short_interval_and_puts_it_back():
    seen = []

    def work():
        seen.append((threading.current_thread().name, sys.getswitchinterval()))
        yield

    job = RecalibrationJob("request", background=True)
    job.run(work(), "thread")
    assert job.commit()
    assert seen == [("hisparse-recalibration", pytest.approx(side_threads.SWITCH_INTERVAL))]
    assert sys.getswitchinterval() == pytest.approx(0.005)
