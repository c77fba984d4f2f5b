"""Bad segments next to good ones: what one target's segment can and cannot do to the others.

Bad segments are byte copies of a real target's live segment, patched (the header still names
the live writer, so the reader takes them for live). The agent is the CLI in a subprocess; where
the question is whether Prometheus can still ingest the agent's /metrics, a real Prometheus
scrapes it.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(__file__))
from helpers_agent import AGENT, agent_proc, finish, read_log, scrape, target_proc, value, wait_for  # noqa: E402
from helpers_prometheus import Prom, poll, start_prometheus  # noqa: E402
from helpers_targets import free_port  # noqa: E402

from easymats import layout as L, segment, telemetry  # noqa: E402

pytestmark = pytest.mark.fault


def entries(raw: bytes) -> list[tuple]:
    h = L.HEADER_STRUCT.unpack_from(raw)
    return [L.ENTRY_STRUCT.unpack_from(raw, h[15] + i * h[5]) for i in range(h[13])]


def patched_copy(src: str, n: int, name: str, patch) -> str:
    """A copy of segment ``src`` named ``<pid>.<n>.seg`` declaring ``name``, bytes changed by
    ``patch(bytearray)``. ``src`` is live (its target keeps publishing): the copy is taken between
    publishes (an even sequence, the same before and after), or it stays busy forever."""
    for _ in range(1000):
        with open(src, "rb") as f:
            raw = bytearray(f.read())
            seq = L.U64.unpack_from(raw, L.OFF_SEQ)[0]
            f.seek(L.OFF_SEQ)
            if seq % 2 == 0 and L.U64.unpack(f.read(8))[0] == seq:
                break
        time.sleep(0.001)
    else:
        raise AssertionError(f"{src}: no copy between two publishes in 1,000 tries")
    raw[L.OFF_NAME:L.OFF_NAME + L.NAME_FIELD] = name.encode().ljust(L.NAME_FIELD, b"\0")
    patch(raw)
    pid = segment.pid_of_path(src)
    path = os.path.join(os.path.dirname(src), f"{pid}.{n}.seg")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(raw))
    finally:
        os.close(fd)
    return path


def entry_index(raw: bytes, name: str, **labels: str) -> int:
    for i, e in enumerate(entries(raw)):
        if L.decode_text(e[5]) == name and L.decode_labels(e[6]) == labels:
            return i
    raise KeyError(name)


def set_entry_labels(raw: bytearray, i: int, encoded: bytes) -> None:
    off = L.HEADER_SIZE + i * L.ENTRY_SIZE + 80
    raw[off:off + L.ENTRY_LABELS_FIELD] = encoded.ljust(L.ENTRY_LABELS_FIELD, b"\0")


def histogram_slot(raw: bytes, name: str) -> tuple[int, int]:
    """(file offset of the first bound, bucket count) of histogram ``name``."""
    e = entries(raw)[entry_index(raw, name)]
    return e[4], e[2]


def bad_label_key(raw: bytearray) -> None:
    i = entry_index(raw, "hisparse_kv_blocks", state="active")
    set_entry_labels(raw, i, b"__name__\x1fx\x1estate\x1factive")


def target_label_key(raw: bytearray) -> None:
    i = entry_index(raw, "hisparse_sequences")
    set_entry_labels(raw, i, b"target\x1fother")


def duplicate_series(raw: bytearray) -> None:
    a = entry_index(raw, "hisparse_kv_blocks", state="active")
    b = entry_index(raw, "hisparse_kv_blocks", state="free")
    set_entry_labels(raw, b, L.encode_labels({"state": "active"}, L.ENTRY_LABELS_FIELD))
    assert a != b


def inf_bound(raw: bytearray) -> None:  # the last finite bound made +Inf: le="+Inf" twice
    off, b = histogram_slot(raw, "hisparse_step_duration_seconds")
    struct.pack_into("<d", raw, off + 8 * (b - 1), float("inf"))


def nan_bound(raw: bytearray) -> None:
    off, b = histogram_slot(raw, "hisparse_quant_block_relative_error")
    struct.pack_into("<d", raw, off + 8, float("nan"))


def unsorted_bounds(raw: bytearray) -> None:
    off, b = histogram_slot(raw, "hisparse_step_duration_seconds")
    first, second = struct.unpack_from("<dd", raw, off)
    struct.pack_into("<dd", raw, off, second, first)


def negative_count(raw: bytearray) -> None:
    off, b = histogram_slot(raw, "hisparse_step_duration_seconds")
    struct.pack_into("<d", raw, off + 8 * b, -3.0)


BAD = {"bad-label": (bad_label_key, "__name__"), "target-label": (target_label_key, "'target'"),
       "dup-series": (duplicate_series, "duplicate"), "inf-bound": (inf_bound, "bound"),
       "nan-bound": (nan_bound, "bound"), "unsorted": (unsorted_bounds, "ascending"),
       "negative": (negative_count, "negative")}


@pytest.mark.parametrize("case", list(BAD))
def test_the_reader_refuses_each_bad_series_with_a_clear_error(case, segment_dir):
    seg = telemetry.open_segment(name="victim")
    seg.gauge("hisparse_kv_blocks", state="active").set(3)
    seg.gauge("hisparse_kv_blocks", state="free").set(5)
    seg.gauge("hisparse_sequences").set(1)
    seg.histogram("hisparse_step_duration_seconds").observe(0.002)
    seg.histogram("hisparse_quant_block_relative_error").observe(0.01)
    seg.publish()
    try:
        patch, words = BAD[case]
        path = patched_copy(seg.path, 50, case, patch)
        with pytest.raises(segment.SegmentError) as err:
            segment.read_segment(path)
        assert err.value.kind == "bad_layout" and words in str(err.value), str(err.value)
        assert segment.read_segment(seg.path).name == "victim"  # the original is fine
    finally:
        seg.close()


@pytest.mark.parametrize("labels", [{"__name__": "x"}, {"__meta_x": "y"}, {"target": "t"}])
def test_the_writer_refuses_reserved_label_names(labels, segment_dir):
    with pytest.raises(ValueError, match="reserved"):
        telemetry.open_segment(name="w", labels=labels)
    with pytest.raises(ValueError, match="reserved"):
        L.encode_labels(labels, L.ENTRY_LABELS_FIELD)


def exposition_problems(text: str) -> list[str]:
    """What makes a Prometheus text exposition unusable: unparseable, a reserved label, a series
    twice, histogram buckets not strictly increasing in le or decreasing in count."""
    problems: list[str] = []
    seen: set = set()
    try:
        fams = list(text_string_to_metric_families(text))
    except ValueError as exc:
        return [f"unparseable: {exc}"]
    for fam in fams:
        buckets: dict[tuple, list[tuple[float, float]]] = {}
        for s in fam.samples:
            if any(k.startswith("__") for k in s.labels):
                problems.append(f"reserved label in {s.name}{s.labels}")
            key = (s.name, tuple(sorted(s.labels.items())))
            if key in seen:
                problems.append(f"duplicate series {key}")
            seen.add(key)
            if s.name.endswith("_bucket"):
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                buckets.setdefault(rest, []).append((float(s.labels["le"]), s.value))
        for rest, points in buckets.items():
            les = [le for le, _ in points]
            counts = [c for _, c in points]
            if les != sorted(les) or len(set(les)) != len(les) or any(le != le for le in les):
                problems.append(f"{fam.name}{rest}: le not strictly ascending: {les}")
            if counts != sorted(counts):
                problems.append(f"{fam.name}{rest}: bucket counts decrease: {counts}")
    return problems


def scraping_prometheus(tmp_path, agent_port: int) -> tuple[subprocess.Popen, Prom]:
    """A real Prometheus scraping the agent every second (its log in tmp_path/prometheus.log)."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "easymats", "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]}],
    }))
    return start_prometheus(str(config), tmp_path, port), Prom(port)


