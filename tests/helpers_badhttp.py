"""Misbehaving metrics endpoints, on real sockets, for the scrape tests.

    python tests/helpers_badhttp.py hang       # prints "ready <port>"

Modes: ``hang`` (accepts, reads the request, never answers), ``trickle`` (a valid answer, one
byte every 50 ms), ``garbage`` (200 with bytes that are no exposition), ``html`` (200 with a web
page), ``error`` (500), ``close`` (accepts and closes at once), ``endless`` (a chunked body that
never ends), ``slow`` (a valid answer after ``delay`` seconds). :class:`BadServer` runs one in a
thread; the command line runs one as its own process.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

VALID = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n"
MODES = ("hang", "trickle", "garbage", "html", "error", "close", "endless", "slow")


def _answer(body: bytes, status: str = "200 OK", ctype: str = "text/plain; version=0.0.4") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
            .encode() + body)


class BadServer:
    def __init__(self, mode: str, delay: float = 0.5):
        assert mode in MODES, mode
        self.mode = mode
        self.delay = delay
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.requests = 0
        self._stop = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        for c in self._conns + [self.sock]:
            try:
                c.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                self.requests += 1
                mode = self.mode
                if mode == "hang":
                    while not self._stop:
                        time.sleep(0.05)
                    return
                if mode == "close":
                    conn.close()
                    return
                if mode == "garbage":
                    conn.sendall(_answer(os.urandom(512)))
                elif mode == "html":
                    conn.sendall(_answer(b"<html><body>Login</body></html>", ctype="text/html"))
                elif mode == "error":
                    conn.sendall(_answer(b"internal error\n", status="500 Internal Server Error"))
                elif mode == "trickle":
                    for b in _answer(VALID):
                        conn.sendall(bytes([b]))
                        time.sleep(0.05)
                elif mode == "endless":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    while not self._stop:
                        conn.sendall(b"10\r\n" + b"x" * 16 + b"\r\n")
                        time.sleep(0.001)
                elif mode == "slow":
                    time.sleep(self.delay)
                    conn.sendall(_answer(VALID))
        except OSError:
            return


if __name__ == "__main__":
    server = BadServer(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.5)
    print(f"ready {server.port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
