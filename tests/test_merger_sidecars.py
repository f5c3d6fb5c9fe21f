"""The merger reads keys first, then the winning rows in the background.

A batch's deletes and winners are decided from the generations' keys (the region keys
file of the batch's newest generation where it covers them, their own keys sidecars
otherwise); the winning rows are read from the rows sidecars while the deletes commit,
and reach the upsert commit as one table. These tests prove the shortcut never changes what a
merge leaves: missing or damaged sidecars fall back to the Lance tables; sidecars that
disagree with the manifest or with each other are a typed error before anything is
committed; a failure while the rows are read is that failure, never a lost commit race,
and leaves a state every reader answers correctly, which the next merge completes.
"""

import os
import warnings

import lance
import numpy as np
import pyarrow as pa
import pytest

from memwal_query.exceptions import CorruptFileError, MergeFailedError
from memwal_query.format import keyfile, rowfile
from memwal_query.maintain import merger
from memwal_query.storage import paths

from helpers import clear_read_caches, damage_file, expr_table, write_generation


def view(t):
    rows = t.provider().to_table().to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a key twice"
    return {r["id"]: r["val"] for r in rows}


def base_view(uri):
    rows = lance.dataset(uri).to_table(columns=["id", "val"]).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a key twice in the base table"
    return {r["id"]: r["val"] for r in rows}


def _generation_dirs(t, region):
    manifest = t.catalog.region_manifest(region)
    return [
        paths.generation_path(t.uri, region, g.path).removeprefix("file://")
        for g in manifest.flushed_generations
    ]


def _drop_region_files(t, region):
    """Remove the region's keys files: its generations' keys come from their own keys
    sidecars (what the tests damaging those sidecars need)."""
    for d in _generation_dirs(t, region):
        path = os.path.join(d, keyfile.REGION_KEYS_FILE)
        if os.path.exists(path):
            os.remove(path)


def _two_regions(base_uri):
    t = expr_table(base_uri)
    model = {k: float(k) for k in range(100)}
    region = write_generation(t, model, {"r": 0}, [0, 2, 200], [4, 6], 1.0)
    write_generation(t, model, {"r": 0}, [4, 8, 202], [0, 10], 2.0)
    write_generation(t, model, {"r": 0}, [12, 204], [14], 3.0)
    write_generation(t, model, {"r": 0}, [16, 206], [18], 4.0)
    write_generation(t, model, {"r": 1}, [1, 3, 201], [5, 7], 1.0)
    return t, model, region


@pytest.fixture(params=[0, 10**12], ids=["split", "one-commit"])
def separate_deletes(request, monkeypatch):
    """Both commit forms: deletes in a commit of their own, or with the upserts."""
    monkeypatch.setattr(merger, "SEPARATE_DELETE_MIN_BASE_ROWS", request.param)
    return request.param == 0


def test_missing_or_damaged_sidecars_merge_from_the_lance_tables(base_uri, separate_deletes):
    t, model, region = _two_regions(base_uri)
    _drop_region_files(t, region)
    gens = _generation_dirs(t, region)
    os.remove(os.path.join(gens[0], keyfile.KEYS_FILE))  # as written by pylance
    path = os.path.join(gens[1], keyfile.KEYS_FILE)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # a flipped bit: the CRC catches it
    open(path, "wb").write(bytes(data))
    os.remove(os.path.join(gens[2], rowfile.ROWS_FILE))
    path = os.path.join(gens[3], rowfile.ROWS_FILE)
    open(path, "wb").write(open(path, "rb").read()[:100])  # truncated
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t.maintenance.merge()
    damaged = " ".join(str(w.message) for w in seen)
    assert keyfile.KEYS_FILE in damaged and rowfile.ROWS_FILE in damaged
    assert base_view(t.uri) == model and view(t) == model
    assert t.maintenance.merge().merged == []


def _rewrite_keys(gen_dir, change):
    """Replace a generation's keys sidecar by a valid one holding ``change(keys)``."""
    from memwal_query.storage.factory import file_io_for

    io = file_io_for(gen_dir, None)
    keys = keyfile.read(io, gen_dir)
    keys = change(keys)
    addresses = keys.column("_rowaddr").to_numpy()
    keyfile.write(io, gen_dir, keys.drop_columns(["_rowaddr"]), ["id"], addresses)


def _region_file(t, region):
    """The region keys file of the region's newest generation."""
    return os.path.join(_generation_dirs(t, region)[-1], keyfile.REGION_KEYS_FILE)


