"""An engine's Prometheus endpoint (``easymats --scrape http://HOST:PORT/metrics``) as a source.

Each fetch is one GET on a kept-alive connection under the worker's deadline, parsed with
prometheus_client's text parser (the library vLLM and SGLang export with). An answer identical to
the previous one is not parsed again: engines refresh most series less often than 10 Hz.
"""

from __future__ import annotations

from typing import Any, Iterable

from .base import SourceError
from .httpget import FetchError, KeepAliveGet, parse_url
from .translate import Family, Sample

# prometheus_client parses the text format 0.0.4 into these type names; 0.0.4 has no "unknown".
_TYPES = {"unknown": "untyped"}


def families_from_parser(parsed: Iterable[Any]) -> list[Family]:
    """prometheus_client Metric objects -> Families (timestamps and exemplars dropped)."""
    out = []
    for m in parsed:
        samples = [Sample(s.name, dict(s.labels), float(s.value)) for s in m.samples]
        if samples:
            out.append(Family(m.name, _TYPES.get(m.type, m.type), m.documentation, samples))
    return out


def parse_exposition(text: str, content_type: str = "") -> list[Family]:
    """The families of a text exposition; SourceError naming what is wrong with it."""
    if "openmetrics" in content_type:
        from prometheus_client.openmetrics.parser import text_string_to_metric_families
    else:
        from prometheus_client.parser import text_string_to_metric_families
    try:
        fams = families_from_parser(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, and worse on some garbage
        first = text.lstrip()[:40]
        raise SourceError(f"the answer is not a Prometheus text exposition ({type(exc).__name__}: "
                          f"{str(exc)[:120]}; it starts with {first!r})") from None
    if not fams:
        raise SourceError("the answer holds no samples: is this the engine's metrics path "
                          "(vLLM and SGLang serve /metrics; SGLang needs --enable-metrics)?")
    return fams


class ScrapeSource:
    kind = "scrape"

    def __init__(self, url: str):
        self.where = url
        self.http = KeepAliveGet(parse_url(url))
        self._last: tuple[bytes, list[Family]] | None = None

    @property
    def connections(self) -> int:
        return self.http.connections

    def fetch(self, deadline: float) -> list[Family]:
        try:
            status, ctype, body = self.http.get(deadline)
        except FetchError:
            raise
        if status != 200:
            raise SourceError(f"HTTP {status} from the endpoint (expected 200 with the metrics)")
        last = self._last
        if last is not None and last[0] == body:
            return last[1]
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError("the answer is not UTF-8 text: not a Prometheus exposition") from None
        fams = parse_exposition(text, ctype)
        self._last = (body, fams)
        return fams

    def close(self) -> None:
        self.http.close()
