"""memwal_query.spark on real PySpark in local mode (local[2,2]: 2 cores, 2 attempts/task).

One SparkSession for the test session (``spark``, tests/conftest.py). Fault points
(``memwal_query.spark._common.fault``) are armed by creating a file in
``$MEMWAL_SPARK_FAULT_DIR``, set before the JVM starts so that Python workers inherit it.
"""

from __future__ import annotations

import os
import warnings

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import memwal_query as mq
from memwal_query import FencedError, SchemaError
from memwal_query.format.index import read_index_at
from memwal_query.storage.paths import generation_path
from memwal_query.table import region_id_for
from memwal_query.write.routing import concurrently, split_by_region
from memwal_query.write.writer import RegionWriter

from helpers import BASIC_SCHEMA, basic_rows

pyspark = pytest.importorskip("pyspark")
from pyspark.sql import functions as F  # noqa: E402

from memwal_query import spark as mqs  # noqa: E402
from memwal_query.spark import ingest, ingest_tasks, source  # noqa: E402
from memwal_query.spark.merge import merge_partition  # noqa: E402

BUCKETS = 16
pytestmark = pytest.mark.filterwarnings(
    "ignore:PySpark does not yet fully support pandas:FutureWarning",
    # the driver starts the JVM with fork+exec after lance is loaded: harmless
    "ignore:lance is not fork-safe:UserWarning",
)


@pytest.fixture
def fault_dir(spark_fault_dir) -> str:
    return spark_fault_dir


@pytest.fixture(autouse=True)
def disarm(spark_fault_dir):
    """No armed fault point outlives its test (a failed test must not trip the next)."""
    yield
    for name in os.listdir(spark_fault_dir):
        os.unlink(os.path.join(spark_fault_dir, name))


def arm(fault_dir: str, name: str) -> str:
    """Arm a fault point: the first process reaching it raises once."""
    path = os.path.join(fault_dir, name)
    open(path, "w").close()
    return path


def new_table(
    tmp_path, base_ids=range(1000), name: str = "t", buckets: int = BUCKETS
) -> mq.MemWalTable:
    from memwal_query.regions.spec import bucket_spec

    uri = str(tmp_path / name)
    ds = lance.write_dataset(basic_rows(base_ids), uri, max_rows_per_file=400)
    return mq.MemWalTable.initialize(uri, region_spec=bucket_spec(ds.lance_schema, "id", buckets))


def spark_rows(spark, start: int, end: int, tag: str = "s", step: int = 1):
    """DataFrame of BASIC_SCHEMA rows: id, val = id * 0.5, name = tag + id."""
    return spark.range(start, end, step, numPartitions=2).select(
        F.col("id"),
        (F.col("id") * 0.5).alias("val"),
        F.concat(F.lit(tag), F.col("id").cast("string")).alias("name"),
    )


def view(uri: str) -> pa.Table:
    """The deduplicated view through a fresh table (every acknowledged write: WAL
    entries not yet flushed included)."""
    return mq.MemWalTable.open(uri).to_table(consistency="latest").sort_by("id")


def wal_tail_rows(t: mq.MemWalTable, region_id: str) -> int:
    """Rows of the region's durable WAL entries after its flushed position."""
    from memwal_query.format.wal import Wal
    from memwal_query.storage import paths

    manifest = t.catalog.region_manifest(region_id)
    wal = Wal(t.catalog.io, paths.wal_dir(t.uri, region_id), region_id)
    after = manifest.replay_after_wal_entry_position
    return sum(e.table.num_rows for e in wal.replay(after, manifest.writer_epoch))


def stored_rows(t: mq.MemWalTable) -> int:
    """Rows physically stored: the base, every flushed generation, every WAL tail."""
    n = lance.dataset(t.uri).count_rows()
    for region_id in t.catalog.region_ids():
        manifest = t.catalog.region_manifest(region_id)
        n += sum(g.physical_rows for g in manifest.flushed_generations)
        n += wal_tail_rows(t, region_id)
    return n


def model_table(model: dict[int, tuple[float, str]]) -> pa.Table:
    ids = sorted(model)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "val": [model[i][0] for i in ids],
            "name": [model[i][1] for i in ids],
        }
    )


def assert_view(uri: str, model: dict[int, tuple[float, str]]) -> None:
    got = view(uri)
    want = model_table(model)
    assert got.num_rows == want.num_rows
    assert got.column("id").to_pylist() == want.column("id").to_pylist()
    assert got.column("val").to_pylist() == want.column("val").to_pylist()
    assert got.column("name").to_pylist() == want.column("name").to_pylist()


def base_model(ids) -> dict[int, tuple[float, str]]:
    return {i: (float(i), f"n{i}") for i in ids}


def upsert_model(model, ids, tag: str = "s") -> None:
    for i in ids:
        model[i] = (i * 0.5, f"{tag}{i}")


def task_options(t: mq.MemWalTable, **overrides) -> dict:
    """The executor options ``mqs.write`` hands its write tasks (plain upserts)."""
    options = {
        "uri": t.uri,
        "storage_options": {},
        "mode": "upsert",
        "delete_column": None,
        "order": [],
        "ignore": [],
        "flush": True,
        "buffer_rows": 20,
        "writer_options": {},
    }
    options.update(overrides)
    return options


def packed(t: mq.MemWalTable, ids, tag: str, options: dict) -> list[pa.RecordBatch]:
    """Stage-1 output (region blobs) for rows ``ids`` with name ``tag + id``."""
    ids = np.asarray(list(ids), dtype=np.int64)
    data = pa.table(
        {"id": ids, "val": ids * 0.5, "name": [f"{tag}{i}" for i in ids]}, schema=BASIC_SCHEMA
    )
    return list(ingest.pack_batches(iter(data.to_batches(max_chunksize=500)), options))


# -- routing -------------------------------------------------------------------------
def test_region_column_equals_regionspec_evaluate(spark, tmp_path):
    t = new_table(tmp_path)
    spec = t.region_spec
    df = spark_rows(spark, -500, 3000, step=7)
    routed = mqs.route(df, t.uri).toArrow()
    rows = routed.select(["id", "val", "name"]).cast(BASIC_SCHEMA)
    values = spec.evaluate(rows, t.catalog.lance_schema)
    field_ids = values.schema.names
    expected = [
        region_id_for(spec.spec_id, {f: values.column(f)[i].as_py() for f in field_ids})
        for i in range(rows.num_rows)
    ]
    assert routed.column(mqs.REGION_COLUMN).to_pylist() == expected
    # ... and the same grouping as MemWalTable.write's routing
    by_split = {}
    for vals, part in split_by_region(spec, rows, t.catalog.lance_schema):
        by_split[t.catalog.region_id_for(vals)] = sorted(part.column("id").to_pylist())
    by_spark: dict[str, list[int]] = {}
    for rid, i in zip(expected, rows.column("id").to_pylist()):
        by_spark.setdefault(rid, []).append(i)
    assert {k: sorted(v) for k, v in by_spark.items()} == by_split
    assert len(by_split) == BUCKETS


def test_region_values_of_several_fields_equal_evaluate(spark, tmp_path):
    """Two region fields (bucket + truncate of the key), upserts and deletes: the region
    values Spark routes by, and those the written regions record, are ``evaluate``'s."""
    from memwal_query.regions.spec import RegionField, RegionSpec, field_id_of

    uri = str(tmp_path / "multi")
    ds = lance.write_dataset(basic_rows(range(100)), uri)
    src = field_id_of(ds.lance_schema, "id")
    spec = RegionSpec(7, [RegionField.bucket("b", src, 3), RegionField.truncate("t", src, 1000)])
    t = mq.MemWalTable.initialize(uri, region_spec=spec)
    rows = [(i, i * 0.5, f"s{i}", i % 5 == 0) for i in range(-1500, 2500, 3)]
    df = spark.createDataFrame(rows, "id long, val double, name string, is_delete boolean")
    routed = mqs.route(df, t.uri, delete_column="is_delete").toArrow()
    data = routed.select(["id", "val", "name"]).cast(BASIC_SCHEMA)
    values = spec.evaluate(data, t.catalog.lance_schema)  # deletes: the key decides alone
    assert values.num_rows == len(rows) and len(set(values.column("t").to_pylist())) == 5
    want = [
        region_id_for(spec.spec_id, {f: values.column(f)[i].as_py() for f in ("b", "t")})
        for i in range(values.num_rows)
    ]
    assert routed.column(mqs.REGION_COLUMN).to_pylist() == want
    res = mqs.write(df, t.uri, delete_column="is_delete")
    assert res.upserted + res.deleted == len(rows)
    by_region = {}
    for rid, i in zip(want, range(values.num_rows)):
        by_region.setdefault(rid, {f: values.column(f)[i].as_py() for f in ("b", "t")})
    assert sorted(t.catalog.region_ids()) == sorted(by_region)
    for rid, vals in by_region.items():
        assert t.catalog.region_values(rid) == (spec.spec_id, vals)