def _rewrite_region_file(t, region, change):
    """Replace the newest generation's region keys file by a valid one (CRC and
    layout right) of ``change(parts)``."""
    from memwal_query.storage.factory import file_io_for

    newest = _generation_dirs(t, region)[-1]
    io = file_io_for(newest, None)
    parts = keyfile.read_region(io, newest)
    assert parts is not None and len(parts) == 4
    io.write(_region_file(t, region), keyfile.encode_region(change(parts)))


def _shifted(keys):
    """``keys`` with every key moved by 1000 (valid, but not the generation's keys)."""
    ids = keys.column("id").to_numpy() + 1000
    return keys.set_column(0, keys.schema.field("id"), pa.array(ids, pa.int64()))


def _change_keys(t, region, i, change, where):
    """Replace generation ``i``'s keys by ``change(keys)`` in a valid file ``where``:
    its own keys sidecar (the region keys files removed) or the region keys file."""
    if where == keyfile.KEYS_FILE:
        _drop_region_files(t, region)
        _rewrite_keys(_generation_dirs(t, region)[i], change)
        return
    _rewrite_region_file(
        t,
        region,
        lambda parts: [
            keyfile.RegionKeysPart(p.generation, p.path, change(p.keys)) if j == i else p
            for j, p in enumerate(parts)
        ],
    )


@pytest.mark.parametrize("where", [keyfile.KEYS_FILE, keyfile.REGION_KEYS_FILE])
def test_keys_that_disagree_with_the_manifest_commit_nothing(base_uri, separate_deletes, where):
    """A keys sidecar, or a (valid) region keys file's part, listing fewer rows than the
    manifest records is a typed error naming that file, raised before the deletes
    commit."""
    t, model, region = _two_regions(base_uri)
    _change_keys(t, region, 1, lambda k: k.slice(1), where)
    before = lance.dataset(t.uri).version
    with pytest.raises(MergeFailedError) as info:
        t.maintenance.merge()
    err = info.value.errors[region]
    assert isinstance(err, CorruptFileError) and where in str(err)
    assert region not in t.catalog.index().merged_generations()
    # the other region merged on its own (deletes and upserts); this one committed nothing
    assert lance.dataset(t.uri).version == before + (2 if separate_deletes else 1)
    assert view(t) == model


@pytest.mark.parametrize("where", [keyfile.KEYS_FILE, keyfile.REGION_KEYS_FILE])
def test_rows_that_disagree_with_the_keys_are_a_typed_error(base_uri, monkeypatch, where):
    """Keys and rows of a generation that differ (a valid keys sidecar or region keys
    file with other keys, counts right) stop the merge with a typed error; in one
    commit, nothing is committed."""
    monkeypatch.setattr(merger, "SEPARATE_DELETE_MIN_BASE_ROWS", 10**12)
    t, model, region = _two_regions(base_uri)
    _change_keys(t, region, 0, _shifted, where)
    before = lance.dataset(t.uri).version
    with pytest.raises(MergeFailedError) as info:
        t.maintenance.merge()
    err = info.value.errors[region]
    assert isinstance(err, CorruptFileError) and "disagree" in str(err)
    assert region not in t.catalog.index().merged_generations()
    assert lance.dataset(t.uri).version == before + 1  # the other region only
    if where == keyfile.REGION_KEYS_FILE:
        # a reader taking the region's keys from that file finds its rows' keys differ:
        # a typed error naming it, never a wrong answer; without it, the right one
        clear_read_caches()
        with pytest.raises(CorruptFileError) as read_err:
            view(t)
        assert keyfile.REGION_KEYS_FILE in read_err.value.path
        _drop_region_files(t, region)
        clear_read_caches()
    assert view(t) == model


def test_a_failure_reading_the_rows_is_that_failure(base_uri, separate_deletes, monkeypatch):
    """The rows read in the background fail (with the text of a lost race): the merge
    reports that error, no progress is recorded, every reader answers the model, and
    the next merge applies each delete once."""
    t, model, region = _two_regions(base_uri)
    before = lance.dataset(t.uri).version

    def failing(*args, **kwargs):
        raise OSError("storage went away (not a concurrent writer conflict)")

    monkeypatch.setattr(merger, "_upsert_rows", failing)
    with pytest.raises(MergeFailedError) as info:
        t.maintenance.merge()
    assert set(info.value.errors) == set(t.catalog.region_ids())
    assert all("storage went away" in str(e) for e in info.value.errors.values())
    assert t.catalog.index().merged_generations() == {}
    # the split form may have committed deletes (as a merger killed between its
    # commits does); the one-commit form committed nothing
    assert (lance.dataset(t.uri).version > before) == separate_deletes
    assert view(t) == model
    monkeypatch.undo()
    monkeypatch.setattr(merger, "SEPARATE_DELETE_MIN_BASE_ROWS", 0 if separate_deletes else 10**12)
    write_generation(t, model, {"r": 0}, [4, 6], [], 5.0)  # deleted keys written again
    t.maintenance.merge()
    assert base_view(t.uri) == model and view(t) == model


