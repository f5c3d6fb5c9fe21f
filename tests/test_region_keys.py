"""The region keys file (``memwal_region_keys.bin``): each flush writes the keys of the
region's unmerged generations into the new generation's directory, and a cold reader
reads one such file per region instead of a keys sidecar per generation.

Every reader (``count_rows``, ``to_table``, ``lookup``, in a table object read cold)
equals a dict model whether the files are used, missing, damaged, stale (an older
generation's file, covering fewer generations), foreign (parts of other flushes), or
cut to their newest generations by the row bound; after a merge, the next flush's file
leaves the merged generations out, and a writer opened afresh continues the file its
predecessor wrote.
"""

from __future__ import annotations

import os
import warnings

import lance
import pyarrow as pa
import pytest

import memwal_query as mq
from memwal_query.format import keyfile
from memwal_query.storage import paths

from helpers import PK, clear_read_caches, damage_file

SCHEMA = pa.schema([pa.field("id", pa.int64(), False, PK), pa.field("v", pa.int64())])


def _rows(keys: list[int], v: int) -> pa.Table:
    return pa.table({"id": keys, "v": [v] * len(keys)}, schema=SCHEMA)


def _round(t: mq.MemWalTable, model: dict, step: int) -> None:
    """Upsert and delete keys of the base and new ones, then flush."""
    keys = list(range(step * 20, 260 + step * 20, 3))
    t.write(_rows(keys, step + 1))
    model.update(dict.fromkeys(keys, step + 1))
    gone = list(range(step, 400, 13))
    t.delete(pa.table({"id": pa.array(gone, pa.int64())}))
    for k in gone:
        model.pop(k, None)
    t.flush()


def _table(tmp_path, rounds: int = 4) -> tuple[mq.MemWalTable, dict]:
    """Two regions, ``rounds`` flushed generations each."""
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(list(range(0, 400, 2)), 0), uri)
    spec = mq.bucket_spec(lance.dataset(uri).lance_schema, "id", 2)
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    model = dict.fromkeys(range(0, 400, 2), 0)
    for step in range(rounds):
        _round(t, model, step)
    return t, model


def _generations(t: mq.MemWalTable) -> dict[str, list[tuple[int, str]]]:
    """Per region, its unmerged generations (number, directory URI), oldest first."""
    merged = t.catalog.index().merged_generations()
    out = {}
    for r in t.catalog.region_ids():
        gens = t.catalog.region_manifest(r).flushed_generations
        out[r] = sorted(
            (g.generation, paths.generation_path(t.uri, r, g.path))
            for g in gens
            if g.generation > merged.get(r, 0)
        )
    return out


def _answers(uri: str, model: dict) -> None:
    """A cold reader's count, full read and lookups equal the model."""
    clear_read_caches()
    other = mq.MemWalTable.open(uri)
    assert other.count_rows() == len(model)
    got = other.to_table().to_pydict()
    assert dict(zip(got["id"], got["v"])) == model
    clear_read_caches()
    found = other.lookup(pa.array(list(range(-5, 460)), pa.int64())).to_pydict()
    assert dict(zip(found["id"], found["v"])) == model
    clear_read_caches()
    assert mq.MemWalTable.open(uri).count_rows() == len(model)


def _keys_sidecar_reads(monkeypatch) -> list[str]:
    """Record every keys sidecar read."""
    seen: list[str] = []
    real = keyfile.read

    def counted(io, uri):
        seen.append(uri)
        return real(io, uri)

    monkeypatch.setattr(keyfile, "read", counted)
    return seen


def test_the_file_holds_the_keys_sidecars_of_the_unmerged_generations(tmp_path):
    t, _ = _table(tmp_path)
    io = t.catalog.io
    for gens in _generations(t).values():
        assert len(gens) == 4
        parts = keyfile.read_region(io, gens[-1][1])
        assert parts is not None
        assert [(p.generation, p.path) for p in parts] == [
            (g, uri.rsplit("/", 1)[-1]) for g, uri in gens
        ]
        for part, (_, uri) in zip(parts, gens):
            assert part.keys.equals(keyfile.read(io, uri))
    t.close()


def test_a_cold_count_reads_one_file_per_region(tmp_path, monkeypatch):
    t, model = _table(tmp_path)
    t.close()
    seen = _keys_sidecar_reads(monkeypatch)
    clear_read_caches()
    assert mq.MemWalTable.open(t.uri).count_rows() == len(model)
    assert seen == []  # every generation's keys came from its region's file
    _answers(t.uri, model)