def test_region_id_array_handles_nulls_and_several_fields():
    spec = type("S", (), {"spec_id": 3})()
    values = pa.record_batch(
        {"a": pa.array([1, None, 1, 2, None], pa.int32()), "b": ["x", "y", "x", None, "y"]}
    )
    got = mqs.region_id_array(spec, values).to_pylist()
    want = [region_id_for(3, {"a": a, "b": b}) for a, b in zip(*values.to_pydict().values())]
    assert got == want
    assert got[0] == got[2] and got[1] == got[4] and len(set(got)) == 3
    single = pa.record_batch({"b": pa.array([3, None, 3, 1], pa.int32())})
    want = [region_id_for(3, {"b": b}) for b in [3, None, 3, 1]]
    assert mqs.region_id_array(spec, single).to_pylist() == want


def test_write_rejects_bad_input(spark, tmp_path):
    t = new_table(tmp_path)
    with pytest.raises(SchemaError, match="not in the table schema"):
        mqs.write(spark_rows(spark, 0, 10).withColumn("zzz", F.lit(1)), t.uri)
    with pytest.raises(SchemaError, match="primary-key"):
        mqs.write(spark_rows(spark, 0, 10).drop("id"), t.uri)
    plain = str(tmp_path / "plain")
    lance.write_dataset(basic_rows(range(10)), plain)
    mq.MemWalTable.initialize(plain)  # the default one-region spec: one write task
    assert {r.region_id for r in mqs.write(spark_rows(spark, 0, 10), plain).regions} == {
        mq.region_id_for(1, {"bucket": 0})
    }


# -- batch ingest ----------------------------------------------------------------------
@pytest.mark.slow
def test_batch_ingest_1m_rows_16_regions(spark, tmp_path):
    n = 1_000_000
    t = new_table(tmp_path, base_ids=range(0, 200_000, 2))
    res = mqs.write(spark_rows(spark, 0, n), t.uri)
    assert res.upserted == n and res.deleted == 0
    # 16 regions, each written by exactly one task, each flushed as generation 1
    assert len(res.regions) == BUCKETS
    assert len({r.region_id for r in res.regions}) == BUCKETS
    assert all(r.generation == 1 and r.attempt == 0 for r in res.regions)
    assert sorted(t.catalog.region_ids()) == sorted(r.region_id for r in res.regions)
    got = view(t.uri)
    assert got.num_rows == n
    ids = got.column("id").to_numpy()
    assert (ids == np.arange(n)).all()
    assert (got.column("val").to_numpy() == np.arange(n) * 0.5).all()
    names = got.column("name").combine_chunks()
    want = pc.binary_join_element_wise("s", pc.cast(pa.array(np.arange(n)), pa.string()), "")
    assert names.equals(want)  # every row is the model's (s{id}), base rows overwritten


def test_upsert_delete_column_and_order_by(spark, tmp_path):
    t = new_table(tmp_path, buckets=4)
    model = base_model(range(1000))
    mqs.write(spark_rows(spark, 500, 1500, tag="a"), t.uri)
    upsert_model(model, range(500, 1500), "a")
    # CDC input: several versions of a key, ordered by seq; deletes in between
    rows = []
    seq = 0
    for i in range(0, 1500, 3):
        rows.append((i, 1.0, "old", False, seq))
        rows.append((i, None, None, True, seq + 1))  # delete
        seq += 2
        if i % 2 == 0:
            rows.append((i, 2.0, f"new{i}", False, seq))
            model[i] = (2.0, f"new{i}")
            seq += 1
        else:
            model.pop(i, None)
    df = spark.createDataFrame(
        rows, "id long, val double, name string, is_delete boolean, seq long"
    ).repartition(3)
    res = mqs.write(df, t.uri, delete_column="is_delete", order_by="seq")
    assert res.deleted == 500 and res.upserted == 500 + 250
    assert_view(t.uri, model)
    # mode="delete": only the key column is needed
    mqs.write(spark.range(0, 100).select("id"), t.uri, mode="delete")
    for i in range(100):
        model.pop(i, None)
    assert_view(t.uri, model)


def test_write_flush_due_flushes_by_the_writer_thresholds(spark, tmp_path):
    """``flush="due"``: repeated small writes leave their rows in the WAL (read by
    default readers) until a region's unflushed rows pass ``max_memtable_rows``; each
    write replays at most that many rows."""
    t = new_table(tmp_path, buckets=2)
    spec = t.catalog.routing_spec()
    model = base_model(range(1000))
    limit = 150
    options = {"max_memtable_rows": limit, "max_memtable_age": 3600}
    pending: dict[str, int] = {}  # the model of each region's unflushed rows
    for n in range(5):  # ~50 rows per region each time
        ids = range(2000 + 100 * n, 2100 + 100 * n)
        res = mqs.write(
            spark_rows(spark, ids.start, ids.stop), t.uri, flush="due", writer_options=options
        )
        upsert_model(model, ids)
        assert_view(t.uri, model)
        for values, part in split_by_region(spec, basic_rows(ids), t.catalog.lance_schema):
            rid = t.catalog.region_id_for(values)
            pending[rid] = pending.get(rid, 0) + part.num_rows
            (done,) = [r for r in res.regions if r.region_id == rid]
            assert (done.generation is not None) == (pending[rid] >= limit), (n, pending)
            if pending[rid] >= limit:
                pending[rid] = 0
            assert wal_tail_rows(t, rid) == pending[rid]
    assert all(len(t.catalog.region_manifest(r).flushed_generations) == 1 for r in pending)
    with pytest.raises(mq.MemWalError, match="flush must be one of"):
        mqs.write(spark_rows(spark, 0, 10), t.uri, flush="sometimes")


# -- task retries and fencing ----------------------------------------------------------
def test_task_retry_after_partial_write(spark, tmp_path, fault_dir):
    t = new_table(tmp_path)
    model = base_model(range(1000))
    arm(fault_dir, "ingest.after_put")
    res = mqs.write(spark_rows(spark, 0, 40_000), t.uri, buffer_rows=500, parallelism=2)
    upsert_model(model, range(40_000))
    assert not os.path.exists(os.path.join(fault_dir, "ingest.after_put"))  # it fired
    retried = [r for r in res.regions if r.attempt == 1]
    assert retried, res.regions  # one task failed on attempt 0 and was retried
    assert all(r.attempt == 0 for r in res.regions if r.partition != retried[0].partition)
    # The failed attempt claimed one region (epoch 1) and made one WAL entry durable;
    # the retry claimed it again (epoch 2) and replayed that entry: its rows are in the
    # flushed generation twice (written twice), and read once.
    reclaimed = [r for r in retried if r.epoch == 2]
    assert len(reclaimed) == 1
    (r,) = reclaimed
    gen = t.catalog.region_manifest(r.region_id).flushed_generations[-1]
    assert lance.dataset(generation_path(t.uri, r.region_id, gen.path)).count_rows() > r.upserted
    assert res.upserted == 40_000
    assert_view(t.uri, model)


def test_stale_attempt_is_fenced_by_spark_retry(spark, tmp_path):
    """An earlier attempt's writer (still alive) is fenced once a later attempt claims."""
    t = new_table(tmp_path, buckets=4)
    model = base_model(range(1000))
    spec = t.region_spec
    ids = range(2000, 4000)
    rows = basic_rows(ids, val=[i * 0.5 for i in ids], name=[f"s{i}" for i in ids])
    (values, part), *_ = split_by_region(spec, rows, t.catalog.lance_schema)
    assert part.num_rows > 20
    stale = t.writer(region_values=values)  # "attempt 0" of the region's task
    stale.put(part.slice(0, 10))
    mqs.write(spark_rows(spark, 2000, 4000), t.uri)  # "attempt 1" covers the same rows
    upsert_model(model, ids)
    with pytest.raises(FencedError):
        stale.put(part.slice(10, 5))
    with pytest.raises(mq.MemWalError):  # fenced (or closed after failing)
        stale.flush()
    stale.close(flush=False)
    assert_view(t.uri, model)


