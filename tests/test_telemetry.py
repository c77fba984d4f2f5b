"""The writer: API, catalogue checks, file safety, and never breaking its host program."""

import os
import resource
import stat
import subprocess
import sys
import tempfile
import textwrap
import warnings

import pytest
from helpers_faults import fill, small_filesystem

from easymats import catalogue, layout as L, segment, telemetry
from easymats.telemetry import TelemetryWarning

NOBODY = 65534


def run_python(code: str, *, env_dir: str | None = None, preexec=None, timeout: float = 60):
    env = dict(os.environ)
    if env_dir is not None:
        env["EASYMATS_SEGMENT_DIR"] = env_dir
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, preexec_fn=preexec, timeout=timeout)


# ---- the public API ---------------------------------------------------------------------------

def test_values_round_trip_through_the_segment(segment_dir):
    seg = telemetry.open_segment(name="decode-0", labels={"model": "llama-8b"})
    assert seg.enabled and os.path.dirname(seg.path) == segment_dir
    assert os.path.basename(seg.path) == f"{os.getpid()}.seg"
    seg.counter("hisparse_hot_buffer_hits_total").inc(5)
    seg.counter("hisparse_hot_buffer_hits_total").inc()  # same series object
    seg.gauge("hisparse_kv_blocks", state="active").set(12)
    seg.gauge("hisparse_kv_blocks", state="free").set(3)
    seg.gauge("hisparse_kv_blocks", state="free").dec(1)
    h = seg.histogram("hisparse_quant_block_relative_error")
    for v in (0.0005, 0.01, 0.01, 0.3, 7.0):
        h.observe(v)
    seg.info("hisparse_runtime_info", version="0.1", model="llama-8b", device="cpu")
    seg.publish()
    snap = segment.read_segment(seg.path)
    assert snap.name == "decode-0" and snap.labels == {"model": "llama-8b"}
    assert snap.get("hisparse_hot_buffer_hits_total") == 6.0
    assert snap.get("hisparse_kv_blocks", state="active") == 12.0
    assert snap.get("hisparse_kv_blocks", state="free") == 2.0
    assert snap.get("hisparse_runtime_info", version="0.1", model="llama-8b", device="cpu") == 1.0
    hist = snap.get("hisparse_quant_block_relative_error")
    assert hist.bounds == catalogue.QUANT_ERROR_BUCKETS
    assert hist.count == 5 and hist.sum == pytest.approx(7.3205)
    cum = dict(hist.cumulative())
    assert cum[0.001] == 1 and cum[0.01] == 3 and cum[0.5] == 4 and cum[float("inf")] == 5
    units = {s.name: s.unit for s in snap.series}
    assert units["hisparse_quant_block_relative_error"] == ""
    seg.close()


def test_values_reach_the_reader_only_at_publish(segment_dir):
    seg = telemetry.open_segment(name="x")
    c = seg.counter("hisparse_anchor_hits_total")
    seg.publish()
    reader = segment.SegmentReader(seg.path)
    first = reader.read()
    c.inc(10)
    assert reader.read().get("hisparse_anchor_hits_total") == 0.0
    seg.publish()
    second = reader.read()
    assert second.get("hisparse_anchor_hits_total") == 10.0
    assert second.seq > first.seq and second.heartbeat_unix_ns >= first.heartbeat_unix_ns
    assert second.heartbeat_mono_ns > first.heartbeat_mono_ns
    seg.close()


def test_series_added_after_a_read_appear_in_the_next_read(segment_dir):
    seg = telemetry.open_segment(name="x")
    seg.gauge("hisparse_sequences").set(1)
    seg.publish()
    reader = segment.SegmentReader(seg.path)
    gen = reader.read().layout_generation
    seg.gauge("hisparse_anchors").set(4)
    seg.publish()
    snap = reader.read()
    assert snap.layout_generation > gen
    assert [s.name for s in snap.series] == ["hisparse_sequences", "hisparse_anchors"]
    assert snap.get("hisparse_anchors") == 4.0
    seg.close()


