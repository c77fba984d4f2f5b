"""Byte layout of the telemetry segment and the control file (version 1.0), and where they live.

docs/segment.md is the normative description, written so that a runtime in any language can
produce the files; this module is the Python rendering of the same tables. Everything is
little-endian; the ``byte_order`` field holds 0x01020304 so a reader can tell.

Segment file::

    +-----------------------------+ 0
    | header (HEADER_SIZE bytes)  |   magic, version, identity, seqlock, heartbeat, layout
    +-----------------------------+ entry_table_offset (= HEADER_SIZE)
    | entry 0 .. entry_capacity-1 |   ENTRY_SIZE bytes each: type, name, labels, value offset
    +-----------------------------+ values_offset
    | values (f64, 8-aligned)     |   counter/gauge/info: 1 x f64; histogram: bounds, counts, sum
    +-----------------------------+ file size
"""

from __future__ import annotations

import os
import re
import struct

SEGMENT_MAGIC = b"EZMATSEG"
CONTROL_MAGIC = b"EZMATCTL"
MAJOR = 1
MINOR = 0
BYTE_ORDER_MARK = 0x01020304

# ---- where the files live (docs/segment.md 1) -------------------------------------------------
ENV_DIR = "EASYMATS_SEGMENT_DIR"


def segment_dir() -> str:
    """The segment directory: $EASYMATS_SEGMENT_DIR, else /dev/shm/easymats-<uid>."""
    return os.environ.get(ENV_DIR) or f"/dev/shm/easymats-{os.geteuid()}"


def control_path(segment_path: str) -> str:
    """The control file paired with a segment: same stem, ``.ctl``."""
    return segment_path[:-4] + ".ctl" if segment_path.endswith(".seg") else segment_path + ".ctl"


# Limits a valid segment stays within (docs/segment.md 2.1): anything beyond is corruption, and
# the bounds keep a garbage header from making the reader allocate or read gigabytes.
MAX_ENTRIES = 65536
MAX_FILE_BYTES = 64 << 20
MAX_HEADER_BYTES = 65536
MAX_ENTRY_BYTES = 4096

# ---- segment header -------------------------------------------------------------------------
HEADER_SIZE = 512
#              magic major minor bom  hdr  ent  pid  start boot  seq  hb_unix hb_mono gen
HEADER_FMT = "<8sHHIIIq Q 16s Q Q Q Q I I Q Q Q Q 64s 256s Q"
HEADER_STRUCT = struct.Struct(HEADER_FMT.replace(" ", ""))
assert HEADER_STRUCT.size == 456, HEADER_STRUCT.size

OFF_MAGIC = 0
OFF_MAJOR = 8
OFF_MINOR = 10
OFF_BYTE_ORDER = 12
OFF_HEADER_SIZE = 16
OFF_ENTRY_SIZE = 20
OFF_WRITER_PID = 24
OFF_START_TICKS = 32
OFF_BOOT_ID = 40
OFF_SEQ = 56
OFF_HEARTBEAT_UNIX_NS = 64
OFF_HEARTBEAT_MONO_NS = 72
OFF_LAYOUT_GENERATION = 80
OFF_ENTRY_COUNT = 88
OFF_ENTRY_CAPACITY = 92
OFF_ENTRY_TABLE = 96
OFF_VALUES = 104
OFF_VALUES_USED = 112
OFF_VALUES_CAPACITY = 120
OFF_NAME = 128
NAME_FIELD = 64
OFF_LABELS = 192
LABELS_FIELD = 256
OFF_CREATED_UNIX_NS = 448
# 456..511 reserved, zero

U64 = struct.Struct("<Q")
U32 = struct.Struct("<I")

# ---- entries --------------------------------------------------------------------------------
ENTRY_SIZE = 256
ENTRY_STRUCT = struct.Struct("<BBHIQ64s160s16s")
assert ENTRY_STRUCT.size == ENTRY_SIZE
ENTRY_NAME_FIELD = 64
ENTRY_LABELS_FIELD = 160
ENTRY_UNIT_FIELD = 16

