"""The key index file a flush writes for a single integer key (``memwal_key_index.bin``):
lookups read it instead of indexing the generation's keys, answer like a model, and a
missing, damaged or foreign file is not used (the index is built from the keys, with
the same answers)."""

from __future__ import annotations

import os
import warnings

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import keyfile
from memwal_query.format.rowfile import seal
from memwal_query.search import keys as search_keys
from memwal_query.storage import paths

from helpers import PK, clear_read_caches, damage_file

SCHEMA = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])


def _rows(keys, v: int) -> pa.Table:
    return pa.table({"id": pa.array(keys, pa.int64()), "v": [v] * len(keys)}, schema=SCHEMA)


def _table(tmp_path, rounds: int = 3) -> tuple[mq.MemWalTable, dict]:
    """Two regions; each round upserts (some keys twice in one generation), deletes,
    re-inserts a deleted key and flushes; then an unflushed MemTable."""
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(range(0, 300, 2), 0), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = dict.fromkeys(range(0, 300, 2), 0)
    for step in range(rounds):
        keys = list(range(step * 10, 200 + step * 10, 3))
        t.write(_rows(keys, 10 * step + 1))
        t.write(_rows(keys[::4], 10 * step + 2))  # a second version in the same MemTable
        model.update(dict.fromkeys(keys, 10 * step + 1))
        model.update(dict.fromkeys(keys[::4], 10 * step + 2))
        gone = list(range(step, 320, 7))
        t.delete(pa.table({"id": pa.array(gone, pa.int64())}))
        for k in gone:
            model.pop(k, None)
        t.write(_rows(gone[::5], 10 * step + 3))  # deleted, then written again
        model.update(dict.fromkeys(gone[::5], 10 * step + 3))
        t.flush()
    t.write(_rows([1, 2, 3], 99))  # MemTable rows on top
    model.update(dict.fromkeys([1, 2, 3], 99))
    return t, model


def _generation_dirs(t: mq.MemWalTable) -> list[str]:
    out = []
    for r in t.catalog.region_ids():
        for g in t.catalog.region_manifest(r).flushed_generations:
            out.append(paths.generation_path(t.uri, r, g.path))
    return sorted(out)


def _check(t: mq.MemWalTable, model: dict) -> None:
    probe = np.arange(-3, 330, dtype=np.int64)
    got = t.lookup(pa.array(probe)).to_pydict()
    assert dict(zip(got["id"], got["v"])) == model
    # a few keys at a time, as a point lookup does
    for chunk in np.array_split(probe, 17):
        got = t.lookup(pa.array(chunk)).to_pydict()
        assert dict(zip(got["id"], got["v"])) == {k: model[k] for k in chunk if k in model}


def _count_builds(monkeypatch) -> list[int]:
    """How many key indexes are built from keys (by hash or by value)."""
    built: list[int] = []
    real_hash, real_value = search_keys._KeyIndex.__init__, keyfile.build_index

    def by_hash(self, *a, **k):
        built.append(1)
        real_hash(self, *a, **k)

    def by_value(*a, **k):
        built.append(1)
        return real_value(*a, **k)

    monkeypatch.setattr(search_keys._KeyIndex, "__init__", by_hash)
    monkeypatch.setattr(keyfile, "build_index", by_value)
    return built


def test_lookups_read_the_flushed_index_and_equal_the_model(tmp_path, monkeypatch):
    t, model = _table(tmp_path)
    built = _count_builds(monkeypatch)
    gens = _generation_dirs(t)
    assert len(gens) == 6
    for g in gens:
        assert os.path.exists(os.path.join(g, keyfile.KEY_INDEX_FILE))
    clear_read_caches()
    _check(t, model)  # the live writer's table: MemTables included
    assert built == []  # no generation's keys were indexed on the lookup path
    t.close()  # flushes the MemTables (their flush builds their index files)
    built.clear()
    clear_read_caches()
    _check(mq.MemWalTable.open(t.uri), model)  # a new reader: generations and WAL
    assert built == []  # no generation's keys were indexed on the lookup path


