"""``count(*)`` of the base counted on the base version's key flags (one scan of its keys
per version, kept for the next queries): DataFusion's ``count(*)`` and ``count_rows``
equal a dict model before and after merges, with newer keys in generations, MemTables
and WAL tails, and fall back to scanning (same answers) when the flags do not apply: a
key in two live base rows, a key range too wide, string keys.
"""

from __future__ import annotations

import shutil
import threading

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.read import provider
from memwal_query.read.dedup import KeySet

from helpers import PK, clear_read_caches

SCHEMA = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])


def _rows(keys, v: int, schema: pa.Schema = SCHEMA) -> pa.Table:
    return pa.table({"id": list(keys), "v": [v] * len(keys)}, schema=schema)


class _KeyScans:
    """Counts the base scans of the key column alone."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = lance.LanceDataset.scanner

        def scanner(ds, *args, **kwargs):
            if kwargs.get("columns") == ["id"] and "_mem_wal" not in ds.uri:
                self.calls += 1
            return real(ds, *args, **kwargs)

        monkeypatch.setattr(lance.LanceDataset, "scanner", scanner)


def _sql_count(t: mq.MemWalTable) -> int:
    ctx = datafusion.SessionContext()
    ctx.register_table("t", t.provider())
    return ctx.sql("SELECT count(*) AS n FROM t").to_arrow_table().column(0)[0].as_py()


def _table(tmp_path, keys, schema: pa.Schema = SCHEMA, regions: int = 2):
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(keys, 0, schema), uri, max_rows_per_file=100)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", regions)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    return t, dict.fromkeys(keys, 0)


def _round(t: mq.MemWalTable, model: dict, rng, step: int, hi: int, flush: bool) -> None:
    keys = sorted({int(k) for k in rng.integers(-20, hi + 40, 40)})
    t.write(_rows(keys, step))
    model.update(dict.fromkeys(keys, step))
    gone = sorted({int(k) for k in rng.integers(-20, hi + 40, 8)})
    t.delete(pa.table({"id": pa.array(gone, pa.int64())}))
    for k in gone:
        model.pop(k, None)
    if flush:
        t.flush()


def test_sql_count_scans_the_base_keys_once_per_base_version(tmp_path, monkeypatch):
    clear_read_caches()
    t, model = _table(tmp_path, range(0, 350))
    rng = np.random.default_rng(7)
    scans = _KeyScans(monkeypatch)
    versions = set()
    for step in range(1, 6):
        _round(t, model, rng, step, 350, flush=step % 2 == 0)
        if step in (2, 4):
            t.maintenance.merge()  # a new base version, fragments with deletion files
        versions.add(lance.dataset(t.uri).version)
        assert _sql_count(t) == len(model)
        assert t.count_rows() == len(model)
    # a reader of its own (WAL tails, no writer): the same answer
    assert _sql_count(mq.MemWalTable.open(t.uri)) == len(model)
    assert scans.calls == len(versions) == 3  # once per base version, not per query
    assert len(lance.dataset(t.uri).get_fragments()) > 2  # several base partitions


@pytest.mark.parametrize(
    "keys",
    [
        [*range(0, 200), *range(100, 150)],  # a key in two live base rows
        [*range(0, 100), 1 << 40],  # a range wider than the flags allow
    ],
    ids=["duplicate", "wide"],
)
def test_counts_scan_when_the_flags_do_not_apply(tmp_path, monkeypatch, keys):
    clear_read_caches()
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(keys, 0), uri, max_rows_per_file=100)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    rows = len(keys)  # base rows, duplicates included
    t.write(_rows([5, 120, 500], 1))  # 5 and 120: base keys (120 in two rows)
    t.delete(pa.table({"id": pa.array([7, 99], pa.int64())}))
    base_kept = sum(1 for k in keys if k not in (5, 120, 7, 99))
    expected = base_kept + 3
    assert provider._base_keys(lance.dataset(uri), ["id"]) is None
    assert _sql_count(t) == expected
    assert t.count_rows() == expected
    assert rows > base_kept


def test_string_keys_count_by_scanning(tmp_path):
    clear_read_caches()
    schema = pa.schema([pa.field("id", pa.string(), False, PK), pa.field("v", pa.int64())])
    keys = [f"k{i:04d}" for i in range(250)]
    t, model = _table(tmp_path, keys, schema)
    t.write(_rows(["k0001", "k0300"], 1, schema))
    t.delete(pa.table({"id": pa.array(["k0002"], pa.string())}))
    assert _sql_count(t) == 250 - 1 + 1
    assert t.count_rows() == 250


@pytest.mark.parametrize("spread", [1_000, 1 << 40])  # a dense set, a sorted one
def test_mark_sets_the_flags_of_the_keys_in_range(spread):
    rng = np.random.default_rng(3)
    keys = np.unique(rng.integers(-spread, spread, 300)).astype(np.int64)
    s = KeySet.of_ints("id", [keys])
    windows = [(int(keys[0]) - 5, 1000), (int(keys[150]) - 500, 1000), (int(keys[-1]) - 9, 10)]
    for lo, size in [*windows, (int(keys[-1]) + 1, 50)]:
        into = np.zeros(size, dtype=bool)
        into[::7] = True  # flags already set stay set
        s.mark(into, lo)
        want = np.zeros(size, dtype=bool)
        want[::7] = True
        inside = keys[(keys >= lo) & (keys < lo + size)]
        want[inside - lo] = True
        assert np.array_equal(into, want)
    with pytest.raises(TypeError):
        KeySet(pa.table({"id": pa.array(["a"])})).mark(np.zeros(3, dtype=bool), 0)


def _check(t: mq.MemWalTable, model: dict) -> None:
    got = t.to_table()
    assert dict(zip(got["id"].to_pylist(), got["v"].to_pylist())) == model
    assert _sql_count(t) == t.count_rows() == len(model)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12])
def test_counts_equal_a_model_as_keys_widen_reappear_and_versions_are_pinned(tmp_path, seed):
    """Negative keys, a key range that widens with each merged version, base keys
    deleted and written again, tombstones of keys never written, WAL tails, MemTables
    and pinned old versions: the counts are the model's."""
    clear_read_caches()
    rng = np.random.default_rng(seed)
    base = sorted({int(k) for k in rng.integers(-300, 300, 250)})
    t, model = _table(tmp_path, base)
    pinned: list[tuple[int, dict]] = []
    for step in range(1, 7):
        hi = 300 + 400 * step  # each merge widens the base's key range
        keys = sorted({int(k) for k in rng.integers(-hi, hi, 30)})
        back = [k for k in base if k not in model][:5]  # deleted base keys, written again
        t.write(_rows(sorted({*keys, *back}), step))
        model.update(dict.fromkeys({*keys, *back}, step))
        gone = sorted({*rng.choice(sorted(model), 6).tolist(), hi + 7, -hi - 7})
        t.delete(pa.table({"id": pa.array(gone, pa.int64())}))
        for k in gone:
            model.pop(int(k), None)
        _check(t, model)
        _check(mq.MemWalTable.open(t.uri), model)  # WAL tails of a reader of its own
        if step % 2 == 0:
            t.flush()
            _check(t, model)
        if step % 3 == 0:
            t.flush()
            t.maintenance.merge()
            pinned.append((lance.dataset(t.uri).version, dict(model)))
            _check(t, model)
    for version, then in pinned:
        old = t.provider(as_of=version)
        ctx = datafusion.SessionContext()
        ctx.register_table("t", old)
        assert ctx.sql("SELECT count(*) FROM t").to_arrow_table().column(0)[0].as_py() == len(then)
        assert old.count_rows() == len(then)


