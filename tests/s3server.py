"""A local S3-compatible server for tests and benchmarks: moto's S3 on 127.0.0.1.

moto (PyPI ``moto[server]``) answers the S3 REST API, including conditional writes
(``If-None-Match: *`` and ``If-Match`` on PutObject), from memory, in a thread of the
current process. Its check of a precondition and the write that follows are separate
steps, though, so two concurrent conditional puts on one key could both pass the check;
real S3 evaluates the condition atomically. :class:`LocalS3Server` therefore runs every
mutating request (anything but GET/HEAD) under one lock, which makes writes
linearizable as on S3, and reads stay concurrent.

Usage::

    server = LocalS3Server().start()
    server.create_bucket("test")
    options = server.storage_options()   # Lance-style storage_options
    ...
    server.stop()
"""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

_READS = ("GET", "HEAD")


class _Linearized:
    """WSGI middleware: mutating requests one at a time (optionally minus preconditions);
    while ``requests`` is a list, each request's ``(method, path, status)`` is appended."""

    def __init__(self, app: Any, strip_conditions: bool = False) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.strip_conditions = strip_conditions
        self.requests: list[tuple[str, str, int]] | None = None

    def __call__(self, environ: dict, start_response: Any) -> Any:
        if self.strip_conditions:
            environ.pop("HTTP_IF_NONE_MATCH", None)
            environ.pop("HTTP_IF_MATCH", None)
        method = environ.get("REQUEST_METHOD", "GET").upper()
        path = environ.get("PATH_INFO", "")
        if environ.get("QUERY_STRING"):
            path += "?" + environ["QUERY_STRING"]

        def logged(status: str, *args: Any) -> Any:
            log = self.requests
            if log is not None:
                log.append((method, path, int(status.split()[0])))
            return start_response(status, *args)

        if method in _READS:
            return self.app(environ, logged)
        with self.lock:
            return list(self.app(environ, logged))


class LocalS3Server:
    """moto's S3 on a free loopback port, started and stopped by the caller.

    Parameters
    ----------
    host : str
        Loopback address to bind (never a public interface).
    port : int
        0 (default): a free port chosen by the OS.
    strip_conditions : bool
        Drop ``If-None-Match``/``If-Match`` request headers, imitating an
        S3-compatible store without conditional writes (for negative tests).
    """

    access_key = "test"
    secret_key = "test"
    region = "us-east-1"

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, strip_conditions: bool = False
    ) -> None:
        if not host.startswith("127.") and host not in ("localhost", "::1"):
            raise ValueError(f"{host}: the test server binds loopback addresses only")
        self.host = host
        self.port = port
        self.strip_conditions = strip_conditions
        self._server: Any = None
        self._app: _Linearized | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> LocalS3Server:
        """Start serving in a daemon thread; returns self."""
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        class _Quiet(MotoRequestHandler):
            def log_request(self, *args: Any, **kwargs: Any) -> None:
                pass

        app = _Linearized(DomainDispatcherApplication(create_backend_app), self.strip_conditions)
        self._app = app
        self._server = make_server(self.host, self.port, app, threaded=True, request_handler=_Quiet)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="local-s3", daemon=True
        )
        self._thread.start()
        return self

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[str, str, int]]]:
        """Within the block, ``(method, path, HTTP status)`` of every request answered is
        appended to the list yielded (tests count requests and retries with it)."""
        if self._app is None:
            raise RuntimeError("the server is not running")
        log: list[tuple[str, str, int]] = []
        self._app.requests = log
        try:
            yield log
        finally:
            self._app.requests = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{self.host}:{self.port}"

    def create_bucket(self, name: str) -> None:
        """Create a bucket (moto does not check request signatures)."""
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        with urllib.request.urlopen(req, timeout=30) as resp:
            if resp.status != 200:
                raise RuntimeError(f"create bucket {name}: HTTP {resp.status}")

    def storage_options(self, endpoint: str | None = None, **extra: str) -> dict[str, str]:
        """Lance-style ``storage_options`` for this server, or for ``endpoint`` (a proxy
        in front of it), plus ``extra``."""
        options = {
            "aws_access_key_id": self.access_key,
            "aws_secret_access_key": self.secret_key,
            "aws_endpoint": endpoint or self.endpoint,
            "aws_region": self.region,
            "allow_http": "true",
        }
        options.update(extra)
        return options

    def stop(self) -> None:
        """Stop serving and join the thread."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> LocalS3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- workers of the multi-process tests ------------------------------------------------------
# They live here, not in the test module, because a forkserver child imports the module
# of its target: this one is cheap to import (no lance, datafusion or moto).
def race_worker(root, options, path, payload, barrier, results) -> None:
    """Race a put-if-not-exists of ``payload`` at ``path``; report won/lost."""
    from memwal_query.exceptions import AlreadyExistsError
    from memwal_query.storage.factory import file_io_for

    io = file_io_for(root, options)
    barrier.wait()
    try:
        io.put_if_not_exists(path, payload)
        results.put(("won", payload[:8]))
    except AlreadyExistsError:
        results.put(("lost", payload[:8]))


def lock_worker(uri, options, counter, rounds, results) -> None:
    """Increment the integer at ``counter`` ``rounds`` times under the index lock."""
    import time

    from memwal_query.storage.factory import file_io_for
    from memwal_query.storage.locking import index_lock

    io = file_io_for(uri, options)
    for _ in range(rounds):
        with index_lock(uri, io):
            n = int(io.read(counter))
            time.sleep(0.02)
            io.write(counter, str(n + 1).encode())
    results.put("done")