def test_the_index_holds_the_newest_row_of_each_key():
    keys = pa.table(
        {
            "id": pa.array([5, 3, 5, 9, 3, 3], pa.int64()),
            "_tombstone": [False, False, True, False, False, True],
        }
    )
    index = keyfile.build_index(keys, ["id"])
    assert index.keys.tolist() == [3, 5, 9]
    assert index.rows.tolist() == [5, 2, 3]
    assert index.tombstone.tolist() == [True, True, False]
    assert index.num_rows == 6
    # uint64 beyond int64: one-to-one, probed by the same mapping
    big = pa.table({"id": pa.array([2**64 - 1, 1, 2**63], pa.uint64())})
    sorted_index = search_keys._SortedKeyIndex(
        keyfile.build_index(big, ["id"]), pa.field("id", pa.uint64())
    )
    probe = pa.table({"id": pa.array([2**63, 7, 2**64 - 1, 1], pa.uint64())})
    pos = sorted_index.probe(probe)
    assert (pos >= 0).tolist() == [True, False, True, True]
    assert sorted_index.rows[pos[pos >= 0]].tolist() == [2, 0, 1]
    assert sorted(sorted_index.keys.column("id").to_pylist()) == [1, 2**63, 2**64 - 1]


def _decode(t: pa.Table, gen_dir: str = "g", rows: int | None = None) -> keyfile.KeyIndex:
    return keyfile.decode_index(seal(t, b"MWX1"), "f", gen_dir, rows)


def test_a_file_that_does_not_describe_its_generation_is_refused():
    keys = pa.table({"id": pa.array([4, 1, 4], pa.int64())})
    good = keyfile.index_columns(keys, ["id"], "g")
    assert _decode(good, "g", 3).keys.tolist() == [1, 4]
    meta = good.schema.metadata
    with pytest.raises(ValueError, match="not 'h'"):
        _decode(good, "h", 3)
    with pytest.raises(ValueError, match="for a generation of 4"):
        _decode(good, "g", 4)
    unsorted = pa.table(
        {"key": pa.array([4, 1], pa.int64()), "row": pa.array([2, 1], pa.int64())}
    ).append_column("_tombstone", pa.array([False, False]))
    with pytest.raises(ValueError, match="strictly increasing"):
        _decode(unsorted.replace_schema_metadata(meta))
    out_of_range = good.set_column(1, "row", pa.array([1, 3], pa.int64()))
    with pytest.raises(ValueError, match="out of range"):
        _decode(out_of_range.replace_schema_metadata(meta))
    with pytest.raises(ValueError, match="CRC"):
        data = bytearray(seal(good, b"MWX1"))
        data[20] ^= 0xFF
        keyfile.decode_index(bytes(data), "f", "g", 3)