def test_a_table_created_again_at_the_uri_is_not_counted_on_the_first_ones_flags(tmp_path):
    """Deleted and created again at the same URI, a table has versions of the same
    numbers as the first one had: its count is its own."""
    clear_read_caches()
    uri = tmp_path / "t"
    t, _ = _table(tmp_path, range(0, 100), regions=1)
    t.write(_rows([5], 1))
    assert _sql_count(t) == 100
    version = lance.dataset(str(uri)).version
    t.close()
    shutil.rmtree(uri)
    t, _ = _table(tmp_path, range(1000, 1100), regions=1)
    assert lance.dataset(str(uri)).version == version
    t.write(_rows([5], 1))  # not a key of this table's base
    assert _sql_count(t) == t.count_rows() == 101


def test_a_merge_and_deletes_committed_mid_count_leave_the_count_of_its_view(tmp_path, monkeypatch):
    """A maintainer merges and a writer deletes while a ``count(*)`` scans the base's
    keys (paused there): the count is of the view it started on; the next is of the
    new one."""
    clear_read_caches()
    t, model = _table(tmp_path, range(0, 300))
    t.write(_rows(range(250, 320), 1))
    t.flush()
    model.update(dict.fromkeys(range(250, 320), 1))
    before = len(model)
    scanning, go = threading.Event(), threading.Event()
    real = provider._scan_base_keys

    def paused(base, pk):
        scanning.set()
        assert go.wait(60)
        return real(base, pk)

    monkeypatch.setattr(provider, "_scan_base_keys", paused)
    got: list[int] = []
    query = threading.Thread(target=lambda: got.append(_sql_count(t)))
    query.start()
    assert scanning.wait(60)
    t.maintenance.merge()  # a new base version: the merged keys in it
    t.delete(pa.table({"id": pa.array(range(0, 40), pa.int64())}))
    t.flush()
    go.set()
    query.join(60)
    assert got == [before]
    assert _sql_count(t) == t.count_rows() == before - 40