@pytest.mark.parametrize("call, words", [
    (lambda s: s.counter("hisparse_no_such_total"), "unknown metric"),
    (lambda s: s.counter("hisparse_hot_buffer_hit_total"), "hisparse_hot_buffer_hits_total"),
    (lambda s: s.gauge("hisparse_tokens_total", phase="decode"), "is a counter"),
    (lambda s: s.counter("hisparse_tokens_total"), "takes labels"),
    (lambda s: s.counter("hisparse_tokens_total", phase="warmup"), "prefill, decode"),
    (lambda s: s.gauge("hisparse_sequences", pid="1"), "takes labels"),
    (lambda s: s.histogram("hisparse_sequences"), "is a gauge"),
])
def test_unknown_names_and_labels_fail_at_creation(segment_dir, call, words):
    seg = telemetry.open_segment(name="x")
    with pytest.raises(catalogue.UnknownMetricError) as err:
        call(seg)
    assert words in str(err.value)
    seg.publish()
    assert segment.read_segment(seg.path).series == []  # nothing half-registered
    seg.close()


def test_counter_rejects_negative_increments(segment_dir):
    seg = telemetry.open_segment(name="x")
    c = seg.counter("hisparse_anchor_hits_total")
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1)
    assert c.value == 0.0
    seg.close()


@pytest.mark.parametrize("name, labels, words", [
    ("", None, "segment name"),
    ("x" * 65, None, "segment name"),
    ("ok", {"bad-key": "v"}, "not a valid Prometheus label name"),
    ("ok", {"k": "a\x1eb"}, "control character"),
    ("ok", {"k": "v" * 300}, "at most"),
])
def test_bad_segment_identity_is_a_clear_error(segment_dir, name, labels, words):
    with pytest.raises(ValueError, match=words):
        telemetry.open_segment(name=name, labels=labels)
    assert os.listdir(segment_dir) == []


@pytest.mark.parametrize("kw", [{"capacity": 0}, {"capacity": 70000}, {"value_slots": 0},
                                {"value_slots": 10_000_000}])
def test_sizes_a_reader_would_refuse_are_refused_up_front(segment_dir, kw):
    with pytest.raises(ValueError, match="capacity="):
        telemetry.open_segment(name="x", **kw)
    assert os.listdir(segment_dir) == []


def test_full_segment_is_a_clear_error(segment_dir):
    seg = telemetry.open_segment(name="x", capacity=1)
    seg.gauge("hisparse_sequences")
    with pytest.raises(RuntimeError, match="capacity=N"):
        seg.gauge("hisparse_anchors")
    seg.close()


# ---- files: modes, links, names, removal ------------------------------------------------------

def test_directory_0700_and_files_0600_whatever_the_umask(tmp_path, monkeypatch):
    d = tmp_path / "fresh" / "easymats"
    (tmp_path / "fresh").mkdir()
    monkeypatch.setenv("EASYMATS_SEGMENT_DIR", str(d))
    old = os.umask(0)
    try:
        seg = telemetry.open_segment(name="x")
    finally:
        os.umask(old)
    assert seg.enabled
    st = os.lstat(d)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    for path in (seg.path, segment.control_path(seg.path)):
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, path
    seg.close()


def test_default_directory_is_per_user_under_dev_shm(monkeypatch):
    monkeypatch.delenv("EASYMATS_SEGMENT_DIR")
    assert segment.segment_dir() == f"/dev/shm/easymats-{os.geteuid()}"