@pytest.mark.slow
def test_speculative_attempts_interleaved(tmp_path):
    """Two attempts of one write task, the second starting while the first runs."""
    t = new_table(tmp_path)
    model = base_model(range(1000))
    ids = np.arange(5000, 9000)
    options = task_options(t, job=ingest.new_job())
    batches = packed(t, ids, "s", options)
    results: dict[str, list] = {}

    def first_attempt():
        for i, b in enumerate(batches):
            if i == 3:  # a speculative copy runs (and finishes) meanwhile
                results["second"] = list(ingest.write_partition(iter(batches), options))
            yield b

    # The first attempt is fenced by the second; its put was not acknowledged, so it
    # claims the region again (the job has not ended) and writes the same rows again.
    first = pa.Table.from_batches(list(ingest.write_partition(first_attempt(), options)))
    second = pa.Table.from_batches(results["second"])
    assert sum(second.column("upserted").to_pylist()) == 4000
    assert set(second.column("epoch").to_pylist()) == {2}
    assert set(first.column("epoch").to_pylist()) == {3}
    # With retries off it fails, with the typed error.
    options2 = task_options(t, job=ingest.new_job())
    options2["fence_retries"] = 0
    batches2 = packed(t, ids, "s", options2)

    def first_attempt2():
        for i, b in enumerate(batches2):
            if i == 3:
                list(ingest.write_partition(iter(batches2), options2))
            yield b

    with pytest.raises(FencedError):
        list(ingest.write_partition(first_attempt2(), options2))
    upsert_model(model, ids.tolist())
    assert_view(t.uri, model)


def test_attempt_of_an_ended_job_writes_nothing(spark, tmp_path, monkeypatch):
    """A speculative loser still running after its job ended (and a later job wrote
    newer rows) must not write its old rows over them, nor fence the later writers."""
    t = new_table(tmp_path)
    model = base_model(range(1000))
    ids = range(5000, 6000)
    options = task_options(t, job=ingest.new_job())
    batches = packed(t, ids, "old", options)
    list(ingest.write_partition(iter(batches), options))  # the winning attempt
    ingest.end_job(options)  # what mqs.write does once Spark returns
    assert f"{options['job']}.done" in os.listdir(ingest_tasks.jobs_dir(t.uri))
    mqs.write(spark_rows(spark, 5000, 6000, tag="new"), t.uri)  # a later job
    upsert_model(model, ids, "new")
    epochs = {r: t.catalog.region_manifest(r).writer_epoch for r in t.catalog.region_ids()}
    with pytest.raises(mqs.JobEndedError, match="already ended"):
        list(ingest.write_partition(iter(batches), options))  # the late loser
    assert {r: t.catalog.region_manifest(r).writer_epoch for r in t.catalog.region_ids()} == epochs
    assert_view(t.uri, model)
    # the race: the job ends between the loser's first check and its claim
    answers = iter([False, True] * BUCKETS)
    monkeypatch.setattr(ingest_tasks, "job_ended", lambda options: next(answers))
    with pytest.raises(mqs.JobEndedError, match="already ended"):
        list(ingest.write_partition(iter(batches), options))
    assert_view(t.uri, model)
    # expired markers are pruned by the next write
    old = f"{0:013d}-{'0' * 32}.done"
    open(os.path.join(ingest_tasks.jobs_dir(t.uri), old), "w").close()
    ingest.end_job(task_options(t, job=ingest.new_job()))
    assert old not in os.listdir(ingest_tasks.jobs_dir(t.uri))


# -- streaming -------------------------------------------------------------------------
def _stream_file(directory: str, n: int, rows: list[tuple]) -> None:
    table = pa.table(
        {
            "id": pa.array([r[0] for r in rows], pa.int64()),
            "val": pa.array([r[1] for r in rows], pa.float64()),
            "name": pa.array([r[2] for r in rows], pa.string()),
            "is_delete": pa.array([r[3] for r in rows], pa.bool_()),
            "seq": pa.array([r[4] for r in rows], pa.int64()),
        }
    )
    tmp = os.path.join(directory, f".part-{n:04d}.tmp")
    pq.write_table(table, tmp)
    os.utime(tmp, (1_700_000_000 + n, 1_700_000_000 + n))
    os.rename(tmp, os.path.join(directory, f"part-{n:04d}.parquet"))


def _micro_batch(n: int, model: dict) -> list[tuple]:
    """Rows of micro-batch n: upserts (two versions of some keys), deletes."""
    rng = np.random.default_rng(n)
    rows = []
    seq = n * 1_000_000
    for k in rng.choice(3000, 400, replace=False).tolist():
        op = rng.integers(0, 4)
        if op == 0:
            rows.append((k, None, None, True, seq))
            model.pop(k, None)
        else:
            rows.append((k, -1.0, "stale", False, seq))
            rows.append((k, float(n), f"b{n}-{k}", False, seq + 1))
            model[k] = (float(n), f"b{n}-{k}")
        seq += 2
    return rows


def test_streaming_sink_restarts(spark, tmp_path, fault_dir):
    t = new_table(tmp_path)
    model = base_model(range(1000))
    src = str(tmp_path / "in")
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(src)
    # generations by size: a region flushes once 120 unflushed rows are in its WAL
    # (~45 rows per region and micro-batch), not at every micro-batch
    writer_options = {"max_memtable_rows": 120, "max_memtable_age": 3600}
    sink = mqs.sink(
        t.uri,
        delete_column="is_delete",
        order_by="seq",
        parallelism=2,
        writer_options=writer_options,
    )
    schema = "id long, val double, name string, is_delete boolean, seq long"

    def run() -> None:
        q = (
            spark.readStream.schema(schema)
            .option("maxFilesPerTrigger", 1)
            .parquet(src)
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", ckpt)
            .trigger(availableNow=True)
            .start()
        )
        try:
            q.awaitTermination()
        finally:
            q.stop()
        return q.id

    sent = 0  # rows sent: each is stored once (no merge runs here)
    for n in range(3):
        rows = _micro_batch(n, model)
        sent += len(rows)
        _stream_file(src, n, rows)
    # a write task fails after a durable put: Spark retries it, and the retry writes
    # nothing into the regions that already hold the batch
    arm(fault_dir, "ingest.after_put")
    query_id = run()
    assert not os.path.exists(os.path.join(fault_dir, "ingest.after_put"))  # it fired
    assert_view(t.uri, model)
    assert sink.committed_batches(query_id) == [0, 1, 2]
    assert stored_rows(t) == 1000 + sent

    # crash after batch 3 is durable but before its marker: replayed, and the replay
    # writes nothing into any region (each holds the batch already)
    for n in (3, 4):
        rows = _micro_batch(n, model)
        sent += len(rows)
        _stream_file(src, n, rows)
    arm(fault_dir, "sink.before_marker")
    with pytest.raises(Exception, match="injected fault"):
        run()
    assert sink.committed_batches(query_id) == [0, 1, 2]
    assert run() == query_id  # restarted from the checkpoint: same query id
    assert sink.committed_batches(query_id) == [0, 1, 2, 3, 4]
    assert_view(t.uri, model)
    assert stored_rows(t) == 1000 + sent

    # crash after the marker, before Spark's commit: the replay is skipped
    rows = _micro_batch(5, model)
    sent += len(rows)
    _stream_file(src, 5, rows)
    arm(fault_dir, "sink.after_marker")
    with pytest.raises(Exception, match="injected fault"):
        run()
    written = dict(sink.last_result.by_region())
    run()
    assert sink.skipped == [5]
    assert sink.last_result.by_region() == written
    assert_view(t.uri, model)
    assert stored_rows(t) == 1000 + sent

    # six micro-batches into 16 regions: flushed by size, each region's WAL tail below
    # the threshold (what the next micro-batch replays)
    regions = t.catalog.region_ids()
    generations = sum(len(t.catalog.region_manifest(r).flushed_generations) for r in regions)
    assert 0 < generations < len(regions) * 6 // 2, generations
    tails = [wal_tail_rows(t, r) for r in regions]
    assert all(n < writer_options["max_memtable_rows"] for n in tails), tails
    assert sum(tails) > 0
    # the tails wait for the next micro-batch: maintenance does not take them over
    # before abandoned_after
    from memwal_query.maintain.recover import recover_abandoned

    assert recover_abandoned(t.catalog, 300.0, dry_run=True) == []
    assert len(recover_abandoned(t.catalog, 0.0, dry_run=True)) == sum(1 for n in tails if n)


def dying(regions: set[str]):
    """``RegionWriter._put_routed`` raising InjectedFault for ``regions``."""
    put = RegionWriter._put_routed

    def put_or_die(self, *args, **kwargs):
        if self.region_id in regions:
            raise mqs.InjectedFault(f"task died at region {self.region_id}")
        return put(self, *args, **kwargs)

    return put_or_die


