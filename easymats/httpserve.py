"""The threaded TCP server under /metrics and the webhook, bounded in threads and in time, and
the /metrics endpoint itself (:func:`serve_metrics`).

``socketserver.ThreadingTCPServer`` as it comes listens with a backlog of 5 (50 concurrent
scrapers overflowed it: connections waited for SYN retransmits, seconds each), starts a thread for
every connection however many there are, and lets a client that never sends a byte hold its thread
for ever. :class:`BoundedServer` changes three things:

- the listen backlog is :data:`LISTEN_BACKLOG` (the kernel caps it at ``net.core.somaxconn``);
- at most ``max_connections`` connections are served at once, by worker threads that are kept
  and reused (starting a thread per connection cost as much as rendering /metrics); the accept
  loop waits for a free slot, so further connections wait in the kernel's backlog, not in threads;
- every request gets at most ``timeout_s`` seconds: each read waits that long at most (the
  socket timeout), and a connection whose request (counted from its accept, or from the last
  answer on a keep-alive connection, see :meth:`BoundedServer.renew`) takes longer is shut down
  by the accept loop, which also cuts a client that trickles one byte at a time.
"""

from __future__ import annotations

import logging
import queue
import socket
import socketserver
import threading
import time
from typing import Any

log = logging.getLogger("easymats.http")

LISTEN_BACKLOG = 1024
MAX_CONNECTIONS = 64
TIMEOUT_S = 10.0


class BoundedServer(socketserver.TCPServer):
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], handler: type[socketserver.BaseRequestHandler], *,
                 max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S):
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._open: dict[socket.socket, float] = {}  # connection -> monotonic time it is cut at
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = 0
        self._spare = 0  # workers waiting for work that no connection has claimed yet
        self._closing = False
        super().__init__(address, handler)

    @property
    def server_port(self) -> int:
        return self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        # Runs in the accept loop: waiting here for a slot leaves later connections in the backlog.
        while not self._slots.acquire(timeout=0.25):
            self.service_actions()
            if self._closing:
                self.shutdown_request(request)
                return
        request.settimeout(self.timeout_s)
        with self._lock:
            self._open[request] = time.monotonic() + self.timeout_s
            spawn = self._spare == 0
            if spawn:
                self._workers += 1
            else:
                self._spare -= 1
        self._work.put((request, client_address))
        if spawn:
            threading.Thread(target=self._worker, name="easymats-http-worker", daemon=True).start()

    def _worker(self) -> None:
        first = True
        while True:
            if not first:
                with self._lock:
                    self._spare += 1
            first = False
            item = self._work.get()
            if item is None:
                return
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
                self._forget(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that resets or times out is not worth a traceback on the agent's stderr.
        log.debug("request from %s failed", client_address, exc_info=True)

    def renew(self, request: Any) -> None:
        """A request on this (keep-alive) connection was answered: its deadline starts again."""
        with self._lock:
            if request in self._open:
                self._open[request] = time.monotonic() + self.timeout_s

    def _forget(self, request: Any) -> None:
        with self._lock:
            known = self._open.pop(request, None) is not None
        if known:
            self._slots.release()

    def service_actions(self) -> None:
        """Called by the accept loop about four times a second: cut connections past their deadline."""
        now = time.monotonic()
        with self._lock:
            late = [s for s, deadline in self._open.items() if deadline < now]
        for s in late:
            try:
                s.shutdown(socket.SHUT_RDWR)  # the handler's next read or write fails; it ends
            except OSError:
                pass

    def shutdown(self) -> None:
        self._closing = True
        super().shutdown()

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            workers, self._workers = self._workers, 0
        for _ in range(workers):
            self._work.put(None)


def serve_in_thread(server: BoundedServer, name: str) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.25}, name=name,
                              daemon=True)
    thread.start()
    return thread


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


MAX_REQUEST_LINE = 8192
MAX_HEADER_LINES = 100


def _response(code: int, reason: str, ctype: str, body: bytes) -> bytes:
    return (f"HTTP/1.0 {code} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode("latin-1") + body


def serve_metrics(registry: Any, host: str, port: int) -> tuple[BoundedServer, threading.Thread]:
    """Serve ``registry.render()`` (easymats.exporter.AgentRegistry) as /metrics on a threaded
    HTTP/1.0 server; returns (server, thread). OSError if it cannot bind.

    A small handler on ``socketserver`` rather than ``http.server``: http.server imports
    http.client, email and ssl, ~7 MB of resident memory in every agent, to parse what is here
    one request line and a few headers (GET only; one request per connection, as http.server's
    HTTP/1.0 default did)."""

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            try:
                out = self._answer()
            except (OSError, ValueError):  # timed out or reset: nothing to answer
                return
            try:
                self.wfile.write(out)
            except OSError:
                pass  # the scraper went away

        def _answer(self) -> bytes:
            line = self.rfile.readline(MAX_REQUEST_LINE + 1)
            if len(line) > MAX_REQUEST_LINE:
                return _response(414, "Request-URI Too Long", "text/plain", b"request line too long\n")
            words = line.decode("latin-1").split()
            if len(words) != 3 or not words[2].startswith("HTTP/"):
                return _response(400, "Bad Request", "text/plain", b"bad request line\n")
            for _ in range(MAX_HEADER_LINES):  # headers: read and ignored
                h = self.rfile.readline(MAX_REQUEST_LINE + 1)
                if h in (b"\r\n", b"\n", b""):
                    break
            else:
                return _response(431, "Request Header Fields Too Large", "text/plain", b"too many headers\n")
            method, path = words[0], words[1].split("?", 1)[0]
            if method != "GET":
                return _response(501, "Not Implemented", "text/plain", f"unsupported method {method}\n".encode())
            if path == "/metrics":
                try:
                    return _response(200, "OK", CONTENT_TYPE, registry.render())
                except Exception as exc:  # a scrape must never take the agent down
                    log.exception("rendering /metrics failed")
                    return _response(500, "Internal Server Error", "text/plain", f"error: {exc}\n".encode())
            if path == "/":
                return _response(200, "OK", "text/plain", b"easymats agent: see /metrics\n")
            return _response(404, "Not Found", "text/plain", b"not found: try /metrics\n")

    server = BoundedServer((host, port), Handler)
    return server, serve_in_thread(server, "easymats-http")