def test_bad_segments_spoil_neither_metrics_nor_other_targets(tmp_path, procs):
    good, path = target_proc(procs, "decode-0")
    for n, case in enumerate(BAD, start=10):
        patched_copy(path, n, case, BAD[case][0])
    port = free_port()
    log = str(tmp_path / "run.log")
    agent = agent_proc(procs, "--pid", str(good.pid), "--listen", f"127.0.0.1:{port}", "--output", log, "--quiet")
    prom, api = scraping_prometheus(tmp_path, port)
    procs.append(prom)
    # Every target listed, and the good one sampled up (on a loaded machine its first sample can
    # come a tick after the bad segments are listed down).
    m = wait_for(lambda: (lambda s: s if len(s.get("easymats_target_up", [])) == 1 + len(BAD)
                          and value(s, "easymats_target_up", target="decode-0") == 1.0 else None)(scrape(port)),
                 timeout=15)
    for case in BAD:
        assert value(m, "easymats_target_up", target=case) == 0.0, case
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert exposition_problems(resp.read().decode()) == []
    # A real Prometheus ingests the scrape: the agent is up and the good target's series are stored.
    poll("the agent up in Prometheus", lambda: api.query('up{job="easymats"} == 1'), 30, 0.5,
         procs={"prometheus": prom})
    poll("the good target's series stored", lambda: api.query('hisparse_kv_blocks{target="decode-0",state="active"}'),
         15, 0.5, procs={"prometheus": prom})
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    assert code == 0, err
    errors = {x["target"]: x.get("error", "") for x in read_log(log) if x["kind"] == "sample" and not x["up"]}
    for case, (_, words) in BAD.items():
        assert words in errors.get(case, ""), (case, errors.get(case))
    assert "Traceback" not in err


