"""An HTTP proxy on loopback in front of the moto server that injects the faults S3 has and moto
does not: throttling (503 SlowDown before the request reaches the server), lost answers (the
request reaches the server and lands, but the client gets a 503 instead of the server's answer),
bodies damaged in transit (a byte of a GET's answer flipped; its checksum header then disagrees),
a request held on its way (``hold``: a test kills the client while it waits, and the request
never lands), and an answer held on its way back (``hold_answer``: the request lands at once, the
client hears of it only when released).

Outside the project on purpose: it only forwards bytes; what is under test is the client's retries.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>")


class FaultyProxy:
    """``throttle(n)``: the next ``n`` requests get 503 SlowDown. ``lose_answer(method, n)``: the next
    ``n`` requests with ``method`` are forwarded, then answered with 503 as if the answer was lost.
    ``damage(n)``: the next ``n`` GET answers with a body arrive with its first byte flipped."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self._lock = threading.Lock()
        self._throttle = 0
        self._lose: dict[str, int] = {}
        self._damage = 0
        self._hold: tuple[str, str] | None = None  # (method, path suffix) of the request to hold
        self._hold_answer: tuple[str, str] | None = None  # (method, path suffix) of the answer to hold
        self.held = threading.Event()  # set when the held request arrived
        self._released = threading.Event()
        self.seen: list[tuple[str, str, int]] = []  # (method, path, status sent to the client)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    hold = proxy._hold is not None and self.command == proxy._hold[0] and \
                        self.path.split("?")[0].endswith(proxy._hold[1])
                    if hold:
                        proxy._hold = None
                if hold:  # never forwarded: whoever sent it waits until released, then gets a 503
                    proxy.held.set()
                    proxy._released.wait()
                    self._reply(503, SLOW_DOWN, {"Content-Type": "application/xml"})
                    return
                with proxy._lock:
                    throttled = proxy._throttle > 0
                    if throttled:
                        proxy._throttle -= 1
                    lose = not throttled and proxy._lose.get(self.command, 0) > 0
                    if lose:
                        proxy._lose[self.command] -= 1
                if throttled:
                    self._reply(503, SLOW_DOWN, {"Content-Type": "application/xml"})
                    return
                connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                connection.request(self.command, self.path, body=body or None, headers=headers)
                response = connection.getresponse()
                data = response.read()
                with proxy._lock:
                    hold_answer = proxy._hold_answer is not None and self.command == proxy._hold_answer[0] and \
                        self.path.split("?")[0].endswith(proxy._hold_answer[1])
                    if hold_answer:
                        proxy._hold_answer = None
                if hold_answer:  # landed upstream; its answer (of that moment) waits until released
                    proxy.held.set()
                    proxy._released.wait()
                with proxy._lock:
                    damaged = self.command == "GET" and bool(data) and proxy._damage > 0 and response.status == 200
                    if damaged:
                        proxy._damage -= 1
                if damaged:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                if lose:
                    self._reply(503, SLOW_DOWN, {"Content-Type": "application/xml"})
                else:
                    passed = {k: v for k, v in response.getheaders()
                              if k.lower() not in ("connection", "transfer-encoding", "content-length")}
                    self._reply(response.status, data, passed)
                connection.close()

            def _reply(self, status: int, data: bytes, headers: dict) -> None:
                with proxy._lock:
                    proxy.seen.append((self.command, self.path, status))
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def throttle(self, requests: int) -> None:
        with self._lock:
            self._throttle = requests

    def lose_answer(self, method: str, requests: int = 1) -> None:
        with self._lock:
            self._lose[method] = requests

    def damage(self, answers: int = 1) -> None:
        with self._lock:
            self._damage = answers

    def hold(self, method: str, path_suffix: str) -> None:
        """The next request with ``method`` whose path ends with ``path_suffix`` waits, unanswered
        and never forwarded, until :meth:`release`; :attr:`held` is set when it arrives."""
        with self._lock:
            self._hold = (method, path_suffix)
            self.held.clear()
            self._released.clear()

    def hold_answer(self, method: str, path_suffix: str) -> None:
        """The next request with ``method`` whose path ends with ``path_suffix`` is forwarded and
        answered upstream at once; its answer reaches the client only after :meth:`release`
        (:attr:`held` is set when the answer is waiting)."""
        with self._lock:
            self._hold_answer = (method, path_suffix)
            self.held.clear()
            self._released.clear()

    def release(self) -> None:
        self._released.set()

    def statuses(self) -> list[int]:
        with self._lock:
            return [status for _, _, status in self.seen]

    def stop(self) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
