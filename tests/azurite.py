"""Azurite (Microsoft's Azure Storage emulator, the npm package ``azurite``) for tests and
benchmarks: found or installed, started on a free loopback port, stopped.

Azurite is looked for, in order, at ``$MEMWAL_AZURITE`` (the path of ``azurite-blob``),
on ``PATH``, and in ``.ci/node_modules/.bin`` of the repository, where ``.ci/run``
installs it; failing all three, and if ``npm`` is on ``PATH``, it is installed there
(``npm install --prefix .ci azurite@VERSION``). It runs with in-memory persistence and
answers the Blob REST API, with the well-known development account and key.
"""

from __future__ import annotations

import base64
import email.utils
import fcntl
import hashlib
import hmac
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

AZURITE_VERSION = "3.35.0"
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_CI = Path(__file__).resolve().parent.parent / ".ci"


class AzuriteUnavailable(RuntimeError):
    """Azurite is not installed and cannot be (no ``npm``, or the install failed)."""


def azurite_blob() -> str:
    """Path of the ``azurite-blob`` executable, installing Azurite if needed.

    Raises
    ------
    AzuriteUnavailable
        Neither found nor installable; the message says why.
    """
    explicit = os.environ.get("MEMWAL_AZURITE")
    if explicit:
        return explicit
    found = shutil.which("azurite-blob")
    if found:
        return found
    local = _CI / "node_modules" / ".bin" / "azurite-blob"
    if local.exists():
        return str(local)
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise AzuriteUnavailable(
            "Azurite is not installed and node/npm are missing: run .ci/run (it installs "
            "Node.js and Azurite), or set MEMWAL_AZURITE to an azurite-blob executable"
        )
    _CI.mkdir(exist_ok=True)
    with open(_CI / ".azurite-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install when several processes ask
        if not local.exists():
            cmd = [npm, "install", "--prefix", str(_CI), "--no-save", "--no-audit", "--no-fund"]
            done = subprocess.run(
                [*cmd, f"azurite@{AZURITE_VERSION}"], capture_output=True, text=True, timeout=600
            )
            if done.returncode != 0 or not local.exists():
                raise AzuriteUnavailable(f"npm install azurite failed: {done.stderr[-2000:]}")
    return str(local)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Azurite:
    """An Azurite blob service on a free loopback port; a context manager.

    Attributes
    ----------
    endpoint : str
        ``http://127.0.0.1:PORT/devstoreaccount1`` (the account's blob endpoint).
    """

    def __init__(self) -> None:
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Azurite:
        exe = azurite_blob()
        for _ in range(3):  # a port taken between choosing and binding: choose again
            self.port = _free_port()
            self._proc = subprocess.Popen(
                [
                    exe,
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    str(self.port),
                    "--inMemoryPersistence",
                    "--disableTelemetry",
                    "--skipApiVersionCheck",
                    "--silent",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                        return self
                except OSError:
                    time.sleep(0.1)
            self.stop()
        raise AzuriteUnavailable("Azurite did not start listening within 60 s")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def create_bucket(self, name: str) -> None:
        """Create a container (a Shared Key signed ``PUT ?restype=container``)."""
        date = email.utils.formatdate(usegmt=True)
        version = "2021-08-06"
        to_sign = "\n".join(
            ["PUT", *[""] * 11, f"x-ms-date:{date}\nx-ms-version:{version}"]
            + [f"/{ACCOUNT}/{ACCOUNT}/{name}\nrestype:container"]
        )
        digest = hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
        request = urllib.request.Request(
            f"{self.endpoint}/{name}?restype=container",
            method="PUT",
            headers={
                "x-ms-date": date,
                "x-ms-version": version,
                "Content-Length": "0",
                "Authorization": f"SharedKey {ACCOUNT}:{base64.b64encode(digest).decode()}",
            },
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            if response.status != 201:
                raise RuntimeError(f"create container {name}: HTTP {response.status}")

    def storage_options(self, endpoint: str | None = None, **extra: str) -> dict[str, str]:
        """Lance-style ``storage_options`` for this emulator (or for ``endpoint``, a
        proxy in front of it, given as ``http://host:port``)."""
        options = {
            "azure_storage_account_name": ACCOUNT,
            "azure_storage_account_key": KEY,
            "azure_storage_endpoint": f"{endpoint}/{ACCOUNT}" if endpoint else self.endpoint,
            "allow_http": "true",
        }
        options.update(extra)
        return options

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._proc = None

    def __enter__(self) -> Azurite:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
