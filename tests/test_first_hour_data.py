"""From a pandas DataFrame to search, as a new user goes: vectors that arrive as lists,
and searches without an index that say how to create one (the public API only)."""

from __future__ import annotations

import re

import lance
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import memwal_query as mq

from helpers import PK

DIM = 8


def frame(ids, rng, dim=DIM) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "id": np.asarray(ids, np.int64),
            "text": [f"hello lance {i}" for i in ids],
            "vec": [rng.random(dim) for _ in ids],  # float64 arrays: list<double> in Arrow
        }
    )


def vector_schema() -> pa.Schema:
    return pa.schema(
        [
            pa.field("id", pa.int64(), False, PK),
            pa.field("text", pa.string()),
            pa.field("vec", pa.list_(pa.float32(), DIM)),
        ]
    )


@pytest.fixture
def declared(tmp_path, rng):
    """A table whose ``vec`` is declared as a vector (the way the error says)."""
    uri = str(tmp_path / "declared")
    df = frame(range(100), rng)
    lance.write_dataset(pa.Table.from_pandas(df, schema=vector_schema(), preserve_index=False), uri)
    return mq.MemWalTable.initialize(uri)


def test_pandas_arrays_are_written_into_a_vector_column(declared, rng):
    df = frame([5, 200], rng)
    declared.write(df)  # a DataFrame of float64 arrays: list<double> -> vector<float32>[8]
    got = declared.lookup(pa.array([5, 200]))
    assert got.schema.field("vec").type == pa.list_(pa.float32(), DIM)
    want = np.stack(df["vec"]).astype(np.float32)
    assert np.array_equal(np.stack(got.sort_by("id")["vec"].to_numpy(zero_copy_only=False)), want)
    hit = declared.vector_search("vec", df["vec"][1], k=1)
    assert hit["id"].to_pylist() == [200]


def test_arrays_of_another_length_are_refused_naming_the_row(declared, rng):
    df = frame([1, 2, 3], rng)
    df.at[2, "vec"] = rng.random(DIM - 1)
    before = declared.to_table().sort_by("id")
    with pytest.raises(mq.SchemaError, match=r"column 'vec': row 2 has 7 values.* vectors of 8"):
        declared.write(df)
    assert declared.to_table().sort_by("id").equals(before)


def test_vector_search_on_a_list_column_says_how_to_declare_it(tmp_path, rng):
    uri = str(tmp_path / "lists")
    t = pa.Table.from_pandas(frame(range(20), rng), preserve_index=False)
    t = t.cast(t.schema.set(0, pa.field("id", pa.int64(), False, PK)))
    lance.write_dataset(t, uri)
    table = mq.MemWalTable.initialize(uri)
    with pytest.raises(mq.SchemaError) as e:
        table.vector_search("vec", rng.random(DIM), k=3)
    assert "not a vector" in str(e.value)
    assert f"pa.field('vec', pa.list_(pa.float32(), {DIM}))" in str(e.value)


def _run_hint(text: str) -> None:
    call = re.search(r"lance\.dataset\(.*\)\.\w+\(.*\)", text)
    assert call is not None, text
    eval(call.group(0), {"lance": lance})  # the exact call the message gives


def test_fts_without_an_index_gives_the_call_that_creates_it(declared):
    with pytest.raises(mq.MemWalError, match="no INVERTED index") as e:
        declared.fts_search("text", "hello", k=3)
    _run_hint(str(e.value))
    table = mq.MemWalTable.open(declared.uri)
    assert table.fts_search("text", "lance", k=3).num_rows == 3


def test_vector_search_without_an_index_gives_the_call_that_creates_it(declared, rng):
    debug: dict = {}
    declared.vector_search("vec", rng.random(DIM), k=3, debug=debug)
    assert "no vector index on the base" in debug["explain"]
    _run_hint(debug["explain"])
    table = mq.MemWalTable.open(declared.uri)
    debug = {}
    assert table.vector_search("vec", rng.random(DIM), k=3, debug=debug).num_rows == 3
    assert "index=vec_idx(IVF_PQ)" in debug["explain"]
