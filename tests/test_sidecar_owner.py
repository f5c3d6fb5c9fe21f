"""A sidecar copied from another generation of the same size (real Lance tables).

Every sidecar a flush writes (rows, keys, postings, key index) names the generation
directory it was written for. A copy of a sibling generation's file into another
generation's directory has a valid frame and CRC, and with the same row count and the
same row addresses nothing else in it tells the two apart: it must be refused with a
warning naming the file, and the generation read from its Lance table, so the answers
are the same as with no sidecar at all.
"""

from __future__ import annotations

import os
import warnings

import datafusion
import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import keyfile, postings, rowfile
from memwal_query.read import view

from helpers import PK, clear_read_caches, damage_file

SCHEMA = pa.schema([pa.field("id", pa.string(), False, PK), pa.field("v", pa.int64())])
INT_SCHEMA = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])


def _rows(keys: range, v: int, ints: bool) -> pa.Table:
    if ints:
        return pa.table({"id": list(keys), "v": [v] * len(keys)}, schema=INT_SCHEMA)
    return pa.table({"id": [f"k{k}" for k in keys], "v": [v] * len(keys)}, schema=SCHEMA)


def _table(tmp_path, ints: bool) -> tuple[mq.MemWalTable, list[str]]:
    """One region, two flushes of 10 different keys each: two generations of the
    same size whose rows have the same row addresses."""
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(range(40), 0, ints), uri)
    t = mq.MemWalTable.initialize(uri)
    t.write(_rows(range(0, 10), 1, ints))
    t.flush()
    t.write(_rows(range(10, 20), 2, ints))
    t.flush()
    t.close()
    gens = [g.uri for g in view.resolve(t.catalog).generations]
    assert len(gens) == 2
    for g in gens:  # the region keys file would answer for the keys sidecars
        path = os.path.join(g, keyfile.REGION_KEYS_FILE)
        if os.path.exists(path):
            os.remove(path)
    return t, gens


def _answers(t: mq.MemWalTable, ints: bool) -> tuple[list, list, list]:
    keys = [3, 12, 25] if ints else ["k3", "k12", "k25"]
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    lit = ", ".join(str(k) if ints else f"'{k}'" for k in keys)
    point = ctx.sql(f"SELECT id, v FROM t WHERE id IN ({lit}) ORDER BY id").to_arrow_table()
    full = t.to_table().sort_by("id")
    looked = t.lookup(pa.array(keys, pa.int64() if ints else pa.string()))
    return (
        point.to_pylist(),
        full.to_pylist(),
        sorted(looked.select(["id", "v"]).to_pylist(), key=str),
    )


@pytest.mark.parametrize("ints", [True, False], ids=["int-key", "string-key"])
@pytest.mark.parametrize("name", [keyfile.KEYS_FILE, rowfile.ROWS_FILE])
def test_a_same_size_sidecar_of_another_generation_is_refused(tmp_path, name, ints):
    t, gens = _table(tmp_path, ints)
    clear_read_caches()
    want = _answers(mq.MemWalTable.open(t.uri), ints)
    assert dict((r["id"], r["v"]) for r in want[0])[3 if ints else "k3"] == 1
    damage_file(os.path.join(gens[1], name), "replaced", donor=os.path.join(gens[0], name))
    clear_read_caches()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _answers(mq.MemWalTable.open(t.uri), ints) == want
    refused = [str(w.message) for w in seen if "copied from another generation" in str(w.message)]
    assert refused and all(name in m and os.path.basename(gens[1]) in m for m in refused)


def test_the_owner_stamp_is_checked_where_the_file_is_read(tmp_path):
    """The stamp names the directory: read from that directory the file is accepted
    (and its schema carries no stamp); from any other, refused as written for it."""
    table = pa.table({"x": [1, 2]}).replace_schema_metadata({b"other": b"kept"})
    data = rowfile.seal(table, b"MWT1", "abcd1234_gen_1")
    got = rowfile.unseal(data, "s3://b/t/_mem_wal/r/abcd1234_gen_1/f.bin", b"MWT1", "x")
    assert got.equals(table) and got.schema.metadata == {b"other": b"kept"}
    with pytest.raises(ValueError, match="abcd1234_gen_1.*ffff0000_gen_1"):
        rowfile.unseal(data, "/t/_mem_wal/r/ffff0000_gen_1/f.bin", b"MWT1", "x")
    unstamped = rowfile.seal(table, b"MWT1")  # an older writer's file: read anywhere
    assert rowfile.unseal(unstamped, "/t/x/f.bin", b"MWT1", "x").equals(table)


def test_a_postings_sidecar_of_another_generation_is_not_used(tmp_path):
    uri = str(tmp_path / "t")
    schema = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("text", pa.string())])
    ds = lance.write_dataset(pa.table({"id": [0], "text": ["zero"]}, schema=schema), uri)
    ds.create_scalar_index("text", "INVERTED")  # the flush stores postings for it
    t = mq.MemWalTable.initialize(uri)
    t.write(pa.table({"id": [1, 2], "text": ["red fox", "blue fox"]}, schema=schema))
    t.flush()
    t.write(pa.table({"id": [3, 4], "text": ["green owl", "grey owl"]}, schema=schema))
    t.flush()
    t.close()
    gens = [g.uri for g in view.resolve(t.catalog).generations]
    assert all(os.path.exists(os.path.join(g, postings.POSTINGS_FILE)) for g in gens)
    clear_read_caches()
    want = mq.MemWalTable.open(uri).fts_search("text", "owl", k=10)["id"].to_pylist()
    assert sorted(want) == [3, 4]
    src = os.path.join(gens[0], postings.POSTINGS_FILE)
    damage_file(os.path.join(gens[1], postings.POSTINGS_FILE), "replaced", donor=src)
    clear_read_caches()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = mq.MemWalTable.open(uri).fts_search("text", "owl", k=10)["id"].to_pylist()
    assert sorted(got) == sorted(want)
    assert any(postings.POSTINGS_FILE in str(w.message) for w in seen)
