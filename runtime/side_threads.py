"""The interpreter's thread switches while the runtime's own threads run beside the decode steps.

A recalibration's worker, a capture ahead and the pool's page-locking run Python on threads of
their own while the steps go on. A step gives the GIL up while it waits for the device (a graph's
replay, a read-back) and then wants it back; CPython hands it back only when the thread holding it
reaches its switch interval, 5 ms by default. A 3.5-4 ms step on the H200 then waited up to a whole
step for each hand-back. While any such thread runs, :func:`beside_the_steps` sets the interval
to ``SWITCH_INTERVAL`` (unless the program set it lower), and puts the program's own back after
the last one ends (unless the program changed it meanwhile).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

SWITCH_INTERVAL: float | None = 2e-4     # seconds; None leaves the interpreter's interval alone

_lock = threading.Lock()
_running = 0
_saved: float | None = None              # the program's interval, to put back
_ours: float | None = None               # what the interpreter reported after we set it


@contextlib.contextmanager
def beside_the_steps() -> Iterator[None]:
    """Enter in a thread of the runtime's that runs beside the decode steps, for as long as it runs."""
    global _running, _saved, _ours
    with _lock:
        _running += 1
        if _running == 1:
            _saved, _ours = sys.getswitchinterval(), None
            if SWITCH_INTERVAL is not None and SWITCH_INTERVAL < _saved:
                sys.setswitchinterval(SWITCH_INTERVAL)
                _ours = sys.getswitchinterval()
    try:
        yield
    finally:
        with _lock:
            _running -= 1
            if _running == 0:
                if _ours is not None and _saved is not None and sys.getswitchinterval() == _ours:
                    sys.setswitchinterval(_saved)
                _saved = _ours = None
