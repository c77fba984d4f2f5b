"""Seqlock consistency between two real processes, and the reader's bounded retries."""

import os
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from easymats import layout as L, segment

# 16 counters from the catalogue, updated in lockstep by the writer, plus a histogram that
# observes once per step: every consistent snapshot has 16 equal counters and a histogram whose
# count equals them.
COUNTERS = [
    ("hisparse_tokens_total", {"phase": "prefill"}), ("hisparse_tokens_total", {"phase": "decode"}),
    ("hisparse_anchor_lookups_total", {}), ("hisparse_anchor_hits_total", {}),
    ("hisparse_recalibrations_total", {"reason": "schedule"}),
    ("hisparse_recalibrations_total", {"reason": "request"}),
    ("hisparse_recalibrations_total", {"reason": "drift"}),
    ("hisparse_kv_block_allocations_total", {}), ("hisparse_kv_block_recycles_total", {}),
    ("hisparse_kv_block_reclaims_total", {}), ("hisparse_kv_tokens_loaded_total", {}),
    ("hisparse_kv_tokens_used_total", {}), ("hisparse_hot_buffer_lookups_total", {}),
    ("hisparse_hot_buffer_hits_total", {}), ("hisparse_prefetch_issued_total", {}),
    ("hisparse_prefetch_used_total", {}),
]

LOCKSTEP_WRITER = textwrap.dedent("""
    import select, sys, time
    from easymats import telemetry
    counters = {counters!r}
    seg = telemetry.open_segment(name="lockstep", labels={{"test": "seqlock"}})
    cs = [seg.counter(n, **lab) for n, lab in counters]
    hist = seg.histogram("hisparse_step_duration_seconds")
    seg.publish()
    print(seg.path, flush=True)
    deadline = time.monotonic() + float(sys.argv[1])
    pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0  # seconds between publishes
    steps = 0
    # Run until the deadline or until the test closes our stdin, whichever is first.
    while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0)[0]:
        for _ in range(50):
            for c in cs:
                c.inc()
            hist.observe(0.001 * (steps % 7))
            seg.publish()
            steps += 1
            if pause:
                time.sleep(pause)
    print(steps, flush=True)
    sys.stdin.read()  # stay alive (segment in place) until the test closes our stdin
""").format(counters=COUNTERS)