def test_replayed_stream_batch_stores_each_row_once(tmp_path, monkeypatch):
    """A write task of a stream batch fails after some regions' entries are durable;
    the batch is written again, twice: no row is stored twice (counted in the WAL
    tails, the generations and the base), in the WAL (flush=False) and after flushes."""
    t = new_table(tmp_path)
    model = base_model(range(1000))
    sent = 0
    for number, flush, ids in ((7, False, range(500, 1300)), (8, True, range(900, 1700, 2))):
        job = ingest.new_job()
        options = task_options(t, flush=flush, stream_batch=("q", number), job=job)
        batches = packed(t, ids, f"b{number}-", options)
        routed = sorted({r for b in batches for r in b.column("__memwal_region").to_pylist()})
        # the task dies at every other region's put: the others' entries are durable
        with monkeypatch.context() as m:
            m.setattr(RegionWriter, "_put_routed", dying(set(routed[::2])))
            with pytest.raises(mqs.InjectedFault):
                list(ingest.write_partition(iter(batches), options))
        durable = stored_rows(t) - 1000 - sent
        assert 0 < durable < len(ids)  # some regions hold the batch, not all
        results = []
        for _ in range(2):  # the retry, then a replay of the whole batch
            (out,) = ingest.write_partition(iter(batches), options)
            results.append(out.to_pydict())
        upsert_model(model, ids, f"b{number}-")
        sent += len(ids)
        assert stored_rows(t) == 1000 + sent
        assert_view(t.uri, model)
        done_before = sum(results[0]["already_written"])
        assert 0 < done_before < len(results[0]["region_id"])
        assert all(results[1]["already_written"])
        assert sum(results[0]["upserted"]) == sum(results[1]["upserted"]) == len(ids)
    # batch 8 flushed every region: the manifests remember it
    regions = t.catalog.region_ids()
    assert {t.catalog.region_manifest(r).stream_batch("q") for r in regions} == {8}


# -- merge ---------------------------------------------------------------------------
def assert_one_generation_per_commit(t: mq.MemWalTable, first: int, last: int) -> None:
    """Every base version in (first, last] advanced exactly one region by exactly one
    generation: none skipped, none merged twice, progress ordered."""
    before = read_index_at(t.catalog.io, t.uri, first).merged_generations()
    for version in range(first + 1, last + 1):
        after = read_index_at(t.catalog.io, t.uri, version).merged_generations()
        changed = {r: (before.get(r, 0), g) for r, g in after.items() if before.get(r, 0) != g}
        assert len(changed) == 1, (version, changed)
        ((_, (old, new)),) = changed.items()
        assert new == old + 1, (version, changed)
        before = after


def test_merge_as_spark_jobs(spark, tmp_path, fault_dir):
    regions = 4  # one merge task per region, each merging 4 generations
    t = new_table(tmp_path, buckets=regions)
    model = base_model(range(1000))
    for round_, (lo, hi) in enumerate([(0, 3000), (2000, 5000), (4000, 6000)]):
        mqs.write(spark_rows(spark, lo, hi, tag=f"r{round_}-"), t.uri)
        upsert_model(model, range(lo, hi), f"r{round_}-")
    mqs.write(spark.range(0, 6000, 5).select("id"), t.uri, mode="delete")
    for i in range(0, 6000, 5):
        model.pop(i, None)
    pending = mqs.pending_generations(t)
    assert len(pending) == regions and set(pending.values()) == {4}
    arm(fault_dir, "merge.after_generation")  # one task dies after its first generation
    first = lance.dataset(t.uri).version
    summary = mqs.merge(spark, t.uri)
    assert not os.path.exists(os.path.join(fault_dir, "merge.after_generation"))  # it fired
    assert any(m.attempt == 1 for m in summary.merged)  # ... and the task was retried
    last = lance.dataset(t.uri).version
    assert last - first == 4 * regions  # one commit per generation
    assert_one_generation_per_commit(t, first, last)
    assert summary.pending == {}
    assert mqs.pending_generations(t) == {}
    assert summary.progress == {r: (0, 4) for r in pending}
    # per region: generations merged in order, none twice (task output of a failed
    # attempt is dropped by Spark, so its first generation may be missing here)
    for gens in summary.by_region().values():
        assert gens == sorted(set(gens)) and gens[-1] == 4
    assert sum(len(g) for g in summary.by_region().values()) >= 4 * regions - 1
    merged = t.catalog.index().merged_generations()
    assert merged == {r: 4 for r in pending}
    assert_view(t.uri, model)
    got = spark.read.format("memwal").load(t.uri).orderBy("id").toArrow()
    assert same(got, model_table(model))
    # nothing left: a second merge is a no-op
    again = mqs.merge(spark, t.uri)
    assert again.merged == [] and again.rounds == 0
    # a region id of no region, or a malformed one: the Python API's typed errors
    with pytest.raises(mq.RegionNotFoundError, match="no region 0000"):
        mqs.merge(spark, t.uri, regions=["00000000-0000-0000-0000-000000000000"])
    with pytest.raises(mq.InvalidPathError):
        mqs.merge(spark, t.uri, regions=["nope/.."])
    # the base table alone holds the model now
    base = lance.dataset(t.uri).to_table().sort_by("id")
    assert base.column("id").to_pylist() == sorted(model)


def test_merge_tasks_running_twice_concurrently(spark, tmp_path):
    """Every region's merge task runs twice at once (a speculative copy of each): the
    copies race for the same generations; each is committed exactly once, in order."""
    t = new_table(tmp_path, buckets=4)
    model = base_model(range(1000))
    for round_, (lo, hi) in enumerate([(0, 1500), (1000, 2500), (2000, 3000)]):
        mqs.write(spark_rows(spark, lo, hi, tag=f"r{round_}-"), t.uri)
        upsert_model(model, range(lo, hi), f"r{round_}-")
    regions = sorted(mqs.pending_generations(t))
    assert len(regions) == 4
    options = {"uri": t.uri, "storage_options": {}, "max_generations": None, "max_retries": 50}
    first = lance.dataset(t.uri).version
    outputs = concurrently(
        lambda order: list(merge_partition(iter(order), options)),
        [regions, regions[::-1]],
    )
    merged = [r["merged"] for out in outputs for r in out if r["kind"] == "merged"]
    assert [r for out in outputs for r in out if r["kind"] != "merged"] == []
    assert sorted((m["region_id"], m["generation"]) for m in merged) == [
        (r, g) for r in regions for g in (1, 2, 3)
    ]
    last = lance.dataset(t.uri).version
    assert last - first == 3 * len(regions)
    assert_one_generation_per_commit(t, first, last)
    assert mqs.pending_generations(t) == {}
    assert_view(t.uri, model)


# -- reader ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def read_table(spark, tmp_path_factory):
    """Base table + merged + unmerged generations + deletes (and NULL names).

    Four regions (fewer Spark tasks per query than 16; one partition per region all the
    same).
    """
    tmp = tmp_path_factory.mktemp("reader")
    t = new_table(tmp, base_ids=range(0, 5000), buckets=4)
    mqs.write(spark_rows(spark, 4000, 7000, tag="a"), t.uri)
    mqs.merge(spark, t.uri, regions=sorted(t.catalog.region_ids())[:2])
    mqs.write(spark_rows(spark, 0, 8000, step=3, tag="b"), t.uri)
    mqs.write(spark.range(0, 8000, 7).select("id"), t.uri, mode="delete")
    nulls = spark.createDataFrame([(i, None, None) for i in range(100, 200)], BASIC_SCHEMA_DDL)
    mqs.write(nulls, t.uri)
    return t


BASIC_SCHEMA_DDL = "id long, val double, name string"


def datafusion_sql(uri: str, sql: str) -> pa.Table:
    ctx = datafusion.SessionContext()
    mq.register(ctx, "t", uri, consistency="strong")
    return ctx.sql(sql).to_arrow_table()


def spark_sql(spark, uri: str, sql: str, **options) -> pa.Table:
    reader = spark.read.format("memwal").options(**options)
    reader.load(uri).createOrReplaceTempView("t")
    return spark.sql(sql).toArrow()


def same(a: pa.Table, b: pa.Table) -> bool:
    a = a.replace_schema_metadata(None)
    b = b.replace_schema_metadata(None)
    return a.to_pylist() == b.to_pylist()


def test_reader_equals_datafusion(spark, read_table):
    uri = read_table.uri
    sql = "SELECT id, val, name FROM t ORDER BY id"
    want = datafusion_sql(uri, sql)
    got = spark_sql(spark, uri, sql)
    assert want.num_rows > 5000
    assert same(got, want)
    df = spark.read.format("memwal").load(uri)
    assert df.rdd.getNumPartitions() == 1  # < rows_per_split rows: one task, regions and base
    # smaller splits: more partitions of about equal rows, the same answer
    got = spark_sql(spark, uri, sql, rows_per_split="1000")
    assert same(got, want)
    # fragments larger than a split are read in row ranges by several partitions
    assert same(spark_sql(spark, uri, sql, rows_per_split="150"), want)
    parts = spark.read.format("memwal").option("rows_per_split", "1000").load(uri)
    assert parts.rdd.getNumPartitions() > 5


