"""Process identity from /proc: start time (to catch PID reuse) and the boot id."""

from __future__ import annotations

import os
import uuid

PROC_ROOT = "/proc"


def read_small(path: str) -> bytes:
    """A small file (/proc/<pid>/stat) in one read: os.open/os.read skip the buffered file object
    ``open()`` builds, which is most of the cost of a /proc read made every second per target."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def stat_state(stat_path: str) -> tuple[bytes, int] | None:
    """(state, start ticks) from a ``/proc/<pid>/stat`` file; None if it is gone or unreadable."""
    try:
        data = read_small(stat_path)
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    # Then the state is the first field and the start time (field 22) the 20th.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int, proc_root: str = PROC_ROOT) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of stat), or None if it is gone."""
    found = stat_state(f"{proc_root}/{pid}/stat")
    return None if found is None else found[1]


def running(stat_path: str, start: int) -> bool:
    """The process of ``stat_path`` runs, started at ``start`` ticks (0: any start time). A zombie
    has exited (its parent just has not reaped it yet) and is not running."""
    found = stat_state(stat_path)
    if found is None or found[0] in (b"Z", b"X", b"x"):
        return False
    return not start or found[1] == start


def boot_id(proc_root: str = PROC_ROOT) -> bytes:
    """The 16 raw bytes of this boot's id, or zeros where /proc does not say."""
    try:
        with open(f"{proc_root}/sys/kernel/random/boot_id") as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return bytes(16)


def pid_exists(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
