"""Time travel (``as_of``): the table as it was at a past base version or moment, with
the generations live then; typed errors when GC removed what that moment needs; GC's
``retain_versions_for``. Plus the change feed and ``as_of`` in SQL, the CLI and Spark.
Real Lance tables on disk."""

from __future__ import annotations

import datetime as dt
import json
import re
import time

import lance
import pyarrow as pa
import pytest
from click.testing import CliRunner

import memwal_query as mq

from helpers import basic_rows, parity_spec

NOW = dt.timedelta(0)


def _table(tmp_path) -> mq.MemWalTable:
    uri = str(tmp_path / "base")
    lance.write_dataset(basic_rows(range(6)), uri)
    return mq.MemWalTable.initialize(uri, region_spec=parity_spec(lance.dataset(uri)))


def _state(table: pa.Table) -> dict[int, float]:
    return dict(zip(table["id"].to_pylist(), table["val"].to_pylist()))


def _history(t: mq.MemWalTable) -> dict[str, object]:
    """v0: before any change; gen 1 flushed (id 1 -> 10, id 2 deleted); merged at v1;
    gen 2 flushed after v1 (id 1 -> 11, id 7 new) and not merged."""
    out: dict[str, object] = {"v0": t.catalog.dataset().version}
    t.write(basic_rows([1], val=[10.0]))
    t.delete(pa.table({"id": pa.array([2], pa.int64())}))
    t.flush()
    time.sleep(0.02)
    out["before_merge"] = dt.datetime.now()
    time.sleep(0.02)
    t.maintenance.merge()
    out["v1"] = t.catalog.dataset().version
    time.sleep(0.02)
    t.write(basic_rows([1, 7], val=[11.0, 70.0]))
    t.flush()
    time.sleep(0.02)
    out["after_flush"] = dt.datetime.now()
    return out


def test_as_of_versions_and_moments(tmp_path):
    t = _table(tmp_path)
    h = _history(t)
    base = {i: float(i) for i in range(6)}
    at_v0 = _state(t.provider(as_of=h["v0"]).to_table())
    assert at_v0 == base
    # the moment before the merge: base v0 plus flushed generation 1
    gen1 = {**base, 1: 10.0}
    del gen1[2]
    assert _state(t.provider(as_of=h["before_merge"]).to_table()) == gen1
    assert _state(t.provider(as_of=h["before_merge"].isoformat()).to_table()) == gen1
    # v1 merged generation 1; generation 2 was flushed after v1's commit
    assert _state(t.provider(as_of=h["v1"]).to_table()) == gen1
    now = {**gen1, 1: 11.0, 7: 70.0}
    assert _state(t.provider(as_of=h["after_flush"]).to_table()) == now
    assert _state(t.to_table()) == now
    assert t.lookup([1, 2, 7], as_of=h["v1"]).to_pylist() == [{"id": 1, "val": 10.0, "name": "n1"}]
    assert t.lookup([2], as_of=str(h["v0"]))["id"].to_pylist() == [2]
    with pytest.raises(mq.VersionGoneError):
        t.provider(as_of=10_000).to_table()
    with pytest.raises(mq.CursorError):
        t.provider(as_of="yesterday").to_table()
    with pytest.raises(mq.CursorError):
        t.provider(as_of=dt.datetime(2000, 1, 1)).to_table()
    t.close()


def test_gc_retention_window_and_typed_errors(tmp_path):
    t = _table(tmp_path)
    h = _history(t)
    t.maintenance.merge()
    # a retention window keeps every version (and what it has not merged)
    t.maintenance.gc(cleanup_older_than=NOW, min_age=NOW, retain_versions_for=dt.timedelta(hours=1))
    assert _state(t.provider(as_of=h["v0"]).to_table()) == {i: float(i) for i in range(6)}
    assert 10.0 in _state(t.provider(as_of=h["before_merge"]).to_table()).values()
    # without it, old versions go: as_of them is a typed error naming the version
    t.maintenance.gc(cleanup_older_than=NOW, min_age=NOW)
    with pytest.raises(mq.VersionGoneError, match=f"base version {h['v0']}"):
        t.provider(as_of=h["v0"]).to_table()
    with pytest.raises(mq.VersionGoneError):
        t.provider(as_of=h["before_merge"]).to_table()
    # the change feed from such a version says the same, with the versions kept
    kept = [v["version"] for v in t.catalog.dataset().versions()]
    with pytest.raises(mq.VersionGoneError, match=re.escape(f"versions kept: {kept}")):
        t.changes(since=h["v0"])
    assert _state(t.provider(as_of=t.catalog.dataset().version).to_table()) == _state(t.to_table())
    t.close()


