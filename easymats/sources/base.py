"""What every engine source is: something that, asked within a deadline, returns an exposition."""

from __future__ import annotations

from typing import Protocol

from .translate import Family


class SourceError(Exception):
    """A read that gave nothing usable; the message says why and, where it can, what to do."""


class Source(Protocol):
    """An engine's metrics, read on demand (in a worker thread, never the sampler's)."""

    kind: str  # "scrape" | "pid" | "log"
    where: str  # what it reads (URL, directory, file), named in errors and in the log

    def fetch(self, deadline: float) -> list[Family]:
        """The engine's families now; SourceError when there is no usable answer by ``deadline``
        (``time.monotonic()``)."""
        ...

    def close(self) -> None:
        ...