def start_writer(code: str, *args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert path.endswith(".seg"), f"writer did not start: {path!r}"
    return proc, path


def stop(proc: subprocess.Popen) -> None:
    if not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_against(writer_args: tuple[str, ...], min_seconds: float, min_snapshots: int,
                 min_distinct: int, max_seconds: float = 30.0) -> dict:
    """Read snapshots while a lockstep writer runs; every snapshot is checked for tearing.

    Reads for at least ``min_seconds`` and until ``min_snapshots`` snapshots with
    ``min_distinct`` distinct counter values were seen (on a loaded machine that takes longer),
    capped at ``max_seconds``; the writer runs for 60 s at most.
    """
    writer, path = start_writer(LOCKSTEP_WRITER, *writer_args)
    try:
        reader = segment.SegmentReader(path)
        snapshots = busy = retried = 0
        seen_values = set()
        previous = -1.0
        t0 = time.monotonic()
        while True:
            elapsed = time.monotonic() - t0
            if elapsed >= max_seconds or (elapsed >= min_seconds and snapshots >= min_snapshots
                                          and len(seen_values) >= min_distinct):
                break
            try:
                snap = reader.read()
            except segment.SegmentBusy:
                busy += 1
                continue
            snapshots += 1
            retried += snap.retries > 0
            values = [s.value for s in snap.series if s.type == "counter"]
            hist = snap.get("hisparse_step_duration_seconds")
            assert len(values) == 16
            assert len(set(values)) == 1, f"torn snapshot: counters {values}"
            assert hist.count == values[0], f"torn snapshot: histogram count {hist.count} != {values[0]}"
            assert values[0] >= previous, "a counter went backwards between snapshots"
            assert snap.seq % 2 == 0
            previous = values[0]
            seen_values.add(values[0])
        writer.stdin.close()  # the writer stops and reports its step count
        steps = int(writer.stdout.readline())
    finally:
        stop(writer)
    print(f"{elapsed:.1f} s: {snapshots} snapshots, {len(seen_values)} distinct, {retried} retried, "
          f"{busy} busy; writer made {steps} steps")
    # The two really ran concurrently: the reader saw the writer move many times.
    assert snapshots >= min_snapshots and len(seen_values) >= min_distinct, (snapshots, len(seen_values))
    return {"snapshots": snapshots, "busy": busy, "retried": retried, "steps": steps}


def test_two_processes_no_torn_snapshot_for_two_seconds():
    # A writer that publishes back to back (about 10^5 publishes a second, 100x a fast decode
    # loop): the stress case for tearing. On a loaded 2-core machine the writer can hold the
    # seqlock for most of the reader's time slice, so reads may come back busy here; what must
    # never happen is a torn or backwards snapshot. Liveness is the next test's claim.
    read_against(("60",), min_seconds=2.0, min_snapshots=100, min_distinct=50)


def test_reader_keeps_up_with_a_writer_publishing_every_200_microseconds():
    # 5,000 publishes a second, still 5x a fast decode loop's one publish per step: a reader
    # sampling this segment must get a snapshot nearly every time, not SegmentBusy.
    stats = read_against(("60", "0.0002"), min_seconds=1.0, min_snapshots=200, min_distinct=100)
    assert stats["busy"] < stats["snapshots"] / 10, stats


def hold_seqlock_odd(path: str) -> tuple[int, int]:
    """Act as a writer stuck in the middle of a publish: seq odd, half the counters changed."""
    fd = os.open(path, os.O_RDWR)
    try:
        seq = L.U64.unpack(os.pread(fd, 8, L.OFF_SEQ))[0]
        assert seq % 2 == 0
        os.pwrite(fd, L.U64.pack(seq + 1), L.OFF_SEQ)
        values_off = L.U64.unpack(os.pread(fd, 8, L.OFF_VALUES))[0]
        os.pwrite(fd, struct.pack("<8d", *[999.0] * 8), values_off)  # the first 8 of 16 counters
        return fd, seq
    except BaseException:
        os.close(fd)
        raise


def test_reader_gives_up_with_busy_while_the_seqlock_is_held_then_recovers():
    writer, path = start_writer(LOCKSTEP_WRITER, "0")
    assert writer.stdout.readline().strip() == "0"  # idle from now on: the file is ours to play writer
    reader = segment.SegmentReader(path, max_retries=20)
    before = reader.read()
    fd, seq = hold_seqlock_odd(path)
    try:
        t0 = time.monotonic()
        with pytest.raises(segment.SegmentBusy) as err:
            reader.read()
        elapsed = time.monotonic() - t0
        assert err.value.kind == "busy"
        assert "busy" in str(err.value) and "20 reads" in str(err.value)
        assert elapsed < 1.0, f"the reader spun for {elapsed:.3f} s"
        # Never a half-written snapshot, with any retry budget.
        with pytest.raises(segment.SegmentBusy):
            segment.SegmentReader(path, check_writer=False, max_retries=0).read()
        # The writer completes its publish: the second half catches up, seq becomes even.
        values_off = L.U64.unpack(os.pread(fd, 8, L.OFF_VALUES))[0]
        os.pwrite(fd, struct.pack("<8d", *[999.0] * 8), values_off + 64)
        os.pwrite(fd, L.U64.pack(seq + 2), L.OFF_SEQ)
    finally:
        os.close(fd)
    after = reader.read()
    stop(writer)
    counters = [s.value for s in after.series if s.type == "counter"]
    assert counters == [999.0] * 16 and after.seq == seq + 2
    assert [s.name for s in after.series] == [s.name for s in before.series]


def test_reader_retries_while_a_writer_rewrites_the_header_mid_read():
    """Layout fields seen mid-change (odd seq) never surface as a bad_layout error."""
    writer, path = start_writer(LOCKSTEP_WRITER, "0")
    assert writer.stdout.readline().strip() == "0"
    fd = os.open(path, os.O_RDWR)
    try:
        seq = L.U64.unpack(os.pread(fd, 8, L.OFF_SEQ))[0]
        count = L.U32.unpack(os.pread(fd, 4, L.OFF_ENTRY_COUNT))[0]
        os.pwrite(fd, L.U64.pack(seq + 1), L.OFF_SEQ)
        os.pwrite(fd, L.U32.pack(count + 5), L.OFF_ENTRY_COUNT)  # entries not yet written
        with pytest.raises(segment.SegmentBusy):
            segment.SegmentReader(path, check_writer=False, max_retries=5).read()
        os.pwrite(fd, L.U32.pack(count), L.OFF_ENTRY_COUNT)
        os.pwrite(fd, L.U64.pack(seq + 2), L.OFF_SEQ)
    finally:
        os.close(fd)
    assert len(segment.SegmentReader(path).read().series) == count
    stop(writer)