def test_upserts_read_slowly_reach_the_commit_whole(base_uri, monkeypatch):
    """Upserts still being read when the deletes have committed (a slow reader): the
    upsert commit waits for every region's rows and takes them as one table (Lance
    plans a table's join from its statistics), and leaves the model."""
    import time

    monkeypatch.setattr(merger, "SEPARATE_DELETE_MIN_BASE_ROWS", 0)
    t, model, region = _two_regions(base_uri)
    real = merger._upsert_rows
    sources = []

    def slow(*args, **kwargs):
        time.sleep(0.2)
        return real(*args, **kwargs)

    real_source = merger._Prepared.upsert_source

    def source(self):
        pending = not all(f.done() for f in self.parts)
        got = real_source(self)
        sources.append((pending, type(got), got.num_rows))
        return got

    monkeypatch.setattr(merger, "_upsert_rows", slow)
    monkeypatch.setattr(merger._Prepared, "upsert_source", source)
    merged = t.maintenance.merge()
    assert sources == [(True, pa.Table, merged.upserted)]
    assert merged.upserted == len({2, 200, 4, 8, 202, 12, 204, 16, 206, 1, 3, 201})
    assert base_view(t.uri) == model and view(t) == model
    ids = np.sort(lance.dataset(t.uri).to_table(columns=["id"]).column("id").to_numpy())
    assert (np.diff(ids) > 0).all()


def test_float_keyed_rows_that_disagree_with_the_keys_are_a_typed_error(tmp_path, monkeypatch):
    """A float primary key: a valid rows sidecar whose rows are in another order than
    the keys sidecar (each key given another key's values) stops the merge with a
    typed error too (NaN keys compare as equal to each other); nothing is committed."""
    import memwal_query as mq
    from memwal_query.storage.factory import file_io_for

    from helpers import PK

    monkeypatch.setattr(merger, "SEPARATE_DELETE_MIN_BASE_ROWS", 10**12)
    schema = pa.schema([pa.field("id", pa.float64(), False, PK), pa.field("val", pa.float64())])
    uri = str(tmp_path / "t")
    lance.write_dataset(pa.table({"id": [0.5, 1.5], "val": [0.0, 0.0]}, schema=schema), uri)
    t = mq.MemWalTable.initialize(uri)
    w = t.writer()
    w.put(pa.table({"id": [1.5, 2.5, float("nan"), 3.5], "val": [1.0, 2.0, 3.0, 4.0]}))
    w.flush()
    w.close()
    (region,) = t.catalog.region_ids()
    (gen_dir,) = _generation_dirs(t, region)
    io = file_io_for(gen_dir, None)
    rows = rowfile.read(io, gen_dir)
    swapped = rows.take([1, 0, 2, 3])  # keys 1.5 and 2.5 swap their rows
    rowfile.write(io, gen_dir, swapped.drop_columns(["_rowaddr"]), np.arange(4, dtype=np.uint64))
    before = lance.dataset(uri).version
    with pytest.raises(MergeFailedError) as info:
        t.maintenance.merge()
    err = info.value.errors[region]
    assert isinstance(err, CorruptFileError) and "disagree" in str(err)
    assert lance.dataset(uri).version == before


def test_a_failure_after_its_own_delete_commit_is_not_taken_for_another_merger(
    base_uri, monkeypatch
):
    """Split form: a batch's rows fail to read after its deletes committed. That commit
    is the batch's own, not another merger's: the failure is reported after one
    attempt per batch, not re-planned ``max_retries`` times (each committing the deletes
    again as a new base version)."""
    monkeypatch.setattr(merger, "SEPARATE_DELETE_MIN_BASE_ROWS", 0)
    t, model, region = _two_regions(base_uri)
    before = lance.dataset(t.uri).version
    reads = []

    def failing(*args, **kwargs):
        reads.append(1)
        raise OSError("storage went away")

    monkeypatch.setattr(merger, "_upsert_rows", failing)
    with pytest.raises(MergeFailedError) as info:
        t.maintenance.merge()
    assert all("storage went away" in str(e) for e in info.value.errors.values())
    regions = len(t.catalog.region_ids())
    # a few tries (across the regions, then region by region), not max_retries (20)
    # re-plans per region, each a delete commit
    assert len(reads) <= 2 * regions
    assert lance.dataset(t.uri).version - before <= 2 * regions
    assert t.catalog.index().merged_generations() == {}
    assert view(t) == model
    monkeypatch.undo()
    t.maintenance.merge()
    assert base_view(t.uri) == model and view(t) == model


