"""A TCP proxy on loopback in front of a test server (moto's S3, Azurite) that cuts the network for
a set time: the outages an object store's clients meet and the test servers never have.

``refuse_for(s)``: for ``s`` seconds nothing listens on the proxy's port, so every connection is
refused (ECONNREFUSED), and the connections open when it starts are reset, so a client's pooled
connections break too. ``reset_for(s)``: for ``s`` seconds connections are accepted and reset at
once (ECONNRESET). Afterwards it forwards bytes again, untouched.

Outside the project on purpose: it only forwards bytes; what is under test is the clients' retries.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from urllib.parse import urlsplit

_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST instead of FIN


class OutageProxy:
    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self._upstream = (target.hostname, target.port)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._refuse_until = 0.0
        self._reset_until = 0.0
        self._stopped = False
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.refused = 0  # outages started by refuse_for: what a test asserts happened
        self._thread = threading.Thread(target=self._serve, daemon=True, name="outage-proxy")
        self._thread.start()

    # ---------------------------------------------------------------- outages
    def refuse_for(self, seconds: float) -> None:
        """Nothing listens for ``seconds``; connections open now are reset."""
        with self._lock:
            self._refuse_until = time.monotonic() + seconds
            self.refused += 1
            listener, self._listener = self._listener, None
            open_now, self._open = self._open, set()
        _reset(listener)  # wakes the accept loop, which listens again once the outage is over
        for sock in open_now:
            _reset(sock)

    def reset_for(self, seconds: float) -> None:
        """Connections are accepted and reset at once for ``seconds``; open ones are reset now."""
        with self._lock:
            self._reset_until = time.monotonic() + seconds
            open_now, self._open = self._open, set()
        for sock in open_now:
            _reset(sock)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            listener, self._listener = self._listener, None
            open_now, self._open = self._open, set()
        if listener is not None:
            listener.close()
        for sock in open_now:
            _reset(sock)

    # ---------------------------------------------------------------- forwarding
    def _listen(self, port: int) -> socket.socket:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        listener.settimeout(0.05)
        return listener

    def _serve(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                listener = self._listener
                refusing = self._refuse_until - time.monotonic()
            if listener is None:
                if refusing > 0:
                    time.sleep(min(refusing, 0.02))
                    continue
                listener = self._listen(self.port)
                with self._lock:
                    self._listener = listener
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            with self._lock:
                resetting = time.monotonic() < self._reset_until
            if resetting:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                cut = source not in self._open  # reset by an outage: reset the other side too
                self._open.discard(source)
                self._open.discard(sink)
            if cut:
                _reset(sink)
            else:
                for sock in (source, sink):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    sock.close()


def _reset(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
    except OSError:
        pass
    sock.close()
