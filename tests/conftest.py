"""Shared fixtures: real Lance tables on disk in pytest's tmp_path."""

from __future__ import annotations

import os
import sys
import warnings

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


MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, ``pyproject.toml``): one worker per CPU this process may
    use, at most :data:`MAX_WORKERS`. Each worker starts its own object-store emulators and,
    for the Spark tests, its own JVM, so more workers than that cost more than they give."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, MAX_WORKERS))


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


@pytest.fixture(scope="session")
def spark_fault_dir(tmp_path_factory) -> str:
    """The directory arming the Spark fault points (``memwal_query.spark._common.fault``):
    ``$MEMWAL_SPARK_FAULT_DIR`` of the session's Spark workers."""
    return str(tmp_path_factory.mktemp("spark-faults"))


@pytest.fixture(scope="session")
def spark(spark_fault_dir):
    """The session's SparkSession (local[2,2]: 2 cores, 2 attempts per task), started on
    first use and shared by every test that asks for it (the JVM and its Python workers
    start once). The memwal data source is registered with filter pushdown on. The fault
    directory is set before the JVM starts, so that Python workers inherit it."""
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    from memwal_query import spark as mqs
    from memwal_query.spark import source
    from memwal_query.spark._common import FAULT_DIR_ENV

    old = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", FAULT_DIR_ENV)}
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ[FAULT_DIR_ENV] = spark_fault_dir
    with warnings.catch_warnings():
        # the driver starts the JVM with fork+exec after lance is loaded: harmless
        warnings.filterwarnings("ignore", "lance is not fork-safe", UserWarning)
        session = (
            SparkSession.builder.master("local[2,2]")
            .appName("memwal_query-tests")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.driver.memory", "2g")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
    session.sparkContext.setLogLevel("ERROR")
    with pytest.warns(source.PushdownWarning, match="wrong"):  # driver-side warning
        mqs.register_source(session, filter_pushdown=True)  # the push_filters tests need it
    yield session
    session.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