def test_split_rows_balances_tasks():
    """Tasks of about equal rows, the first one with the regions' rows too."""
    split = source.split_rows
    # the benchmark's shape: 1M-row fragment, 150k newer rows -> 2 tasks of 575k rows
    assert split([(0, 1_000_000)], 150_000, 1_000_000, True) == [
        [(0, 0, 425_000)],
        [(0, 425_000, 575_000)],
    ]
    frags = [(0, 300), (1, 300), (2, 300)]
    assert split(frags, 100, 10_000, True) == [[(0, None, None), (1, None, None), (2, None, None)]]
    tasks = split(frags, 100, 250, True)  # 1000 rows: 4 tasks of 250
    sizes = [sum(n if o is not None else dict(frags)[f] for f, o, n in t) for t in tasks]
    assert [sizes[0] + 100, *sizes[1:]] == [250] * 4
    assert sorted((f, o or 0) for t in tasks for f, o, _ in t)[0] == (0, 0)
    # a pushed filter: whole fragments only (Lance's offset/limit count filtered rows)
    assert split(frags, 100, 500, False) == [
        [(0, None, None)],
        [(1, None, None)],
        [(2, None, None)],
    ]
    assert split([(0, 1_000_000)], 150_000, 1_000_000, False) == [[], [(0, None, None)]]
    assert split([], 0, 1000, True) == [[]]


@pytest.mark.parametrize(
    "where",
    [
        "id = 4003",
        "id > 6500",
        "id >= 10 AND id < 400",
        "id IN (1, 2, 3, 4002, 4003, 4005, 7999)",
        "NOT id IN (1, 2, 3) AND id < 50",
        "id <> 5",
        "name LIKE 'a4%'",
        "name LIKE '%99'",
        "name LIKE '%b1%'",
        "NOT name LIKE 'n%'",
        "name IS NULL",
        "name IS NOT NULL AND id < 300",
        "val > 3000.0",
        "val IS NULL OR id = 7",
        "name = 'b4002'",
    ],
)
def test_reader_filters_equal_datafusion(spark, read_table, where):
    uri = read_table.uri
    sql = f"SELECT id, val, name FROM t WHERE {where} ORDER BY id"
    assert same(spark_sql(spark, uri, sql), datafusion_sql(uri, sql))


def test_reader_projection(spark, read_table):
    uri = read_table.uri
    want = datafusion_sql(uri, "SELECT name, id FROM t WHERE id < 500 ORDER BY id")
    got = (
        spark.read.format("memwal")
        .option("columns", "name, id")
        .load(uri)
        .where("id < 500")
        .orderBy("id")
    )
    assert got.columns == ["name", "id"]
    assert same(got.toArrow(), want)
    got = spark.read.format("memwal").schema("id long, name string").load(uri)
    assert same(got.where("id < 500").orderBy("id").select("name", "id").toArrow(), want)
    # mqs.read hands Spark the schema computed in the driver: the same columns and types
    # as the data source's own schema(), and the same rows
    for options in ({}, {"columns": "name, id"}):
        given = mqs.read(spark, uri, **options)
        asked = spark.read.format("memwal").options(**options).load(uri)
        assert given.schema == asked.schema
        got = given.where("id < 500").orderBy("id").select("name", "id").toArrow()
        assert same(got, want)
    with pytest.raises(Exception, match="not in the table"):
        spark.read.format("memwal").option("columns", "id,nope").load(uri).collect()


def test_reader_filters_pushed_by_spark(spark, read_table, capsys):
    """Spark hands the source the filters it can evaluate and keeps only the others."""
    reader = spark.read.format("memwal").option("push_filters", "true")
    df = reader.load(read_table.uri).where("id = 4003 AND val > 1.0")
    df.explain("formatted")
    plan = capsys.readouterr().out
    assert "PushedFilters: [EqualTo(id,4003)" in plan
    condition = next(line for line in plan.splitlines() if line.startswith("Condition"))
    assert "val" in condition and "id" not in condition  # id = 4003 is not re-evaluated
    assert [r.asDict() for r in df.collect()] == [{"id": 4003, "val": 2001.5, "name": "a4003"}]
    for off in (
        spark.read.format("memwal").option("push_filters", "false").load(read_table.uri),
        spark.read.format("memwal").load(read_table.uri),  # the default
    ):
        off.where("id = 4003").explain("formatted")
        plan = capsys.readouterr().out
        assert "PushedFilters: [EqualTo" not in plan and "(id#" in plan.split("Condition")[1]


def test_reader_pushdown_prunes_regions(read_table):
    from pyspark.sql.datasource import EqualTo, GreaterThan, In, Not, StringStartsWith

    uri = read_table.uri
    ds = source.MemWalDataSource({"path": uri, "push_filters": "true"})
    schema = ds.schema()
    reader = ds.reader(schema)
    filters = [
        EqualTo(("id",), 4003),
        Not(In(("id",), (1, 2))),
        StringStartsWith(("name",), "a"),
        GreaterThan(("val",), 1.0),  # float: left to Spark
    ]
    left = list(reader.pushFilters(filters))
    assert left == [filters[3]] and left[0] is filters[3]
    parts = reader.partitions()
    (newer,) = [p.newer for p in parts if p.with_newer]
    assert len(newer.regions) <= 1  # bucket pruning: id = 4003 lives in one region
    rows = [r for p in parts for b in reader.read(p) for r in b.to_pylist()]
    assert rows == [{"id": 4003, "val": 2001.5, "name": "a4003"}]


def _non_key_filter_table(tmp_path) -> mq.MemWalTable:
    """Key 1: base x = 10, newer x = 0; key 2: base x = 0, newer x = 10; key 3: base only,
    x = 7; key 4 deleted (base x = 10). ``x`` is ``val`` (float, stays with Spark) and
    ``name`` ("hi"/"lo", a pushable string)."""
    t = new_table(tmp_path, base_ids=[])
    t.write(basic_rows([1, 2, 3, 4], [10.0, 0.0, 7.0, 10.0], ["hi", "lo", "hi", "hi"]))
    t.flush()
    t.maintenance.merge()
    t.write(basic_rows([1, 2], [0.0, 10.0], ["lo", "hi"]))
    t.delete(pa.table({"id": pa.array([4], pa.int64())}))
    t.flush()
    for w in t.writers():
        w.close()
    return t


def test_pushed_non_key_filter_sees_the_newest_version_only(tmp_path):
    """A pushed filter on a non-key column never returns a key's older version: the
    base rows of keys with a newer row are dropped whatever the filter says."""
    from pyspark.sql.datasource import EqualTo

    t = _non_key_filter_table(tmp_path)
    ds = source.MemWalDataSource({"path": t.uri, "push_filters": "true"})
    for value, want in (("hi", [2, 3]), ("lo", [1])):
        reader = ds.reader(ds.schema())
        assert list(reader.pushFilters([EqualTo(("name",), value)])) == []
        rows = [r["id"] for p in reader.partitions() for b in reader.read(p) for r in b.to_pylist()]
        assert sorted(rows) == want


@pytest.mark.slow
def test_register_source_leaves_pushdown_off_and_queries_answer_for_themselves(spark, tmp_path):
    """``register_source(spark)`` does not turn Spark's Python filter pushdown on (a
    planning worker per filtered query); several queries in a row with different
    filters on one DataFrame each get their own answer, newest versions only, with the
    setting off or on; Spark refuses a ``pushFilters`` reader with the setting off."""
    t = _non_key_filter_table(tmp_path)
    try:
        spark.conf.set(source.PUSHDOWN_CONF, "false")
        mqs.register_source(spark)
        assert spark.conf.get(source.PUSHDOWN_CONF) == "false"
        df = spark.read.format("memwal").option("push_filters", "true").load(t.uri)
        with pytest.raises(Exception, match="filterPushdown.enabled"):
            df.count()  # Spark refuses a pushFilters reader with the setting off
        for conf in ("false", "true"):
            spark.conf.set(source.PUSHDOWN_CONF, conf)
            df = spark.read.format("memwal").load(t.uri)
            assert df.where("val > 5").count() == 2  # keys 2 (newer 10) and 3, not 1 or 4
            assert df.count() == 3
            assert sorted(r.id for r in df.where("name = 'lo'").collect()) == [1]
        with pytest.warns(source.PushdownWarning, match="self-union"):
            mqs.register_source(spark, filter_pushdown=True)
        assert spark.conf.get(source.PUSHDOWN_CONF) == "true"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the default registration does not warn
            mqs.register_source(spark)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", source.PushdownWarning)
            mqs.register_source(spark, filter_pushdown=True)


def test_filter_expression_null_semantics():
    from pyspark.sql.datasource import EqualTo, In, IsNull, Not, StringContains

    t = pa.table({"a": pa.array([1, 2, None], pa.int64()), "s": ["xa", None, "b"]})

    def keep(f):
        expr, _ = mqs.filter_expression(f, t.schema)
        return t.filter(expr).column("a").to_pylist()

    assert keep(EqualTo(("a",), 1)) == [1]
    assert keep(Not(EqualTo(("a",), 1))) == [2]  # NULL <> 1 is NULL: dropped
    assert keep(Not(In(("a",), (1,)))) == [2]
    assert keep(Not(IsNull(("a",)))) == [1, 2]
    assert keep(Not(StringContains(("s",), "a"))) == [None]  # s = 'b' (a is NULL)
    assert keep(Not(Not(EqualTo(("a",), 2)))) == [2]
    with pytest.raises(ValueError):
        mqs.filter_expression(EqualTo(("a",), 1.5), t.schema)