def test_a_huge_declared_values_area_costs_what_is_used(tmp_path, procs, segment_dir):
    """A legal 63 MiB values area with a few series in use is read for those series only; one
    whose live series really span more than a target may cost is refused as over budget, and
    neither slows the others down."""
    script = (
        "import os, struct, sys, time\n"
        "from easymats import telemetry, layout as L\n"
        "big = telemetry.open_segment(name='big-area', value_slots=(63 << 20) // 8 - 4096)\n"
        "big.gauge('hisparse_sequences').set(1)\n"
        "big.publish()\n"
        "os.pwrite(big._fd, struct.pack('<Q', big._slots_capacity * 8), L.OFF_VALUES_USED)  # all "
        "of it 'in use'\n"
        "span = telemetry.open_segment(name='over-budget', value_slots=(8 << 20) // 8)\n"
        "span.gauge('hisparse_sequences').set(1)\n"
        "span.publish()\n"
        "used = span._slots_capacity * 8\n"
        "os.pwrite(span._fd, struct.pack('<Q', used), L.OFF_VALUES_USED)\n"
        "# entry 0 now lives at the very end of the 8 MiB area: its series span all of it\n"
        "os.pwrite(span._fd, struct.pack('<Q', span._values_off + used - 8), L.HEADER_SIZE + 8)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    big.publish(); span.publish(); time.sleep(0.01)\n")
    odd = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    procs.append(odd)
    assert odd.stdout.readline().strip() == "ready"
    good, _ = target_proc(procs, "decode-0")
    port = free_port()
    agent = agent_proc(procs, "--pid", f"{good.pid},{odd.pid}", "--listen", f"127.0.0.1:{port}", "--quiet")
    m = wait_for(lambda: (lambda s: s if (value(s, "easymats_samples_total", target="big-area") or 0) >= 20
                          else None)(scrape(port)), timeout=20)
    assert value(m, "easymats_target_up", target="big-area") == 1.0
    assert value(m, "easymats_target_up", target="over-budget") == 0.0
    assert value(m, "easymats_target_over_budget", target="over-budget") == 1.0
    assert value(m, "easymats_target_over_budget", target="big-area") == 0.0
    # Seconds the sampler spent per sample of the big-area target: its used series, not 63 MiB
    # (reading the whole area took ~0.5 s a sample).
    per_sample = (value(m, "easymats_target_sample_seconds_total", target="big-area")
                  / value(m, "easymats_samples_total", target="big-area"))
    assert per_sample < 0.02, per_sample
    assert value(m, "easymats_target_up", target="decode-0") == 1.0
    assert value(m, "easymats_process_resident_memory_bytes", target="decode-0") is not None
    rss = int(open(f"/proc/{agent.pid}/status").read().split("VmRSS:")[1].split()[0]) * 1024
    assert rss < 150 << 20, rss
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    assert code == 0, err
    assert "budget" in err  # said once, with the fix


