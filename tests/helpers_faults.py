"""Real faults for the fault-injection tests (marker ``fault``): a full file system, a file size
limit, a wall clock that jumps. Each produces the error the kernel gives in production; nothing
here fakes an errno.

- :func:`small_filesystem`: a tmpfs of a few KiB mounted on a temporary directory (needs root, as
  CI has; ENOSPC when full);
- :func:`file_size_limit`: RLIMIT_FSIZE for a child process (EFBIG past the limit; Python ignores
  SIGXFSZ, so the write fails instead of killing the process): works for any user;
- :func:`jumping_clock_env`: libfaketime in a child process, with its offset read from a file
  the test rewrites, so CLOCK_REALTIME jumps while CLOCK_MONOTONIC does not.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
import tempfile
from typing import Callable, Iterator

import pytest

FAKETIME_LIBS = ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
                 "/usr/lib/faketime/libfaketimeMT.so.1")


@contextlib.contextmanager
def small_filesystem(size_kib: int, mode: int = 0o755,
                     instead: str = "the RLIMIT_FSIZE test covers a failing write") -> Iterator[str]:
    """A fresh tmpfs of ``size_kib`` KiB; skipped where mounting is not allowed, saying why and
    which test covers the same code path (``instead``)."""
    where = tempfile.mkdtemp(prefix="easymats-smallfs-")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode={mode:04o}", "tmpfs", where],
                         capture_output=True, text=True)
    if out.returncode != 0:
        os.rmdir(where)
        who = "mounting a tmpfs needs root (CI runs as root)" if os.geteuid() else out.stderr.strip()
        pytest.skip(f"cannot mount a small tmpfs here ({who}); {instead}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True)
        shutil.rmtree(where, ignore_errors=True)


def fill(directory: str, leave_bytes: int = 0) -> str:
    """Fill the file system of ``directory`` up to ``leave_bytes`` free; returns the filler path."""
    path = os.path.join(directory, "filler")
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f:
        try:
            f.write(b"\0" * max(0, free - leave_bytes))
            f.flush()
        except OSError:  # ENOSPC: full is what we wanted
            pass
    return path


def file_size_limit(limit_bytes: int) -> Callable[[], None]:
    """A ``preexec_fn`` that caps every file the child writes at ``limit_bytes`` (EFBIG past it)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def faketime_library() -> str:
    for path in FAKETIME_LIBS:
        if os.path.exists(path):
            return path
    pytest.skip("libfaketime is not installed: apt-get install faketime (make system-deps does)")
    raise AssertionError  # unreachable: skip raises


# libfaketime 0.9.10 (Debian 12) breaks Python 3.11's time.sleep when the monotonic clock is left
# alone: sleep is clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME), which libfaketime hands to the
# kernel as a negative time, EINVAL (wolfcw/libfaketime#426). This startup hook, loaded only by
# the child under faketime, sleeps on an Event instead (a CLOCK_MONOTONIC wait libfaketime passes
# through untouched). It works around the tool; the clocks the agent reads are the faked ones.
_SLEEP_FIX = """\
import threading
import time


def _sleep(seconds):
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    threading.Event().wait(seconds)


time.sleep = _sleep
"""


def jumping_clock_env(offset_file: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child whose wall clock is shifted by the offset written in ``offset_file``
    (e.g. "+0", then "-3600" to jump back an hour); the monotonic clock is left alone."""
    with open(offset_file, "w") as f:
        f.write("+0\n")
    hook_dir = os.path.join(os.path.dirname(offset_file), "faketime-site")
    os.makedirs(hook_dir, exist_ok=True)
    with open(os.path.join(hook_dir, "sitecustomize.py"), "w") as f:
        f.write(_SLEEP_FIX)
    env = dict(base if base is not None else os.environ)
    env.update(LD_PRELOAD=faketime_library(), FAKETIME_TIMESTAMP_FILE=offset_file,
               FAKETIME_NO_CACHE="1", DONT_FAKE_MONOTONIC="1",
               PYTHONPATH=os.pathsep.join(p for p in (hook_dir, env.get("PYTHONPATH")) if p))
    return env
