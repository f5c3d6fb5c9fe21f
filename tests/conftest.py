"""Shared fixtures: real Lance tables on disk in pytest's tmp_path."""

from __future__ import annotations

import lance
import numpy as np
import pytest

from helpers import basic_rows


@pytest.fixture
def base_uri(tmp_path) -> str:
    """A Lance base table (ids 0..99) with a primary key, not yet initialized."""
    uri = str(tmp_path / "base")
    lance.write_dataset(basic_rows(range(100)), uri)
    return uri


@pytest.fixture
def table(base_uri):
    """An initialized MemWalTable without region spec."""
    import memwal_query as mq

    t = mq.MemWalTable.initialize(base_uri)
    yield t
    t.close(flush=False)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts a SparkSession (the ``spark`` fixture, directly or through
    another fixture) is ``slow``: the JVM alone takes seconds, so the fast lane
    (``pytest -m "not slow"``) leaves Spark to the full run."""
    for item in items:
        if "spark" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


class StorePool:
    """Object-store emulators started on first use and shared by the session's tests,
    each with the bucket :attr:`BUCKET` (see ``tests/stores.py``)."""

    BUCKET = "memwal-test"

    def __init__(self) -> None:
        self.servers: dict = {}

    def get(self, kind: str):
        """The running :class:`stores.StoreServer` of ``kind``; skips the test when
        Azurite can be neither found nor installed (the reason says why)."""
        from azurite import AzuriteUnavailable
        from stores import start_store

        if kind not in self.servers:
            try:
                server = start_store(kind)
            except AzuriteUnavailable as e:
                pytest.skip(f"Azure emulator unavailable: {e}")
            server.create_bucket(self.BUCKET)
            self.servers[kind] = server
        return self.servers[kind]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.servers.clear()


@pytest.fixture(scope="session")
def store_pool():
    """The session's :class:`StorePool`."""
    pool = StorePool()
    yield pool
    pool.stop()
