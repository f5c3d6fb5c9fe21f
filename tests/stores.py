"""The object stores the tests and benchmarks run against, behind one interface.

- ``"s3"``: moto's S3 server in this process (``s3server.py``);
- ``"azure"``: Azurite, the Azure Storage emulator (``azurite.py``; a Node.js process);
- ``"gcs"``: the loopback GCS stand-in (``gcs_standin.py``).

:func:`start_store` starts one and returns a :class:`StoreServer`, which names its URI
scheme, creates buckets, and gives Lance-style ``storage_options`` reaching it directly
or through a proxy (``tests/faultproxy.py``) in front of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STORES = ("s3", "azure", "gcs")
SCHEME = {"s3": "s3", "azure": "az", "gcs": "gs"}


@dataclass
class StoreServer:
    """A running store emulator.

    Attributes
    ----------
    kind : str
        ``"s3"``, ``"azure"`` or ``"gcs"``.
    server : object
        The emulator (``LocalS3Server``, ``Azurite``, ``GcsStandIn``).
    """

    kind: str
    server: Any

    @property
    def scheme(self) -> str:
        return SCHEME[self.kind]

    @property
    def upstream(self) -> str:
        """``http://host:port`` of the emulator (what a proxy forwards to)."""
        return "/".join(self.server.endpoint.split("/")[:3])

    def create_bucket(self, name: str) -> None:
        self.server.create_bucket(name)

    def root(self, bucket: str) -> str:
        return f"{self.scheme}://{bucket}"

    def storage_options(self, endpoint: str | None = None, **extra: str) -> dict[str, str]:
        """Options reaching the emulator, or ``endpoint`` (``http://host:port`` of a
        proxy in front of it)."""
        return dict(self.server.storage_options(endpoint=endpoint, **extra))

    def stop(self) -> None:
        self.server.stop()


def start_store(kind: str) -> StoreServer:
    """Start an emulator of ``kind`` (see the module docs).

    Raises
    ------
    azurite.AzuriteUnavailable
        ``kind == "azure"`` and Azurite cannot be found or installed.
    """
    if kind == "s3":
        from s3server import LocalS3Server

        return StoreServer(kind, LocalS3Server().start())
    if kind == "azure":
        from azurite import Azurite

        return StoreServer(kind, Azurite().start())
    if kind == "gcs":
        from gcs_standin import GcsStandIn

        return StoreServer(kind, GcsStandIn().start())
    raise ValueError(f"unknown store {kind!r}")