def _flagged(k: provider._BaseKeys) -> list[int]:
    return (np.flatnonzero(k.flags) + k.lo).tolist()


def test_flags_of_a_new_version_are_derived_from_the_last_ones(tmp_path, monkeypatch):
    """Each base version's flags equal a full scan's; a version with the same fragments
    shares the last flags, one whose few fragments changed reads only those (and the
    fragments they replaced), whatever made it: a merge, a delete, a compaction."""
    clear_read_caches()
    t, model = _table(tmp_path, range(0, 1000), regions=2)
    uri = t.uri
    full = []
    real = provider._scan_base_keys
    monkeypatch.setattr(
        provider, "_scan_base_keys", lambda base, pk: full.append(base.version) or real(base, pk)
    )

    def check(expect_scan: bool) -> provider._BaseKeys:
        ds = lance.dataset(uri)
        before = len(full)
        got = provider._base_keys(ds, ["id"])
        assert got is not None
        assert _flagged(got) == _flagged(real(ds, ["id"]))
        assert (len(full) > before) == expect_scan
        assert _sql_count(t) == len(model)
        return got

    first = check(expect_scan=True)
    lance.dataset(uri).create_scalar_index("id", "BTREE")  # same fragments
    assert check(expect_scan=False).flags is first.flags
    # a merge of keys in one fragment, and new keys: one deletion file, one new fragment
    t.write(_rows(range(110, 130), 1))
    t.write(_rows(range(1000, 1010), 1))
    t.delete(pa.table({"id": pa.array([150, 151, 5000], pa.int64())}))
    model.update(dict.fromkeys([*range(110, 130), *range(1000, 1010)], 1))
    model.pop(150)
    model.pop(151)
    t.flush()
    t.maintenance.merge()
    check(expect_scan=False)
    lance.dataset(uri).delete("id >= 300 AND id < 320")  # a delete of the table's own
    for k in range(300, 320):
        model.pop(k)
    check(expect_scan=False)
    before = {f.fragment_id for f in lance.dataset(uri).get_fragments()}
    lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=100)
    assert {f.fragment_id for f in lance.dataset(uri).get_fragments()} != before
    check(expect_scan=False)
    # most fragments changed: a scan
    t.write(_rows(range(0, 1000, 3), 2))
    model.update(dict.fromkeys(range(0, 1000, 3), 2))
    t.flush()
    t.maintenance.merge()
    check(expect_scan=True)


def test_flags_are_scanned_when_the_last_version_is_unreadable(tmp_path, monkeypatch):
    clear_read_caches()
    t, model = _table(tmp_path, range(0, 1000), regions=2)
    uri = t.uri
    t.write(_rows(range(200, 210), 1))
    t.flush()
    t.maintenance.merge()
    lance.dataset(uri).delete("id >= 300 AND id < 330")
    old = lance.dataset(uri)
    assert provider._base_keys(old, ["id"]) is not None
    lance.dataset(uri).optimize.compact_files(target_rows_per_fragment=100)
    new = lance.dataset(uri)
    gone = {f.fragment_id for f in old.get_fragments()} - {
        f.fragment_id for f in new.get_fragments()
    }
    for f in old.get_fragments():  # the replaced fragments' files removed
        if f.fragment_id in gone:
            for d in f.data_files():
                (tmp_path / "t" / "data" / d.path).unlink()
    assert gone
    scans = []
    real = provider._scan_base_keys
    monkeypatch.setattr(
        provider, "_scan_base_keys", lambda base, pk: scans.append(1) or real(base, pk)
    )
    got = provider._base_keys(new, ["id"])
    assert got is not None and scans == [1]
    assert _flagged(got) == _flagged(real(new, ["id"]))
    model.update(dict.fromkeys(range(200, 210), 1))
    assert _sql_count(t) == len(model) - 30