def test_reader_types_spark_lacks_and_lance_cannot_filter(spark, tmp_path):
    """Unsigned integers, float16, date64, nanosecond timestamps (floored to Spark's
    microseconds), large strings and binaries: the table is readable, and pushed filters
    on these columns (Lance's scanner cannot filter them: applied after the scan) keep
    the newest version of each key only."""
    from decimal import Decimal

    from memwal_query.regions.spec import bucket_spec

    from helpers import PK

    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False, metadata=PK),
            pa.field("u32", pa.uint32()),
            pa.field("u64", pa.uint64()),
            pa.field("h", pa.float16()),
            pa.field("d", pa.date64()),
            pa.field("ts", pa.timestamp("ns", tz="UTC")),
            pa.field("s", pa.large_string()),
            pa.field("lb", pa.large_binary()),
        ]
    )

    def rows(ids, newer: bool) -> pa.Table:
        return pa.table(
            {
                "id": ids,
                "u32": [i if newer else 4_000_000_000 + i for i in ids],
                "u64": [i if newer else 2**64 - 1 - i for i in ids],
                "h": pa.array([i / 2 for i in ids], pa.float16()),
                "d": pa.array([86_400_000 * (100 if newer else i) for i in ids], pa.date64()),
                "ts": [i * 1000 + 999 if newer else i * 1_000_000_001 - 1 for i in ids],
                "s": [f"b{i}" if newer else f"a{i}" for i in ids],
                "lb": [b"b" if newer else bytes([97, i]) for i in ids],
            },
            schema=schema,
        )

    uri = str(tmp_path / "types")
    ds = lance.write_dataset(rows(list(range(8)), False), uri)
    t = mq.MemWalTable.initialize(uri, region_spec=bucket_spec(ds.lance_schema, "id", 2))
    t.write(rows([0, 1, 2, 3], True))
    t.delete(pa.table({"id": [7]}))
    t.close()  # flushed: generations newer than the base rows

    got = spark.read.format("memwal").load(uri).orderBy("id").toArrow()
    # mqs.read reads this small view in the driver: the same schema and values, in any
    # session time zone
    zone = spark.conf.get("spark.sql.session.timeZone")
    try:
        for tz in ("UTC", "Asia/Kolkata"):
            spark.conf.set("spark.sql.session.timeZone", tz)
            small = mqs.read(spark, uri)
            assert "ExistingRDD" in _scan(small)
            assert small.schema == spark.read.format("memwal").load(uri).schema
            assert same(small.orderBy("id").toArrow(), got)
    finally:
        spark.conf.set("spark.sql.session.timeZone", zone)
    assert got.column("id").to_pylist() == list(range(7))
    assert got.column("u32").to_pylist() == [0, 1, 2, 3] + [4_000_000_000 + i for i in (4, 5, 6)]
    assert got.column("u64").to_pylist() == [Decimal(i) for i in range(4)] + [
        Decimal(2**64 - 1 - i) for i in (4, 5, 6)
    ]
    assert got.column("h").to_pylist() == [i / 2 for i in range(7)]
    assert got.column("ts").cast(pa.int64()).to_pylist() == [0, 1, 2, 3] + [
        (i * 1_000_000_001 - 1) // 1000 for i in (4, 5, 6)
    ]
    for where, want in [
        ("s LIKE 'a%'", [4, 5, 6]),
        ("s = 'b1' OR s = 'a5'", [1, 5]),
        ("NOT s IN ('b0', 'a4')", [1, 2, 3, 5, 6]),
        ("u32 > 5", [4, 5, 6]),
        ("u64 >= 3 AND u64 < 100", [3]),
        ("d > DATE '1970-01-05'", [0, 1, 2, 3, 5, 6]),
        ("lb = X'6104'", [4]),
    ]:
        sql = f"SELECT id FROM t WHERE {where} ORDER BY id"
        assert spark_sql(spark, uri, sql).column("id").to_pylist() == want, where
        off = spark_sql(spark, uri, sql, push_filters="false")
        assert off.column("id").to_pylist() == want, where


def test_filter_literal_fraction_on_integer_column():
    """A fractional decimal literal on an integer column is not pushed (pyarrow would
    truncate 5.5 to 5 and keep the rows equal to 5)."""
    from decimal import Decimal

    from pyspark.sql.datasource import EqualTo

    schema = pa.schema([pa.field("a", pa.int64()), pa.field("u", pa.uint64())])
    for column in ("a", "u"):
        with pytest.raises(ValueError):
            mqs.filter_expression(EqualTo((column,), Decimal("5.5")), schema)
        expr, _ = mqs.filter_expression(EqualTo((column,), Decimal("5")), schema)
        assert (
            pa.table({"a": [5, 6], "u": pa.array([5, 6], pa.uint64())}).filter(expr).num_rows == 1
        )


def test_write_bad_types_and_values_are_typed_errors(spark, tmp_path):
    """A column of another kind of type, a bad delete flag, or values the table type
    cannot hold raise the library's typed errors, and nothing is written."""
    t = new_table(tmp_path, base_ids=range(10), buckets=2)
    model = base_model(range(10))
    with pytest.raises(SchemaError, match="'name'"):  # int into a string column
        mqs.write(spark.createDataFrame([(1, 1.0, 7)], "id long, val double, name int"), t.uri)
    with pytest.raises(SchemaError, match="'id'"):  # string keys into an int64 key
        mqs.write(spark.createDataFrame([("1",)], "id string"), t.uri, mode="delete")
    with pytest.raises(SchemaError, match="must be boolean"):
        mqs.write(
            spark.createDataFrame([(1, "yes")], "id long, op string"), t.uri, delete_column="op"
        )
    big = spark.createDataFrame([(1, 1e300, "x")], "id long, val double, name string")
    with pytest.raises(SchemaError, match="'id'"):  # 2**70 does not fit the int64 key
        mqs.write(big.withColumn("id", F.expr(f"CAST('{2**70}' AS DECIMAL(30,0))")), t.uri)
    with pytest.raises(mq.PrimaryKeyError):  # a NULL key
        mqs.write(spark.createDataFrame([(None, 1.0, "x")], BASIC_SCHEMA_DDL), t.uri)
    assert t.catalog.region_ids() == []
    assert_view(t.uri, model)


# -- whole rows or partial updates; writers of one region take turns --------------------
def test_write_refuses_missing_columns_unless_partial(spark, tmp_path):
    t = new_table(tmp_path, base_ids=range(10))
    df = spark.range(5, 15, numPartitions=2).select(F.col("id"), (F.col("id") * 2.0).alias("val"))
    with pytest.raises(mq.SchemaError, match="name"):
        mqs.write(df, t.uri)
    assert t.catalog.region_ids() == []  # refused before any task wrote a region
    mqs.write(df, t.uri, partial=True)
    got = {
        r["id"]: (r["val"], r["name"]) for r in mq.MemWalTable.open(t.uri).to_table().to_pylist()
    }
    assert got[7] == (14.0, "n7")  # existing key: name kept
    assert got[12] == (24.0, None)  # new key
    assert got[2] == (2.0, "n2")  # untouched


def test_write_schema_mode_merge_adds_columns_and_the_reader_shows_them(spark, tmp_path):
    t = new_table(tmp_path, base_ids=range(10))
    df = spark_rows(spark, 5, 15).withColumn("score", F.col("id") * 10)
    with pytest.raises(mq.SchemaError, match=r"\['score'\].*schema_mode='merge'"):
        mqs.write(df, t.uri)
    mqs.write(df, t.uri, schema_mode="merge")
    fresh = mq.MemWalTable.open(t.uri)
    assert fresh.schema.field("score").type == pa.int64()
    got = spark_sql(spark, t.uri, "SELECT id, score FROM t ORDER BY id").to_pylist()
    assert got == [{"id": i, "score": i * 10 if i >= 5 else None} for i in range(15)]
    feed = spark.read.format("memwal").option("changes_since", "0").load(t.uri)
    assert "score" in feed.columns


def test_fenced_task_claims_its_region_again(spark, tmp_path, fault_dir):
    """Another writer claims a region right after a task's put (fault point): the task's
    next put, or its flush, is fenced; it claims the region again and finishes."""
    t = new_table(tmp_path, base_ids=range(100))
    arm(fault_dir, "ingest.fence_after_put")
    res = mqs.write(spark_rows(spark, 0, 400, tag="f"), t.uri, buffer_rows=50)
    assert res.rows == 400
    got = {r["id"]: r["name"] for r in mq.MemWalTable.open(t.uri).to_table().to_pylist()}
    assert len(got) == 400 and all(got[k] == f"f{k}" for k in range(400))


