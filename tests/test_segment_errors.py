"""Every class of bad segment ends in SegmentError with the right kind and a useful message."""

import os
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from easymats import layout as L, segment, telemetry
from easymats.segment import SegmentError

OTHER_UID = 12345


@pytest.fixture
def live(segment_dir):
    """A small valid segment of this (live) process, with a counter, a gauge and a histogram."""
    seg = telemetry.open_segment(name="victim", labels={"model": "tiny"}, capacity=4, value_slots=64)
    assert seg.enabled
    seg.counter("hisparse_tokens_total", phase="decode").inc(7)
    seg.gauge("hisparse_kv_blocks", state="active").set(3)
    seg.histogram("hisparse_step_duration_seconds").observe(0.002)
    seg.publish()
    yield seg
    seg.close()


def copy_of(seg, segment_dir, name: str = None) -> str:
    """A byte copy of ``seg`` in the segment directory, named as another segment of this pid."""
    path = os.path.join(segment_dir, name or f"{os.getpid()}.60.seg")
    with open(seg.path, "rb") as f:
        data = f.read()
    write_file(path, data)
    return path


def write_file(path: str, data: bytes, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def patch(path: str, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def read_error(path: str, **kw) -> SegmentError:
    with pytest.raises(SegmentError) as err:
        segment.read_segment(path, **kw)
    assert type(err.value) in (SegmentError, segment.SegmentBusy)
    assert err.value.kind in SegmentError.KINDS
    # The message starts with what is wrong: the file, or its directory.
    assert str(err.value).startswith((path + ": ", os.path.dirname(path) + ": ")), str(err.value)
    return err.value


def test_valid_copy_reads_back(live, segment_dir):
    snap = segment.read_segment(copy_of(live, segment_dir))
    assert snap.name == "victim" and snap.labels == {"model": "tiny"} and snap.pid == os.getpid()
    assert snap.get("hisparse_tokens_total", phase="decode") == 7.0
    assert snap.get("hisparse_kv_blocks", state="active") == 3.0
    assert snap.get("hisparse_step_duration_seconds").count == 1


def test_empty_file(segment_dir):
    path = os.path.join(segment_dir, f"{os.getpid()}.61.seg")
    write_file(path, b"")
    err = read_error(path)
    assert err.kind == "empty" and "empty" in str(err)


HEADER_BOUNDARIES = sorted({0, 1, 4, 7} | {v for k, v in vars(L).items() if k.startswith("OFF_")}
                           | {L.HEADER_STRUCT.size, L.HEADER_SIZE - 1})


@pytest.mark.parametrize("cut", HEADER_BOUNDARIES)
def test_truncated_at_every_header_boundary(live, segment_dir, cut):
    path = copy_of(live, segment_dir)
    os.truncate(path, cut)
    err = read_error(path)
    assert err.kind == ("empty" if cut == 0 else "truncated")
    if cut:
        assert "truncated" in str(err) and "needed" in str(err)


@pytest.mark.parametrize("where", ["entry_table", "values_start", "values_end"])
def test_truncated_entry_table_or_value_area(live, segment_dir, where):
    path = copy_of(live, segment_dir)
    raw = open(path, "rb").read()
    h = L.HEADER_STRUCT.unpack_from(raw)
    values_off, values_used = h[16], h[17]
    cut = {"entry_table": L.HEADER_SIZE + 100, "values_start": values_off + 4,
           "values_end": values_off + values_used - 8}[where]
    os.truncate(path, cut)
    err = read_error(path)
    assert err.kind == "truncated", err


def test_wrong_magic(live, segment_dir):
    path = copy_of(live, segment_dir)
    patch(path, 0, b"NOTASEG!")
    err = read_error(path)
    assert err.kind == "bad_magic" and "not an easymats segment" in str(err)


def test_future_major_version(live, segment_dir):
    path = copy_of(live, segment_dir)
    patch(path, L.OFF_MAJOR, struct.pack("<HH", L.MAJOR + 1, 3))
    err = read_error(path)
    assert err.kind == "future_version"
    assert f"{L.MAJOR + 1}.3" in str(err) and "upgrade easymats" in str(err)


def test_newer_minor_version_is_read(live, segment_dir):
    path = copy_of(live, segment_dir)
    patch(path, L.OFF_MINOR, struct.pack("<H", L.MINOR + 7))
    assert segment.read_segment(path).get("hisparse_tokens_total", phase="decode") == 7.0


def test_big_endian_byte_order(live, segment_dir):
    path = copy_of(live, segment_dir)
    patch(path, L.OFF_BYTE_ORDER, struct.pack(">I", L.BYTE_ORDER_MARK))
    err = read_error(path)
    assert err.kind == "byte_order" and "little-endian" in str(err)


def _u32(v):
    return struct.pack("<I", v)


def _u64(v):
    return struct.pack("<Q", v)


BAD_HEADERS = {
    "header size too small": (L.OFF_HEADER_SIZE, _u32(64), "header size"),
    "header size unaligned": (L.OFF_HEADER_SIZE, _u32(L.HEADER_SIZE + 3), "header size"),
    "entry size wrong": (L.OFF_ENTRY_SIZE, _u32(100), "entry size"),
    "count over capacity": (L.OFF_ENTRY_COUNT, _u32(5), "entry count"),
    "capacity huge": (L.OFF_ENTRY_CAPACITY, _u32(1 << 30), "capacity"),
    "table inside header": (L.OFF_ENTRY_TABLE, _u64(64), "entry table"),
    "table unaligned": (L.OFF_ENTRY_TABLE, _u64(L.HEADER_SIZE + 4), "entry table"),
    "values inside table": (L.OFF_VALUES, _u64(L.HEADER_SIZE + 256), "values"),
    "values past the limit": (L.OFF_VALUES, _u64(1 << 40), "values"),
    "values used over capacity": (L.OFF_VALUES_USED, _u64(1 << 20), "values area"),
    "values used unaligned": (L.OFF_VALUES_USED, _u64(13), "values area"),
    "pid zero": (L.OFF_WRITER_PID, _u64(0), "not a pid"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS), ids=list(BAD_HEADERS))
def test_offsets_and_counts_out_of_range(live, segment_dir, case):
    offset, data, words = BAD_HEADERS[case]
    path = copy_of(live, segment_dir)
    patch(path, offset, data)
    err = read_error(path, check_writer=False)
    assert err.kind == "bad_layout", err
    assert words in str(err), err


ENTRY0 = L.HEADER_SIZE
BAD_ENTRIES = {
    "unknown type": (ENTRY0, bytes([9]), "unknown type code 9"),
    "buckets on a counter": (ENTRY0 + 2, struct.pack("<H", 3), "bucket count"),
    "too many buckets": (ENTRY0 + L.ENTRY_SIZE * 2 + 2, struct.pack("<H", 200), "bucket count"),
    "value before the area": (ENTRY0 + 8, _u64(8), "outside"),
    "value past the used area": (ENTRY0 + 8, _u64(1 << 20), "outside"),
    "value unaligned": (ENTRY0 + L.ENTRY_SIZE + 8, None, "outside"),
    "bad metric name": (ENTRY0 + 16, b"9 not a name\x00", "not a metric name"),
    "undecodable name": (ENTRY0 + 16, b"\xff\xfe\x00", "undecodable"),
    "malformed labels": (ENTRY0 + 80, b"phase-decode\x00", "malformed label"),
}


@pytest.mark.parametrize("case", list(BAD_ENTRIES), ids=list(BAD_ENTRIES))
def test_bad_entries(live, segment_dir, case):
    offset, data, words = BAD_ENTRIES[case]
    path = copy_of(live, segment_dir)
    if data is None:  # shift the value offset by 4 bytes
        raw = open(path, "rb").read()
        data = _u64(struct.unpack_from("<Q", raw, offset)[0] + 4)
    patch(path, offset, data)
    err = read_error(path)
    assert err.kind == "bad_layout", err
    assert words in str(err) and "entry" in str(err), err


def test_bad_segment_name_or_labels(live, segment_dir):
    path = copy_of(live, segment_dir)
    patch(path, L.OFF_LABELS, b"model\x1ftiny\x1emodel\x1fagain")  # a label twice
    err = read_error(path)
    assert err.kind == "bad_layout" and "labels" in str(err)


def test_symlink_is_not_followed(live, segment_dir):
    link = os.path.join(segment_dir, f"{os.getpid()}.62.seg")
    os.symlink(live.path, link)
    err = read_error(link)
    assert err.kind == "symlink" and "symbolic link" in str(err)


def test_fifo_is_not_a_segment(segment_dir):
    path = os.path.join(segment_dir, f"{os.getpid()}.63.seg")
    os.mkfifo(path, 0o600)
    err = read_error(path)  # never blocks on the open
    assert err.kind == "not_regular"


def test_missing_file(segment_dir):
    err = read_error(os.path.join(segment_dir, "424242.seg"))
    assert err.kind == "not_found"


def test_file_of_another_owner(live, segment_dir):
    assert os.geteuid() == 0 or os.geteuid() != OTHER_UID
    path = copy_of(live, segment_dir)
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")  # CI runs as root
    os.chown(path, OTHER_UID, OTHER_UID)
    err = read_error(path)
    assert err.kind == "bad_owner" and f"uid {OTHER_UID}" in str(err)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o666])