def _flag_keys(got: provider._BaseKeys) -> set[int]:
    return set((np.flatnonzero(got.flags) + got.lo).tolist())


@pytest.mark.parametrize("seed", range(3))
def test_derived_flags_are_the_scanned_ones_under_any_lance_commit(tmp_path, monkeypatch, seed):
    """Flags derived from an earlier version's equal the live keys of every version
    plain Lance commits make (appends, deletes, updates, upserts, compactions, added
    columns, restores, overwrites, a key appended twice), of old versions read again,
    and with commits made through a dataset object the cache holds."""
    clear_read_caches()
    rng = np.random.default_rng(seed)
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(range(400), 0), uri, max_rows_per_file=50)
    versions = [lance.dataset(uri).version]
    held = lance.dataset(uri)
    derived = 0
    real = provider._derived_base_keys

    def counted(base, pk):
        nonlocal derived
        got = real(base, pk)
        derived += got is not None
        return got

    def check(ds: lance.LanceDataset) -> None:
        got = provider._base_keys(ds, ["id"])
        keys = ds.to_table(columns=["id"]).column("id").to_numpy()
        if len(np.unique(keys)) != len(keys):
            assert got is None
        else:
            assert got is not None and _flag_keys(got) == set(keys.tolist())

    monkeypatch.setattr(provider, "_derived_base_keys", counted)
    check(held)
    top = 400
    for step in range(1, 15):
        ds = held if rng.random() < 0.5 else lance.dataset(uri)
        op = rng.choice(["append", "delete", "update", "upsert", "compact", "column", "restore"])
        if step % 7 == 0:
            op = "overwrite" if step == 7 else "twice"
        try:
            if op == "append":
                n = int(rng.integers(1, 30))
                lance.write_dataset(_rows(range(top, top + n), step), uri, mode="append")
                top += n
            elif op == "delete":
                lo = int(rng.integers(0, top))
                ds.delete(f"id >= {lo} AND id < {lo + int(rng.integers(1, 60))}")
            elif op == "update":
                lo = int(rng.integers(0, top))
                ds.update({"v": "v + 1"}, where=f"id >= {lo} AND id < {lo + 10}")
            elif op == "upsert":
                keys = sorted({int(k) for k in rng.integers(0, top + 20, 15)})
                top = max(top, keys[-1] + 1)
                builder = ds.merge_insert("id").when_matched_update_all()
                builder.when_not_matched_insert_all().execute(_rows(keys, step))
            elif op == "compact":
                ds.optimize.compact_files(target_rows_per_fragment=120, num_threads=1)
            elif op == "column":
                ds.add_columns({f"c{step}": "v * 2"})
            elif op == "restore":
                ds.checkout_version(int(rng.choice(versions))).restore()
            elif op == "overwrite":
                top = int(rng.integers(50, 300))
                lance.write_dataset(_rows(range(top), step), uri, mode="overwrite")
            else:  # a key in two live rows: no flags
                lance.write_dataset(_rows([top - 1], step), uri, mode="append")
        except (OSError, ValueError, RuntimeError):  # a commit through a stale object
            continue
        latest = lance.dataset(uri)
        versions.append(latest.version)
        check(latest)
        check(lance.dataset(uri, version=int(rng.choice(versions))))
        if rng.random() < 0.5:
            held = latest
    assert derived  # derivations taken, not only scans


@pytest.mark.parametrize("order", ["descending", "alternating"])
def test_the_flags_hold_about_one_and_a_half_flags_per_key_of_the_span(
    tmp_path, monkeypatch, order
):
    """Batches whose keys widen the range downwards, or on either side in turn, grow the
    flags to the keys' span and some spare room: never by half again per batch, which
    would reach the limit on flags and leave the count to the scan."""
    monkeypatch.setattr(provider, "BASE_BATCH_ROWS", 100)
    keys = list(range(20_000, 0, -1))
    if order == "alternating":
        middle = len(keys) // 2
        low, high = keys[middle:], keys[:middle][::-1]
        keys = [k for pair in zip(high, low, strict=True) for k in pair]
        keys = [k for i in range(0, len(keys), 200) for k in sorted(keys[i : i + 200])]
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(keys, 0), uri, max_rows_per_file=100)
    ds = lance.dataset(uri)
    clear_read_caches()
    flags = provider._base_keys(ds, ["id"])
    assert flags is not None
    assert len(flags.flags) <= 1.5 * 20_000 + 2
    assert int(np.count_nonzero(flags.flags)) == 20_000
    assert flags.lo <= 1 and flags.lo + len(flags.flags) > 20_000
