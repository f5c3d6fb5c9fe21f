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


def parity_spec(schema_or_dataset):
    """A two-region spec: region ``{"p": id % 2}`` (tests that need two regions with
    known keys: even keys in region 0, odd ones in region 1)."""
    from memwal_query.regions.spec import expression_spec

    return expression_spec(schema_or_dataset, ["id"], "col0 % 2", "int64", field_id="p")


def default_region() -> str:
    """Id of the one region of a table initialized without a region spec."""
    from memwal_query.table import region_id_for

    return region_id_for(1, {"bucket": 0})


def expr_table(uri: str, sql: str = "col0 % 2"):
    """Initialize the Lance table at ``uri`` with a one-field region spec ``r`` = ``sql``
    over ``id`` (``col0``): tests that need several regions with chosen keys write
    region ``r`` with ``t.writer(region_values={"r": r})``."""
    import lance

    import memwal_query as mq
    from memwal_query.regions.spec import expression_spec

    spec = expression_spec(lance.dataset(uri), ["id"], sql, "int64", field_id="r")
    return mq.MemWalTable.initialize(uri, region_spec=spec)


def write_generation(t, model: dict, region_values: dict, puts, deletes, val: float) -> str:
    """One flushed generation of the region of ``region_values``: ``puts`` (``val``
    each), then ``deletes``; ``model`` ({id: val}) follows. Returns the region id."""
    w = t.writer(region_values=region_values)
    if puts:
        w.put(basic_rows(puts, val=[val] * len(puts)))
        model.update({k: val for k in puts})
    if deletes:
        w.delete(pa.table({"id": pa.array(deletes, pa.int64())}))
        for k in deletes:
            model.pop(k, None)
    w.flush()
    w.close()
    return w.region_id


def clear_read_caches() -> None:
    """Forget every decoded generation, sidecar verdict, view, WAL entry and tail, and
    the per-region rows and winners kept between queries (as a new process would
    start)."""
    from memwal_query.read import basecache, deletions, newer, pointview, provider, sources, waltail
    from memwal_query.search import caches

    for cache in (
        sources.GENERATION_CACHE,
        sources.GENERATIONS_WITHOUT_SIDECAR,
        sources.GENERATIONS_WITHOUT_KEYS,
        sources.REGION_FILES_WITHOUT_KEYS,
        newer.FLUSHED_VIEWS,
        newer.NEWEST_COLUMNS,
        newer._REGION_FLUSHED,
        newer._REGION_ROWS,
        newer._MEMTABLE_VIEWS,
        newer._NEWER_COMBINED,
        provider._OVERWRITTEN_BASE_COUNTS,
        provider._OVERWRITTEN_BASE_ROWS,
        provider._BASE_KEYS,
        deletions._RUNS,
        deletions._DELETED,
        basecache.FRAGMENTS,
        basecache._IDS,
        basecache._FIRST,
        pointview.KEY_INDEXES,
    ):
        cache.clear()
    deletions.TWINS.clear()
    waltail.forget()
    caches.clear_caches()


def damage_file(
    path: str, kind: str, *, keep_bytes: int | None = None, donor: str | None = None
) -> None:
    """Damage the file at ``path`` as hostile storage would.

    ``kind``: ``"missing"`` (removed), ``"flipped"`` (the middle byte inverted: its CRC
    no longer matches), ``"truncated"`` (only its first ``keep_bytes`` kept) or
    ``"replaced"`` (the bytes of the file ``donor``: a valid file of something else).
    """
    import os
    import shutil

    if kind == "missing":
        os.remove(path)
    elif kind == "flipped":
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
    elif kind == "truncated":
        assert keep_bytes is not None
        data = open(path, "rb").read()
        open(path, "wb").write(data[:keep_bytes])
    elif kind == "replaced":
        assert donor is not None
        shutil.copy(donor, path)
    else:
        raise ValueError(f"unknown damage {kind!r}")


def id_val_view(t, **kw) -> dict:
    """``{id: val}`` of what ``t``'s provider answers (``kw``: its options); every key
    once."""
    rows = t.provider(**kw).to_table().to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a key twice"
    return {r["id"]: r["val"] for r in rows}


def base_id_val(uri: str, version: int | None = None) -> dict:
    """``{id: val}`` of the Lance base table at ``uri`` (``version``: that version); every
    key once."""
    import lance

    rows = lance.dataset(uri, version=version).to_table(columns=["id", "val"]).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a key twice in the base table"
    return {r["id"]: r["val"] for r in rows}


def kill_merger_at(uri: str, crash_at: str, **settings: int):
    """Run ``t.maintenance.merge()`` in a new process with ``MEMWAL_CRASH_AT=crash_at``
    and the merger's module constants ``settings``; return the finished process (killed
    by SIGKILL when the point was reached)."""
    import os
    import subprocess
    import sys

    lines = ["import sys", "import memwal_query as mq", "from memwal_query.maintain import merger"]
    lines += [f"merger.{k} = {v!r}" for k, v in settings.items()]
    lines += [
        "t = mq.MemWalTable.open(sys.argv[1])",
        "t.maintenance.merge()",
        "print('not killed', flush=True)",
    ]
    env = {**os.environ, "MEMWAL_CRASH_AT": crash_at}
    return subprocess.run(
        [sys.executable, "-c", "\n".join(lines), uri],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def write_region(t, model: dict, region: int, puts, deletes, val: float) -> str:
    """One flushed generation in region ``r = region`` of an :func:`expr_table`:
    ``puts`` then ``deletes`` (see :func:`write_generation`)."""
    return write_generation(t, model, {"r": region}, puts, deletes, val)


def native_snapshot(t, region_id: str):
    """pylance's ``ShardSnapshot`` of a region of ``t``: its generations above the
    region's ``merged_generations`` entry (what pylance's MemWAL readers are given)."""
    from lance.mem_wal import ShardSnapshot

    m = t.catalog.region_manifest(region_id)
    merged = t.catalog.index().merged_generations().get(region_id, 0)
    snap = ShardSnapshot(region_id).with_current_generation(m.current_generation)
    for g in m.flushed_generations:
        if g.generation > merged:
            snap = snap.with_sstable(g.generation, g.path)
    return snap
