"""GET one URL again and again over one kept-alive HTTP/1.1 connection, each GET under a deadline.

A small client on a plain socket rather than ``http.client``: a scrape at 10 Hz must end by a
deadline below the interval however the server misbehaves (accepts and never answers, trickles
bytes, sends an endless body, closes mid-answer), and ``http.client`` bounds only each socket
operation, not the whole answer. It also keeps the agent free of ``http.client`` and ``email``.

Only ``http://`` is supported: the agent runs beside the engine (a sidecar on localhost or the
pod network), where TLS adds nothing but cost.
"""

from __future__ import annotations

import socket
import time
import urllib.parse
from dataclasses import dataclass

from .. import __version__
from .base import SourceError

MAX_BODY_BYTES = 64 << 20  # an exposition larger than this is not a metrics endpoint
MAX_HEADER_BYTES = 64 << 10
ACCEPT = "text/plain;version=0.0.4;q=1.0,*/*;q=0.1"  # the text format; never OpenMetrics or gzip
# A server that writes its header and body in two sends with Nagle on waits for our ACK of the
# first before sending the second, and Linux delays that ACK by 40 ms: every GET took 45 ms
# instead of 2 (measured against an http.server in docs/BENCHMARKS.md). Quick ACKs avoid it.
_QUICKACK = getattr(socket, "TCP_QUICKACK", None)


class FetchError(SourceError):
    """One GET that did not give a usable answer; the message says why, for a user."""


