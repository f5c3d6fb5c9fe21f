"""What the loopback HTTP servers of the tests share (``gcs_standin.py``,
``faultproxy.py``): a quiet threaded server, request bodies, and start/stop."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class QuietServer(ThreadingHTTPServer):
    """Quiet about clients that went away mid-answer (timeouts, dropped connections)."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive, no access log, no Nagle stalls (headers and body go out
    at once: with Nagle's algorithm every answer waited 40 ms for a delayed ACK)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def body(self) -> bytes:
        """The request body (``Content-Length`` or chunked)."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""


class LoopbackServer:
    """A :class:`QuietServer` of ``handler`` on ``host:port`` (0: a free port) in a daemon
    thread; ``server.owner`` is this object. A context manager."""

    handler: type[Handler] = Handler
    name = "loopback"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._server: QuietServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Any:
        server = QuietServer((self.host, self.port), self.handler)
        server.owner = self  # type: ignore[attr-defined]
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, name=self.name, daemon=True)
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