def test_an_invalid_segment_is_named_not_called_missing(tmp_path, procs, segment_dir):
    """A watched process whose only segment is bad from the start: the log and stderr name the
    real cause once (here: wrong magic), never 'no telemetry segment'."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs.append(sleeper)
    path = os.path.join(segment_dir, f"{sleeper.pid}.seg")
    with open(path, "wb") as f:
        f.write(b"GARBAGE!" + bytes(600))
    os.chmod(path, 0o600)
    log = str(tmp_path / "run.log")
    agent = agent_proc(procs, "--pid", str(sleeper.pid), "--listen", "none", "--output", log, "--quiet",
                       "--duration", "4.5")
    code, _, err = finish(agent)
    assert code == 0, err
    named = [line for line in err.splitlines() if "not an easymats segment" in line]
    assert len(named) == 1 and path in named[0], err
    assert "no telemetry segment" not in err
    lines = read_log(log)
    samples = [x for x in lines if x["kind"] == "sample"]
    assert samples and all("not an easymats segment" in x["error"] for x in samples), samples[-1]
    warnings = [x for x in lines if x["kind"] == "event" and x["event"] == "warning"]
    assert len(warnings) == 1 and "not an easymats segment" in warnings[0]["detail"]


@pytest.mark.parametrize("case", ["dangling-symlink", "directory-missing", "directory-is-a-file"])
def test_the_real_reason_a_pid_has_no_readable_segment(tmp_path, procs, segment_dir, case):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs.append(sleeper)
    env = dict(os.environ)
    if case == "dangling-symlink":
        os.symlink("/nonexistent/segment", os.path.join(segment_dir, f"{sleeper.pid}.seg"))
        words = "symbolic link"
    elif case == "directory-missing":
        env["EASYMATS_SEGMENT_DIR"] = str(tmp_path / "nowhere")
        words = "does not exist"
    else:
        (tmp_path / "afile").write_text("x")
        env["EASYMATS_SEGMENT_DIR"] = str(tmp_path / "afile")
        words = "not a directory"
    agent = subprocess.Popen([*AGENT, "--pid", str(sleeper.pid), "--listen", "none", "--quiet", "--duration", "4.5"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    procs.append(agent)
    code, _, err = finish(agent)
    assert code == 0, err
    named = [line for line in err.splitlines() if words in line]
    assert len(named) == 1, err


def test_a_writer_pid_that_differs_from_the_file_name_is_followed(tmp_path, procs, segment_dir):
    """A segment named after one process but written by another (renamed, or created for a worker):
    the target is the live writer, not 'exited'."""
    writer, path = target_proc(procs, "decode-0")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    procs.append(sleeper)
    os.link(path, os.path.join(segment_dir, f"{sleeper.pid}.seg"))  # same file, another pid's name
    port = free_port()
    agent = agent_proc(procs, "--pid", str(sleeper.pid), "--listen", f"127.0.0.1:{port}", "--quiet")
    m = wait_for(lambda: (lambda s: s if (value(s, "easymats_samples_total", target="decode-0") or 0) >= 10
                          else None)(scrape(port)), timeout=15)
    assert value(m, "easymats_target_up", target="decode-0") == 1.0
    assert value(m, "easymats_target_info", target="decode-0", pid=str(writer.pid)) == 1.0
    time.sleep(0.5)
    assert value(scrape(port), "easymats_target_up", target="decode-0") == 1.0
    agent.send_signal(signal.SIGTERM)
    code, _, err = finish(agent)
    assert code == 0, err
    assert str(writer.pid) in err and str(sleeper.pid) in err  # said once, naming both


def test_escape_sequences_in_a_target_name_never_reach_the_terminal(segment_dir):
    """A segment name is the runtime's to choose: ESC, BEL and other controls in it are shown
    escaped by the live view (table and summary line), never sent to the terminal."""
    import io

    from easymats.liveview import LiveView
    from easymats.targets import Target

    evil = "x\x1b[2J\x1b]0;pwned\x07\x9b31m"
    seg = telemetry.open_segment(name=evil)
    seg.gauge("hisparse_kv_blocks", state="active").set(3)
    seg.publish()
    try:
        tg = Target(os.getpid(), seg.path, peak_window_s=15)
        tg.sample(time.time())
        for colour in (True, False):
            view = LiveView(colour=colour)
            out = io.StringIO()
            view.observe([tg], time.monotonic())
            view.draw(out, [tg], title="easymats")
            drawn = out.getvalue()
            assert drawn.startswith("\033[H\033[2J")  # the view's own cursor-home and clear
            rest = drawn[len("\033[H\033[2J"):]
            controls = {c for c in rest if (ord(c) < 32 and c != "\n") or 127 <= ord(c) < 160}
            if colour:  # its own colours: ESC [ ... m, nothing else
                import re
                controls = {c for c in re.sub(r"\x1b\[[0-9;]*m", "", rest)
                            if (ord(c) < 32 and c != "\n") or 127 <= ord(c) < 160}
            assert not controls, repr(drawn)
            line = view.summary_line([tg], "12:00:00")
            assert not {c for c in line if ord(c) < 32 or 127 <= ord(c) < 160}, repr(line)
            assert "\\x1b" in line  # shown, escaped
    finally:
        seg.close()
