"""Process identity from /proc: start time (to catch PID reuse) and the boot id."""

from __future__ import annotations

import os
import uuid

PROC_ROOT = "/proc"


def start_ticks(pid: int, proc_root: str = PROC_ROOT) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of stat), or None if it is gone."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


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