@pytest.mark.parametrize("damage", ["missing", "flipped", "truncated", "stale", "foreign"])
def test_a_missing_damaged_or_stale_file_gives_the_same_answers(tmp_path, monkeypatch, damage):
    t, model = _table(tmp_path)
    t.close()
    gens = list(_generations(t).values())[0]
    newest = os.path.join(gens[-1][1], keyfile.REGION_KEYS_FILE)
    # stale: an older generation's file (covers fewer generations); foreign: the other
    # region's file (parts of flushes this region does not have)
    donor = {
        "stale": gens[1][1],
        "foreign": list(_generations(t).values())[1][-1][1],
    }.get(damage)
    damage_file(
        newest,
        "replaced" if donor else damage,
        keep_bytes=64,
        donor=donor and os.path.join(donor, keyfile.REGION_KEYS_FILE),
    )
    seen = _keys_sidecar_reads(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clear_read_caches()
        assert mq.MemWalTable.open(t.uri).count_rows() == len(model)
        by_count = list(seen)
        _answers(t.uri, model)
    uncovered = {"missing": 4, "flipped": 4, "truncated": 4, "stale": 2, "foreign": 4}[damage]
    # the count read exactly the generations the file does not cover from their sidecars
    assert sorted(by_count) == sorted(uri for _, uri in gens[len(gens) - uncovered :])
    named = [str(w.message) for w in caught if keyfile.REGION_KEYS_FILE in str(w.message)]
    assert bool(named) == (damage in ("flipped", "truncated"))


def test_merged_generations_leave_the_file_and_a_new_writer_continues_it(tmp_path):
    t, model = _table(tmp_path, rounds=3)
    t.maintenance.merge()
    for step in range(3, 5):
        _round(t, model, step)
    t.close()
    t = mq.MemWalTable.open(t.uri)  # a new writer: starts from the file it finds
    for step in range(5, 7):
        _round(t, model, step)
    t.close()
    io = t.catalog.io
    merged = t.catalog.index().merged_generations()
    for region, gens in _generations(t).items():
        assert merged.get(region, 0) == 3 and len(gens) == 4
        parts = keyfile.read_region(io, gens[-1][1])
        assert parts is not None
        assert [(p.generation, p.path) for p in parts] == [
            (g, uri.rsplit("/", 1)[-1]) for g, uri in gens
        ]
    _answers(t.uri, model)


def test_the_row_bound_keeps_the_newest_generations(tmp_path, monkeypatch):
    monkeypatch.setattr(keyfile, "REGION_KEYS_MAX_ROWS", 100)
    t, model = _table(tmp_path)
    t.close()
    for gens in _generations(t).values():
        parts = keyfile.read_region(t.catalog.io, gens[-1][1])
        assert parts is not None
        assert 1 <= len(parts) < len(gens)
        assert [p.generation for p in parts] == [g for g, _ in gens][-len(parts) :]
    _answers(t.uri, model)


def test_a_failed_write_of_the_file_does_not_fail_the_flush(tmp_path, monkeypatch):
    real = keyfile.write_region
    calls = []

    def fails_once(io, uri, parts):
        calls.append(uri)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(io, uri, parts)

    monkeypatch.setattr(keyfile, "write_region", fails_once)
    uri = str(tmp_path / "t")
    lance.write_dataset(_rows(list(range(0, 400, 2)), 0), uri)
    t = mq.MemWalTable.initialize(uri)
    model = dict.fromkeys(range(0, 400, 2), 0)
    for step in range(4):
        _round(t, model, step)
    t.close()
    gens = list(_generations(t).values())[0]
    assert len(gens) == 4 and len(calls) == 4
    assert not os.path.exists(os.path.join(gens[1][1], keyfile.REGION_KEYS_FILE))
    parts = keyfile.read_region(t.catalog.io, gens[-1][1])
    assert parts is not None and [p.generation for p in parts] == [3, 4]  # afresh after it
    _answers(t.uri, model)


def test_a_part_of_another_flush_of_the_same_number_is_not_taken(tmp_path, monkeypatch):
    """A file whose newest part names the generation's number but another directory
    (a flush that failed and was retried) holding other keys: the region's file is not
    taken as a whole, and that part not at all."""
    t, model = _table(tmp_path)
    t.close()
    gens = list(_generations(t).values())[0]
    newest = gens[-1][1]
    parts = keyfile.read_region(t.catalog.io, newest)
    assert parts is not None and len(parts) == len(gens)
    last = parts[-1]
    bogus = last.keys.set_column(
        0, last.keys.schema.field(0), pa.compute.add(last.keys.column(0), 100_000)
    )
    retried = keyfile.RegionKeysPart(last.generation, "0badf00d_gen_4", bogus)
    data = keyfile.encode_region([*parts[:-1], retried])
    open(os.path.join(newest, keyfile.REGION_KEYS_FILE), "wb").write(data)
    seen = _keys_sidecar_reads(monkeypatch)
    clear_read_caches()
    assert mq.MemWalTable.open(t.uri).count_rows() == len(model)
    assert seen == [newest]  # that generation's own keys sidecar
    _answers(t.uri, model)


def test_the_newest_row_flags_spare_a_cold_reader_the_dedup(tmp_path, monkeypatch):
    """The file flags the last row of each key; a cold reader whose view holds exactly
    the file's generations takes them, and one of a file without them (an older
    writer's) deduplicates: same answers."""
    from memwal_query.read import newer

    t, model = _table(tmp_path)
    t.close()
    for gens in _generations(t).values():
        got = keyfile.read_region_table(t.catalog.io, gens[-1][1])
        assert got is not None
        whole, parts = got
        ids = whole.column("id").to_pylist()
        last = {k: i for i, k in enumerate(ids)}
        want = [last[k] == i for i, k in enumerate(ids)]
        assert whole.column(keyfile.NEWEST_COLUMN).to_pylist() == want
        assert keyfile.NEWEST_COLUMN not in parts[0].keys.column_names
    dedups: list[int] = []
    real = newer.int_runs

    def counted(ints):
        dedups.append(len(ints))
        return real(ints)

    monkeypatch.setattr(newer, "int_runs", counted)
    clear_read_caches()
    assert mq.MemWalTable.open(t.uri).count_rows() == len(model)
    assert dedups == []
    for gens in _generations(t).values():  # as an older writer wrote them
        path = os.path.join(gens[-1][1], keyfile.REGION_KEYS_FILE)
        parts = keyfile.read_region(t.catalog.io, gens[-1][1])
        monkeypatch.setattr(keyfile, "_newest_flags", lambda _: None)
        open(path, "wb").write(keyfile.encode_region(parts))
        monkeypatch.undo()
        monkeypatch.setattr(newer, "int_runs", counted)
    clear_read_caches()
    assert mq.MemWalTable.open(t.uri).count_rows() == len(model)
    assert len(dedups) == 2  # one per region
    _answers(t.uri, model)
