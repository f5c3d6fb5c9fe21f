"""A fault-injecting HTTP proxy on the loopback interface, between an object-store client
(obstore, Lance) and a store emulator, for tests and benchmarks.

Every request is forwarded to the upstream server unless a fault is chosen for it. A
fault is one of

- ``"503"`` (SlowDown), ``"500"`` (InternalError), ``"429"`` (TooManyRequests): that
  answer instead of the store's;
- ``"timeout"``: no answer for ``delay`` seconds (past the client's timeout), then the
  connection is closed;
- ``"drop"``: the connection is closed without an answer;

injected ``"before"`` the store sees the request (nothing happened) or ``"after"`` it
applied it (the client cannot tell it happened). Faults are chosen by :attr:`plan`, a
callable ``(method, path) -> (kind, when) | None``, for example :class:`RandomFaults`
(seeded). :attr:`latency` adds a delay to every request (benchmarks). Counts of what was
injected are kept in :attr:`counts` by ``(phase, kind, when)``, where :attr:`phase` is
whatever the driver sets (the operation under way).
"""

from __future__ import annotations

import http.client
import random
import threading
import time
from collections import Counter
from collections.abc import Callable

from loopback import Handler, LoopbackServer

KINDS = ("503", "500", "429", "timeout", "drop")
WHEN = ("before", "after")
Fault = tuple[str, str]
Plan = Callable[[str, str], "Fault | None"]

_BODIES = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "429": (429, "TooManyRequests", "Too many requests."),
}
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class RandomFaults:
    """A seeded plan: each request is faulted with probability ``rate`` (kind and
    moment drawn uniformly from ``kinds`` and ``when``), while ``enabled``.

    Parameters
    ----------
    seed : int
    rate : float
    kinds : sequence of str
        Among :data:`KINDS`; weights follow repetition (``("503", "503", "drop")``).
    when : sequence of str
        Among :data:`WHEN`.
    """

    def __init__(
        self,
        seed: int,
        rate: float,
        kinds: tuple[str, ...] = KINDS,
        when: tuple[str, ...] = WHEN,
    ) -> None:
        self.rng = random.Random(seed)
        self.rate = rate
        self.kinds = kinds
        self.when = when
        self.enabled = True
        self._lock = threading.Lock()

    def __call__(self, method: str, path: str) -> Fault | None:
        with self._lock:
            if not self.enabled or self.rng.random() >= self.rate:
                return None
            return self.rng.choice(self.kinds), self.rng.choice(self.when)


class _Handler(Handler):
    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        proxy: FaultProxy = self.server.owner
        headers = {
            k: v for k, v in self.headers.items() if k.lower() not in (*_HOP, "content-length")
        }
        if body or self.command in ("PUT", "POST") or "content-length" in self.headers:
            headers["Content-Length"] = str(len(body))
        for attempt in range(2):  # a kept-alive upstream connection may have gone stale
            conn = getattr(self, "_upstream", None)
            if conn is None:
                conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, 60)
                self._upstream = conn
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.getheaders(), data
            except (OSError, http.client.HTTPException):
                conn.close()
                self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        length_sent = False
        for k, v in headers:
            if k.lower() in _HOP:
                continue
            if k.lower() == "content-length":
                if self.command == "HEAD":
                    self.send_header(k, v)
                    length_sent = True
                continue
            self.send_header(k, v)
        if not length_sent:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _fail(self, kind: str) -> None:
        proxy: FaultProxy = self.server.owner
        if kind in _BODIES:
            status, code, message = _BODIES[kind]
            body = (
                f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                f"<Message>{message}</Message></Error>"
            ).encode()
            self._send(status, [("Content-Type", "application/xml")], body)
            return
        if kind == "timeout":
            time.sleep(proxy.delay)
        self.close_connection = True  # "drop", or a timeout's end: no answer at all

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.owner
        body = self.body()
        if proxy.latency:
            time.sleep(proxy.latency)
        fault = proxy.plan(self.command, self.path) if proxy.plan is not None else None
        proxy.seen(self.command, self.path, fault)
        if fault is not None:
            kind, when = fault
            if when == "after":
                try:
                    self._forward(body)
                except (OSError, http.client.HTTPException):
                    pass
            self._fail(kind)
            return
        try:
            status, headers, data = self._forward(body)
        except (OSError, http.client.HTTPException):
            self.close_connection = True
            return
        self._send(status, headers, data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle  # noqa: N815


class FaultProxy(LoopbackServer):
    """The proxy on a free loopback port in front of ``upstream`` (``http://host:port``);
    a context manager.

    Parameters
    ----------
    upstream : str
        ``http://host:port`` of the emulator.
    plan : callable, optional
        ``(method, path) -> (kind, when) | None`` (see the module docs).
    delay : float
        Seconds a ``"timeout"`` fault keeps the client waiting (set it past the
        client's ``timeout`` storage option).
    latency : float
        Seconds added to every request.
    """

    handler = _Handler
    name = "fault-proxy"

    def __init__(
        self, upstream: str, plan: Plan | None = None, delay: float = 2.0, latency: float = 0.0
    ) -> None:
        host, _, port = upstream.removeprefix("http://").split("/")[0].partition(":")
        self.upstream_host = host
        self.upstream_port = int(port or 80)
        self.plan = plan
        self.delay = delay
        self.latency = latency
        self.phase = "setup"
        self.requests = 0
        self.retries = 0  # requests sent again after a fault on the same method and path
        self._faulted: set[tuple[str, str]] = set()
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self._lock = threading.Lock()
        super().__init__()

    def seen(self, method: str, path: str, fault: Fault | None) -> None:
        """Count a request (and its fault)."""
        with self._lock:
            self.requests += 1
            key = (method, path)
            if key in self._faulted:
                self.retries += 1
                self._faulted.discard(key)
            if fault is not None:
                self.counts[(self.phase, *fault)] += 1
                self._faulted.add(key)

    @property
    def faults(self) -> int:
        return sum(self.counts.values())