def test_generation_gone_is_a_typed_error(tmp_path):
    """A generation live at the moment but removed (by hand: GC would keep it) is named."""
    t = _table(tmp_path)
    h = _history(t)
    gen = t.provider(as_of=h["after_flush"]).check().generations[0]
    t.catalog.io.delete_tree(gen.uri)
    with pytest.raises(mq.VersionGoneError, match="generation 2"):
        t.provider(as_of=h["after_flush"]).to_table()
    t.close()


def test_sql_changes_function_and_cli(tmp_path):
    import datafusion

    from memwal_query.cli.commands import main

    t = _table(tmp_path)
    h = _history(t)
    ctx = datafusion.SessionContext()
    mq.register(ctx, "events", t.uri, consistency="strong")
    got = ctx.sql(
        f"SELECT id, _change_type FROM changes('events', '{h['v1']}') ORDER BY _region, _seq"
    ).to_arrow_table()
    assert got.to_pylist() == [
        {"id": 1, "_change_type": "upsert"},
        {"id": 7, "_change_type": "upsert"},
    ]
    every = ctx.sql("SELECT count(*) AS n FROM changes('events')").to_arrow_table()
    assert every["n"].to_pylist() == [4]
    runner = CliRunner()
    res = runner.invoke(main, ["changes", t.uri, "--since", str(h["v1"]), "--consumer", "etl"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert [x["id"] for x in lines] == [1, 7]
    assert t.consumers.list()["etl"] in res.stderr
    # the consumer resumes where it stopped: nothing new
    res = runner.invoke(main, ["changes", t.uri, "--consumer", "etl", "--format", "table"])
    assert res.exit_code == 0 and "upsert" not in res.stdout
    out = str(tmp_path / "c.parquet")
    res = runner.invoke(main, ["changes", t.uri, "--format", "parquet", "--output", out])
    assert res.exit_code == 0 and pa.parquet.read_table(out).num_rows == 4
    res = runner.invoke(
        main,
        [
            "sql",
            t.uri,
            "SELECT count(*) AS n FROM base",
            "--as-of",
            str(h["v0"]),
            "--format",
            "json",
        ],
    )
    assert res.exit_code == 0 and json.loads(res.stdout.splitlines()[0]) == {"n": 6}
    res = runner.invoke(main, ["changes", t.uri, "--since", "mwc1.garbage"])
    assert res.exit_code == 1 and "CursorError" in res.stderr
    t.close()


@pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning")
def test_spark_changes_as_of_and_streaming(spark, tmp_path):
    """Spark batch feed, ``changes_frame``, ``as_of`` and the Structured Streaming source
    (resuming from its checkpoint), on the session's SparkSession."""
    import pyarrow.parquet as pq

    from memwal_query import spark as mqs
    from memwal_query.spark.source import changes_frame

    t = _table(tmp_path)
    h = _history(t)
    df = spark.read.format("memwal").option("changes_since", str(h["v1"])).load(t.uri)
    assert sorted(r["id"] for r in df.collect()) == [1, 7]
    feed = mqs.read(spark, t.uri, changes_since=str(h["v1"]))  # the change feed: the data source
    assert "memwal" in feed._jdf.queryExecution().executedPlan().toString()
    assert sorted(r["id"] for r in feed.collect()) == [1, 7]
    frame, cursor = changes_frame(spark, t.uri, since="earliest")
    assert frame.count() == 4
    t.write(basic_rows([9]))
    t.flush()
    assert frame.count() == 4  # the end was fixed when the frame was made
    rest, _ = changes_frame(spark, t.uri, since=cursor)
    assert [r["id"] for r in rest.collect()] == [9]
    old = spark.read.format("memwal").option("as_of", str(h["v0"])).load(t.uri)
    assert sorted(r["id"] for r in old.collect()) == list(range(6))
    old = mqs.read(spark, t.uri, as_of=str(h["v0"]))  # read in the driver, at that version
    assert "ExistingRDD" in old._jdf.queryExecution().executedPlan().toString()
    assert sorted(r["id"] for r in old.collect()) == list(range(6))

    def run_stream():
        q = (
            spark.readStream.format("memwal")
            .option("changes_since", str(h["v1"]))
            .option("consumer", "stream")
            .load(t.uri)
            .writeStream.format("parquet")
            .option("path", str(tmp_path / "sink"))
            .option("checkpointLocation", str(tmp_path / "ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination()

    run_stream()
    t.write(basic_rows([10, 11]))
    t.flush()
    run_stream()  # resumes from the checkpoint: only the new changes
    assert sorted(pq.read_table(tmp_path / "sink")["id"].to_pylist()) == [1, 7, 9, 10, 11]
    # the registered consumer trails by at most the last batch (committed when the next starts)
    cursor = t.consumers.list()["stream"]
    assert sorted(t.changes(since=cursor).table["id"].to_pylist()) in ([], [10, 11])
    t.close()
