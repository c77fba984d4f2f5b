"""The control file beside a segment (docs/segment.md 6): requests in, acknowledgements out.

Two sides, one small module, so that neither pulls in the other's machinery:

- the **requester** (the agent's webhook, ``easymats recalibrate``, the demo) opens a runtime's
  control file with :meth:`ControlFile.open_existing` and calls :meth:`ControlFile.request`;
- the **runtime** creates the file with its segment (:meth:`ControlFile.create`, which
  :mod:`easymats.telemetry` does), polls it with :meth:`ControlFile.pending` and answers with
  :meth:`ControlFile.ack` (``seg.poll_control()`` / ``seg.ack(req)`` in the writer's API).
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import time
from dataclasses import dataclass

from . import layout as L

__all__ = ["ControlFile", "ControlRequest", "RECALIBRATE"]

RECALIBRATE = "recalibrate"  # the action a runtime recalibrates its anchors and probe on


@dataclass(frozen=True, slots=True)
class ControlRequest:
    """A pending request as the runtime sees it (only the latest: requests coalesce)."""

    id: int
    action: str
    reason: str
    requester: str
    requested_unix_ns: int


class ControlFile:
    """The control file beside a segment: the agent writes requests, the runtime acknowledges.

    Requests coalesce: the runtime sees the latest request id and acknowledging it covers every
    earlier one. Writers (agents) serialise on ``flock`` and bracket each request with a write
    sequence word (odd while writing), so the runtime, which never locks, never takes the id of
    one request with the reason of another.
    """

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd

    @classmethod
    def create(cls, path: str) -> "ControlFile":
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
        os.fchmod(fd, 0o600)
        record = L.CONTROL_STRUCT.pack(L.CONTROL_MAGIC, L.MAJOR, L.MINOR, L.BYTE_ORDER_MARK, 0, 0, 0, 0,
                                       b"", b"", b"", 0)
        os.pwrite(fd, record.ljust(L.CONTROL_SIZE, b"\x00"), 0)
        return cls(path, fd)

    @classmethod
    def open_existing(cls, path: str) -> "ControlFile":
        """Open a runtime's control file for writing requests (the agent's side).

        Raises OSError if it cannot be opened (FileNotFoundError: the runtime is gone) and
        ValueError if it is not a control file of ours (wrong magic, size, owner or mode).
        """
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        st = os.fstat(fd)
        ok = (stat.S_ISREG(st.st_mode) and st.st_size >= L.CONTROL_SIZE and st.st_uid == os.geteuid()
              and os.pread(fd, 8, 0) == L.CONTROL_MAGIC and not stat.S_IMODE(st.st_mode) & 0o077)
        if not ok:
            os.close(fd)
            raise ValueError(f"{path} is not an easymats control file of yours (owner uid {st.st_uid}, "
                             f"mode {stat.S_IMODE(st.st_mode):04o}, {st.st_size} bytes; expected your "
                             f"uid, 0600, >= {L.CONTROL_SIZE} bytes, magic {L.CONTROL_MAGIC!r})")
        return cls(path, fd)

    def _read(self) -> tuple:
        raw = os.pread(self._fd, L.CONTROL_STRUCT.size, 0)
        if len(raw) < L.CONTROL_STRUCT.size or raw[:8] != L.CONTROL_MAGIC:
            raise ValueError(f"control file {self.path} is truncated or corrupt")
        return L.CONTROL_STRUCT.unpack(raw)

    def _write_seq(self) -> int:
        raw = os.pread(self._fd, 8, L.CTL_OFF_WRITE_SEQ)
        if len(raw) != 8:
            raise ValueError(f"control file {self.path} is truncated")
        return L.U64.unpack(raw)[0]

    def pending(self, max_retries: int = 8) -> ControlRequest | None:
        """The latest unacknowledged request, or None (also when the file is unreadable or an
        agent kept writing through every retry: the next poll sees it)."""
        for _ in range(max_retries):
            try:
                w1 = self._write_seq()
                if w1 & 1:
                    os.sched_yield()
                    continue
                (_, _, _, _, req_seq, ack_seq, req_ns, _, action, reason, requester, _) = self._read()
                if self._write_seq() != w1:
                    continue
            except (ValueError, OSError):
                return None
            if req_seq <= ack_seq:
                return None
            return ControlRequest(req_seq, L.decode_text(action, errors="replace"),
                                  L.decode_text(reason, errors="replace"),
                                  L.decode_text(requester, errors="replace"), req_ns)
        return None

    def ack(self, request: ControlRequest, status: int = 0) -> None:
        os.pwrite(self._fd, struct.pack("<Q", time.time_ns()), L.CTL_OFF_ACK_UNIX_NS)
        os.pwrite(self._fd, struct.pack("<Q", status), L.CTL_OFF_ACK_STATUS)
        os.pwrite(self._fd, struct.pack("<Q", request.id), L.CTL_OFF_ACK_SEQ)

    def request(self, action: str, reason: str = "", requester: str = "") -> int:
        """Write a request (agent side); returns its id. The id is written last."""
        with _Flock(self._fd):
            fields = self._read()
            req_id = max(fields[4], fields[5]) + 1
            wseq = self._write_seq() | 1  # odd: a request is being written (an odd leftover
            os.pwrite(self._fd, L.U64.pack(wseq), L.CTL_OFF_WRITE_SEQ)  # of a crash stays odd)
            os.pwrite(self._fd, struct.pack("<Q", time.time_ns()), L.CTL_OFF_REQUEST_UNIX_NS)
            os.pwrite(self._fd, _field(action, L.CTL_ACTION_FIELD), L.CTL_OFF_ACTION)
            os.pwrite(self._fd, _field(reason, L.CTL_REASON_FIELD), L.CTL_OFF_REASON)
            os.pwrite(self._fd, _field(requester, L.CTL_REQUESTER_FIELD), L.CTL_OFF_REQUESTER)
            os.pwrite(self._fd, struct.pack("<Q", req_id), L.CTL_OFF_REQUEST_SEQ)
            os.pwrite(self._fd, L.U64.pack(wseq + 1), L.CTL_OFF_WRITE_SEQ)
        return req_id

    def acked(self) -> tuple[int, int, int]:
        """(ack id, ack unix ns, ack status) as last written by the runtime."""
        f = self._read()
        return f[5], f[7], f[11]

    def close(self, unlink: bool = False) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _field(text: str, size: int) -> bytes:
    raw = text.encode("utf-8")[:size]
    while raw:  # never cut a multi-byte character in half
        try:
            raw.decode("utf-8")
            break
        except UnicodeDecodeError:
            raw = raw[:-1]
    return raw.ljust(size, b"\x00")


class _Flock:
    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