def test_fenced_task_out_of_retries_raises_typed_error_in_driver(spark, tmp_path, fault_dir):
    t = new_table(tmp_path, base_ids=range(10))
    with open(arm(fault_dir, "ingest.fence_after_put"), "w") as f:
        f.write("always")  # every attempt of the task is fenced
    with pytest.raises(mq.FencedError):
        mqs.write(
            spark_rows(spark, 0, 200, tag="g"),
            t.uri,
            buffer_rows=20,
            fence_retries=0,
            parallelism=1,
        )


def test_two_concurrent_jobs_on_overlapping_regions_both_succeed(spark, tmp_path):
    import threading

    t = new_table(tmp_path, base_ids=range(10))
    errors = []

    def job(tag: str) -> None:
        try:
            for _ in range(2):
                mqs.write(spark_rows(spark, 0, 300, tag=tag), t.uri, buffer_rows=30)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=job, args=(tag,)) for tag in ("a", "b")]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    rows = mq.MemWalTable.open(t.uri).to_table().to_pylist()
    names = {r["id"]: r["name"] for r in rows}
    assert len(rows) == 300 == len(names)
    assert all(names[k] in (f"a{k}", f"b{k}") for k in range(300))


@pytest.mark.slow
def test_reader_differential(spark, tmp_path):
    """Random puts, deletes (the same keys again), flushes, merges and GC over two
    regions; after every step several queries in a row on one DataFrame equal a dict
    model (``consistency="latest"``: acknowledged writes not yet flushed included).

    Each query answers for itself: a filter of one query does not leak into the next
    (Spark shares a pushed-down reader between the queries of a DataFrame: with
    pushdown, ``count()`` after ``where(...).count()`` returned the filtered count)."""
    import datetime as dt

    rng = np.random.default_rng(5)
    t = new_table(tmp_path, base_ids=range(300), buckets=2)
    model = {i: float(i) for i in range(300)}
    hot = rng.choice(320, 25, replace=False)
    for step in range(3):
        ks = sorted({int(k) for k in rng.choice(hot, 12)})
        vals = [float(step * 1000 + k) for k in ks]
        t.write(basic_rows(ks, vals))
        model.update(zip(ks, vals))
        gone = sorted({int(k) for k in rng.choice(hot, 4)})
        t.delete(pa.table({"id": pa.array(gone, pa.int64())}))
        for k in gone:
            model.pop(k, None)
        if step % 2:
            t.flush()
        if step == 1:
            t.maintenance.merge()
            t.maintenance.gc(cleanup_older_than=dt.timedelta(0), min_age=dt.timedelta(0))
        df = spark.read.format("memwal").option("consistency", "latest").load(t.uri)
        ids = sorted(model)
        assert df.where("id < 100").count() == sum(1 for i in ids if i < 100)
        assert df.count() == len(ids)
        assert df.select("id").distinct().count() == len(ids)
        got = df.select("id", "val").toArrow().sort_by("id")
        assert got["id"].to_pylist() == ids
        assert got["val"].to_pylist() == [model[i] for i in ids]
    for w in t.writers():
        w.close()


# -- maintenance with merges as Spark tasks ---------------------------------------------
@pytest.mark.slow
def test_maintain_merges_over_the_policy_as_tasks(tmp_path, spark):
    """mqs.maintain: the regions over the policy are merged by Spark tasks; catch-up,
    snapshots and GC on the driver (the rest of maintenance: tests/test_maintain.py)."""
    from test_maintain import NOW, _put, _state, _table, _writer

    from memwal_query.maintain.policy import MaintenancePolicy

    t = _table(tmp_path)
    model = {i: float(i) for i in range(20)}
    writers = [_writer(t, p) for p in (0, 1)]
    for i in range(3):
        _put(model, writers[i % 2], i)
    summary = mqs.maintain(spark, t.uri, policy=MaintenancePolicy(merge_over_generations=1))
    assert summary.merge is not None
    assert summary.merge.by_region() == {writers[0].region_id: [1, 2]}  # odd: 1 generation
    assert [(m.region_id, m.generation) for m in summary.report.merged] == [
        (writers[0].region_id, 1),
        (writers[0].region_id, 2),
    ]
    assert summary.report.catch_up == ["name_idx"] and summary.report.snapshots_refreshed
    assert _state(t) == model
    dry = mqs.maintain(spark, t.uri, policy=NOW, dry_run=True)
    assert dry.merge is None and [r.generations for r in dry.report.to_merge] == [[1]]
    for w in writers:
        w.close()


def test_ingest_after_a_region_spec_change(spark, tmp_path):
    """After ``set_region_spec`` Spark ingest routes by the new spec; keys
    written under the old one (flushed, and unflushed in a writer when the spec
    changed) are updated and deleted through their new regions by one CDC job, and both
    readers (Python and the Spark source) give the newest row of every key."""
    from memwal_query.regions.spec import bucket_spec

    t = new_table(tmp_path, base_ids=range(100), buckets=2)
    model = base_model(range(100))
    t.write(basic_rows(range(50, 150), name=[f"a{i}" for i in range(50, 150)]))
    t.flush()
    t.write(basic_rows(range(140, 160), val=[1.0] * 20, name=["w"] * 20))  # unflushed
    model.update({i: (float(i), f"a{i}") for i in range(50, 150)})
    model.update({i: (1.0, "w") for i in range(140, 160)})
    t.maintenance.set_region_spec(bucket_spec(t.catalog.lance_schema, "id", 3, spec_id=2))
    cdc = spark_rows(spark, 120, 200, tag="b").withColumn("gone", F.col("id") % 9 == 0)
    mqs.write(cdc, t.uri, delete_column="gone")
    model.update({i: (i * 0.5, f"b{i}") for i in range(120, 200)})
    for i in range(126, 200, 9):
        model.pop(i, None)
    assert_view(t.uri, model)
    got = spark_sql(spark, t.uri, "SELECT id, val, name FROM t ORDER BY id")
    assert same(got, model_table(model))
    specs = {}
    for rid in t.catalog.region_ids():
        m = t.catalog.region_manifest(rid)
        specs.setdefault(m.region_spec_id, []).append(m)
    assert all(m.sealed for m in specs[1]) and len(specs[2]) == 3
    assert all(m.flushed_generations for m in specs[2])  # Spark's rows are in them
    t.close()


def test_reader_returns_rows_of_a_process_that_exited_without_close(spark, tmp_path):
    # A process writes with t.write and exits without close (its rows are durable in
    # the WAL, and flushed by its exit hook): the Spark reader's default returns them.
    # Then a writer that leaves rows unflushed (close(flush=False), as a killed one
    # would): the default reader reads them from the WAL, strong does not.
    from test_acknowledged import BASE, _send, _table, _writer

    uri = _table(tmp_path)
    p = _writer(uri)
    _send(p, "write 100 7")
    _send(p, "exit")
    assert p.wait(60) == 0
    ids = sorted(r["id"] for r in spark.read.format("memwal").load(uri).select("id").collect())
    assert ids == sorted([*BASE, 100])
    t = mq.MemWalTable.open(uri)
    w = t.writer()
    w.put(t.lookup(pa.array([100], pa.int64())).set_column(0, "id", pa.array([101], pa.int64())))
    w.close(flush=False)
    ids = sorted(r["id"] for r in spark.read.format("memwal").load(uri).select("id").collect())
    assert ids == sorted([*BASE, 100, 101])
    strong = spark.read.format("memwal").option("consistency", "strong").load(uri)
    assert sorted(r["id"] for r in strong.select("id").collect()) == sorted([*BASE, 100])


# -- mqs.read: small views read in the driver ------------------------------------------------
def _scan(df) -> str:
    """The DataFrame's physical plan (a driver-read view is an Arrow RDD scan; the data
    source is a Python ``BatchScan memwal``)."""
    return df._jdf.queryExecution().executedPlan().toString()


@pytest.fixture(scope="module")
def wal_table(spark, tmp_path_factory):
    """Base + flushed generations with upserts and deletes, then upserts and deletes
    that are only in the WAL (acknowledged, never flushed), and NULLs."""
    t = new_table(tmp_path_factory.mktemp("walread"), base_ids=range(0, 3000), buckets=4)
    mqs.write(spark_rows(spark, 2500, 4000, tag="a"), t.uri)
    mqs.write(spark.range(0, 3000, 11).select("id"), t.uri, mode="delete")
    t = mq.MemWalTable.open(t.uri)
    t.write(basic_rows(range(3900, 4200), name=[None] * 300))  # WAL only
    t.delete(pa.table({"id": pa.array(range(0, 600, 5), pa.int64())}))
    t.close(flush=False)
    return t


