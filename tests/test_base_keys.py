"""Key runs of the base's data files (``_mem_wal/_base_keys/``): written when the MemWAL
index is created, read by ``count(*)`` instead of scanning the base's key column.

Every count equals a dict model whether the summaries are used, missing, damaged, of
another data file, or unusable (a fragment with a deletion file after a merge; keys
that are not a few runs; string keys), with newer keys in flushed generations and in a
writer's MemTable, new keys and deletes, and runs ending at the int64 limit.
"""

from __future__ import annotations

import os
import shutil
import warnings

import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import basekeys
from memwal_query.storage import paths

from helpers import PK, clear_read_caches

SCHEMA = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])


def _rows(keys, v: int, schema: pa.Schema = SCHEMA) -> pa.Table:
    return pa.table({"id": list(keys), "v": [v] * len(keys)}, schema=schema)


def _summaries(uri: str) -> list[str]:
    d = os.path.join(paths.mem_wal_root(uri), basekeys.BASE_KEYS_DIR)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


class _KeyScans:
    """Records the base scans of the key column alone (what the count's fallback does)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[object] = []
        real = lance.LanceDataset.scanner

        def scanner(ds, *args, **kwargs):
            if kwargs.get("columns") == ["id"] and "_mem_wal" not in ds.uri:
                self.calls.append(kwargs.get("fragments"))
            return real(ds, *args, **kwargs)

        monkeypatch.setattr(lance.LanceDataset, "scanner", scanner)


def _table(tmp_path, base_keys, regions: int = 2) -> tuple[mq.MemWalTable, dict]:
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(base_keys, 0), uri, max_rows_per_file=100)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", regions)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    return t, dict.fromkeys(base_keys, 0)


def _changes(t: mq.MemWalTable, model: dict, rounds: int, seed: int, hi: int) -> None:
    """Upserts of base and new keys and deletes, each round flushed."""
    rng = np.random.default_rng(seed)
    for step in range(rounds):
        keys = sorted({int(k) for k in rng.integers(-20, hi + 40, 30)})
        t.write(_rows(keys, step + 1))
        model.update(dict.fromkeys(keys, step + 1))
        gone = sorted({int(k) for k in rng.integers(-20, hi + 40, 6)})
        t.delete(pa.table({"id": pa.array(gone, pa.int64())}))
        for k in gone:
            model.pop(k, None)
        t.flush()


def _cold_count(uri: str) -> int:
    clear_read_caches()
    return mq.MemWalTable.open(uri).count_rows()


def test_a_count_reads_the_runs_not_the_base_keys(tmp_path, monkeypatch):
    t, model = _table(tmp_path, range(1000, 1350))
    assert len(_summaries(t.uri)) == 4  # one per data file: 100, 100, 100, 50 rows
    _changes(t, model, 4, seed=1, hi=1400)
    scans = _KeyScans(monkeypatch)
    assert _cold_count(t.uri) == len(model)
    assert scans.calls == []
    # the same count scanning the keys
    shutil.rmtree(os.path.join(paths.mem_wal_root(t.uri), basekeys.BASE_KEYS_DIR))
    assert _cold_count(t.uri) == len(model)
    assert scans.calls == [None]  # the whole base


def test_memtable_keys_count_once_with_the_flushed_ones(tmp_path):
    t, model = _table(tmp_path, range(0, 300))
    _changes(t, model, 3, seed=2, hi=300)
    # not flushed: the writer's MemTable holds keys that the generations hold too
    keys = list(range(-5, 320, 7))
    t.write(_rows(keys, 9))
    model.update(dict.fromkeys(keys, 9))
    t.delete(pa.table({"id": pa.array([1, 2, 3, 400], pa.int64())}))
    for k in (1, 2, 3):
        model.pop(k, None)
    clear_read_caches()
    assert t.count_rows() == len(model)
    assert mq.MemWalTable.open(t.uri).count_rows() == len(model)  # WAL tail


def test_a_damaged_or_foreign_summary_is_not_used(tmp_path, monkeypatch):
    t, model = _table(tmp_path, range(0, 350))
    _changes(t, model, 2, seed=3, hi=350)
    d = os.path.join(paths.mem_wal_root(t.uri), basekeys.BASE_KEYS_DIR)
    rows = {n: _rows_of(d, n) for n in _summaries(t.uri)}
    full = [n for n, r in rows.items() if r == 100]
    small = next(n for n, r in rows.items() if r == 50)
    flipped, other = full[0], full[1]
    data = bytearray(open(os.path.join(d, flipped), "rb").read())
    data[10] ^= 0x40
    open(os.path.join(d, flipped), "wb").write(bytes(data))
    # the 50-row data file's summary in place of a 100-row one's: rows do not match
    shutil.copy(os.path.join(d, small), os.path.join(d, other))
    scans = _KeyScans(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _cold_count(t.uri) == len(model)
    text = " ".join(str(w.message) for w in caught)
    assert flipped in text and "CRC" in text
    assert other in text and "rows" in text
    assert len(scans.calls) == 1 and len(scans.calls[0]) == 2  # those two fragments only


def _rows_of(d: str, name: str) -> int:
    from memwal_query.format.rowfile import unseal

    t = unseal(open(os.path.join(d, name), "rb").read(), name, b"MWB1", "x")
    return int(pa.compute.sum(t.column("length")).as_py())


def test_fragments_with_deletions_are_scanned_after_a_merge(tmp_path, monkeypatch):
    t, model = _table(tmp_path, range(0, 350))
    keys = [*range(200, 260, 3), *range(400, 420)]  # base keys of the last two files only
    t.write(_rows(keys, 1))
    model.update(dict.fromkeys(keys, 1))
    t.delete(pa.table({"id": pa.array([300, 301, 410], pa.int64())}))
    for k in (300, 301, 410):
        model.pop(k, None)
    t.flush()
    t.maintenance.merge()
    _changes(t, model, 2, seed=5, hi=350)
    base = lance.dataset(t.uri)
    with_deletions = {f.fragment_id for f in base.get_fragments() if f.metadata.deletion_file}
    assert with_deletions  # the merge deleted overwritten base rows
    scans = _KeyScans(monkeypatch)
    assert _cold_count(t.uri) == len(model)
    scanned = {f.fragment_id for f in scans.calls[0]}
    assert with_deletions <= scanned
    assert {f.fragment_id for f in base.get_fragments()} - scanned  # the others: runs


def test_keys_that_are_not_runs_get_no_summary(tmp_path):
    keys = np.random.default_rng(6).permutation(10_000)[:350]
    t, model = _table(tmp_path, [int(k) for k in keys])
    assert _summaries(t.uri) == []
    _changes(t, model, 2, seed=7, hi=10_000)
    assert _cold_count(t.uri) == len(model)


def test_runs_at_the_int64_limits(tmp_path):
    top = np.iinfo(np.int64).max
    low = np.iinfo(np.int64).min
    base = list(range(low, low + 40)) + list(range(-30, 30)) + list(range(top - 59, top + 1))
    t, model = _table(tmp_path, base)
    assert len(_summaries(t.uri)) == 2
    keys = [low, low + 1, 5, top - 1, top, top - 100]
    t.write(_rows(keys, 1))
    model.update(dict.fromkeys(keys, 1))
    t.delete(pa.table({"id": pa.array([top - 2, low + 39], pa.int64())}))
    for k in (top - 2, low + 39):
        model.pop(k, None)
    t.flush()
    assert _cold_count(t.uri) == len(model)


def test_string_keys_take_the_scan(tmp_path):
    schema = pa.schema([pa.field("id", pa.string(), False, PK), pa.field("v", pa.int64())])
    uri = str(tmp_path / "s")
    lance.write_dataset(_rows([f"k{i:04d}" for i in range(200)], 0, schema), uri)
    t = mq.MemWalTable.initialize(uri)
    assert _summaries(uri) == []
    t.write(_rows([f"k{i:04d}" for i in range(150, 260)], 1, schema))
    t.flush()
    assert _cold_count(uri) == 260


def test_runs_of_keys():
    keys = np.array([*range(10, 40), *range(0, 20), 7, *range(7, 20)], np.int64)
    got = basekeys.runs(keys)
    assert got is not None
    assert got[0].tolist() == [10, 0, 7, 7] and got[1].tolist() == [30, 20, 1, 13]
    assert basekeys.runs(np.arange(0, 2 * basekeys.MAX_RUNS + 2, 2)) is None
    assert basekeys.runs(np.array([*range(15), 20], np.int64)) is None  # 2 runs in 16 keys
    assert basekeys.runs(np.array([*range(31), 40], np.int64)) is not None
    assert basekeys.summary_path("memory://t", "../x.lance") is None


@pytest.mark.parametrize("loop_max", [4096, 0])
@pytest.mark.parametrize("spread", [1_000, 1 << 40])  # a dense table; a sorted array
def test_keys_counted_in_ranges(monkeypatch, loop_max, spread):
    from memwal_query.read import dedup

    monkeypatch.setattr(dedup, "_RANGE_LOOP_MAX", loop_max)
    rng = np.random.default_rng(spread % 97 + loop_max)
    keys = rng.integers(-spread, spread, 300)
    s = dedup.KeySet(pa.table({"id": pa.array(keys, pa.int64())}))
    first = rng.integers(-2 * spread, 2 * spread, 50)
    last = first + rng.integers(0, spread, 50)
    distinct = np.unique(keys)
    want = sum(int(((distinct >= a) & (distinct <= b)).sum()) for a, b in zip(first, last))
    assert s.count_in_ranges(first, last) == want
    strings = dedup.KeySet(pa.table({"id": pa.array(["a"])}))
    assert strings.count_in_ranges(first, last) is None


def test_keys_wrapping_past_the_int64_limit_are_not_one_run(tmp_path):
    """``top`` then ``low`` in row order differ by 1 modulo 2**64: not consecutive keys."""
    top = np.iinfo(np.int64).max
    low = np.iinfo(np.int64).min
    base = list(range(top - 49, top + 1)) + list(range(low, low + 50))
    t, model = _table(tmp_path, base)
    keys = [low, low + 3, top]
    t.write(_rows(keys, 1))
    model.update(dict.fromkeys(keys, 1))
    t.flush()
    assert _summaries(t.uri)  # two runs
    assert _cold_count(t.uri) == len(model) == 100
    # a summary claiming one run across the limit is refused (a warning), and scanned
    (name,) = _summaries(t.uri)
    field = lance.dataset(t.uri).lance_schema.field("id").id()
    forged = basekeys.encode("id", field, 100, np.array([top - 49]), np.array([100]))
    path = os.path.join(paths.mem_wal_root(t.uri), basekeys.BASE_KEYS_DIR, name)
    open(path, "wb").write(forged)
    with pytest.warns(RuntimeWarning, match="past the int64 range"):
        assert _cold_count(t.uri) == 100


def test_a_count_asks_the_store_only_for_summaries_that_exist(tmp_path, monkeypatch):
    """One listing of the summaries' directory, then a read of each summary listed: a
    fragment without one (random keys, compacted or merged since) costs no request."""
    from memwal_query.storage.io import LocalFileIO

    rng = np.random.default_rng(5)
    random_keys = [int(k) for k in rng.permutation(np.arange(10_000, 10_600))]
    t, model = _table(tmp_path, list(range(0, 200)) + random_keys)
    assert len(_summaries(t.uri)) == 2  # the two data files of runs
    _changes(t, model, 2, seed=4, hi=900)
    reads: list[str] = []
    real = LocalFileIO.read_buffer

    def read_buffer(self, path):
        if basekeys.BASE_KEYS_DIR in path:
            reads.append(path)
        return real(self, path)

    monkeypatch.setattr(LocalFileIO, "read_buffer", read_buffer)
    assert _cold_count(t.uri) == len(model)
    assert sorted(os.path.basename(p) for p in reads) == _summaries(t.uri)
    shutil.rmtree(os.path.join(paths.mem_wal_root(t.uri), basekeys.BASE_KEYS_DIR))
    reads.clear()
    assert _cold_count(t.uri) == len(model)
    assert reads == []