def test_file_readable_or_writable_by_others(live, segment_dir, mode):
    path = copy_of(live, segment_dir)
    os.chmod(path, mode)
    err = read_error(path)
    assert err.kind == "bad_mode" and f"{mode:04o}" in str(err) and "0600" in str(err)


@pytest.mark.parametrize("mode", [0o770, 0o720, 0o702, 0o777])
def test_group_or_world_writable_directory(live, segment_dir, mode):
    os.chmod(segment_dir, mode)
    try:
        err = read_error(live.path)
    finally:
        os.chmod(segment_dir, 0o700)
    assert err.kind == "bad_directory" and "chmod 700" in str(err)


def test_directory_of_another_owner(live, segment_dir):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    os.chown(segment_dir, OTHER_UID, -1)
    try:
        err = read_error(live.path)
    finally:
        os.chown(segment_dir, 0, -1)
    assert err.kind == "bad_directory" and f"uid {OTHER_UID}" in str(err)


def test_directory_that_is_a_symlink(live, segment_dir, tmp_path):
    link = tmp_path / "segments"
    os.symlink(segment_dir, link)
    err = read_error(str(link / os.path.basename(live.path)))
    assert err.kind == "bad_directory" and "symbolic link" in str(err)


def test_dead_writer(segment_dir):
    """A writer killed with SIGKILL leaves its segment behind: the reader calls it stale."""
    code = textwrap.dedent("""
        import os, signal
        from easymats import telemetry
        seg = telemetry.open_segment(name="doomed")
        seg.counter("hisparse_anchor_hits_total").inc()
        seg.publish()
        print(seg.path, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    path = proc.stdout.strip()
    assert os.path.exists(path)
    err = read_error(path)
    assert err.kind == "dead_pid" and "not running" in str(err) and "stale" in str(err)
    # Without the liveness check the last snapshot is still readable (post-mortem).
    assert segment.read_segment(path, check_writer=False).get("hisparse_anchor_hits_total") == 1.0


def test_reused_pid(live, segment_dir):
    """Same pid, different start time: the pid now belongs to another process."""
    path = copy_of(live, segment_dir)
    start = L.U64.unpack(open(path, "rb").read()[L.OFF_START_TICKS:L.OFF_START_TICKS + 8])[0]
    assert start > 0
    patch(path, L.OFF_START_TICKS, _u64(start - 1))
    err = read_error(path)
    assert err.kind == "pid_reused" and "another process" in str(err)


def test_segment_from_an_earlier_boot(live, segment_dir):
    path = copy_of(live, segment_dir)
    patch(path, L.OFF_BOOT_ID, bytes(range(1, 17)))
    err = read_error(path)
    assert err.kind == "dead_pid" and "earlier boot" in str(err)


def test_closed_reader(live):
    reader = segment.SegmentReader(live.path)
    reader.close()
    with pytest.raises(SegmentError) as err:
        reader.read()
    assert err.value.kind == "io"


# ---- hypothesis: nothing but SegmentError, never a hang -------------------------------------

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))


def read_or_error(path: str, check_writer: bool) -> None:
    try:
        snap = segment.read_segment(path, check_writer=check_writer)
    except SegmentError as exc:
        assert exc.kind in SegmentError.KINDS and str(exc)
        return
    # A mutation can leave a readable file; then the snapshot is well formed.
    for s in snap.series:
        assert s.type in ("counter", "gauge", "histogram", "info")
        if s.type == "histogram":
            assert len(s.value.counts) == len(s.value.bounds) + 1
        else:
            assert isinstance(s.value, float)


@FUZZ
@given(data=st.binary(max_size=3000))
def test_random_bytes_raise_only_segment_error(segment_dir, data):
    path = os.path.join(segment_dir, f"{os.getpid()}.70.seg")
    write_file(path, data)
    read_or_error(path, check_writer=True)


@FUZZ
@given(data=st.binary(min_size=L.HEADER_SIZE, max_size=3000), magic=st.booleans())
def test_random_bytes_behind_a_valid_magic_raise_only_segment_error(segment_dir, data, magic):
    path = os.path.join(segment_dir, f"{os.getpid()}.71.seg")
    if magic:  # get past the first check so the rest of the validation is exercised
        data = L.SEGMENT_MAGIC + struct.pack("<HHI", L.MAJOR, 0, L.BYTE_ORDER_MARK) + data[16:]
    write_file(path, data)
    read_or_error(path, check_writer=False)


_VALID: dict[str, bytes] = {}


def valid_bytes() -> bytes:
    """A valid small segment's bytes (made once per session by a real writer)."""
    if "b" not in _VALID:
        seg = telemetry.open_segment(name="fuzz", labels={"a": "b"}, capacity=4, value_slots=48)
        seg.counter("hisparse_tokens_total", phase="prefill").inc(3)
        seg.gauge("hisparse_kv_memory_bytes", tier="host", kind="data").set(1 << 20)
        seg.histogram("hisparse_quant_block_relative_error").observe(0.01)
        seg.info("hisparse_runtime_info", version="1", model="m", device="cpu")
        seg.publish()
        with open(seg.path, "rb") as f:
            _VALID["b"] = f.read()
        seg.close()
    return _VALID["b"]


mutation = st.tuples(st.integers(0, 3000), st.binary(min_size=1, max_size=8))


@FUZZ
@given(mutations=st.lists(mutation, min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 3000)))
def test_random_mutations_of_a_valid_file_raise_only_segment_error(segment_dir, mutations, cut):
    raw = bytearray(valid_bytes())
    for offset, data in mutations:
        offset %= len(raw)
        raw[offset:offset + len(data)] = data
    if cut is not None:
        del raw[cut:]
    path = os.path.join(segment_dir, f"{os.getpid()}.72.seg")
    write_file(path, bytes(raw))
    read_or_error(path, check_writer=True)
    read_or_error(path, check_writer=False)