def test_read_small_view_in_driver_equals_the_data_source(spark, wal_table, read_table):
    uri = wal_table.uri
    want = view(uri)
    assert 3900 in want.column("id").to_pylist() and 5 not in want.column("id").to_pylist()
    for u, options in [
        (uri, {}),
        (uri, {"columns": "name, id"}),
        (uri, {"consistency": "strong"}),
        (uri, {"rows_per_split": "700"}),
        (read_table.uri, {}),
    ]:
        small = mqs.read(spark, u, **options)
        large = mqs.read(spark, u, driver_read_bytes="0", **options)
        assert "ExistingRDD" in _scan(small) and "memwal" not in _scan(small)
        assert "BatchScan memwal" in _scan(large)
        assert small.schema == large.schema  # names, order, types, nullability
        assert small.columns == (
            ["name", "id"] if options.get("columns") else ["id", "val", "name"]
        )
        assert same(small.orderBy("id").toArrow(), large.orderBy("id").toArrow())
        # Filters (Spark's own over the driver path's rows, pushed into the data source on
        # the other), with the default options: the other options change which rows and
        # columns are read (compared in full above), not how a filter applies to them.
        for where in ("id < 700", "name IS NULL", "name LIKE 'a3%'", "val > 3000.0"):
            if options:
                break
            a = small.where(where).orderBy("id").toArrow()
            assert same(a, large.where(where).orderBy("id").toArrow()), (options, where)
        if options.get("rows_per_split"):
            assert small.rdd.getNumPartitions() == -(-small.count() // 700)
    latest = mqs.read(spark, uri).orderBy("id").toArrow()
    assert same(latest, want)  # WAL-only rows and deletes: every acknowledged write
    strong = mqs.read(spark, uri, consistency="strong").select("id").toArrow()
    assert 4100 not in strong.column("id").to_pylist()


def test_read_in_driver_pins_the_view_when_called(spark, tmp_path):
    """The driver path reads at mqs.read: rows acknowledged before it are in the
    DataFrame, later ones are not (read it again to see them)."""
    t = new_table(tmp_path, base_ids=range(100), buckets=2)
    t.write(basic_rows(range(100, 110)))  # acknowledged: in the WAL only
    df = mqs.read(spark, t.uri)
    assert df.count() == 110
    t.write(basic_rows(range(110, 120)))
    t.delete(pa.table({"id": pa.array([0, 1], pa.int64())}))
    assert df.count() == 110
    assert mqs.read(spark, t.uri).count() == 118
    t.close()


def test_read_in_driver_of_an_empty_view(spark, tmp_path):
    t = new_table(tmp_path, base_ids=range(20), buckets=2)
    t.delete(pa.table({"id": pa.array(range(20), pa.int64())}))
    t.close(flush=False)
    small = mqs.read(spark, t.uri)
    large = mqs.read(spark, t.uri, driver_read_bytes="0")
    assert "ExistingRDD" in _scan(small) or "LocalTableScan" in _scan(small)
    assert small.schema == large.schema
    assert small.count() == 0 == large.count()
    assert small.where("id > 3").toArrow().num_rows == 0


def test_read_above_driver_read_bytes_uses_the_data_source(spark, wal_table):
    uri = wal_table.uri
    rows = view(uri)
    # the bound from the keys: live rows, at least 20 bytes each
    assert "BatchScan memwal" in _scan(mqs.read(spark, uri, driver_read_bytes="1000"))
    # the running count: past the bound from the keys (8 + 8 bytes and the name's 4-byte
    # offset a row), below the rows read
    fixed = 20 * rows.num_rows
    df = mqs.read(spark, uri, driver_read_bytes=str(fixed))
    assert "BatchScan memwal" in _scan(df)
    assert same(df.orderBy("id").toArrow(), rows)
    with pytest.raises(mq.MemWalError, match="driver_read_bytes='lots'"):
        mqs.read(spark, uri, driver_read_bytes="lots")


def test_read_in_driver_budget_is_the_arrow_bytes(wal_table):
    """read_in_driver returns the rows when they fit ``budget`` bytes exactly, None one
    byte below (no Spark session: the reader alone)."""
    from memwal_query.spark._common import _spark_schema

    schema = _spark_schema(wal_table.schema)
    got = source.read_in_driver(wal_table.uri, {}, schema, 1 << 30)
    assert got is not None
    assert same(got.sort_by("id"), view(wal_table.uri))
    assert source.read_in_driver(wal_table.uri, {}, schema, got.nbytes) is not None
    assert source.read_in_driver(wal_table.uri, {}, schema, got.nbytes - 1) is None


# -- object stores ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["s3", "azure", "gcs"])
def test_ingest_merge_and_read_on_each_object_store(spark, store_pool, kind):
    """The executors reach each object store with the table's storage options: an
    ingest (deletes included), a merge as Spark jobs and the Spark reader agree with
    the model and with a fresh DataFusion view."""
    import uuid

    from memwal_query.regions.spec import bucket_spec

    server = store_pool.get(kind)
    options = server.storage_options()
    uri = f"{server.root(store_pool.BUCKET)}/{uuid.uuid4().hex}/t"
    ds = lance.write_dataset(
        basic_rows(range(500)), uri, max_rows_per_file=200, storage_options=options
    )
    spec = bucket_spec(ds.lance_schema, "id", 4)
    t = mq.MemWalTable.initialize(uri, region_spec=spec, storage_options=options)
    model = base_model(range(500))
    mqs.write(spark_rows(spark, 300, 900, tag="a"), uri, storage_options=options)
    upsert_model(model, range(300, 900), "a")
    mqs.write(spark.range(0, 900, 7).select("id"), uri, mode="delete", storage_options=options)
    for i in range(0, 900, 7):
        model.pop(i, None)
    summary = mqs.merge(spark, uri, storage_options=options)
    assert summary.pending == {} and summary.merged
    mqs.write(spark_rows(spark, 850, 950, tag="b"), uri, storage_options=options)
    upsert_model(model, range(850, 950), "b")
    reader = spark.read.format("memwal").options(**{f"storage.{k}": v for k, v in options.items()})
    got = reader.load(uri).orderBy("id").toArrow()
    assert same(got, model_table(model))
    fresh = mq.MemWalTable.open(uri, storage_options=options).to_table().sort_by("id")
    assert same(fresh.select(["id", "val", "name"]), model_table(model))
    assert t.maintenance.fsck().findings == []


def test_read_in_driver_refuses_newer_rows_above_the_budget_before_reading(tmp_path, monkeypatch):
    """A view whose rows are all newer than the base (an empty base, flushed
    generations and WAL entries) is measured before any row is read: over the budget,
    read_in_driver returns None without reading them into the driver."""
    from memwal_query.spark._common import _spark_schema

    t = new_table(tmp_path, base_ids=[], buckets=2)
    t.write(basic_rows(range(0, 3000), name=["n" * 20] * 3000))
    t.close()  # flushed generations
    t = mq.MemWalTable.open(t.uri)
    t.write(basic_rows(range(2000, 5000)))  # WAL and MemTables: 5,000 live rows in all
    schema = _spark_schema(t.schema)
    got = source.read_in_driver(t.uri, {}, schema, 1 << 30, t)
    assert got is not None and got.num_rows == 5000
    reads = []
    real = source.MemWalReader.read
    monkeypatch.setattr(
        source.MemWalReader, "read", lambda self, part: reads.append(part) or real(self, part)
    )
    # 5,000 rows of at least 8 + 8 + 4 (the name's offset) bytes
    assert source.read_in_driver(t.uri, {}, schema, 5000 * 20 - 1, t) is None
    assert reads == []
    ids = _spark_schema(pa.schema([t.schema.field("id")]))
    assert source.read_in_driver(t.uri, {"columns": "id"}, ids, 5000 * 8 - 1, t) is None
    assert reads == []
    t.close(flush=False)


def test_a_column_spark_has_no_type_for_is_a_schema_error_naming_it(spark, tmp_path):
    """A decimal wider than Spark's 38 digits (alone or in a list): ``mqs.read``
    (either path) raises SchemaError naming the column and its type; the other columns
    are read with ``columns``."""
    import decimal

    from helpers import pk_schema

    for i, (kind, value) in enumerate(
        [
            (pa.decimal256(40, 2), decimal.Decimal("1.25")),
            (pa.list_(pa.decimal256(39, 2)), [decimal.Decimal("1.25")]),
        ]
    ):
        uri = str(tmp_path / f"t{i}")
        schema = pk_schema(pa.field("x", kind))
        rows = pa.table({"id": [1], "x": pa.array([value], kind)}, schema)
        lance.write_dataset(rows, uri)
        mq.MemWalTable.initialize(uri).close()
        for options in ({}, {"driver_read_bytes": "0"}):
            with pytest.raises(SchemaError, match=r"'x' of type " + str(kind)[:6]):
                mqs.read(spark, uri, **options)
        assert mqs.read(spark, uri, columns="id").collect()[0]["id"] == 1