@dataclass(frozen=True)
class Url:
    host: str
    port: int
    path: str  # path and query, as sent in the request line

    @property
    def netloc(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_url(text: str) -> Url:
    """``http://HOST:PORT/path`` -> Url; ValueError naming the fix for anything else."""
    u = urllib.parse.urlsplit(text.strip())
    if u.scheme != "http":
        raise ValueError(f"{text!r}: only http:// URLs are supported (e.g. http://127.0.0.1:8000/metrics; "
                         "run easymats next to the engine instead of scraping it over TLS)")
    try:
        port = u.port or 80
    except ValueError:
        raise ValueError(f"{text!r}: the port is not a number") from None
    if not u.hostname:
        raise ValueError(f"{text!r}: no host (e.g. http://127.0.0.1:8000/metrics)")
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return Url(u.hostname, port, path)


class KeepAliveGet:
    """GETs of one URL on one persistent connection (reopened when the server closes it)."""

    def __init__(self, url: Url):
        self.url = url
        self.connections = 0  # how many connections were opened: 1 while keep-alive holds
        self._sock: socket.socket | None = None
        self._request = (f"GET {url.path} HTTP/1.1\r\nHost: {url.netloc}\r\nAccept: {ACCEPT}\r\n"
                         f"Accept-Encoding: identity\r\nUser-Agent: easymats/{__version__}\r\n"
                         "Connection: keep-alive\r\n\r\n").encode("latin-1")
        self._buf = b""

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
        self._buf = b""

    def get(self, deadline: float) -> tuple[int, str, bytes]:
        """(status, content type, body) of one GET that ends by ``deadline`` (time.monotonic()).

        FetchError on a timeout, a refused or reset connection, or an answer that is not HTTP.
        A connection reused from an earlier GET that the server closed meanwhile is retried once
        on a new connection, as every HTTP client does for idempotent requests.
        """
        reused = self._sock is not None
        try:
            return self._get(deadline)
        except _Stale:
            self.close()
            if not reused:
                raise FetchError("the server closed the connection without an answer") from None
            try:
                return self._get(deadline)
            except _Stale:
                self.close()
                raise FetchError("the server closed the connection without an answer") from None
        except BaseException:
            self.close()  # a half-read answer leaves the connection unusable
            raise

    # -- one exchange --------------------------------------------------------------------------
    def _remaining(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout()
        return left

    def _get(self, deadline: float) -> tuple[int, str, bytes]:
        try:
            if self._sock is None:
                self._connect(deadline)
            sock = self._sock
            assert sock is not None
            sock.settimeout(self._remaining(deadline))
            sock.sendall(self._request)
            status_line, headers = self._head(deadline)
            status, keep = _status(status_line, headers)
            body = self._body(headers, deadline, keep)
        except _Timeout:
            raise FetchError("no complete answer before the deadline (timed out)") from None
        except socket.timeout:
            raise FetchError("no complete answer before the deadline (timed out)") from None
        except ConnectionRefusedError:
            raise FetchError("connection refused: is the engine running and serving metrics on "
                             f"{self.url.netloc}?") from None
        except (BrokenPipeError, ConnectionResetError):
            raise _Stale() from None
        except OSError as exc:
            raise FetchError(f"network error: {exc.strerror or exc}") from None
        if not keep:
            self.close()
        return status, headers.get("content-type", ""), body

    def _connect(self, deadline: float) -> None:
        self._buf = b""
        sock = socket.create_connection((self.url.host, self.url.port), timeout=self._remaining(deadline))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self.connections += 1

    def _recv(self, deadline: float) -> bytes:
        sock = self._sock
        assert sock is not None
        sock.settimeout(self._remaining(deadline))
        if _QUICKACK is not None:  # the kernel leaves quick-ACK mode on its own: set it each time
            sock.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
        return sock.recv(1 << 16)

    def _head(self, deadline: float) -> tuple[str, dict[str, str]]:
        buf = self._buf
        while b"\r\n\r\n" not in buf:
            if len(buf) > MAX_HEADER_BYTES:
                raise FetchError(f"the answer's header is longer than {MAX_HEADER_BYTES} bytes: not a "
                                 "metrics endpoint")
            data = self._recv(deadline)
            if not data:
                if not buf:
                    raise _Stale()
                raise FetchError("the server closed the connection in the middle of the header")
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        self._buf = rest
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        return lines[0], headers

    def _take(self, n: int, deadline: float) -> bytes:
        while len(self._buf) < n:
            data = self._recv(deadline)
            if not data:
                raise FetchError("the server closed the connection in the middle of the answer")
            self._buf += data
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _line(self, deadline: float) -> bytes:
        while b"\r\n" not in self._buf:
            if len(self._buf) > MAX_HEADER_BYTES:
                raise FetchError("a chunk size line is too long: not HTTP")
            data = self._recv(deadline)
            if not data:
                raise FetchError("the server closed the connection in the middle of the answer")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\r\n")
        return line

    def _body(self, headers: dict[str, str], deadline: float, keep: bool) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            parts: list[bytes] = []
            size = 0
            while True:
                word = self._line(deadline).split(b";", 1)[0].strip()
                try:
                    n = int(word, 16)
                except ValueError:
                    raise FetchError(f"bad chunk size {word[:20]!r}: not HTTP") from None
                if n == 0:
                    while self._line(deadline):  # trailers, then the empty line
                        pass
                    return b"".join(parts)
                size += n
                if size > MAX_BODY_BYTES:
                    raise FetchError(f"the answer is larger than {MAX_BODY_BYTES >> 20} MiB: not a metrics endpoint")
                parts.append(self._take(n, deadline))
                self._take(2, deadline)
        length = headers.get("content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                raise FetchError(f"bad Content-Length {length[:20]!r}") from None
            if n < 0 or n > MAX_BODY_BYTES:
                raise FetchError(f"Content-Length {n} is out of range: not a metrics endpoint")
            return self._take(n, deadline)
        if keep:
            raise FetchError("the answer has neither Content-Length nor chunked encoding")
        while True:  # HTTP/1.0 style: the body ends when the server closes
            data = self._recv(deadline)
            if not data:
                body, self._buf = self._buf, b""
                return body
            self._buf += data
            if len(self._buf) > MAX_BODY_BYTES:
                raise FetchError(f"the answer is larger than {MAX_BODY_BYTES >> 20} MiB: not a metrics endpoint")


def _status(line: str, headers: dict[str, str]) -> tuple[int, bool]:
    """(status code, whether the connection stays open) from the status line and headers."""
    words = line.split(None, 2)
    if len(words) < 2 or not words[0].startswith("HTTP/") or not words[1].isdigit():
        raise FetchError(f"the answer is not HTTP (status line {line[:40]!r})")
    conn = headers.get("connection", "").lower()
    keep = conn != "close" if words[0] == "HTTP/1.1" else conn == "keep-alive"
    return int(words[1]), keep


class _Stale(Exception):
    """The connection was closed before any byte of the answer arrived."""


class _Timeout(Exception):
    pass