@pytest.mark.parametrize("damage", ["missing", "flipped", "truncated", "foreign"])
def test_a_missing_damaged_or_foreign_file_gives_the_same_answers(tmp_path, monkeypatch, damage):
    t, model = _table(tmp_path)
    t.close()
    gens = _generation_dirs(t)
    path = os.path.join(gens[0], keyfile.KEY_INDEX_FILE)
    other = os.path.join(gens[1], keyfile.KEY_INDEX_FILE)  # another generation's file
    kind = "replaced" if damage == "foreign" else damage
    damage_file(path, kind, keep_bytes=40, donor=other)
    built = _count_builds(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clear_read_caches()
        _check(mq.MemWalTable.open(t.uri), model)
    assert built  # that generation's index was built from its keys
    named = [str(w.message) for w in caught if keyfile.KEY_INDEX_FILE in str(w.message)]
    assert bool(named) == (damage != "missing")


def _forge(path: str, change) -> None:
    """Rewrite the key index file at ``path`` with ``change`` applied to its columns
    (``{"key", "row", "_tombstone"}`` as numpy arrays): a valid file (framing, CRC,
    row count, generation) that lies."""
    gen_dir = os.path.basename(os.path.dirname(path))
    index = keyfile.decode_index(open(path, "rb").read(), path, gen_dir, None)
    cols = {"key": index.keys.copy(), "row": index.rows.copy(), "_tombstone": index.tombstone}
    change(cols)
    meta = {b"memwal.rows": str(index.num_rows).encode(), b"memwal.generation": gen_dir.encode()}
    t = pa.table(cols).replace_schema_metadata(meta)
    open(path, "wb").write(seal(t, b"MWX1"))


def _swap_live_rows(cols) -> None:
    live = np.flatnonzero(~cols["_tombstone"])[:2]
    cols["row"][live] = cols["row"][live[::-1]]


def test_a_valid_file_pointing_at_other_keys_rows_is_a_corrupt_file(tmp_path):
    """An index file whose framing, CRC and row count are right but whose rows are other
    keys' rows: a typed error naming it, never another key's row as the answer."""
    t, _ = _table(tmp_path)
    t.close()
    for g in _generation_dirs(t):
        _forge(os.path.join(g, keyfile.KEY_INDEX_FILE), _swap_live_rows)
    clear_read_caches()
    with pytest.raises(mq.CorruptFileError, match=keyfile.KEY_INDEX_FILE):
        mq.MemWalTable.open(t.uri).lookup(pa.array(np.arange(-3, 330, dtype=np.int64)))


@pytest.mark.parametrize(
    "key_type, lo, hi",
    [
        (pa.int8(), -128, 127),
        (pa.int16(), -30_000, 30_000),
        (pa.int32(), -(2**31), 2**31 - 1),
        (pa.uint8(), 0, 255),
        (pa.uint32(), 0, 2**32 - 1),
        (pa.int64(), -(2**63), 2**63 - 1),
        (pa.uint64(), 0, 2**64 - 1),
    ],
    ids=str,
)
@pytest.mark.parametrize("files", ["index files", "no index files"])
def test_lookups_of_every_integer_key_type_equal_a_model(tmp_path, key_type, lo, hi, files):
    """Keys at both ends of their type's range, negative keys, keys in several
    generations, deleted keys and keys deleted then written again: lookups, a full
    read and a count equal a model, with and without the flush's key index files
    (pylance's native MemWAL writes none)."""
    clear_read_caches()
    rng = np.random.default_rng(5)
    pool = sorted(
        {
            lo,
            hi,
            lo + 1,
            hi - 1,
            0,
            1,
            *(
                int(k)
                for k in rng.integers(lo, hi, 60, dtype=np.int64 if hi < 2**63 else np.uint64)
            ),
        }
    )
    schema = pa.schema([pa.field("id", key_type, False, PK), pa.field("v", pa.int64())])
    uri = str(tmp_path / "t")
    lance.write_dataset(
        pa.table({"id": pa.array(pool[::3], key_type), "v": [0] * len(pool[::3])}, schema=schema),
        uri,
    )
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = dict.fromkeys(pool[::3], 0)
    for step in range(1, 5):
        keys = sorted({pool[i] for i in rng.integers(0, len(pool), 25)})
        t.write(pa.table({"id": pa.array(keys, key_type), "v": [step] * len(keys)}, schema=schema))
        model.update(dict.fromkeys(keys, step))
        gone = sorted({pool[i] for i in rng.integers(0, len(pool), 8)})
        t.delete(pa.table({"id": pa.array(gone, key_type)}))
        for k in gone:
            model.pop(k, None)
        t.flush()
    t.close()
    if files == "no index files":
        for g in _generation_dirs(t):
            os.remove(os.path.join(g, keyfile.KEY_INDEX_FILE))
    clear_read_caches()
    r = mq.MemWalTable.open(t.uri)
    got = r.lookup(pa.array(pool, key_type)).to_pydict()
    assert dict(zip(got["id"], got["v"])) == model
    for k in pool[::7]:
        got = r.lookup(pa.array([k], key_type)).to_pydict()
        assert dict(zip(got["id"], got["v"])) == ({k: model[k]} if k in model else {})
    whole = r.to_table()
    assert dict(zip(whole["id"].to_pylist(), whole["v"].to_pylist())) == model
    assert r.count_rows() == len(model)