TYPE_COUNTER = 1
TYPE_GAUGE = 2
TYPE_HISTOGRAM = 3
TYPE_INFO = 4
TYPE_CODES = {"counter": TYPE_COUNTER, "gauge": TYPE_GAUGE, "histogram": TYPE_HISTOGRAM, "info": TYPE_INFO}
TYPE_NAMES = {v: k for k, v in TYPE_CODES.items()}
MAX_BUCKETS = 64


def value_slots(type_code: int, bucket_count: int) -> int:
    """Number of f64 slots an entry's value takes: histograms store bounds, counts(+Inf) and sum."""
    if type_code == TYPE_HISTOGRAM:
        return 2 * bucket_count + 2
    return 1


# ---- labels ---------------------------------------------------------------------------------
# Pairs are separated by 0x1E (record separator), key from value by 0x1F (unit separator).
PAIR_SEP = "\x1e"
KV_SEP = "\x1f"
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


# Label names no segment may use: Prometheus reserves the "__" prefix (``__name__`` in a series
# made the whole /metrics unparseable), and the agent adds "target" to every series itself.
RESERVED_LABEL = "target"


def label_name_problem(key: str) -> str | None:
    """Why ``key`` cannot be a label name in a segment, or None."""
    if not LABEL_NAME_RE.match(key):
        return f"label name {key!r} is not a valid Prometheus label name"
    if key.startswith("__") or key == RESERVED_LABEL:
        return (f"label name {key!r} is reserved (names starting with '__' belong to Prometheus; "
                f"{RESERVED_LABEL!r} is the one the agent adds to every series)")
    return None


def encode_labels(labels: dict[str, str], field: int) -> bytes:
    for key, value in labels.items():
        problem = label_name_problem(key)
        if problem:
            raise ValueError(problem)
        if any(c in str(value) for c in ("\x00", PAIR_SEP, KV_SEP)):
            raise ValueError(f"label {key}: value {value!r} contains a control character")
    raw = PAIR_SEP.join(f"{k}{KV_SEP}{v}" for k, v in sorted(labels.items())).encode("utf-8")
    if len(raw) > field:
        raise ValueError(f"labels {labels!r} take {len(raw)} bytes encoded; at most {field} fit")
    return raw


def decode_labels(raw: bytes) -> dict[str, str]:
    """Decode a NUL-padded label field; raises ValueError on anything malformed or reserved."""
    text = raw.rstrip(b"\x00").decode("utf-8")
    if not text:
        return {}
    out: dict[str, str] = {}
    for pair in text.split(PAIR_SEP):
        key, sep, value = pair.partition(KV_SEP)
        if not sep or not LABEL_NAME_RE.match(key) or key in out:
            raise ValueError(f"malformed label pair {pair!r}")
        problem = label_name_problem(key)
        if problem:
            raise ValueError(problem)
        out[key] = value
    return out


def decode_text(raw: bytes, errors: str = "strict") -> str:
    """A NUL-padded UTF-8 field as text; ``errors`` as for bytes.decode."""
    return raw.rstrip(b"\x00").decode("utf-8", errors)


# ---- control file ---------------------------------------------------------------------------
CONTROL_SIZE = 256
CONTROL_STRUCT = struct.Struct("<8sHHIQQQQ32s128s32sQ")
assert CONTROL_STRUCT.size == 248
CTL_OFF_REQUEST_SEQ = 16
CTL_OFF_ACK_SEQ = 24
CTL_OFF_REQUEST_UNIX_NS = 32
CTL_OFF_ACK_UNIX_NS = 40
CTL_OFF_ACTION = 48
CTL_ACTION_FIELD = 32
CTL_OFF_REASON = 80
CTL_REASON_FIELD = 128
CTL_OFF_REQUESTER = 208
CTL_REQUESTER_FIELD = 32
CTL_OFF_ACK_STATUS = 240
CTL_OFF_WRITE_SEQ = 248  # odd while an agent writes a request (a seqlock for the request fields)
