"""Shared fixtures: real Lance tables on disk in pytest's tmp_path."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest

PK = {"lance-schema:unenforced-primary-key": "true"}


def pk_schema(*extra: pa.Field, key_type: pa.DataType = pa.int64()) -> pa.Schema:
    """Schema ``id`` (primary key) + ``extra`` fields."""
    return pa.schema([pa.field("id", key_type, nullable=False, metadata=PK), *extra])


BASIC_SCHEMA = pk_schema(pa.field("val", pa.float64()), pa.field("name", pa.string()))


def basic_rows(ids, val=None, name=None) -> pa.Table:
    """Rows of BASIC_SCHEMA."""
    ids = list(ids)
    if val is None:
        val = [float(i) for i in ids]
    if name is None:
        name = [f"n{i}" for i in ids]
    return pa.table({"id": ids, "val": val, "name": name}, schema=BASIC_SCHEMA)


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
