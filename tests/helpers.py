"""Test helpers shared by several test modules."""

from __future__ import annotations

import pyarrow as pa

PK = {"lance-schema:unenforced-primary-key": "true"}


def pk_schema(*extra: pa.Field, key_type: pa.DataType | None = None) -> pa.Schema:
    """Schema ``id`` (primary key) + ``extra`` fields."""
    key = pa.int64() if key_type is None else key_type
    return pa.schema([pa.field("id", key, nullable=False, metadata=PK), *extra])


BASIC_SCHEMA = pk_schema(pa.field("val", pa.float64()), pa.field("name", pa.string()))


def basic_rows(ids, val=None, name=None) -> pa.Table:
    """Rows of BASIC_SCHEMA."""
    ids = list(ids)
    if val is None:
        val = [float(i) for i in ids]
    if name is None:
        name = [f"n{i}" for i in ids]
    return pa.table({"id": ids, "val": val, "name": name}, schema=BASIC_SCHEMA)