# -- the region keys file: one read per region, used only where it matches -----------
def _keys_sidecar_reads(monkeypatch):
    """Record the generation directories whose own keys sidecar is read."""
    seen = []
    real = keyfile.read

    def counted(io, uri):
        seen.append(uri.removeprefix("file://").rstrip("/"))
        return real(io, uri)

    monkeypatch.setattr(keyfile, "read", counted)
    return seen


def test_the_merger_reads_one_region_keys_file_per_region(base_uri, separate_deletes, monkeypatch):
    """The region with four generations: their keys come from its newest generation's
    region keys file, no keys sidecar is read; the one-generation region reads its own."""
    t, model, region = _two_regions(base_uri)
    (other,) = set(t.catalog.region_ids()) - {region}
    seen = _keys_sidecar_reads(monkeypatch)
    t.maintenance.merge()
    assert seen == _generation_dirs(t, other)
    assert base_view(t.uri) == model and view(t) == model


@pytest.mark.parametrize("damage", ["missing", "flipped", "stale", "foreign", "renamed", "mixed"])
def test_a_missing_damaged_or_stale_region_file_merges_the_same(
    base_uri, separate_deletes, monkeypatch, damage
):
    """Whatever is wrong with the region keys file, the generations it does not cover
    (by generation number *and* directory) are read from their own keys sidecars, or
    from their rows when those are missing too, and the merge leaves the model."""
    t, model, region = _two_regions(base_uri)
    gens = _generation_dirs(t, region)
    path = _region_file(t, region)
    if damage in ("missing", "flipped"):
        damage_file(path, damage)
    elif damage in ("stale", "mixed"):  # an older generation's file: covers gens 0-1
        damage_file(path, "replaced", donor=os.path.join(gens[1], keyfile.REGION_KEYS_FILE))
        if damage == "mixed":  # and the newest generation has no keys sidecar either
            damage_file(os.path.join(gens[3], keyfile.KEYS_FILE), "missing")
    elif damage == "foreign":  # the other region's file: no flush of this region
        (other,) = set(t.catalog.region_ids()) - {region}
        foreign = [p for p in _generation_dirs(t, other)]
        damage_file(path, "replaced", donor=os.path.join(foreign[-1], keyfile.REGION_KEYS_FILE))
    else:  # gen 2's part: its number, another flush's directory, other keys
        _rewrite_region_file(
            t,
            region,
            lambda parts: [
                keyfile.RegionKeysPart(p.generation, "00000000_gen_3", _shifted(p.keys))
                if i == 2
                else p
                for i, p in enumerate(parts)
            ],
        )
    seen = _keys_sidecar_reads(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.maintenance.merge()
    own = {
        "missing": gens,
        "flipped": gens,
        "foreign": gens,
        "stale": gens[2:],
        "mixed": gens[2:],
        "renamed": gens[2:3],
    }[damage]
    assert set(own) <= set(seen) and not set(seen) & (set(gens) - set(own))
    named = [str(w.message) for w in caught if keyfile.REGION_KEYS_FILE in str(w.message)]
    assert bool(named) == (damage == "flipped")
    assert base_view(t.uri) == model and view(t) == model
    assert t.maintenance.merge().merged == []


def test_a_keys_sidecar_short_of_the_manifest_is_not_counted(base_uri):
    """A keys sidecar listing fewer rows than its region manifest records (CRC-valid) is
    not used by a cold count (a warning naming it; the generation's rows are read): the
    count and the full read are the model's."""
    t, model, region = _two_regions(base_uri)
    # generation 2 holds keys 4, 8, 202 and a delete of 0 and 10: dropping its first
    # listed row would leave key 4 at its older value
    _change_keys(t, region, 1, lambda k: k.slice(1), keyfile.KEYS_FILE)
    clear_read_caches()
    with pytest.warns(RuntimeWarning, match=keyfile.KEYS_FILE):
        assert t.count_rows() == len(model)
    clear_read_caches()
    assert view(t) == model
