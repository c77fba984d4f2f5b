"""An engine's Prometheus endpoint (``easymats --scrape http://HOST:PORT/metrics``) as a source.

Each fetch is one GET on a kept-alive connection under the worker's deadline. A vLLM server's
exposition is some 500-1,000 lines per engine, almost all of them request-latency histograms the
tables do not read; parsing all of it at 10 Hz would cost more than everything else the agent
does. So a fetch checks every line's shape (garbage fails the read), keeps the lines of the series
the tables read, detect revisions by or log (:func:`easymats.sources.maps.wanted_samples`, a few
dozen lines) and parses those with prometheus_client's text parser, the library vLLM and SGLang
export with. The other families, which only pass through to the agent's /metrics, are parsed from
the latest answer when /metrics is scraped (:meth:`ScrapeSource.rest`, once per answer). An answer
identical to the previous one is not parsed again.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Iterable

from .base import SourceError
from .httpget import KeepAliveGet, parse_url
from .maps import wanted_samples
from .translate import Family, Sample

# prometheus_client parses the text format 0.0.4 into these type names; 0.0.4 has no "unknown".
_TYPES = {"unknown": "untyped"}
_NAME = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*")
_FAMILY_SUFFIXES = (b"", b"_total", b"_bucket", b"_count", b"_sum")


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
        return families_from_parser(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, and worse on some garbage
        first = text.lstrip()[:40]
        raise SourceError(f"the answer is not a Prometheus text exposition ({type(exc).__name__}: "
                          f"{str(exc)[:120]}; it starts with {first!r})") from None


def split_exposition(body: bytes, wanted: frozenset[bytes]) -> tuple[bytes, bytes, int]:
    """(lines of wanted series with their HELP/TYPE, the other lines, sample lines in all).

    Every sample line must start with a metric name followed by ``{`` or a blank: anything else
    (HTML, binary, a truncated answer) fails here, as the full parse would.
    """
    keep: list[bytes] = []
    rest: list[bytes] = []
    samples = 0
    for line in body.split(b"\n"):
        line = line.rstrip(b"\r")
        if not line:
            continue
        if line[:1] == b"#":
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in (b"HELP", b"TYPE"):
                name = parts[2]
                (keep if any(name + s in wanted for s in _FAMILY_SUFFIXES) else rest).append(line)
            continue
        m = _NAME.match(line)
        if m is None or m.end() >= len(line) or line[m.end()] not in b"{ \t":
            raise SourceError(f"the answer is not a Prometheus text exposition (line {line[:40]!r})")
        samples += 1
        (keep if m.group() in wanted else rest).append(line)
    return b"\n".join(keep) + b"\n", b"\n".join(rest) + b"\n", samples


class ScrapeSource:
    kind = "scrape"

    def __init__(self, url: str, wanted: frozenset[str] | None = None):
        self.where = url
        self.http = KeepAliveGet(parse_url(url))
        self.wanted = frozenset(n.encode() for n in (wanted if wanted is not None else wanted_samples()))
        self._last: tuple[bytes, list[Family]] | None = None
        self._rest_text: tuple[bytes, bytes] | None = None  # (answer, its unwanted lines)
        self._rest: tuple[bytes, list[Family]] | None = None
        self._rest_lock = threading.Lock()

    @property
    def connections(self) -> int:
        return self.http.connections

    def fetch(self, deadline: float) -> list[Family]:
        status, ctype, body = self.http.get(deadline)
        if status != 200:
            raise SourceError(f"HTTP {status} from the endpoint (expected 200 with the metrics)")
        last = self._last
        if last is not None and last[0] == body:
            return last[1]
        if "openmetrics" in ctype:
            raise SourceError(f"the endpoint answered {ctype!r}, not the text format 0.0.4 easymats asks for")
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise SourceError("the answer is not UTF-8 text: not a Prometheus exposition") from None
        wanted, rest, samples = split_exposition(body, self.wanted)
        if not samples:
            raise SourceError("the answer holds no samples: is this the engine's metrics path "
                              "(vLLM and SGLang serve /metrics; SGLang needs --enable-metrics)?")
        fams = parse_exposition(wanted.decode("utf-8"), ctype)
        self._last = (body, fams)
        self._rest_text = (body, rest)  # decoded only if /metrics asks for it
        return fams

    def rest(self) -> list[Family]:
        """The families no table reads, parsed from the latest answer (once per answer); [] if
        they do not parse (the wanted part did, so the sample stands)."""
        got = self._rest_text
        if got is None:
            return []
        with self._rest_lock:
            cached = self._rest
            if cached is not None and cached[0] is got[0]:
                return cached[1]
            try:
                fams = parse_exposition(got[1].decode("utf-8"))  # the whole answer decoded in fetch
            except SourceError:
                fams = []
            self._rest = (got[0], fams)
            return fams

    def close(self) -> None:
        self.http.close()