def test_planted_symlinks_are_not_followed(segment_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    seg_path = os.path.join(segment_dir, f"{os.getpid()}.seg")
    os.symlink(victim, seg_path)
    os.symlink(victim, segment.control_path(seg_path))
    seg = telemetry.open_segment(name="x")
    seg.counter("hisparse_anchor_hits_total").inc()
    seg.publish()
    assert seg.path == seg_path
    assert not os.path.islink(seg.path) and not os.path.islink(segment.control_path(seg.path))
    assert victim.read_bytes() == b"precious"
    seg.close()
    assert victim.read_bytes() == b"precious"


def test_stale_file_of_an_earlier_process_with_our_pid_is_replaced(segment_dir):
    stale = os.path.join(segment_dir, f"{os.getpid()}.seg")
    with open(stale, "wb") as f:
        f.write(b"left behind by a crashed process")
    os.chmod(stale, 0o600)
    seg = telemetry.open_segment(name="x")
    assert seg.path == stale
    assert segment.read_segment(seg.path).name == "x"
    seg.close()


def test_second_segment_gets_the_next_name_and_close_removes_both_files(segment_dir):
    pid = os.getpid()
    a = telemetry.open_segment(name="a")
    b = telemetry.open_segment(name="b")
    assert os.path.basename(a.path) == f"{pid}.seg" and os.path.basename(b.path) == f"{pid}.1.seg"
    assert segment.segments_for_pid(pid, segment_dir) == sorted([a.path, b.path])
    assert segment.pid_of_path(b.path) == pid
    assert sorted(os.listdir(segment_dir)) == sorted([f"{pid}.seg", f"{pid}.ctl", f"{pid}.1.seg", f"{pid}.1.ctl"])
    assert segment.read_segment(b.path).name == "b"
    b.close()
    assert sorted(os.listdir(segment_dir)) == [f"{pid}.ctl", f"{pid}.seg"]
    a.close()
    a.close()  # idempotent
    assert os.listdir(segment_dir) == []


def test_close_publishes_a_last_time_and_context_manager_closes(segment_dir):
    with telemetry.open_segment(name="x") as seg:
        c = seg.counter("hisparse_anchor_hits_total")
        reader = segment.SegmentReader(seg.path)
        c.inc(3)
    # The reader's open descriptor still sees the final snapshot of the unlinked file.
    assert reader.read().get("hisparse_anchor_hits_total") == 3.0
    assert os.listdir(segment_dir) == []


def test_atexit_removes_the_files(segment_dir):
    proc = run_python("""
        from easymats import telemetry
        a = telemetry.open_segment(name="a")
        b = telemetry.open_segment(name="b")
        a.counter("hisparse_anchor_hits_total").inc()
        print(a.path, b.path)
    """)
    assert proc.returncode == 0, proc.stderr
    paths = proc.stdout.split()
    assert len(paths) == 2 and all(p.startswith(segment_dir) for p in paths)
    assert os.listdir(segment_dir) == []


def test_fork_child_never_publishes_into_the_parents_segment(segment_dir):
    seg = telemetry.open_segment(name="parent")
    c = seg.counter("hisparse_anchor_hits_total")
    c.inc()
    seg.publish()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report through the pipe, leave with os._exit (no pytest teardown)
        status = 1
        try:
            os.close(r)
            c.inc(100)
            seg.publish()
            ok = not seg.enabled and seg.poll_control() is None and c.value == 101.0
            own = telemetry.open_segment(name="child")
            ok = ok and own.enabled and os.path.basename(own.path) == f"{os.getpid()}.seg"
            own.counter("hisparse_anchor_hits_total").inc(7)
            own.publish()
            ok = ok and segment.read_segment(own.path).get("hisparse_anchor_hits_total") == 7.0
            own.close()
            seg.close()  # must not remove the parent's files
            os.write(w, b"ok" if ok else b"bad")
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    report = os.read(r, 16)
    os.close(r)
    assert status == 0 and report == b"ok", report
    assert os.path.exists(seg.path) and os.path.exists(segment.control_path(seg.path))
    assert segment.read_segment(seg.path).get("hisparse_anchor_hits_total") == 1.0
    seg.publish()
    assert segment.read_segment(seg.path).get("hisparse_anchor_hits_total") == 1.0
    seg.close()


# ---- never break the host: one warning, then a no-op writer -----------------------------------

def assert_noop_writer(make_segment, expect_in_message: str) -> None:
    """One TelemetryWarning, then a writer whose metrics update and whose publish does nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seg = make_segment()
        c = seg.counter("hisparse_anchor_hits_total")
        g = seg.gauge("hisparse_kv_blocks", state="active")
        h = seg.histogram("hisparse_step_duration_seconds")
        for i in range(3):
            c.inc(2)
            g.set(i)
            h.observe(0.01)
            seg.publish()
        assert seg.poll_control() is None
        seg.close()
    ours = [w for w in caught if issubclass(w.category, TelemetryWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert expect_in_message in str(ours[0].message)
    assert "in memory only" in str(ours[0].message)
    assert not seg.enabled and seg.path is None
    assert c.value == 6.0 and g.value == 2.0 and h.counts[6] == 3.0


def test_directory_path_under_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    assert_noop_writer(lambda: telemetry.open_segment(name="x", directory=str(f / "segments")),
                       "Not a directory")


def test_regular_file_in_place_of_the_directory(tmp_path):
    f = tmp_path / "segments"
    f.write_text("not a directory")
    assert_noop_writer(lambda: telemetry.open_segment(name="x", directory=str(f)), "not a real directory")
    assert f.read_text() == "not a directory"


def test_symlinked_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    os.symlink(real, link)
    assert_noop_writer(lambda: telemetry.open_segment(name="x", directory=str(link)), "not a real directory")
    assert os.listdir(real) == []


def test_directory_open_to_others_is_refused(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o755)
    assert_noop_writer(lambda: telemetry.open_segment(name="x", directory=str(d)), "mode 0700")
    assert os.listdir(d) == []


def test_missing_parent_directory(tmp_path):
    assert_noop_writer(lambda: telemetry.open_segment(name="x", directory=str(tmp_path / "a" / "b")),
                       "No such file")


NOOP_CHILD = """
    import warnings, os
    from easymats import telemetry
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seg = telemetry.open_segment(name="x")
        c = seg.counter("hisparse_anchor_hits_total")
        for _ in range(5):
            c.inc()
            seg.publish()
        seg.close()
    ours = [str(w.message) for w in caught if issubclass(w.category, telemetry.TelemetryWarning)]
    print(len(ours), c.value, seg.enabled)
    print(ours[0] if ours else "")
"""


def test_unwritable_directory_as_a_normal_user():
    """A 0500 directory of our own: the open fails (EACCES), the program carries on.

    Root ignores directory permissions, so a forked child drops to uid nobody first (the
    interpreter lives under /root, so exec'ing a fresh one as nobody is not possible here).
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another uid")  # CI runs as root
    base = tempfile.mkdtemp(prefix="easymats-ro-")
    d = os.path.join(base, "segments")
    try:
        os.chmod(base, 0o711)
        os.mkdir(d, 0o500)
        os.chown(d, NOBODY, NOBODY)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                os.close(r)
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    seg = telemetry.open_segment(name="x", directory=d)
                    c = seg.counter("hisparse_anchor_hits_total")
                    for _ in range(5):
                        c.inc()
                        seg.publish()
                    seg.close()
                ours = [str(x.message) for x in caught if issubclass(x.category, TelemetryWarning)]
                os.write(w, f"{len(ours)} {c.value} {seg.enabled}\n{ours[0] if ours else ''}".encode())
                status = 0
            finally:
                os._exit(status)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        out = os.read(r, 4096).decode()
        os.close(r)
        assert status == 0, out
        first, message = out.splitlines()[:2]
        assert first == "1 5.0 False", out
        assert "Permission denied" in message and "EASYMATS_SEGMENT_DIR" in message
        assert os.listdir(d) == []
    finally:
        os.chmod(d, 0o700)
        subprocess.run(["rm", "-rf", base], check=True)


def test_full_filesystem_file_size_limit(segment_dir):
    """RLIMIT_FSIZE below the segment size: allocation fails (EFBIG), never SIGXFSZ/SIGBUS."""
    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = run_python(NOOP_CHILD, preexec=small_files)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    first, message = proc.stdout.splitlines()[:2]
    assert first == "1 5.0 False", proc.stdout
    assert "File too large" in message
    assert os.listdir(segment_dir) == []


def test_segment_removed_under_the_writer_keeps_working(segment_dir):
    seg = telemetry.open_segment(name="x")
    c = seg.counter("hisparse_anchor_hits_total")
    os.unlink(seg.path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.inc()
        seg.publish()
        seg.close()
    assert c.value == 1.0


def test_header_fields_match_the_documented_layout(segment_dir):
    seg = telemetry.open_segment(name="x", labels={"b": "2", "a": "1"})
    seg.publish()
    raw = open(seg.path, "rb").read()
    h = L.HEADER_STRUCT.unpack_from(raw)
    assert raw[:8] == b"EZMATSEG" and h[1:6] == (1, 0, 0x01020304, 512, 256)
    assert h[6] == os.getpid() and h[7] > 0 and h[8] != bytes(16)
    assert h[9] % 2 == 0 and h[9] >= 2
    assert h[15] == 512 and h[16] == 512 + h[14] * 256 and len(raw) == h[16] + h[18]
    assert L.decode_labels(h[20]) == {"a": "1", "b": "2"}
    assert h[20].rstrip(b"\0") == b"a\x1f1\x1eb\x1f2"  # sorted by key
    assert raw[L.HEADER_STRUCT.size:L.HEADER_SIZE] == bytes(L.HEADER_SIZE - L.HEADER_STRUCT.size)
    seg.close()


@pytest.fixture
def tiny_tmpfs():
    """A real 64 KiB tmpfs, nearly filled; skipped where mounting is not permitted."""
    with small_filesystem(64, mode=0o700,
                          instead="test_full_filesystem_file_size_limit covers the same path") as mnt:
        fill(mnt, leave_bytes=8 << 10)
        d = os.path.join(mnt, "segments")
        os.mkdir(d, 0o700)
        yield d


def test_full_tmpfs_warns_instead_of_crashing_with_sigbus(tiny_tmpfs):
    """A write through a mapping into a full tmpfs raises SIGBUS; the writer reserves space first."""
    proc = run_python(NOOP_CHILD + """
    seg = telemetry.open_segment(name="small", capacity=2, value_slots=16)
    c = seg.counter("hisparse_anchor_hits_total"); c.inc(); seg.publish()
    print(seg.enabled)
    seg.close()
    """, env_dir=tiny_tmpfs)
    assert proc.returncode == 0, (proc.returncode, proc.stderr)  # -7 would be SIGBUS
    lines = proc.stdout.splitlines()
    assert lines[0] == "1 5.0 False" and "No space left" in lines[1], proc.stdout
    assert lines[2] == "True", "a segment that fits the space left is still published"
    assert os.listdir(tiny_tmpfs) == []


def test_threads_creating_the_same_series_share_one_entry(segment_dir):
    import threading

    seg = telemetry.open_segment(name="x")
    barrier = threading.Barrier(8)
    got = []

    def worker():
        barrier.wait()
        for _ in range(200):
            got.append(seg.counter("hisparse_tokens_total", phase="decode"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(c) for c in got}) == 1
    seg.publish()
    assert [s.name for s in segment.read_segment(seg.path).series] == ["hisparse_tokens_total"]
    seg.close()


def test_bucketed_counts_add_up_to_what_observing_each_value_gives():
    """Histogram.observe_counts (the runtime's errors bucketed on the GPU, one read-back) leaves
    the histogram as observing each value does; a count list of the wrong length is refused."""
    bounds = catalogue.QUANT_ERROR_BUCKETS
    values = [0.0, bounds[0], bounds[0] * 1.0001, bounds[3], 0.5 * (bounds[2] + bounds[3]), 9.0]
    one, many = telemetry.Histogram(bounds), telemetry.Histogram(bounds)
    for v in values:
        one.observe(v)
    counts = [0.0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    many.observe_counts(counts, sum(values))
    assert many.counts == one.counts and many.sum == pytest.approx(one.sum)
    with pytest.raises(ValueError, match="bucket counts for a histogram of"):
        many.observe_counts(counts[:-1], 0.0)