@FUZZ
@given(field=st.sampled_from(sorted(k for k in vars(L) if k.startswith("OFF_"))),
       value=st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 4096)))
def test_random_header_field_values_raise_only_segment_error(segment_dir, field, value):
    """A whole header field set to an arbitrary (often extreme) number."""
    raw = bytearray(valid_bytes())
    offset = getattr(L, field)
    width = 8 if offset % 8 == 0 else 4 if offset % 4 == 0 else 2
    raw[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    path = os.path.join(segment_dir, f"{os.getpid()}.73.seg")
    write_file(path, bytes(raw))
    read_or_error(path, check_writer=False)


def test_fuzz_inputs_do_leave_a_valid_file_readable(segment_dir):
    """The fuzz base is a real, readable segment (so the mutations start from something valid)."""
    path = os.path.join(segment_dir, f"{os.getpid()}.74.seg")
    write_file(path, valid_bytes())
    snap = segment.read_segment(path, check_writer=False)
    assert snap.get("hisparse_runtime_info", version="1", model="m", device="cpu") == 1.0


def test_an_open_reader_notices_the_file_going_bad(live, segment_dir):
    """Validation is cached per layout, but a change to any structural field is seen."""
    path = copy_of(live, segment_dir)
    reader = segment.SegmentReader(path)
    assert reader.read().get("hisparse_tokens_total", phase="decode") == 7.0
    patch(path, L.OFF_ENTRY_COUNT, _u32(9))  # above the capacity of 4
    with pytest.raises(SegmentError) as err:
        reader.read()
    assert err.value.kind == "bad_layout"
    patch(path, L.OFF_ENTRY_COUNT, _u32(3))
    assert reader.read().get("hisparse_kv_blocks", state="active") == 3.0
    patch(path, 0, b"garbage!")
    with pytest.raises(SegmentError) as err:
        reader.read()
    assert err.value.kind == "bad_magic"
    patch(path, 0, L.SEGMENT_MAGIC)
    assert len(reader.read().series) == 3
    os.truncate(path, L.HEADER_SIZE + 10)
    with pytest.raises(SegmentError) as err:
        reader.read()
    assert err.value.kind == "truncated"
    reader.close()


def test_snapshot_labels_are_the_callers_own(live):
    """Each snapshot gets fresh label dicts: changing one never leaks into the next read."""
    reader = segment.SegmentReader(live.path)
    first = reader.read()
    first.labels["model"] = "changed"
    first.series[0].labels["phase"] = "changed"
    second = reader.read()
    assert second.labels == {"model": "tiny"} and second.series[0].labels == {"phase": "decode"}
    reader.close()
